"""`enable(model)` with a model whose own `generation_config.cache_implementation` names a cache (some checkpoints ship
`"static"`): every value the installed transformers accepts (read from transformers) passes through, as a
`cache_implementation=` keyword does: the call gives exactly what the same call gives without the switch (the same
tokens, or the same error where transformers cannot build that cache here), and builds no ring. `"hybrid"`, which
transformers unsets (its default for sliding-window models), gets the ring. Before the fix every such call raised
transformers' "Passing both `cache_implementation` ... and `cache`", though the user passed neither.
"""

from __future__ import annotations

import pytest
import torch
from builders import prompt, tiny_gemma3
from transformers import GenerationConfig
from transformers.generation import configuration_utils

import hybrid_cache
from hybrid_cache import HybridRingCache

GREEDY = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)

# Every value `GenerationConfig.validate` accepts in the installed release ("paged" re-routes to continuous batching).
IMPLEMENTATIONS = sorted(set(configuration_utils.ALL_CACHE_IMPLEMENTATIONS) | {"paged"})
PASSED_THROUGH_AS_NONE = {"hybrid"}  # transformers' `_prepare_generation_config` unsets it


def outcome(call):
    """The tokens a `generate` call returns, or the type and first line of the error it raises."""
    try:
        with torch.no_grad():
            return call()
    except Exception as error:  # noqa: BLE001 - the outcome compared is whatever transformers does
        return (type(error), str(error).splitlines()[0] if str(error) else "")


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return torch.equal(a, b)
    return a == b


def returned_cache(output):
    """The cache a `generate` output returns (`cache` from transformers 5.24, `past_key_values` before)."""
    return getattr(output, "cache", None) or output.past_key_values


def bound_paged_cache_memory(monkeypatch, headroom: int = 256 << 20) -> None:
    """Continuous batching sizes its paged cache from the machine's memory (on CPU a share of
    `psutil.virtual_memory().total`, on every release in range): 20 GiB on a 24 GiB machine, which with a second test
    process ran it out of memory. Report `headroom` bytes above what this process holds instead."""
    psutil = pytest.importorskip("psutil")
    real = psutil.virtual_memory

    def bounded():
        return real()._replace(total=psutil.Process().memory_info().rss + headroom)

    monkeypatch.setattr(psutil, "virtual_memory", bounded)


@pytest.fixture(scope="module")
def model():
    return tiny_gemma3(window=4)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("where", ["model_config", "passed_config", "keyword"])
def test_named_cache_implementation_passes_through(model, implementation, where, monkeypatch, one_thread):
    inputs = prompt(length=9)
    monkeypatch.setattr(model.generation_config, "cache_implementation", None)
    if implementation == "paged":
        bound_paged_cache_memory(monkeypatch)
    kwargs = dict(GREEDY)
    if where == "model_config":
        monkeypatch.setattr(model.generation_config, "cache_implementation", implementation)
    elif where == "passed_config":
        kwargs = {"generation_config": GenerationConfig(cache_implementation=implementation, **GREEDY)}
    else:
        kwargs["cache_implementation"] = implementation
    # The outcome of a repeated call: transformers 5.5's "offloaded_hybrid" fails on CUDA the first time, then on an
    # attribute of the cache it half-built.
    outcome(lambda: model.generate(**inputs, **kwargs))
    expected = outcome(lambda: model.generate(**inputs, **kwargs))
    hybrid_cache.enable(model)
    try:
        built = model.generate.caches_built
        got = outcome(lambda: model.generate(**inputs, **kwargs))
        rings = model.generate.caches_built - built
    finally:
        hybrid_cache.disable(model)
    assert same(got, expected), (implementation, where, got, expected)
    if isinstance(got, tuple):
        assert "Passing both" not in got[1]
    gets_ring = implementation in PASSED_THROUGH_AS_NONE
    assert rings == int(gets_ring), (implementation, where)


def test_static_model_config_gives_the_static_cache_and_none_gives_the_ring(monkeypatch, one_thread):
    """The reported case: a checkpoint shipping `cache_implementation="static"`. A `cache_implementation=None` keyword
    overrides the model's value (as in transformers), so that call gets the ring. (A model of its own: transformers
    5.5's "paged" in the test above leaves the module's model on `paged|sdpa` attention, which the ring refuses.)"""
    model = tiny_gemma3(window=4)
    monkeypatch.setattr(model.generation_config, "cache_implementation", "static")
    inputs = prompt(length=9)
    hybrid_cache.enable(model)
    try:
        out = model.generate(**inputs, **GREEDY, return_dict_in_generate=True)
        assert type(returned_cache(out)).__name__ == "StaticCache" and model.generate.caches_built == 0
        out = model.generate(**inputs, **GREEDY, cache_implementation=None, return_dict_in_generate=True)
        assert isinstance(returned_cache(out), HybridRingCache) and model.generate.caches_built == 1
    finally:
        hybrid_cache.disable(model)
