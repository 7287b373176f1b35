"""Mask functions and attention implementations registered by the user after the cache was made."""

from __future__ import annotations

import pytest
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
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from hybrid_cache import HybridRingCache
from hybrid_cache.errors import UnsupportedAttentionError
from hybrid_cache.mask_hook import install_mask_hook


def test_mask_function_registered_after_the_cache(model_name):
    """transformers documents `AttentionMaskInterface.register` for custom masks. Registered after the cache was
    made: used before the wrap (time-ordered keys, dense decode masks) and after it (the hook re-wraps it); exact."""
    model = MODEL_BUILDERS[model_name](window=4)
    cache = HybridRingCache(model.config)
    calls = []

    def my_sdpa_mask(*args, **kwargs):
        calls.append(kwargs.get("q_length"))
        return sdpa_mask(*args, **kwargs)

    ids = tokens(14, batch=2)
    previous = AttentionMaskInterface._global_mapping["sdpa"]
    AttentionMaskInterface.register("sdpa", my_sdpa_mask)
    try:
        got = chunked_logits(model, cache, ids, [3, 1, 1, 5, 1, 1, 1, 1])
    finally:
        AttentionMaskInterface.register("sdpa", previous)
        install_mask_hook()
    assert 1 in calls and 3 in calls, "the user's mask function was not used"
    assert_close(got, no_cache_logits(model, ids), "user mask function")


def test_custom_attention_name_registered_later():
    """A new attention implementation with its own mask function: exact while the ring is in time order, then the
    documented `UnsupportedAttentionError` (its mask cannot express ring order), with the cache unchanged."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    model = tiny_gemma3(window=4)
    cache = HybridRingCache(model.config)
    AttentionInterface.register("my_kernel", sdpa_attention_forward)
    AttentionMaskInterface.register("my_kernel", sdpa_mask)
    model.set_attn_implementation("my_kernel")
    ids = tokens(8)
    try:
        got = chunked_logits(model, cache, ids[:, :4], [3, 1])
        model.set_attn_implementation("sdpa")
        assert_close(got, no_cache_logits(model, ids)[:, :4], "before the wrap")
        model.set_attn_implementation("my_kernel")
        before = snapshot(cache)
        with pytest.raises(UnsupportedAttentionError, match="my_kernel"):
            chunked_logits(model, cache, ids[:, 4:6], [1, 1])
        assert_unchanged(before, cache)
    finally:
        model.set_attn_implementation("sdpa")
