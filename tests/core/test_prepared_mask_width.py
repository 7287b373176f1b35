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


@pytest.mark.parametrize("seed", range(4))
def test_built_masks_handed_to_the_wrong_layer_type(model, seed, one_thread):
    """The mask hook built this step's masks, but the model hands its sliding layers the full layers' mask (what
    transformers 5.14's Gemma 3 / 4 do given token types): refused with `PreparedMaskError` before anything is
    written, whatever the held length and step (random, before and after the wrap), and the cache continues exactly.
    A width check skipped in steps whose masks the hook built let this end in a bare shape error inside attention."""
    rng = torch.Generator().manual_seed(seed)
    held, step = (int(torch.randint(low, high, (), generator=rng)) for low, high in ((1, 12), (2, 6)))
    ids = tokens(held + step + 1, seed=seed)
    cache = HybridRingCache(model.config)
    sliding = [i for i, kind in enumerate(model.config.layer_types) if kind == "sliding_attention"]
    full = model.config.layer_types.index("full_attention")
    with torch.no_grad():
        chunked_logits(model, cache, ids[:, :held], [held])
        before = snapshot(cache)
        full_width = cache.layers[full].returned_key_count(step)

        def full_layers_mask(module, args, kwargs):
            kwargs["attention_mask"] = torch.ones(1, 1, step, full_width, dtype=torch.bool)
            return args, kwargs

        layers = model.model.layers
        handles = [layers[i].register_forward_pre_hook(full_layers_mask, with_kwargs=True) for i in sliding]
        try:
            expected_width = cache.layers[sliding[0]].returned_key_count(step)
            if full_width == expected_width:  # the ring has not dropped anything yet: the mask fits
                chunked_logits(model, cache, ids[:, : held + step], [step], start=held)
                return
            with pytest.raises(PreparedMaskError, match=rf"{full_width} keys wide.*returns {expected_width} keys"):
                model(input_ids=ids[:, held : held + step], **cache_kwargs(cache))
        finally:
            for handle in handles:
                handle.remove()
        assert_unchanged(before, cache)
        got = chunked_logits(model, cache, ids, [step, 1], start=held)
        assert_close(got, no_cache_logits(model, ids)[:, held:], "after the refused step")


@pytest.mark.parametrize(
    "options",
    [{}, {"max_cache_len": 40}, {"full_layer_window": 5, "full_layer_sink_tokens": 2}],
    ids=["growing", "fixed", "sink-window"],
)
def test_returned_key_count_is_the_mask_width(model, options, one_thread):
    """`returned_key_count` (what the width check compares, no layout built) equals `get_mask_sizes`' width, for
    every layer kind and step length, before and after the wrap, over a random schedule."""
    rng = torch.Generator().manual_seed(len(options))
    cache = HybridRingCache(model.config, **options)
    ids, position = tokens(36), 0
    with torch.no_grad():
        while position < 30:
            for layer in cache.layers:
                for query in (1, 2, WINDOW, WINDOW + 3):
                    assert layer.returned_key_count(query) == int(layer.get_mask_sizes(query)[0]), (position, query)
            size = int(torch.randint(1, 2 * WINDOW, (), generator=rng))
            chunked_logits(model, cache, ids[:, : position + size], [size], start=position)
            position += size
