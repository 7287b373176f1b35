"""Prefill steps (`hybrid_cache.prefill_steps`): on `hybrid_cache_sdpa`, `generate` prefills a long prompt in steps,
exactly where that is transformers' own chunked prefill of the same result, and nowhere else.

Oracle: transformers' SDPA with DynamicCache on the whole prompt (tokens equal, logits within 1e-5). Each refusal
case is checked by the step count the wrapper keeps and by the chunk sizes the model's forward sees.
"""

from __future__ import annotations

import pytest
import torch
from builders import BANDED_TEST_SETTINGS, left_padded_batch, tiny_gemma3, tiny_gemma4, tokens
from transformers import DynamicCache

from hybrid_cache import HybridRingCache, cache_kwargs, disable, enable, use_code_attention
from hybrid_cache.banded import banded_prefill
from hybrid_cache.code_attention import CODE_ATTENTION
from hybrid_cache.prefill_steps import (
    PREFILL_STEP,
    SteppedGenerate,
    disable_prefill_steps,
    enable_prefill_steps,
    prefill_steps_of,
)

BUILDERS = {"gemma3": tiny_gemma3, "gemma4": tiny_gemma4}


def forward_lengths(model, monkeypatch) -> list[int]:
    """The query lengths of the model's forwards from now on."""
    lengths: list[int] = []
    forward = type(model).forward

    def spy(self, *args, **kwargs):
        ids = kwargs.get("input_ids")
        lengths.append(ids.shape[1] if ids is not None else kwargs["inputs_embeds"].shape[1])
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(type(model), "forward", spy)
    return lengths


def run(model, inputs, cache=None, **kwargs) -> torch.Tensor:
    extra = {} if cache is None else cache_kwargs(cache)
    with torch.no_grad():
        return model.generate(**inputs, **extra, max_new_tokens=6, min_new_tokens=6, do_sample=False, **kwargs)


@pytest.mark.parametrize("cache_kind", ["ring", "dynamic", "generate's own"])
def test_long_prompt_is_prefilled_in_steps_with_the_same_tokens(model_name, cache_kind, monkeypatch):
    """Within `use_code_attention`, a 23-token prompt (steps of 5, banded from 2 tokens) is prefilled 5, 5, 5, 5, 3
    and generates SDPA + DynamicCache's tokens; on exit `generate` is the class method again."""
    model = BUILDERS[model_name](window=4)
    inputs = left_padded_batch([tokens(23, seed=1)[0], tokens(16, seed=2)[0]])
    expected = run(model, inputs, DynamicCache(config=model.config))
    make = {"ring": lambda: HybridRingCache(model.config), "dynamic": lambda: DynamicCache(config=model.config)}
    cache = make.get(cache_kind, lambda: None)()
    with use_code_attention(model), banded_prefill(**BANDED_TEST_SETTINGS):
        stepped = prefill_steps_of(model)
        assert isinstance(stepped, SteppedGenerate) and stepped.step == PREFILL_STEP
        enable_prefill_steps(model, CODE_ATTENTION, step=5)  # again: sets the step
        lengths = forward_lengths(model, monkeypatch)
        got = run(model, inputs, cache)
    assert torch.equal(got, expected)
    assert lengths[:5] == [5, 5, 5, 5, 3] and set(lengths[5:]) == {1}
    assert stepped.steps_given == 1 and not stepped.active
    assert "generate" not in model.__dict__ and prefill_steps_of(model) is None


def test_calls_that_keep_one_forward(monkeypatch):
    """No steps where they would not be transformers' chunked prefill of the same result, or were not asked for."""
    model = tiny_gemma3(window=4, attn=CODE_ATTENTION)
    enable_prefill_steps(model, CODE_ATTENTION, step=4)
    stepped = prefill_steps_of(model)
    inputs = left_padded_batch([tokens(13, seed=3)[0]])
    cases = {
        "explicit one forward": {"prefill_chunk_size": None},
        "explicit chunks": {"prefill_chunk_size": 6},
        "no cache": {"use_cache": False},
        "compileable cache": cache_kwargs(HybridRingCache(model.config, max_cache_len=64)),
    }
    for label, kwargs in cases.items():
        lengths = forward_lengths(model, monkeypatch)
        run(model, inputs, **kwargs)
        assert stepped.steps_given == 0, label
        assert lengths[0] in (13, 6), (label, lengths)
    # Multimodal inputs (a text model would not take them: asked of the wrapper directly).
    images = torch.zeros_like(inputs["input_ids"])
    images[0, 3:7] = 1
    assert not stepped.wants_steps({**inputs, "token_type_ids": images})
    assert stepped.wants_steps({**inputs, "token_type_ids": torch.zeros_like(images)})  # text only
    assert not stepped.wants_steps({**inputs, "pixel_values": torch.zeros(1, 3, 8, 8)})
    model.generation_config.prefill_chunk_size = 7  # the model's own setting wins
    run(model, inputs, HybridRingCache(model.config))
    model.generation_config.prefill_chunk_size = None
    model.set_attn_implementation("sdpa")  # another attention: unchanged
    run(model, inputs, HybridRingCache(model.config))
    assert stepped.steps_given == 0
    model.set_attn_implementation(CODE_ATTENTION)
    run(model, inputs, HybridRingCache(model.config))
    assert stepped.steps_given == 1


def test_stacks_with_the_ring_switch():
    """`hybrid_cache.enable` on top of the steps: both apply; disabling the steps leaves the switch working and the
    step wrapper inert below it."""
    model = tiny_gemma3(window=4, attn=CODE_ATTENTION)
    inputs = left_padded_batch([tokens(13, seed=4)[0]])
    model.set_attn_implementation("sdpa")
    expected = run(model, inputs, DynamicCache(config=model.config))
    model.set_attn_implementation(CODE_ATTENTION)
    enable_prefill_steps(model, CODE_ATTENTION, step=4)
    enable(model)
    with banded_prefill(**BANDED_TEST_SETTINGS):
        assert torch.equal(run(model, inputs), expected)
        assert prefill_steps_of(model).steps_given == 1 and model.generate.caches_built == 1
        inner = prefill_steps_of(model)
        disable_prefill_steps(model)
        assert prefill_steps_of(model) is None and not inner.active
        assert torch.equal(run(model, inputs), expected)
        assert inner.steps_given == 1 and model.generate.caches_built == 2
    disable(model)
    assert model.__dict__.get("generate") is inner  # the inert wrapper: passes every call through
    assert torch.equal(run(model, inputs, DynamicCache(config=model.config)), expected)


def test_misuse():
    model = tiny_gemma3(window=4)
    with pytest.raises(ValueError, match="positive int"):
        enable_prefill_steps(model, CODE_ATTENTION, step=0)
    with pytest.raises(TypeError, match="generate"):
        enable_prefill_steps(model.model, CODE_ATTENTION)
    with use_code_attention(model.model):  # a model without `generate`: attention only
        assert model.model.config._attn_implementation == CODE_ATTENTION
    assert disable_prefill_steps(model) is model  # no-op where off
