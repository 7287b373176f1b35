"""A cache pickled or `torch.save`d, loaded in a fresh process (no mask hook installed there), continues exactly."""

from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from builders import MODEL_BUILDERS, chunked_logits, tokens

from hybrid_cache import HybridRingCache

TESTS = Path(__file__).resolve().parents[1]


CHILD = """
import sys, torch, pickle
sys.path.insert(0, {tests!r})
from builders import MODEL_BUILDERS, VOCAB, chunked_logits, no_cache_logits
import hybrid_cache.mask_hook as mask_hook
assert not mask_hook.is_mask_hook_installed("sdpa"), "a fresh process starts without the hook"
model = MODEL_BUILDERS[{name!r}](window=4)
ids = torch.randint(3, VOCAB, (2, 20), generator=torch.Generator().manual_seed(0))
mask = torch.ones_like(ids)
mask[1, :2] = 0
cache = torch.load({path!r}, weights_only=False) if {use_torch!r} else pickle.load(open({path!r}, "rb"))
got = chunked_logits(model, cache, ids, [1, 1, 1, 1, 3, 1, 1, 1, 1, 1, 1, 1], mask, start={start})
expected = no_cache_logits(model, ids, mask)[:, {start}:]
difference = (got - expected)[mask[:, {start}:].bool()].abs().max().item()
assert difference <= 1e-4, difference
print("OK", difference)
"""


@pytest.mark.parametrize("use_torch", [True, False], ids=["torch.save", "pickle"])
def test_saved_cache_in_fresh_process(model_name, use_torch, tmp_path):
    """Saved before the wrap, loaded in a new process (no hook installed there): the dense decode-mask path and the
    wrapped steps that follow are exact."""
    model = MODEL_BUILDERS[model_name](window=4)
    cache = HybridRingCache(model.config)
    ids, mask = tokens(20, batch=2), torch.ones(2, 20, dtype=torch.long)
    mask[1, :2] = 0
    ids[1, :2] = 0
    chunked_logits(model, cache, ids[:, :6], [3, 1, 1, 1], mask[:, :6])  # the child starts from here
    path = tmp_path / "cache.bin"
    if use_torch:
        torch.save(cache, path)
    else:
        path.write_bytes(pickle.dumps(cache))
    child = CHILD.format(tests=str(TESTS), name=model_name, path=str(path), use_torch=use_torch, start=6)
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(child)], capture_output=True, text=True, timeout=300, cwd=TESTS.parent
    )
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]
