"""`output_attentions=True` over a wrapped ring, and `attention_in_time_order` back to the no-cache weights."""

from __future__ import annotations

import pytest
import torch
from builders import MODEL_BUILDERS, chunked_logits, reference_cache_kwargs, tokens

from hybrid_cache import HybridRingCache, attention_in_time_order
from hybrid_cache.compat import cache_kwargs


def test_attention_maps_in_time_order(model_name):
    """`output_attentions=True` after the wrap: sliding layers attend over the ring in slot order;
    `attention_in_time_order(weights, cache.key_positions(i))` equals the no-cache forward's weights row."""
    model = MODEL_BUILDERS[model_name](window=4, attn="eager")
    ids = tokens(15)
    cache = HybridRingCache(model.config)
    chunked_logits(model, cache, ids[:, :14], [9] + [1] * 5)
    with torch.no_grad():
        step = model(input_ids=ids[:, 14:], **cache_kwargs(cache), output_attentions=True)
        full = model(input_ids=ids, **reference_cache_kwargs(model), output_attentions=True)
    checked = 0
    for layer_idx, weights in enumerate(step.attentions):
        store = layer_idx if cache.layer_kinds[layer_idx] != "shared" else _store_layer(model, cache, layer_idx)
        positions = cache.key_positions(store)
        if cache.layer_kinds[store] == "sliding_attention":
            assert positions.tolist() != sorted(positions.tolist()), "the ring should be out of time order here"
        timed = attention_in_time_order(weights, positions, length=15)
        difference = (timed[:, :, 0] - full.attentions[layer_idx][:, :, 14]).abs().max().item()
        assert difference < 1e-5, f"layer {layer_idx}: {difference:.3g}"
        checked += 1
    assert checked == len(cache.layers)
    with pytest.raises(ValueError, match="key_positions"):
        attention_in_time_order(step.attentions[0], torch.arange(3))


def _store_layer(model, cache, layer_idx: int) -> int:
    """The storing layer whose keys a KV-shared Gemma 4 layer reuses: the last non-shared layer of its type."""
    layer_type = model.config.layer_types[layer_idx]
    return max(
        i for i, kind in enumerate(cache.layer_kinds) if kind != "shared" and model.config.layer_types[i] == layer_type
    )
