"""The mask hook: exact ring masks (overlays, padding), and no change at all for every other cache class."""

from __future__ import annotations

import threading

import pytest
import torch
from builders import VOCAB, chunked_logits, tiny_gemma3
from transformers import DynamicCache, StaticCache
from transformers.masking_utils import (
    ALL_MASK_ATTENTION_FUNCTIONS,
    AttentionMaskInterface,
    create_causal_mask,
    create_sliding_window_causal_mask,
)

import hybrid_cache.mask_hook as mask_hook
from hybrid_cache import HybridRingCache
from hybrid_cache.compat import cache_kwargs
from hybrid_cache.errors import UnsupportedAttentionError
from hybrid_cache.mask_hook import DenseMaskRequest, HeldFromOffset, RingLayout, WindowMismatchError, install_mask_hook


def run_other_caches(model, input_ids, attention_mask):
    """Logits of DynamicCache / StaticCache runs with prefill, decode and a chunk past the window."""
    results = {}
    for name in ("dynamic", "static"):
        cache = DynamicCache(config=model.config) if name == "dynamic" else StaticCache(model.config, max_cache_len=64)
        results[name] = chunked_logits(model, cache, input_ids, [9, 1, 1, 5, 1, 3], attention_mask)
    return results


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_other_caches_bit_identical(attn):
    """Trap: a global hook must not change any other cache's results: compare with the hook removed."""
    model = tiny_gemma3(window=4, attn=attn)
    input_ids = torch.randint(3, VOCAB, (2, 20), generator=torch.Generator().manual_seed(0))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :6] = 0
    install_mask_hook()
    with_hook = run_other_caches(model, input_ids, attention_mask)
    mask_hook.uninstall_mask_hook()
    try:
        assert not mask_hook.is_mask_hook_installed(attn)
        without_hook = run_other_caches(model, input_ids, attention_mask)
    finally:
        install_mask_hook()
    for name in with_hook:
        assert torch.equal(with_hook[name], without_hook[name]), name


def test_mask_functions_pass_through_exactly():
    """For plain integer offsets the wrapped functions return exactly what the originals return."""
    install_mask_hook()
    for name in ("sdpa", "eager"):
        wrapped = AttentionMaskInterface._global_mapping[name]
        original = getattr(wrapped, mask_hook._HOOK_MARKER)
        padding = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)
        for kv_offset in (0, 2):
            kwargs = dict(
                batch_size=2,
                q_length=3,
                kv_length=7 - kv_offset,
                q_offset=4,
                kv_offset=kv_offset,
                attention_mask=padding,
                allow_is_causal_skip=False,
            )
            expected, got = original(**kwargs), wrapped(**kwargs)
            assert torch.equal(expected, got)


