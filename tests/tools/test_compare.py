"""The named caches of the tools (`hybrid_cache.tools.compare`): one table name -> `HybridRingCache` options, and
the same caches as the suffix parsing it replaced built."""

from __future__ import annotations

import pytest
from builders import tiny_gemma3
from transformers import DynamicCache, StaticCache
from transformers.cache_utils import Fp8QuantizedLayer

from hybrid_cache import HybridRingCache
from hybrid_cache.tools.compare import CACHE_NAMES, EXACT_CACHE_NAMES, RING_CACHE_OPTIONS, make_cache

# The names and their order before the table (the help text, --caches choices and the plots' legend order).
OLD_CACHE_NAMES = (
    "ring",
    "dynamic",
    "static",
    "ring-int8",
    "ring-int4",
    "ring-fp8",
    "ring-int4-rot",
    "ring-int4-norot",
    "ring-int8-nocal",
    "ring-int4-nocal",
    "ring-int8-deq",
    "ring-int4-deq",
    "ring-stream",
    "ring-hf-fp8",
)
OLD_QUANTIZED = {
    "ring-int8": "int8",
    "ring-int4": "int4",
    "ring-fp8": "fp8",
    "ring-int4-rot": "int4",
    "ring-int4-norot": "int4",
    "ring-int8-nocal": "int8",
    "ring-int4-nocal": "int4",
    "ring-int8-deq": "int8",
    "ring-int4-deq": "int4",
}


def old_ring_kwargs(name: str, fixed: int | None) -> dict:
    """The `HybridRingCache` keyword arguments the suffix-parsing `make_cache` passed for ring `name` (the oracle)."""
    if name == "ring":
        return {"max_cache_len": fixed}
    if name == "ring-stream":
        return {"full_layer_sink_tokens": 4, "full_layer_window": 2044}
    return {
        "max_cache_len": fixed,
        "full_layer_quantization": OLD_QUANTIZED[name],
        "full_layer_rotation": {"rot": True, "norot": False}.get(name.rsplit("-", 1)[-1]),
        "full_layer_key_calibration": not name.endswith("-nocal"),
        "full_layer_code_attention": False if name.endswith("-deq") else None,
    }


@pytest.fixture(scope="module")
def config():
    return tiny_gemma3(window=4, head_dim=64).config


def test_names_and_order_unchanged():
    assert CACHE_NAMES == OLD_CACHE_NAMES
    assert set(RING_CACHE_OPTIONS) == {"ring", "ring-stream", *OLD_QUANTIZED}
    assert set(EXACT_CACHE_NAMES) <= set(CACHE_NAMES)


@pytest.mark.parametrize("compileable", [False, True], ids=["growing", "compileable"])
@pytest.mark.parametrize("name", list(RING_CACHE_OPTIONS))
def test_ring_options_equal_the_old_construction(config, name, compileable):
    if compileable and name == "ring-stream":
        pytest.skip("no compileable mode: test_not_compileable")
    cache = make_cache(name, config, 64, compileable=compileable)
    assert isinstance(cache, HybridRingCache)
    assert cache.options == HybridRingCache(config, **old_ring_kwargs(name, 64 if compileable else None)).options
    for option, value in RING_CACHE_OPTIONS[name].items():
        assert getattr(cache.options, option) == value, (name, option)
    assert cache.options.max_cache_len == (64 if compileable else None)


def test_every_ring_name_is_a_different_cache(config):
    """Different table entries, and different caches but for `ring-int4-rot`, which states int4's default."""
    entries = [sorted(options.items()) for options in RING_CACHE_OPTIONS.values()]
    assert len({repr(entry) for entry in entries}) == len(entries)
    built = {name: make_cache(name, config, 64).options for name in RING_CACHE_OPTIONS}
    alike = [(a, b) for a in built for b in built if a < b and built[a] == built[b]]
    assert alike == [("ring-int4", "ring-int4-rot")]


def test_the_other_caches(config):
    assert type(make_cache("dynamic", config, 64)) is DynamicCache
    full = [index for index, kind in enumerate(config.layer_types) if kind == "full_attention"]
    static = make_cache("static", config, 64)
    assert type(static) is StaticCache and [static.layers[index].max_cache_len for index in full] == [64] * len(full)
    hf_fp8 = make_cache("ring-hf-fp8", config, 64)
    assert full == [index for index, layer in enumerate(hf_fp8.layers) if isinstance(layer, Fp8QuantizedLayer)]


@pytest.mark.parametrize("name", ["ring-stream", "ring-hf-fp8"])
def test_not_compileable(config, name):
    with pytest.raises(ValueError, match=f"{name} .*without --compile"):
        make_cache(name, config, 64, compileable=True)


def test_unknown_name(config):
    with pytest.raises(ValueError, match="unknown cache 'ring-int3'; expected one of ring, dynamic"):
        make_cache("ring-int3", config, 64)
