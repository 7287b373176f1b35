"""Misuse raises a clear error naming the fix; memory is the theoretical minimum and matches what is allocated."""

from __future__ import annotations

import copy

import pytest
import torch
from builders import MODEL_BUILDERS, VOCAB, chunked_logits, no_cache_logits, tiny_gemma3
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

from hybrid_cache import CacheCapacityError, HybridRingCache, RollbackError


def test_not_a_config():
    with pytest.raises(TypeError, match="model.config"):
        HybridRingCache({"sliding_window": 4})


def test_sliding_layer_without_window():
    config = Gemma3TextConfig(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"])
    config.sliding_window = None
    with pytest.raises(ValueError, match="sliding_window"):
        HybridRingCache(config)


def test_unknown_layer_type():
    config = Gemma3TextConfig(num_hidden_layers=2)
    config.layer_types = ["sliding_attention", "mamba"]
    with pytest.raises(ValueError, match="DynamicCache"):
        HybridRingCache(config)


def test_config_without_sliding_layers_works():
    """No sliding layers: every layer is full, results exact, nothing saved (and no error)."""
    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        layer_types=["full_attention"] * 3,
        attn_implementation="sdpa",
    )
    model = Gemma3ForCausalLM(config).eval()
    cache = HybridRingCache(model.config)
    input_ids = torch.randint(3, VOCAB, (1, 12))
    got = chunked_logits(model, cache, input_ids, [5, 1, 6])
    assert (got - no_cache_logits(model, input_ids)).abs().max() < 1e-4
    assert cache.layer_kinds == ["full_attention"] * 3 and cache.memory_report().total_bytes > 0


def test_batch_size_change_needs_reset():
    model = tiny_gemma3(window=3)
    cache = HybridRingCache(model.config)
    chunked_logits(model, cache, torch.randint(3, VOCAB, (2, 5)), [5])
    with pytest.raises(ValueError, match=r"cache\.reset\(\)"):
        chunked_logits(model, cache, torch.randint(3, VOCAB, (3, 1)), [1])
    cache.reset()
    input_ids = torch.randint(3, VOCAB, (3, 7))
    got = chunked_logits(model, cache, input_ids, [4, 1, 2])
    assert (got - no_cache_logits(model, input_ids)).abs().max() < 1e-4


def test_fixed_capacity_exceeded():
    model = tiny_gemma3(window=3)
    cache = HybridRingCache(model.config, max_cache_len=8)
    chunked_logits(model, cache, torch.randint(3, VOCAB, (1, 8)), [6, 1, 1])
    with pytest.raises(CacheCapacityError, match="max_cache_len"):
        chunked_logits(model, cache, torch.randint(3, VOCAB, (1, 1)), [1])


def test_rollback_beyond_horizon():
    model = tiny_gemma3(window=3)
    cache = HybridRingCache(model.config, rollback_margin=1)
    chunked_logits(model, cache, torch.randint(3, VOCAB, (1, 10)), [10])
    with pytest.raises(RollbackError, match="rollback_margin"):
        cache.crop(-3)
    cache.crop(-2)
    assert cache.get_seq_length() == 8


def test_fixed_capacity_matches_oracle():
    model = tiny_gemma3(window=4)
    input_ids = torch.randint(3, VOCAB, (2, 20), generator=torch.Generator().manual_seed(2))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :5] = 0
    cache = HybridRingCache(model.config, max_cache_len=24)
    got = chunked_logits(model, cache, input_ids, [7, 1, 1, 6, 1, 1, 1, 1, 1], attention_mask)
    expected = no_cache_logits(model, input_ids, attention_mask)
    assert (got - expected)[attention_mask.bool()].abs().max() < 1e-4


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
    assert report.total_bytes == allocated
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


def test_deepcopy_prefix_cache():
    """Trap 7: copy a prefix cache (after the wrap) and continue two ways; each equals the oracle."""
    model = tiny_gemma3(window=3)
    prefix = torch.randint(3, VOCAB, (1, 9), generator=torch.Generator().manual_seed(4))
    cache = HybridRingCache(model.config)
    chunked_logits(model, cache, prefix, [9])
    for seed in (5, 6):
        suffix = torch.randint(3, VOCAB, (1, 5), generator=torch.Generator().manual_seed(seed))
        branch = copy.deepcopy(cache)
        got = chunked_logits(model, branch, suffix, [2, 1, 2])
        expected = no_cache_logits(model, torch.cat([prefix, suffix], 1))[:, 9:]
        assert (got - expected).abs().max() < 1e-4
    assert cache.get_seq_length() == 9


def test_early_initialization_per_layer_head_sizes():
    """Gemma 4: early_initialization allocates sliding and full layers with their own head sizes (trap 9)."""
    model = MODEL_BUILDERS["gemma4"](window=4)
    cache = HybridRingCache(model.config)
    cache.early_initialization(batch_size=2, num_heads=2, head_dim=8, dtype=torch.float32, device="cpu")
    dims = {kind: layer.k_head_dim for kind, layer in zip(cache.layer_kinds, cache.layers) if kind != "shared"}
    assert dims == {"sliding_attention": 8, "full_attention": 16}
    got = chunked_logits(model, cache, torch.randint(3, VOCAB, (2, 10)), [6, 1, 3])
    assert got.shape == (2, 10, VOCAB)


def test_layers_on_their_own_devices():
    """Each layer allocates on the device/dtype of its first update (device_map placement)."""
    model = tiny_gemma3(window=3, layers=2)
    cache = HybridRingCache(model.config)
    cache.update(torch.zeros(1, 2, 4, 8, dtype=torch.float64), torch.zeros(1, 2, 4, 8, dtype=torch.float64), 0)
    cache.update(torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8), 1)
    assert cache.layers[0].keys.dtype == torch.float64 and cache.layers[1].keys.dtype == torch.float32


def test_initial_capacity_sizes_full_layers_exactly():
    """`initial_capacity=prompt + new tokens`: the full layers are allocated once at that size and never grow."""
    model = tiny_gemma3(window=4)
    prompt, new = 9, 6
    cache = HybridRingCache(model.config, initial_capacity=prompt + new)
    chunked_logits(model, cache, torch.randint(3, VOCAB, (1, prompt + new)), [prompt] + [1] * new)
    full = [layer for kind, layer in zip(cache.layer_kinds, cache.layers) if kind == "full_attention"]
    assert all(layer.capacity == prompt + new for layer in full)


def test_every_error_has_one_base_and_keeps_its_builtin_base():
    """`except HybridCacheError` catches every error of the package; `except ValueError` / `RuntimeError` code written
    before the base class existed still catches the same errors."""
    import hybrid_cache
    from hybrid_cache import errors

    builtin = {
        "CacheCapacityError": RuntimeError,
        "RollbackError": RuntimeError,
        "UnsupportedAttentionError": RuntimeError,
        "WindowMismatchError": ValueError,
        "ConversationMismatchError": ValueError,
        "CodeAttentionError": RuntimeError,
        "UnsupportedReleaseError": RuntimeError,
    }
    assert set(errors.__all__) == set(builtin) | {"HybridCacheError"}
    for name, base in builtin.items():
        error = getattr(hybrid_cache, name)
        assert issubclass(error, hybrid_cache.HybridCacheError) and issubclass(error, base), name
    assert len(hybrid_cache.__all__) <= 16
