"""A cache filled under `torch.inference_mode()` (as pipelines do) continues under `no_grad` and in `generate`."""

from __future__ import annotations

import pytest
import torch
from builders import MODEL_BUILDERS, assert_close, chunked_logits, no_cache_logits, tokens
from transformers import DynamicCache

from hybrid_cache import HybridRingCache
from hybrid_cache.compat import cache_kwargs


@pytest.mark.parametrize("fixed", [False, True], ids=["growing", "fixed"])
def test_inference_mode_cache_reused_under_no_grad(model_name, fixed):
    """A cache filled under `torch.inference_mode()` (as pipelines do) continues under `no_grad` (as `generate`
    does), and again after `reset()`: exact both times."""
    model = MODEL_BUILDERS[model_name](window=4)
    ids = tokens(20)
    cache = HybridRingCache(model.config, max_cache_len=32 if fixed else None)
    with torch.inference_mode():
        first = chunked_logits(model, cache, ids[:, :10], [7, 1, 1, 1])
    with torch.no_grad():
        rest = chunked_logits(model, cache, ids[:, 10:], [1, 3, 1, 5])
    expected = no_cache_logits(model, ids)
    assert_close(torch.cat([first, rest], 1), expected, "inference_mode then no_grad")
    cache.reset()
    with torch.inference_mode():
        chunked_logits(model, cache, ids[:, :5], [5])
    cache.reset()
    assert_close(chunked_logits(model, cache, ids, [9, 1, 1, 9]), expected, "after reset")


def test_generate_after_inference_mode_prefill(model_name):
    model = MODEL_BUILDERS[model_name](window=4)
    ids = tokens(12)
    cache = HybridRingCache(model.config)
    with torch.inference_mode():
        model(input_ids=ids[:, :-1], **cache_kwargs(cache))
    kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False)
    out = model.generate(**kwargs, **cache_kwargs(cache))
    with torch.no_grad():
        assert torch.equal(out, model.generate(**kwargs, **cache_kwargs(DynamicCache(config=model.config))))
