"""A crop the rings cannot serve is refused before any layer is cut: the cache is unchanged and continues exactly."""

from __future__ import annotations

import pytest
import torch
from builders import VOCAB, assert_close, assert_unchanged, chunked_logits, no_cache_logits, snapshot, tokens

from hybrid_cache import HybridRingCache, RollbackError


def qwen2_full_first():
    """A Qwen2-style model whose first layer is full attention (`max_window_layers=1`), the others sliding."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_sliding_window=True,
        sliding_window=4,
        max_window_layers=1,
        attn_implementation="sdpa",
    )
    return Qwen2ForCausalLM(config).eval()


def test_refused_crop_changes_nothing():
    """A full layer before the sliding ones: a crop the rings cannot serve raises `RollbackError` before any layer
    is cut, and the caller who catches it continues with exact logits."""
    model = qwen2_full_first()
    ids = tokens(16)
    cache = HybridRingCache(model.config)
    assert cache.layer_kinds[0] == "full_attention"
    chunked_logits(model, cache, ids[:, :12], [9, 1, 1, 1])
    before = snapshot(cache)
    with pytest.raises(RollbackError, match="rollback_margin"):
        cache.crop(-3)
    assert_unchanged(before, cache)
    got = chunked_logits(model, cache, ids[:, 12:], [1, 1, 2])
    assert_close(got, no_cache_logits(model, ids)[:, 12:], "after a refused crop")
