"""Memory is the theoretical minimum and `memory_report()` matches what is allocated."""

from __future__ import annotations

import pytest
import torch
from builders import MODEL_BUILDERS, VOCAB, chunked_logits, decode_record_bytes, tiny_gemma3

from hybrid_cache import HybridRingCache


def storage_bytes(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().nbytes()


@pytest.mark.parametrize("model_name", ["gemma3", "gemma4"])
def test_memory_after_twenty_windows(model_name):
    """After 20 x window tokens: sliding layers hold exactly their window, full layers at most 2x the tokens,
    shared layers nothing, and the report equals the bytes of the storages actually allocated (trap 8)."""
    window = 5
    model = MODEL_BUILDERS[model_name](window=window)
    cache = HybridRingCache(model.config)
    tokens = 20 * window
    schedule = [7] + [1] * 40 + [13] + [1] * (tokens - 7 - 40 - 13)
    chunked_logits(model, cache, torch.randint(3, VOCAB, (2, tokens)), schedule)
    report = cache.memory_report()
    assert report.tokens == tokens
    allocated = 0
    for kind, layer in zip(cache.layer_kinds, cache.layers):
        if kind == "shared":
            assert layer.keys is None and layer.values is None
            continue
        slots = layer.keys.shape[-2]
        if kind == "sliding_attention":
            assert slots == window
        else:
            assert tokens <= slots <= 2 * tokens
        allocated += storage_bytes(layer.keys) + storage_bytes(layer.values)
        allocated += sum(storage_bytes(t) for t in getattr(layer, "undo_tensors", list)())  # the last step's slot
    assert report.total_bytes == allocated
    assert report.extra_bytes == decode_record_bytes(cache)  # one slot per ring: what undoes the last decode step
    assert report.bytes_by_type.get("shared", 0) == 0
    assert report.total_bytes < report.full_cache_bytes
    assert "sliding_attention" in str(report)


def test_memory_formula_gemma3_like():
    """5 sliding : 1 full, W=4, 40 tokens, growable full storage: bytes == sliding W slots + full layer capacity."""
    model = tiny_gemma3(window=4, layers=6)
    cache = HybridRingCache(model.config)
    chunked_logits(model, cache, torch.randint(3, VOCAB, (1, 40)), [40])
    per_token_per_layer = 2 * 2 * 8 * 4  # K and V x 2 KV heads x head_dim 8 x fp32
    report = cache.memory_report()
    assert report.layers_by_type == {"sliding_attention": 5, "full_attention": 1}
    assert report.bytes_by_type["sliding_attention"] == 5 * 4 * per_token_per_layer
    assert report.bytes_by_type["full_attention"] == 40 * per_token_per_layer
    assert report.full_cache_bytes == 6 * 40 * per_token_per_layer


def test_initial_capacity_sizes_full_layers_exactly():
    """`initial_capacity=prompt + new tokens`: the full layers are allocated once at that size and never grow."""
    model = tiny_gemma3(window=4)
    prompt, new = 9, 6
    cache = HybridRingCache(model.config, initial_capacity=prompt + new)
    chunked_logits(model, cache, torch.randint(3, VOCAB, (1, prompt + new)), [prompt] + [1] * new)
    full = [layer for kind, layer in zip(cache.layer_kinds, cache.layers) if kind == "full_attention"]
    assert all(layer.capacity == prompt + new for layer in full)
