"""A cache built from a config whose sliding window disagrees with the model's: refused when smaller, exact when
larger; an all-sliding model's unused full-attention mask does not trip the check.
"""

from __future__ import annotations

import copy

import pytest
import torch
from builders import (
    MODEL_BUILDERS,
    assert_close,
    assert_unchanged,
    chunked_logits,
    no_cache_logits,
    snapshot,
    tiny_gemma3,
    tokens,
)

from hybrid_cache import HybridRingCache, WindowMismatchError


def test_cache_window_smaller_than_model_raises(model_name):
    """A cache built from a config with a smaller window than the model's mask: a clear error at the first step
    that would need an overwritten key (never wrong logits), and the cache is unchanged."""
    model = MODEL_BUILDERS[model_name](window=6)
    small = copy.deepcopy(model.config)
    small.sliding_window = 4
    cache = HybridRingCache(small)
    chunked_logits(model, cache, tokens(20)[:, :8], [8])
    before = snapshot(cache)
    with pytest.raises(WindowMismatchError, match="sliding_window=6"):
        chunked_logits(model, cache, tokens(20)[:, 8:9], [1])
    assert_unchanged(before, cache)


def test_cache_window_larger_than_model_is_exact(model_name):
    """A larger window than the model's only keeps more slots: still exact."""
    model = MODEL_BUILDERS[model_name](window=4)
    large = copy.deepcopy(model.config)
    large.sliding_window = 6
    cache = HybridRingCache(large)
    ids = tokens(20)
    assert_close(chunked_logits(model, cache, ids, [7] + [1] * 13), no_cache_logits(model, ids), "larger window")


@pytest.mark.parametrize("fixed", [False, True], ids=["growing", "fixed"])
def test_all_sliding_model_full_mask_request_is_harmless(fixed):
    """A Gemma 3 with only sliding layers still builds a full-attention mask, which transformers sizes against layer
    0 (a ring) for want of a full layer: unused, it must not trip the window check; results stay exact."""
    model = tiny_gemma3(window=4, layers=2)
    assert set(model.config.layer_types) == {"sliding_attention"}
    ids = tokens(16, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    cache = HybridRingCache(model.config, max_cache_len=32 if fixed else None)
    got = chunked_logits(model, cache, ids, [6, 1, 1, 1, 3, 1, 1, 1, 1], mask)
    expected = no_cache_logits(model, ids, mask)
    assert_close(got[mask.bool()], expected[mask.bool()], "all sliding")
