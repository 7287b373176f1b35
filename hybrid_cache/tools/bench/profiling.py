"""torch.profiler tables (top ops by self CPU time) of a few decode steps, or of a chunked prefill, per cache."""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hybrid_cache import cache_kwargs

from ..compare import make_cache, text_config
from .workload import random_prefill, step_inputs, synthesize_prefill

__all__ = ["profile_decode", "profile_prefill"]


def _tables(run: Callable[[], None], row_limit: int) -> tuple[str, str]:
    """Profile `run` on the CPU: (ops by self CPU time, the same grouped by input shape)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        run()
    return (
        prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=row_limit, max_name_column_width=48),
        prof.key_averages(group_by_input_shape=True).table(
            sort_by="self_cpu_time_total", row_limit=row_limit, max_name_column_width=48, max_shapes_column_width=90
        ),
    )


def profile_decode(
    model: Any, caches: Sequence[str], *, context: int, batch: int, steps: int = 3, row_limit: int = 12
) -> dict[str, str]:
    """Profiler tables of `steps` decode steps per cache after a synthesized `context`-token prefill (2 untimed
    steps first)."""
    dtype = next(model.parameters()).dtype
    vocab = text_config(model).vocab_size
    device = next(model.parameters()).device
    source = random_prefill(model, batch, context, dtype)
    tables = {}
    for cache_name in caches:
        cache = make_cache(cache_name, model, context + steps + 4)
        synthesize_prefill(cache, source)
        _decode_steps(model, cache, batch, context, 2, vocab, device, seed=0)  # warm-up
        tables[cache_name], tables[cache_name + " (by input shape)"] = _tables(
            lambda c=cache: _decode_steps(model, c, batch, context + 2, steps, vocab, device, seed=1), row_limit
        )
        del cache
        gc.collect()
    return tables


def _decode_steps(
    model: Any, cache: Any, batch: int, position: int, steps: int, vocab: int, device: torch.device, seed: int
) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.inference_mode():
        for i in range(steps):
            model(**step_inputs(batch, position + i, vocab, generator, device), **cache_kwargs(cache), use_cache=True)


def profile_prefill(
    model: Any, caches: Sequence[str], *, context: int, chunk: int, row_limit: int = 15, seed: int = 0
) -> dict[str, str]:
    """Profiler tables of a whole chunked prefill (`context` random tokens in chunks of `chunk`) per cache."""
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed + context)
    ids = torch.randint(3, text_config(model).vocab_size, (1, context), generator=generator).to(device)
    tables = {}
    for cache_name in caches:
        cache = make_cache(cache_name, model, context)
        tables[cache_name], tables[cache_name + " (by input shape)"] = _tables(
            lambda c=cache: _prefill(model, c, ids, chunk), row_limit
        )
        del cache
        gc.collect()
    return tables


def _prefill(model: Any, cache: Any, ids: torch.Tensor, chunk: int) -> None:
    with torch.inference_mode():
        for start in range(0, ids.shape[1], chunk):
            model(input_ids=ids[:, start : start + chunk], **cache_kwargs(cache), use_cache=True, logits_to_keep=1)
