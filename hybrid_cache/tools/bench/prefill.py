"""Prefill: the time to put a long prompt into each cache chunk by chunk (evaluation), the K/V bytes each cache holds
on the way, ``generate(..., prefill_chunk_size=...)``'s bound on what a ring's sliding layer returns, and the time to
the first token of one whole-prompt ``generate`` per way of running it (`run_ttft_benchmark`: transformers' SDPA
with DynamicCache, whole or with ``prefill_chunk_size``, the ring on SDPA, the ring on ``hybrid_cache_sdpa``'s banded
prefill), with the peak memory of each.

A prefill run feeds `context` random token ids through ``model(input_ids=chunk, **cache_kwargs(cache), use_cache=True,
logits_to_keep=1)`` in chunks of `chunk` tokens, as ``generate``'s chunked prefill does (the model builds every mask
itself; only the last position's logits are computed). Before the timed runs each cache does one untimed short
prefill (first-call costs); runs are interleaved across caches (``for rep: for cache``, the order rotated each rep so
that no cache always goes first); every run uses a fresh cache.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hybrid_cache import cache_kwargs, use_code_attention
from hybrid_cache.specs import declared_window

from ..compare import kv_bytes_held, make_cache, peak_rss_bytes, text_config
from .instrument import CacheOpTimer
from .machine import Contention, ContentionMeter, RssSampler, current_rss_bytes, release_free_memory, sync

__all__ = [
    "TTFT_VARIANTS",
    "PrefillResult",
    "TtftResult",
    "prefill_chunk_check",
    "run_prefill_benchmark",
    "run_ttft_benchmark",
]


@dataclass
class PrefillResult:
    """One (cache, context, chunk, dtype) row of the prefill benchmark.

    Attributes:
        prefill_ms_median / prefill_ms_min: wall time of the whole prefill (all chunks), median / min over reps.
        tokens_per_s: ``batch * context / median``.
        peak_kv_bytes: most K/V bytes the cache held after any chunk (distinct storages, as `kv_bytes_held`).
        kv_bytes: K/V bytes held after the last chunk.
        max_abs_logit_diff: last-position logits of this cache's first run against the reference cache's (the first
            of ``dynamic`` / the first cache given) on the same tokens; 0 for the reference itself.
        other_cpu_cores / loadavg_max / competing_load: the load while this row's runs were timed.
    """

    cache: str
    context: int
    chunk: int
    dtype: str
    prefill_ms_median: float
    tokens_per_s: float
    peak_kv_bytes: int
    prefill_ms_min: float = 0.0
    kv_bytes: int = 0
    batch: int = 1
    model: str = ""
    window: int | None = None
    reps: int = 1
    prefill_ms: list[float] = field(default_factory=list)
    max_abs_logit_diff: float | None = None
    other_cpu_cores: float | None = None
    loadavg_max: float | None = None
    competing_load: bool = False


def _prefill_once(model: Any, cache_name: str, ids: torch.Tensor, chunk: int) -> tuple[float, int, int, torch.Tensor]:
    """One chunked prefill into a fresh cache: (seconds in forwards, peak K/V bytes, final K/V bytes, last logits)."""
    device = ids.device
    cache = make_cache(cache_name, model, ids.shape[1])
    gc.collect()
    seconds, peak = 0.0, 0
    with torch.inference_mode():
        for start in range(0, ids.shape[1], chunk):
            sync(device)
            t0 = time.perf_counter()
            out = model(
                input_ids=ids[:, start : start + chunk], **cache_kwargs(cache), use_cache=True, logits_to_keep=1
            )
            sync(device)
            seconds += time.perf_counter() - t0
            peak = max(peak, kv_bytes_held(cache))  # outside the timed region
    logits = out.logits[:, -1].float().clone()
    held = kv_bytes_held(cache)
    del cache, out
    gc.collect()
    return seconds, peak, held, logits


def run_prefill_benchmark(
    model: Any,
    *,
    model_name: str,
    dtype: torch.dtype,
    contexts: Sequence[int],
    chunks: Sequence[int],
    caches: Sequence[str],
    reps: int,
    batch: int = 1,
    log: Callable[[str], None] = print,
    meter: ContentionMeter | None = None,
    seed: int = 0,
) -> list[PrefillResult]:
    """Time a chunked prefill of every context with every chunk size into every cache, reps interleaved across caches.

    Args:
        model: the causal LM (its dtype is `dtype`).
        contexts: prompt lengths (tokens).
        chunks: prefill chunk sizes (a chunk larger than the context is one forward).
        caches: names of `hybrid_cache.tools.compare.CACHE_NAMES`.
        reps: repetitions per (context, chunk).
        meter: records the load during each row's runs (default: one for torch's threads).
    """
    meter = meter or ContentionMeter()
    dtype_name = str(dtype).replace("torch.", "")
    config = text_config(model)
    device = next(model.parameters()).device
    reference = "dynamic" if "dynamic" in caches else caches[0]
    results = []
    for context in contexts:
        generator = torch.Generator().manual_seed(seed + context)
        ids = torch.randint(3, config.vocab_size, (batch, context), generator=generator).to(device)
        for chunk in chunks:
            times: dict[str, list[float]] = {c: [] for c in caches}
            peaks: dict[str, int] = {}
            held: dict[str, int] = {}
            logits: dict[str, torch.Tensor] = {}
            load = {c: Contention() for c in caches}
            for cache_name in caches:  # untimed warm-up: first calls of each path (allocations, kernels, hooks)
                _prefill_once(model, cache_name, ids[:, : min(context, 2 * chunk)], chunk)
            for rep in range(reps):
                for cache_name in caches[rep % len(caches) :] + caches[: rep % len(caches)]:  # rotate who goes first
                    with meter.track(load[cache_name]):
                        seconds, peak, final, last = _prefill_once(model, cache_name, ids, chunk)
                    times[cache_name].append(seconds * 1e3)
                    peaks[cache_name] = max(peaks.get(cache_name, 0), peak)
                    held[cache_name] = final
                    logits.setdefault(cache_name, last)
            for cache_name in caches:
                median = statistics.median(times[cache_name])
                diff = float((logits[cache_name] - logits[reference]).abs().max())
                result = PrefillResult(
                    cache=cache_name,
                    context=context,
                    chunk=chunk,
                    dtype=dtype_name,
                    prefill_ms_median=median,
                    tokens_per_s=1e3 * batch * context / median,
                    peak_kv_bytes=peaks[cache_name],
                    prefill_ms_min=min(times[cache_name]),
                    kv_bytes=held[cache_name],
                    batch=batch,
                    model=model_name,
                    window=declared_window(config),
                    reps=reps,
                    prefill_ms=[round(t, 2) for t in times[cache_name]],
                    max_abs_logit_diff=diff,
                    other_cpu_cores=load[cache_name].other_cores,
                    loadavg_max=load[cache_name].loadavg_max,
                    competing_load=meter.competing(load[cache_name]),
                )
                results.append(result)
                busy = "  [!] other work competed for the CPUs" if result.competing_load else ""
                log(
                    f"  {dtype_name:>8} ctx={context:>6} chunk={chunk:>5} {cache_name:>9}: prefill "
                    f"{median / 1e3:8.2f} s (min {result.prefill_ms_min / 1e3:.2f}), {result.tokens_per_s:7.1f} tok/s, "
                    f"peak KV {result.peak_kv_bytes / 2**20:.1f} MiB, last logits vs {reference} {diff:.1e}{busy}"
                )
    return results


def prefill_chunk_check(
    model: Any, *, prompt_length: int = 32768, chunk_size: int = 2048, max_new_tokens: int = 2
) -> dict[str, Any]:
    """``model.generate`` of a `prompt_length` prompt with ``prefill_chunk_size=chunk_size`` into a HybridRingCache.

    Records the longest key tensor returned by a sliding-layer update (it must be <= ring capacity + chunk), the
    largest sliding-layer storage, the KV bytes held, and the RSS (sampled every 5 ms: peak during generate minus
    the RSS before; plus the process' ``ru_maxrss``).
    """
    from hybrid_cache import HybridRingCache

    config = text_config(model)
    cache = HybridRingCache(model.config)
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, config.vocab_size, (1, prompt_length), generator=generator)
    input_ids = input_ids.to(next(model.parameters()).device)
    timer = CacheOpTimer()
    gc.collect()
    rss_before = current_rss_bytes()
    start = time.perf_counter()
    with timer.instrument(model, cache), RssSampler() as sampler, torch.inference_mode():
        output = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            **cache_kwargs(cache),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            prefill_chunk_size=chunk_size,
        )
    elapsed = time.perf_counter() - start
    sliding_caps = [
        layer.capacity for layer, kind in zip(cache.layers, cache.layer_kinds) if kind == "sliding_attention"
    ]
    window = declared_window(config)
    report = cache.memory_report()
    bound = (max(sliding_caps) if sliding_caps else 0) + chunk_size
    return {
        "prompt_length": prompt_length,
        "chunk_size": chunk_size,
        "generated": int(output.shape[-1] - prompt_length),
        "sliding_window": window,
        "sliding_capacity_max": max(sliding_caps) if sliding_caps else 0,
        "max_sliding_update_returned_tokens": timer.max_sliding_returned,
        "bound_capacity_plus_chunk": bound,
        "within_bound": timer.max_sliding_returned <= bound,
        "kv_bytes": report.total_bytes,
        "full_cache_bytes": report.full_cache_bytes,
        "rss_before_bytes": rss_before,
        "rss_peak_sampled_bytes": sampler.peak,
        "rss_peak_delta_bytes": sampler.peak - rss_before,
        "ru_maxrss_bytes": peak_rss_bytes(),
        "seconds": elapsed,
        "cache_update_s": timer.update_s,
        "mask_s": timer.mask_s,
    }


# --- time to first token of one whole-prompt generate -----------------------------------------------------------------
#: How `run_ttft_benchmark` runs a prompt: (attention, cache, prefill_chunk_size). "banded" is hybrid_cache's attention
#: (`use_code_attention`: the banded prefill); "sdpa" transformers' own.
TTFT_VARIANTS: dict[str, tuple[str, str, int | None]] = {
    "sdpa": ("sdpa", "dynamic", None),
    "sdpa-chunk512": ("sdpa", "dynamic", 512),
    "sdpa-chunk2048": ("sdpa", "dynamic", 2048),
    "ring-sdpa": ("sdpa", "ring", None),
    "ring-banded": ("banded", "ring", None),
    "dynamic-banded": ("banded", "dynamic", None),
}


@dataclass
class TtftResult:
    """One (variant, context) row of the time-to-first-token benchmark.

    Attributes:
        ttft_s_median / ttft_s_min / ttft_s: wall time of ``generate(max_new_tokens=1)`` (prefill and the first
            token), median / min / every rep.
        peak_rss_delta_bytes: the most the process' RSS rose above its level before the call (sampled every 5 ms,
            the allocator's free pages released before each call), highest over reps: masks, activations and the cache
            together.
        first_token / same_token: the greedy first token, and whether it equals the reference's (the first variant).
        max_abs_logit_diff: its logits against the reference's.
        other_cpu_cores / loadavg_max / competing_load: the load while the row's runs were timed.
    """

    variant: str
    context: int
    dtype: str
    ttft_s_median: float
    ttft_s_min: float
    ttft_s: list[float]
    peak_rss_delta_bytes: int
    first_token: int
    same_token: bool
    max_abs_logit_diff: float
    reps: int
    threads: int
    other_cpu_cores: float | None = None
    loadavg_max: float | None = None
    competing_load: bool = False


def _ttft_once(model: Any, variant: str, ids: torch.Tensor) -> tuple[float, int, int, torch.Tensor]:
    """One whole-prompt ``generate`` of one token: (seconds, peak RSS rise, token, its logits)."""
    from transformers import DynamicCache

    from hybrid_cache import HybridRingCache

    attention, cache_name, chunk = TTFT_VARIANTS[variant]
    cache = HybridRingCache(model.config) if cache_name == "ring" else DynamicCache(config=model.config)
    kwargs: dict[str, Any] = {"prefill_chunk_size": chunk} if chunk else {}
    release_free_memory()  # every run starts from the same heap: the RSS rise is what it allocates
    before = current_rss_bytes()
    device = ids.device
    with RssSampler() as sampler, torch.inference_mode():
        with use_code_attention(model) if attention == "banded" else _attention(model, attention):
            sync(device)
            start = time.perf_counter()
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                **cache_kwargs(cache),
                max_new_tokens=1,
                do_sample=False,
                return_dict_in_generate=True,
                output_logits=True,
                **kwargs,
            )
            sync(device)
            seconds = time.perf_counter() - start
    logits = out.logits[0][0].float().clone()
    token = int(out.sequences[0, -1])
    del cache, out
    gc.collect()
    return seconds, sampler.peak - before, token, logits


@contextlib.contextmanager
def _attention(model: Any, name: str) -> Iterator[None]:
    """Within the block, `model` runs the attention implementation `name` (the previous one comes back on exit)."""
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


def run_ttft_benchmark(
    model: Any,
    *,
    contexts: Sequence[int],
    variants: Sequence[str],
    reps: int,
    dtype: torch.dtype,
    log: Callable[[str], None] = print,
    meter: ContentionMeter | None = None,
    seed: int = 0,
    warmup_tokens: int = 1024,
) -> list[TtftResult]:
    """Time one whole-prompt ``generate`` (one new token) per variant of `TTFT_VARIANTS` at every context.

    Per context: random token ids (seeded), one untimed warm-up per variant on a `warmup_tokens` prompt, then `reps`
    rounds, each running every variant once (the order rotated every round, so that no variant always goes first).
    The first variant is the reference of the token and logit comparisons.
    """
    unknown = [v for v in variants if v not in TTFT_VARIANTS]
    if unknown:
        raise ValueError(f"unknown variants {unknown}; choose from {list(TTFT_VARIANTS)}")
    meter = meter or ContentionMeter()
    config = text_config(model)
    device = next(model.parameters()).device
    dtype_name = str(dtype).replace("torch.", "")
    results = []
    for context in contexts:
        generator = torch.Generator().manual_seed(seed + context)
        ids = torch.randint(3, config.vocab_size, (1, context), generator=generator).to(device)
        for variant in variants:
            _ttft_once(model, variant, ids[:, : min(context, warmup_tokens)])
        times: dict[str, list[float]] = {v: [] for v in variants}
        peaks: dict[str, int] = {v: 0 for v in variants}
        firsts: dict[str, tuple[int, torch.Tensor]] = {}
        load = {v: Contention() for v in variants}
        for rep in range(reps):
            for variant in list(variants[rep % len(variants) :]) + list(variants[: rep % len(variants)]):
                with meter.track(load[variant]):
                    seconds, peak, token, logits = _ttft_once(model, variant, ids)
                times[variant].append(seconds)
                peaks[variant] = max(peaks[variant], peak)
                firsts.setdefault(variant, (token, logits))
                log(f"  ctx={context:>6} {variant:>15}: {seconds:8.2f} s, peak RSS +{peak / 2**20:8.1f} MiB")
        reference_token, reference_logits = firsts[variants[0]]
        for variant in variants:
            token, logits = firsts[variant]
            results.append(
                TtftResult(
                    variant=variant,
                    context=context,
                    dtype=dtype_name,
                    ttft_s_median=statistics.median(times[variant]),
                    ttft_s_min=min(times[variant]),
                    ttft_s=[round(t, 3) for t in times[variant]],
                    peak_rss_delta_bytes=peaks[variant],
                    first_token=token,
                    same_token=token == reference_token,
                    max_abs_logit_diff=float((logits - reference_logits).abs().max()),
                    reps=reps,
                    threads=torch.get_num_threads(),
                    other_cpu_cores=load[variant].other_cores,
                    loadavg_max=load[variant].loadavg_max,
                    competing_load=meter.competing(load[variant]),
                )
            )
    return results
