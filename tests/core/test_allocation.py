"""How storage is allocated: fixed capacity (`max_cache_len`), `early_initialization` with per-layer head sizes,
each layer on the device and dtype of its first update, and a config without sliding layers; results stay exact."""

from __future__ import annotations

import torch
from builders import MODEL_BUILDERS, VOCAB, chunked_logits, no_cache_logits, tiny_gemma3
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

from hybrid_cache import HybridRingCache


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


def test_fixed_capacity_matches_oracle():
    model = tiny_gemma3(window=4)
    input_ids = torch.randint(3, VOCAB, (2, 20), generator=torch.Generator().manual_seed(2))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :5] = 0
    cache = HybridRingCache(model.config, max_cache_len=24)
    got = chunked_logits(model, cache, input_ids, [7, 1, 1, 6, 1, 1, 1, 1, 1], attention_mask)
    expected = no_cache_logits(model, input_ids, attention_mask)
    assert (got - expected)[attention_mask.bool()].abs().max() < 1e-4


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
