"""`hybrid_cache.enable` / `disable` and the cache keyword: every generate() caller gets the ring, exactly.

Properties: a generate() call that brings no cache gets one fresh HybridRingCache (and no DynamicCache) and the same
tokens as without the switch; an explicit cache, `use_cache=False` or a named `cache_implementation` passes through;
`disable` restores the exact previous `generate`; `cache=` on a release before 5.24 is swallowed by the model (the trap)
and `cache_kwargs` avoids it. The pipeline tests run the embedded Gemma 3 270M past its 512-token window.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import transformers
from builders import (
    BOI_ID,
    EOI_ID,
    IMAGE_ID,
    prompt,
    random_images,
    tiny_gemma3,
    tiny_gemma3_multimodal,
    tiny_gemma4,
)
from transformers import DynamicCache

import hybrid_cache
from hybrid_cache import HybridRingCache
from hybrid_cache.compat import CACHE_KEYWORD, CACHE_KEYWORD_SINCE, TRANSFORMERS_VERSION, cache_kwargs
from hybrid_cache.switch import is_enabled


class ConstructionCounter:
    """Counts constructions of cache classes (monkeypatched `__init__`), without changing what they do."""

    def __init__(self, monkeypatch, *classes):
        self.counts = {cls.__name__: 0 for cls in classes}
        for cls in classes:
            original = cls.__init__

            def counting_init(obj, *args, _original=original, _name=cls.__name__, **kwargs):
                if type(obj).__name__ == _name:
                    self.counts[_name] += 1
                _original(obj, *args, **kwargs)

            monkeypatch.setattr(cls, "__init__", counting_init)


def old_keyword_warning():
    """`past_key_values=` works on every supported release; from 5.24 transformers warns that it is deprecated."""
    if CACHE_KEYWORD == "cache":
        return pytest.warns(FutureWarning, match="past_key_values")
    return contextlib.nullcontext()


def returned_cache(out):
    """The cache a `return_dict_in_generate=True` output carries (`cache` from 5.24, `past_key_values` before)."""
    for name in ("cache", "past_key_values"):
        if out.get(name) is not None:
            return out[name]
    return None


GREEDY = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("builder", [tiny_gemma3, tiny_gemma4])
def test_enabled_generate_equals_dynamic_cache_one_ring_per_call(builder, monkeypatch, one_thread):
    model = builder(window=6)
    inputs = prompt(length=20)
    expected = model.generate(**inputs, **GREEDY, **cache_kwargs(DynamicCache(config=model.config)))
    hybrid_cache.enable(model)  # builds (and drops) one cache to check the options
    counter = ConstructionCounter(monkeypatch, HybridRingCache, DynamicCache)
    assert is_enabled(model)
    for call in range(1, 3):
        out = model.generate(**inputs, **GREEDY, return_dict_in_generate=True)
        assert torch.equal(out.sequences, expected)
        assert isinstance(returned_cache(out), HybridRingCache)
        assert counter.counts == {"HybridRingCache": call, "DynamicCache": 0}
    assert model.generate.caches_built == 2


def test_beams_and_sampling_through_the_switch(one_thread):
    model = tiny_gemma3(window=6)
    inputs = prompt(2, 15)
    for options in (dict(num_beams=3), dict(do_sample=True, top_k=20)):
        kwargs = dict(max_new_tokens=10, min_new_tokens=10, pad_token_id=0, **options)
        torch.manual_seed(0)
        expected = model.generate(**inputs, **kwargs, **cache_kwargs(DynamicCache(config=model.config)))
        hybrid_cache.enable(model)
        torch.manual_seed(0)
        got = model.generate(**inputs, **kwargs)
        hybrid_cache.disable(model)
        assert torch.equal(got, expected), options


def test_explicit_cache_and_opt_outs_pass_through(monkeypatch, one_thread):
    model = tiny_gemma3(window=6)
    inputs = prompt(length=10)
    hybrid_cache.enable(model)
    counter = ConstructionCounter(monkeypatch, HybridRingCache)
    mine = DynamicCache(config=model.config)
    with old_keyword_warning():
        model.generate(**inputs, **GREEDY, past_key_values=mine)  # the spelling of most code and tutorials
    assert mine.get_seq_length() == 10 + 11
    model.generate(**inputs, **GREEDY, use_cache=False)
    model.generate(**inputs, **GREEDY, cache_implementation="static")
    assert counter.counts["HybridRingCache"] == 0
    ring = HybridRingCache(model.config)
    model.generate(**inputs, **GREEDY, **cache_kwargs(ring))
    assert ring.get_seq_length() == 10 + 11 and counter.counts["HybridRingCache"] == 1  # only the one built here
    if TRANSFORMERS_VERSION < CACHE_KEYWORD_SINCE:
        with pytest.raises(ValueError, match="past_key_values=cache"):
            model.generate(**inputs, **GREEDY, cache=HybridRingCache(model.config))


def test_disable_restores_exactly_and_options_are_checked(one_thread):
    model = tiny_gemma3(window=6)
    assert "generate" not in model.__dict__
    hybrid_cache.enable(model, rollback_margin=2)
    hybrid_cache.enable(model, rollback_margin=3)  # replaces the options, does not stack
    assert model.generate.cache_options == {"rollback_margin": 3} and model.generate.previous is None
    hybrid_cache.disable(model)
    assert "generate" not in model.__dict__ and not is_enabled(model)
    hybrid_cache.disable(model)  # no-op

    def someone_elses(*args, **kwargs):
        return "theirs"

    model.generate = someone_elses
    hybrid_cache.enable(model)
    assert model.generate(**prompt(length=4)) == "theirs"  # their wrapper runs, under ours
    hybrid_cache.disable(model)
    assert model.__dict__["generate"] is someone_elses
    del model.generate

    with pytest.raises(TypeError):
        hybrid_cache.enable(model, no_such_option=1)
    with pytest.raises(ValueError, match="full_layer_quantization"):
        hybrid_cache.enable(model, full_layer_quantization="int3")
    assert "generate" not in model.__dict__
    with pytest.raises(TypeError, match="generate"):
        hybrid_cache.enable(torch.nn.Linear(2, 2))


def test_deepcopy_of_an_enabled_model_builds_caches_for_the_copy(one_thread):
    model = hybrid_cache.enable(tiny_gemma3(window=6))
    twin = copy.deepcopy(model)
    assert twin.generate.model is twin and is_enabled(twin)
    out = twin.generate(**prompt(length=12), **GREEDY, return_dict_in_generate=True)
    assert isinstance(returned_cache(out), HybridRingCache)


def test_composite_multimodal_model(one_thread):
    model = tiny_gemma3_multimodal(window=4)
    images = random_images(model, 1)
    ids = torch.tensor([[2, 5, 6, BOI_ID] + [IMAGE_ID] * model.tiny_tokens_per_image + [EOI_ID] + list(range(7, 20))])
    kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), **images, **GREEDY)
    expected = model.generate(**kwargs, **cache_kwargs(DynamicCache(config=model.config)))
    hybrid_cache.enable(model)
    assert torch.equal(model.generate(**kwargs), expected)
    assert model.generate.caches_built == 1


def test_cache_keyword_trap_before_5_24(one_thread):
    """Before 5.24 a model forward swallows `cache=` in `**kwargs` and runs without any cache: the logits of a
    continuation are wrong and the cache stays empty. `cache_kwargs` uses the name the release reads."""
    model = tiny_gemma3(window=6)
    ids = prompt(length=14)["input_ids"]
    oracle = model(input_ids=ids).logits[:, 10:]
    right = HybridRingCache(model.config)
    model(input_ids=ids[:, :10], **cache_kwargs(right))
    torch.testing.assert_close(model(input_ids=ids[:, 10:], **cache_kwargs(right)).logits, oracle, atol=1e-4, rtol=0)
    if TRANSFORMERS_VERSION >= CACHE_KEYWORD_SINCE:
        assert CACHE_KEYWORD == "cache"
        return
    assert CACHE_KEYWORD == "past_key_values"
    swallowed = HybridRingCache(model.config)
    model(input_ids=ids[:, :10], cache=swallowed)
    assert swallowed.get_seq_length() == 0  # never written
    wrong = model(input_ids=ids[:, 10:], cache=swallowed).logits
    assert (wrong - oracle).abs().max() > 1e-2  # the silent wrong result that cache_kwargs avoids


# --- the embedded model, through transformers' pipeline ------------------------------------------------------------
@pytest.fixture(scope="module")
def real_model():
    from hybrid_cache.tools.models import load_model

    model, tokenizer = load_model()
    return model, tokenizer


@pytest.mark.slow
def test_text_generation_pipeline_past_the_window(real_model, monkeypatch):
    model, tokenizer = real_model
    window = model.config.get_text_config().sliding_window
    text = " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(60))
    assert len(tokenizer(text).input_ids) > window + 20
    pipe = transformers.pipeline("text-generation", model=model, tokenizer=tokenizer)
    kwargs = dict(max_new_tokens=24, do_sample=False, return_full_text=False)
    expected = pipe(text, **kwargs)[0]["generated_text"]

    hybrid_cache.enable(model)
    counter = ConstructionCounter(monkeypatch, HybridRingCache, DynamicCache)
    try:
        for call in (1, 2):
            assert pipe(text, **kwargs)[0]["generated_text"] == expected
            assert counter.counts == {"HybridRingCache": call, "DynamicCache": 0}
        mine = DynamicCache(config=model.config)  # an explicit cache passes through the pipeline untouched
        with old_keyword_warning():
            assert pipe(text, **kwargs, past_key_values=mine)[0]["generated_text"] == expected
        assert mine.get_seq_length() > window and counter.counts["HybridRingCache"] == 2
    finally:
        hybrid_cache.disable(model)
    pipe(text, max_new_tokens=2, do_sample=False)
    assert counter.counts["HybridRingCache"] == 2 and counter.counts["DynamicCache"] == 2
