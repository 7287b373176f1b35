"""Gradients through the cache (chunked training) equal DynamicCache's and the no-cache forward's."""

from __future__ import annotations

import pytest
import torch
from builders import MODEL_BUILDERS, reference_cache_kwargs, tiny_gemma3, tokens
from transformers import DynamicCache

from hybrid_cache import HybridRingCache
from hybrid_cache.compat import cache_kwargs


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_gradients_through_the_cache(model_name, attn):
    """Chunked training (a loss over chunks fed through one cache, keys not detached): the gradients equal
    DynamicCache's and the no-cache forward's, through several wraps; `backward()` never trips over in-place
    writes."""
    model = MODEL_BUILDERS[model_name](window=4, attn=attn)
    ids = tokens(18, batch=2)
    schedule = [5, 3, 1, 1, 6, 1, 1]

    def gradients(cache) -> dict[str, torch.Tensor]:
        model.zero_grad()
        if cache is None:
            logits = model(input_ids=ids, **reference_cache_kwargs(model)).logits
        else:
            logits, position = [], 0
            for size in schedule:
                logits.append(model(input_ids=ids[:, position : position + size], **cache_kwargs(cache)).logits)
                position += size
            logits = torch.cat(logits, 1)
        (logits.square().mean()).backward()
        return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    expected = gradients(None)
    for cache in (HybridRingCache(model.config), DynamicCache(config=model.config)):
        got = gradients(cache)
        assert got.keys() == expected.keys()
        worst = max((got[name] - expected[name]).abs().max().item() for name in expected)
        assert worst < 1e-5, f"{type(cache).__name__}: gradient differs by {worst:.3g}"


def test_fixed_capacity_refuses_gradients_clearly():
    model = tiny_gemma3(window=4)
    cache = HybridRingCache(model.config, max_cache_len=16)
    with pytest.raises(RuntimeError, match="cannot record gradients"):
        model(input_ids=tokens(5), **cache_kwargs(cache))
