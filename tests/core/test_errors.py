"""Misuse raises a clear error naming the fix; every error of the package shares one base class."""

from __future__ import annotations

import pytest
import torch
from builders import VOCAB, chunked_logits, no_cache_logits, tiny_gemma3
from transformers import Gemma3TextConfig

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
        "CodeKernelError": RuntimeError,
        "UnsupportedReleaseError": RuntimeError,
        "IncompleteStepError": RuntimeError,
        "PreparedMaskError": RuntimeError,
        "ProgramFormatError": ValueError,
        "BandedMaskError": RuntimeError,
    }
    assert set(errors.__all__) == set(builtin) | {"HybridCacheError"}
    for name, base in builtin.items():
        error = getattr(errors, name)
        assert issubclass(error, hybrid_cache.HybridCacheError) and issubclass(error, base), name
    assert len(hybrid_cache.__all__) <= 16
