"""torch.compile: with a fixed full-layer capacity the cache is compileable; a compiled decode step gives the eager
tokens and compiles once (no recompilation per step or per ring wrap: counters live in tensors, trap 8)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from builders import MODEL_BUILDERS, VOCAB, greedy_decode
from torch._dynamo.testing import CompileCounterWithBackend

from hybrid_cache import HybridRingCache


def test_dynamic_cache_is_not_compileable_but_fixed_is():
    model = MODEL_BUILDERS["gemma3"](window=4)
    assert not HybridRingCache(model.config).is_compileable
    assert HybridRingCache(model.config, max_cache_len=32).is_compileable


@pytest.mark.parametrize("model_name", ["gemma3", "gemma4"])
def test_compiled_decode_matches_eager_without_recompiling(model_name):
    window, steps = 4, 5 * 4  # five wraps of the ring
    model = MODEL_BUILDERS[model_name](window=window)
    prompt = torch.randint(3, VOCAB, (2, 2 * window + 1), generator=torch.Generator().manual_seed(0))
    eager = greedy_decode(model, HybridRingCache(model.config, max_cache_len=64), prompt, model.forward, steps)

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("eager")  # dynamo's own graph capture; the backend does not matter here
    compiled_forward = torch.compile(model.forward, backend=counter, fullgraph=True)
    cache = HybridRingCache(model.config, max_cache_len=64)
    compiled = greedy_decode(model, cache, prompt, compiled_forward, steps)
    assert torch.equal(eager, compiled)
    assert counter.frame_count == 1, f"recompiled: {counter.frame_count} graphs for {steps} decode steps"
    assert cache.get_seq_length() == prompt.shape[1] + steps