def test_install_is_idempotent_and_thread_safe():
    install_mask_hook()
    before = dict(AttentionMaskInterface._global_mapping)
    threads = [threading.Thread(target=install_mask_hook) for _ in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert AttentionMaskInterface._global_mapping == before
    original = getattr(before["sdpa"], mask_hook._HOOK_MARKER)
    assert not hasattr(original, mask_hook._HOOK_MARKER), "wrapped twice"


def wrapped_ring_cache(model, attention_mask, length):
    cache = HybridRingCache(model.config)
    input_ids = torch.randint(3, VOCAB, (attention_mask.shape[0], length), generator=torch.Generator().manual_seed(1))
    chunked_logits(model, cache, input_ids, [length - 3, 1, 1, 1], attention_mask[:, :length])
    return cache


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("q_length", [1, 3])
def test_ring_mask_equals_time_ordered_mask_with_overlays(attn, q_length):
    """Ring mask == columns of the oracle's time-ordered mask at each slot's position, with an `or_mask_function`
    and an `and_mask_function` overlay (the vmap path) and left padding longer than the window (trap 5). One-token
    steps after the wrap get a `RingLayout`; multi-token steps time-ordered keys with an integer offset."""
    window, length = 4, 14
    model = tiny_gemma3(window=window, attn=attn)
    config = model.config
    attention_mask = torch.ones(2, length + q_length, dtype=torch.long)
    attention_mask[1, :6] = 0
    cache = wrapped_ring_cache(model, attention_mask, length)
    sliding_idx = cache.is_sliding.index(True)
    kv_length, layout = cache.get_mask_sizes(q_length, sliding_idx)
    if q_length == 1:
        assert isinstance(layout, RingLayout)
        positions = layout.positions
    else:
        assert isinstance(layout, HeldFromOffset) and type(layout + 0) is int  # an int the hook also checks
        positions = torch.arange(layout, layout + kv_length)

    def or_overlay(batch_idx, head_idx, q_idx, kv_idx):  # e.g. a bidirectional image block 14..15: 14 sees 15
        return (q_idx == 14) & (kv_idx == 15)

    def and_overlay(batch_idx, head_idx, q_idx, kv_idx):
        return kv_idx != 11

    embeds = torch.zeros(2, q_length, config.hidden_size)
    full_embeds = torch.zeros(2, length + q_length, config.hidden_size)
    for overlays in ({}, {"or_mask_function": or_overlay}, {"and_mask_function": and_overlay}):
        ring_mask = create_sliding_window_causal_mask(
            config, embeds, attention_mask, **cache_kwargs(cache), **overlays
        )
        oracle = create_sliding_window_causal_mask(
            config, full_embeds, attention_mask, **cache_kwargs(None), **overlays
        )
        if attn == "eager":
            ring_mask, oracle = ring_mask == 0, oracle == 0
        if oracle is None:
            continue
        expected = oracle[:, :, length:, :][..., positions.clamp(min=0)] & (positions >= 0)
        assert torch.equal(ring_mask, expected), overlays


def test_mask_beyond_the_ring_raises():
    """A mask that lets a query see a key the ring has overwritten (here an overlay reaching 4 positions back through
    a window of 4) cannot be served exactly: a clear error, never a silently dropped key."""
    model = tiny_gemma3(window=4)
    attention_mask = torch.ones(1, 15, dtype=torch.long)
    cache = wrapped_ring_cache(model, attention_mask, 14)
    _, layout = cache.get_mask_sizes(1, cache.is_sliding.index(True))
    assert layout.positions.min() == 11

    def or_overlay(batch_idx, head_idx, q_idx, kv_idx):
        return kv_idx == 10

    embeds = torch.zeros(1, 1, model.config.hidden_size)
    with pytest.raises(WindowMismatchError, match="position 10"):
        create_sliding_window_causal_mask(
            model.config, embeds, attention_mask, **cache_kwargs(cache), or_mask_function=or_overlay
        )


def test_full_layer_mask_unchanged():
    """Full layers are time-ordered: their mask is transformers' own (plain integer offsets, no ring layout)."""
    model = tiny_gemma3(window=4)
    attention_mask = torch.ones(1, 15, dtype=torch.long)
    cache = wrapped_ring_cache(model, attention_mask, 14)
    cache.dense_decode_mask = False
    full_idx = cache.is_sliding.index(False)
    kv_length, kv_offset = cache.get_mask_sizes(1, full_idx)
    assert (kv_length, kv_offset) == (15, 0)
    embeds = torch.zeros(1, 1, model.config.hidden_size)
    assert (
        create_causal_mask(model.config, embeds, attention_mask, **cache_kwargs(cache)) is None
    )  # sdpa may skip it, as before


def test_dense_decode_mask_on_cpu_gqa():
    """On CPU with grouped-query attention a one-token step asks for a materialized mask (transformers' fast packed
    SDPA path instead of `enable_gqa`): the same mask transformers builds when it does not skip, all keys visible."""
    model = tiny_gemma3(window=4)
    attention_mask = torch.ones(1, 15, dtype=torch.long)
    cache = wrapped_ring_cache(model, attention_mask, 14)
    full_idx = cache.is_sliding.index(False)
    kv_length, kv_offset = cache.get_mask_sizes(1, full_idx)
    assert kv_length == 15 and isinstance(kv_offset, DenseMaskRequest) and kv_offset.offset == 0
    embeds = torch.zeros(1, 1, model.config.hidden_size)
    mask = create_causal_mask(model.config, embeds, attention_mask, **cache_kwargs(cache))
    assert mask is not None and mask.shape == (1, 1, 1, 15) and bool(mask.all())
    # Multi-token steps keep transformers' own decision.
    assert cache.get_mask_sizes(3, full_idx) == (17, 0)


def test_unsupported_attention_raises():
    """An attention implementation without transformers' mask functions cannot see the ring layout: clear error."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register("custom_kernel", sdpa_attention_forward)
    model = tiny_gemma3(window=3)
    cache = HybridRingCache(model.config)
    input_ids = torch.randint(3, VOCAB, (1, 8))
    model.set_attn_implementation("custom_kernel")
    with pytest.raises(UnsupportedAttentionError, match="attn_implementation"):
        chunked_logits(model, cache, input_ids, [5, 1, 1, 1])


def test_guarded_backends_refuse_ring_layout():
    """Flash attention cannot mask keys out of time order: a ring layout reaching it raises, naming the fix."""
    install_mask_hook()
    layout = RingLayout(torch.tensor([4, 5, 2, 3]))
    for name in ("flash_attention_2", "flash_attention_3"):
        if name in AttentionMaskInterface._global_mapping:
            with pytest.raises(UnsupportedAttentionError, match=name):
                AttentionMaskInterface._global_mapping[name](
                    batch_size=1, q_length=1, kv_length=4, q_offset=5, kv_offset=layout
                )


def test_ring_layout_arithmetic():
    """`kv_length + kv_offset` (how transformers pads per-position ids) gives the cache length after the step; any
    other integer use of a ring layout raises a clear error (a time-ordered reading of ring slots would be wrong)."""
    layout = RingLayout(torch.tensor([4, 5, 2, 3]), end=6)
    assert 4 + layout == 6 and layout + 4 == 6
    for misuse in (lambda: layout - 1, lambda: int(layout), lambda: torch.arange(4) + layout, lambda: layout < 3):
        with pytest.raises(UnsupportedAttentionError, match="kv_offset"):
            misuse()
    dense = DenseMaskRequest(7)
    assert dense == 7 and dense + 2 == 9 and isinstance(dense, int) and dense.offset == 7


def test_prepared_4d_mask_after_wrap_raises():
    """A user-prepared 4D mask bypasses mask creation; after the wrap that would be wrong, so it raises (here first on
    its width: 7 keys where the ring returns 3), and nothing is written."""
    model = tiny_gemma3(window=3)
    cache = HybridRingCache(model.config)
    input_ids = torch.randint(3, VOCAB, (1, 8))
    chunked_logits(model, cache, input_ids[:, :6], [6])
    mask_4d = torch.ones(1, 1, 1, 7, dtype=torch.bool)
    with pytest.raises(RuntimeError, match="prepared attention mask 7 keys wide.*returns 3 keys"):
        model(input_ids=input_ids[:, 6:7], attention_mask=mask_4d, **cache_kwargs(cache))
    assert cache.get_seq_length() == 6


def test_mask_interface_default_instance_sees_hook():
    install_mask_hook()
    assert ALL_MASK_ATTENTION_FUNCTIONS["sdpa"] is AttentionMaskInterface._global_mapping["sdpa"]
