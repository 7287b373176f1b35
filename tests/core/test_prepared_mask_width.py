"""A prepared attention mask (a 4D tensor, or a dict of them per layer type) whose key width is not what the cache
returns for the step raises `PreparedMaskError` (a `HybridCacheError`) naming both widths, before the layer writes
anything; before, it ended in a bare tensor-shape `RuntimeError` inside attention, or, for a width of 1, in a silent
broadcast. Masks the model builds itself (2D or none), and the prepared masks `generate` builds from this cache
(fixed capacity), pass."""

from __future__ import annotations

import pytest
import torch
from builders import (
    assert_close,
    assert_unchanged,
    chunked_logits,
    no_cache_logits,
    prompt,
    snapshot,
    tiny_gemma3,
    tokens,
)

from hybrid_cache import HybridCacheError, HybridRingCache
from hybrid_cache.compat import cache_kwargs
from hybrid_cache.errors import PreparedMaskError

WINDOW = 4


@pytest.fixture(scope="module")
def model():
    return tiny_gemma3(window=WINDOW, layers=4, layer_types=["sliding_attention"] * 3 + ["full_attention"])


def test_mask_dict_built_for_the_window_on_a_wrapped_ring(model, one_thread):
    """The reported case: a 2-token step on a wrapped ring, sliding mask built for W past keys, where the ring
    returns its W - 1 newest (what the step's first query sees) followed by the step's 2."""
    ids = tokens(14)
    cache = HybridRingCache(model.config)
    chunked_logits(model, cache, ids[:, :10], [10])
    before = snapshot(cache)
    masks = {
        "full_attention": torch.ones(1, 1, 2, 12, dtype=torch.bool),
        "sliding_attention": torch.ones(1, 1, 2, WINDOW + 2, dtype=torch.bool),
    }
    with (
        torch.no_grad(),
        pytest.raises(PreparedMaskError, match=rf"{WINDOW + 2} keys wide.*returns {WINDOW + 1} keys"),
    ):
        model(input_ids=ids[:, 10:12], attention_mask=masks, **cache_kwargs(cache))
    assert_unchanged(before, cache)
    got = chunked_logits(model, cache, ids, [2, 1, 1], start=10)
    assert_close(got, no_cache_logits(model, ids)[:, 10:], "after the refused step")


@pytest.mark.parametrize("width", [1, 6, 8], ids=lambda w: f"width{w}")
def test_4d_tensor_of_another_width(model, width, one_thread):
    """Before the wrap every layer returns the 3 held keys + 4 new ones: 7 wide. Width 1 used to broadcast."""
    ids = tokens(7)
    cache = HybridRingCache(model.config)
    chunked_logits(model, cache, ids[:, :3], [3])
    before = snapshot(cache)
    mask = torch.ones(1, 1, 4, width, dtype=torch.bool)
    with torch.no_grad(), pytest.raises(HybridCacheError, match=rf"{width} keys wide.*returns 7 keys"):
        model(input_ids=ids[:, 3:], attention_mask=mask, **cache_kwargs(cache))
    assert_unchanged(before, cache)


def test_prepared_masks_of_generate_pass(model, one_thread):
    """`generate` with a fixed-capacity cache prepares 4D masks from the cache itself: they fit, tokens exact."""
    inputs = prompt(2, 12, pad=3)
    kwargs = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        ring = model.generate(**inputs, **cache_kwargs(HybridRingCache(model.config, max_cache_len=30)), **kwargs)
        assert torch.equal(ring, model.generate(**inputs, use_cache=False, **kwargs))
