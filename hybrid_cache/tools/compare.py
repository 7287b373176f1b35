"""The caches `HybridRingCache` is compared against, and what a cache (and the process) holds: shared by the
perplexity evaluation and the decode benchmark, so both build the same caches and count bytes the same way."""

from __future__ import annotations

import resource
import sys
from typing import Any

import torch
from transformers import DynamicCache, StaticCache

from hybrid_cache import HybridRingCache, specs

__all__ = [
    "CACHE_NAMES",
    "EXACT_CACHE_NAMES",
    "RING_CACHE_OPTIONS",
    "full_cache_bytes_per_token",
    "kv_bytes_held",
    "layer_kv_geometry",
    "make_cache",
    "peak_rss_bytes",
    "text_config",
]

# `dynamic` = DynamicCache(config=config); `static` = StaticCache(config, max_len). The rings are
# `HybridRingCache(config, **RING_CACHE_OPTIONS[name])`: `ring` with the defaults; `ring-<mode>` with
# compressed full-attention layers (whose default rotates int4 only; `-rot` / `-norot` force the Hadamard rotation
# on / off, `-nocal` turns the key calibration off: the designs before, kept for side-by-side runs); `ring-stream`
# with bounded full layers (4 sinks + a 2044-token window: a 2048-token budget, so an 8192-token text streams through
# 4x its budget).
# The compressed caches' decode steps attend on the int8 / int4 codes when the model's attention implementation is
# "hybrid_cache_sdpa" (`hybrid_cache.code_attention`; the benchmark loads models with it); `-deq` keeps today's
# dequantize-then-SDPA path whatever the model uses (`full_layer_code_attention=False`), for side-by-side runs.
# `ring-hf-fp8`: the alternative we did not pick, for side-by-side comparisons: the ring with transformers' own
# `Fp8QuantizedLayer` as full layers (per-tensor scale frozen at the first update; not croppable, not compileable).
STREAM_SINK_TOKENS, STREAM_WINDOW = 4, 2044
#: name -> the `HybridRingCache` keyword options of that ring (besides `max_cache_len`, set by `make_cache`).
RING_CACHE_OPTIONS: dict[str, dict[str, Any]] = {
    "ring": {},
    "ring-int8": {"full_layer_quantization": "int8"},
    "ring-int4": {"full_layer_quantization": "int4"},
    "ring-fp8": {"full_layer_quantization": "fp8"},
    "ring-int4-rot": {"full_layer_quantization": "int4", "full_layer_rotation": True},
    "ring-int4-norot": {"full_layer_quantization": "int4", "full_layer_rotation": False},
    "ring-int8-nocal": {"full_layer_quantization": "int8", "full_layer_key_calibration": False},
    "ring-int4-nocal": {"full_layer_quantization": "int4", "full_layer_key_calibration": False},
    "ring-int8-deq": {"full_layer_quantization": "int8", "full_layer_code_attention": False},
    "ring-int4-deq": {"full_layer_quantization": "int4", "full_layer_code_attention": False},
    "ring-stream": {"full_layer_sink_tokens": STREAM_SINK_TOKENS, "full_layer_window": STREAM_WINDOW},
}
# The caches whose results must equal a no-cache forward (the others are approximate by design).
EXACT_CACHE_NAMES = ("ring", "dynamic", "static")
CACHE_NAMES = (
    *EXACT_CACHE_NAMES,
    *(name for name in RING_CACHE_OPTIONS if name not in EXACT_CACHE_NAMES),
    "ring-hf-fp8",
)


def text_config(model_or_config: Any) -> Any:
    """The decoder text config of a model or config (composite configs: their text part; `specs.text_config`)."""
    return specs.text_config(getattr(model_or_config, "config", model_or_config))


def make_cache(name: str, model_or_config: Any, max_cache_len: int, *, compileable: bool = False) -> Any:
    """Build cache `name` for a model (or its config).

    Args:
        name: one of `CACHE_NAMES` (the rings: the keys of `RING_CACHE_OPTIONS`).
        model_or_config: the model or its config.
        max_cache_len: `StaticCache`'s capacity (prompt + new tokens); with `compileable=True` also the ring's
            full-layer capacity (its fixed, compileable mode).
    """
    config = getattr(model_or_config, "config", model_or_config)
    if name in RING_CACHE_OPTIONS:
        options = RING_CACHE_OPTIONS[name]
        if compileable and options.get("full_layer_window") is not None:
            raise ValueError(f"{name} (bounded full layers) has no compileable mode; time it without --compile.")
        return HybridRingCache(config, max_cache_len=max_cache_len if compileable else None, **options)
    if name == "ring-hf-fp8":
        return _ring_with_transformers_fp8(config, compileable)
    if name == "dynamic":
        return DynamicCache(config=config)
    if name == "static":
        return StaticCache(config=config, max_cache_len=max_cache_len)
    raise ValueError(f"unknown cache {name!r}; expected one of {', '.join(CACHE_NAMES)}")


def _ring_with_transformers_fp8(config: Any, compileable: bool) -> HybridRingCache:
    """The ring whose full layers are transformers' `Fp8QuantizedLayer` (the side-by-side alternative)."""
    from transformers.cache_utils import Fp8QuantizedLayer

    from hybrid_cache.full import GrowableFullLayer

    if compileable:
        raise ValueError(
            "ring-hf-fp8 (transformers' Fp8QuantizedLayer) is not compileable; time it without --compile."
        )
    cache = HybridRingCache(config)
    for index, layer in enumerate(cache.layers):
        if isinstance(layer, GrowableFullLayer):
            cache.layers[index] = Fp8QuantizedLayer()
    return cache


def layer_kv_geometry(model_or_config: Any) -> list[tuple[int, int] | None]:
    """`(kv_heads, head_dim)` of every layer, `None` for layers that store nothing (KV-shared: they reuse an earlier
    layer's keys and values).

    The layers' specifications (`hybrid_cache.specs.layer_specs`): per layer, since Gemma 4's configs are
    heterogeneous (global and sliding layers have different head sizes and KV heads).
    """
    return [
        (spec.kv_heads, spec.head_dim) if spec.stores else None
        for spec in specs.layer_specs(text_config(model_or_config))
    ]


def full_cache_bytes_per_token(model_or_config: Any, dtype: torch.dtype) -> int:
    """KV bytes per token (batch 1) of a cache keeping every token in every storing layer: the "full cache"."""
    element = torch.empty((), dtype=dtype).element_size()
    return sum(2 * heads * head_dim * element for heads, head_dim in filter(None, layer_kv_geometry(model_or_config)))


def kv_bytes_held(cache: Any) -> int:
    """Bytes of the distinct K/V storages a cache holds (allocated, not used: a `StaticCache` counts its whole buffer,
    a view keeping a larger tensor alive counts it whole); 0 for `None`."""
    seen: set[int] = set()
    total = 0
    for layer in getattr(cache, "layers", []):
        tensors = [getattr(layer, "keys", None), getattr(layer, "values", None)]
        if hasattr(layer, "storage_tensors"):  # hybrid_cache's compressed layers: codes and scales
            tensors += layer.storage_tensors()
        for quantized in (getattr(layer, "_quantized_keys", None), getattr(layer, "_quantized_values", None)):
            if isinstance(quantized, tuple):  # transformers' Fp8QuantizedLayer: (codes, per-tensor scale)
                tensors += list(quantized)
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor) and tensor.numel():
                storage = tensor.untyped_storage()
                if storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    total += storage.nbytes()
    return total


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (`getrusage` `ru_maxrss`: KiB on Linux, bytes on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)
