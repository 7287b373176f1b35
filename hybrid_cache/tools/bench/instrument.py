"""Instrumentation of a decode step: time spent in cache operations (``cache.update`` and mask creation) and bytes
written by tensor operations inside ``cache.update``."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hybrid_cache import cache_kwargs
from hybrid_cache.specs import SLIDING, layer_specs

from ..compare import text_config

__all__ = ["MASK_FUNCTION_NAMES", "CacheOpTimer", "count_update_copy_bytes"]

MASK_FUNCTION_NAMES = ("create_causal_mask", "create_sliding_window_causal_mask")


class CacheOpTimer:
    """Accumulates wall time spent in ``cache.update`` and in the model's mask-creation functions.

    Use :meth:`instrument` around the decode; it wraps the cache instance's ``update`` and patches
    ``create_causal_mask`` / ``create_sliding_window_causal_mask`` in the model's modeling module, restoring both.
    """

    def __init__(self) -> None:
        self.update_s = 0.0
        self.mask_s = 0.0
        self.update_calls = 0
        self.max_sliding_returned = 0  # longest key tensor returned by an update of a sliding layer

    def reset(self) -> None:
        self.update_s = self.mask_s = 0.0
        self.update_calls = 0

    @property
    def total_s(self) -> float:
        return self.update_s + self.mask_s

    @contextlib.contextmanager
    def instrument(self, model: Any, cache: Any) -> Iterator[CacheOpTimer]:
        sliding = {spec.index for spec in layer_specs(text_config(model)) if spec.kind == SLIDING}
        original_update = cache.update
        timer = self

        def timed_update(key_states, value_states, layer_idx, *args, **kwargs):
            start = time.perf_counter()
            out = original_update(key_states, value_states, layer_idx, *args, **kwargs)
            timer.update_s += time.perf_counter() - start
            timer.update_calls += 1
            if layer_idx in sliding:
                timer.max_sliding_returned = max(timer.max_sliding_returned, out[0].shape[-2])
            return out

        modules = {
            sys.modules[type(m).__module__]
            for m in model.modules()
            if type(m).__module__.startswith("transformers.models.")
        }
        patched: list[tuple[Any, str, Any]] = []

        def wrap(fn):
            def timed_mask(*args, **kwargs):
                start = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    timer.mask_s += time.perf_counter() - start

            timed_mask.__wrapped__ = fn
            return timed_mask

        cache.update = timed_update
        try:
            for module in modules:
                for name in MASK_FUNCTION_NAMES:
                    fn = getattr(module, name, None)
                    if fn is not None:
                        patched.append((module, name, fn))
                        setattr(module, name, wrap(fn))
            yield self
        finally:
            for module, name, fn in patched:
                setattr(module, name, fn)
            del cache.update  # back to the class method


_WRITE_SOURCE_OPS = {"index_copy_", "index_copy", "index_put_", "index_put", "_index_put_impl_"}
_NO_WRITE_OPS = {
    "view",
    "_unsafe_view",
    "slice",
    "select",
    "as_strided",
    "expand",
    "t",
    "transpose",
    "unsqueeze",
    "squeeze",
    "alias",
    "detach",
    "permute",
    "split",
    "split_with_sizes",
    "unbind",
    "lift_fresh",
    "empty",
    "empty_like",
    "detach_",
    "new_empty",
    "empty_strided",
    "new_empty_strided",
    "sym_size",
    "sym_stride",
    "is_same_size",
    "_local_scalar_dense",
    "item",
    "sym_numel",
    "sym_storage_offset",
}


class _CopyCounter(TorchDispatchMode):
    """Counts bytes written by aten ops (outputs; for index copies the source) and which ops wrote them."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0
        self.by_op: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in _NO_WRITE_OPS:
            return out
        if name in _WRITE_SOURCE_OPS:
            source = args[-1] if isinstance(args[-1], torch.Tensor) else (kwargs or {}).get("source")
            written = source.numel() * source.element_size() if isinstance(source, torch.Tensor) else 0
        else:
            written = 0
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    written += t.numel() * t.element_size()
        if written:
            self.bytes += written
            self.by_op[name] = self.by_op.get(name, 0) + written
        return out


def count_update_copy_bytes(
    model: Any, cache: Any, step_inputs: dict[str, torch.Tensor]
) -> tuple[int, dict[str, int]]:
    """Run one decode step and count the bytes written by tensor ops inside ``cache.update`` (all layers)."""
    counter = _CopyCounter()
    original_update = cache.update

    def counted_update(*args, **kwargs):
        with counter:
            return original_update(*args, **kwargs)

    cache.update = counted_update
    try:
        with torch.inference_mode():
            model(**step_inputs, **cache_kwargs(cache), use_cache=True)
    finally:
        del cache.update
    return counter.bytes, counter.by_op
