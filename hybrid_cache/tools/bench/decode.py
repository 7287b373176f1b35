"""The decode benchmark: ms per decode step, cache-operation time, bytes copied and K/V bytes held, per (context,
batch) and cache, repetitions interleaved across caches so that machine noise hits every cache alike."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hybrid_cache import cache_kwargs
from hybrid_cache.specs import declared_window

from ..compare import QUANTIZED_CACHES, kv_bytes_held, make_cache, text_config
from .compiled import COMPILEABLE_CACHES, CompileOptions, compiled_decode_once, new_compiled
from .instrument import CacheOpTimer, count_update_copy_bytes
from .machine import Contention, ContentionMeter, sync
from .workload import (
    PrefillSource,
    exact_kv_bytes,
    live_kv_bytes,
    parameter_bytes,
    random_prefill,
    step_inputs,
    synthesize_prefill,
)

__all__ = ["BenchResult", "run_benchmark"]


@dataclass
class BenchResult:
    cache: str
    context: int
    batch: int
    dtype: str
    model: str
    window: int | None
    steps: int
    reps: int
    ms_per_token_median: float
    ms_per_token_min: float
    cache_ms_per_step_median: float | None
    update_ms_per_step_median: float | None
    mask_ms_per_step_median: float | None
    kv_bytes: int
    copy_bytes_per_step: int
    copy_bytes_by_op: dict[str, int]
    bytes_must_read_per_step: int
    roofline_pct_of_bandwidth: float
    tokens_per_s: float
    step_times_ms: list[float] = field(default_factory=list)
    device: str = "cpu"
    # CUDA: torch.cuda.max_memory_allocated, max over reps (the eager caches of a rep are held together: the rep's)
    peak_memory_bytes: int | None = None
    # K/V bytes held at every point of the first repetition: after the prefill and after every decode step.
    kv_trace: list[tuple[int, int]] = field(default_factory=list)  # (tokens held, K/V bytes held)
    kv_bytes_peak: int | None = None  # max over kv_trace
    kv_bytes_exact: int | None = None  # a cache sized exactly for the tokens held at the end (see exact_kv_bytes)
    kv_ratio_to_exact_max: float | None = None  # max over kv_trace of bytes / exact bytes for the same tokens
    # Load: CPU other processes used on our CPUs while this row's runs were timed (see machine.ContentionMeter).
    other_cpu_cores: float | None = None
    loadavg_max: float | None = None
    competing_load: bool = False
    # --compile: compiled decode steps (`cache_ms`/`update_ms` are then None: cache ops run inside the graph)
    compiled: bool = False
    compile_backend: str | None = None
    compile_mode: str | None = None
    compile_mask: str | None = None  # "inside": the model builds its masks in the graph; "outside": built eagerly
    compile_dynamic: bool | None = None  # the `dynamic` argument given to torch.compile
    compile_seconds: float | None = None  # first compiled call (trace + compile + run)
    compile_seconds_total: float | None = None  # every call that compiled a graph (incl. recompilations)
    graphs: int | None = None  # graphs compiled for this cache over all reps (1 = no recompilation)
    recompiles: int | None = None  # graphs - 1
    recompiled_during_timing: bool | None = None  # a timed step compiled (its time is then meaningless)
    compiled_check_steps: int | None = None  # compiled steps compared with eager steps of the same cache type
    compiled_max_abs_logit_diff: float | None = None
    compiled_argmax_agree: float | None = None  # fraction of (step, sequence) where the argmax is identical
    compiled_matches_eager: bool | None = None  # finite, and argmax equal or a near-tie of the eager logits


@dataclass
class _DecodeRun:
    """One eager decode run of one cache: timed steps and what the cache held."""

    step_ms: list[float]
    update_ms: list[float]
    mask_ms: list[float]
    kv_trace: list[tuple[int, int]]
    copy_bytes: int
    copy_bytes_by_op: dict[str, int]


def _reset_peak(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device: torch.device | str) -> int | None:
    return int(torch.cuda.max_memory_allocated(device)) if torch.device(device).type == "cuda" else None


def _max_peak(previous: int | None, peak: int | None) -> int | None:
    return peak if previous is None else max(previous, peak or 0)


def _held(cache: Any) -> tuple[int, int]:
    return int(cache.get_seq_length()), kv_bytes_held(cache)


class _DecodeSession:
    """One cache's eager decode: a fresh cache, the prefill, `warmup` untimed steps (+1 step counting copies) on
    construction; then `step()` times one decode step at a time, so that the steps of several caches can be
    interleaved (the K/V bytes held are read after the prefill and after every step, outside the timed region)."""

    def __init__(
        self,
        model: Any,
        cache_name: str,
        batch: int,
        context: int,
        steps: int,
        warmup: int,
        source: PrefillSource,
        vocab: int,
        count_copies: bool,
        device: torch.device | str = "cpu",
    ) -> None:
        self.model, self.batch, self.vocab, self.device = model, batch, vocab, device
        self.generator = torch.Generator().manual_seed(context * 31 + batch)
        self.cache = make_cache(cache_name, model, context + warmup + steps + 2)
        synthesize_prefill(self.cache, source)
        self.trace = [_held(self.cache)]
        self.position = context
        with torch.inference_mode():
            for _ in range(warmup):
                model(**self._inputs(), **cache_kwargs(self.cache), use_cache=True)
                self._advance()
        self.copy_bytes, self.by_op = 0, {}
        if count_copies:
            self.copy_bytes, self.by_op = count_update_copy_bytes(model, self.cache, self._inputs())
            self._advance()
        self.step_ms: list[float] = []
        self.update_ms: list[float] = []
        self.mask_ms: list[float] = []
        self.timer = CacheOpTimer()

    def _inputs(self) -> dict[str, torch.Tensor]:
        return step_inputs(self.batch, self.position, self.vocab, self.generator, self.device)

    def _advance(self) -> None:
        self.trace.append(_held(self.cache))
        self.position += 1

    def step(self) -> None:
        """Time one decode step (model call only; the instrumentation is set up and read outside the clock)."""
        inputs = self._inputs()
        with self.timer.instrument(self.model, self.cache), torch.inference_mode():
            self.timer.reset()
            sync(self.device)
            start = time.perf_counter()
            self.model(**inputs, **cache_kwargs(self.cache), use_cache=True)
            sync(self.device)
            self.step_ms.append((time.perf_counter() - start) * 1e3)
        self.update_ms.append(self.timer.update_s * 1e3)
        self.mask_ms.append(self.timer.mask_s * 1e3)
        self._advance()

    def close(self) -> _DecodeRun:
        """Free the cache; what was measured."""
        del self.cache
        return _DecodeRun(self.step_ms, self.update_ms, self.mask_ms, self.trace, self.copy_bytes, self.by_op)


def _interleaved_decode(
    built: list[tuple[int, _DecodeSession]], steps: int, meter: ContentionMeter, load: dict
) -> dict[int, _DecodeRun]:
    """Time the sessions' steps round-robin (step 0 of each cache, then step 1, ..., the starting cache rotating),
    so that a drift of the machine's speed reaches every cache alike; close them and return what they measured."""
    if not built:
        return {}
    for step in range(steps):
        turn = step % len(built)
        for index, session in built[turn:] + built[:turn]:
            with meter.track(load[index]):
                session.step()
    runs = {index: session.close() for index, session in built}
    gc.collect()
    return runs


def _must_read(cache_name: str, exact_must_read: int, weights: int, held: int) -> int:
    """Bytes a decode step must read: the weights and the live K/V in the model dtype, or for compressed caches
    (``ring-int*``, ``ring-fp8``) the weights and the K/V bytes they hold (codes, scales, exact sliding rings)."""
    if cache_name in QUANTIZED_CACHES:
        return min(exact_must_read, weights + held)
    return exact_must_read


def run_benchmark(
    model: Any,
    *,
    model_name: str,
    dtype: torch.dtype,
    contexts: Sequence[int],
    batches: Sequence[int],
    caches: Sequence[str],
    steps: int,
    warmup: int,
    reps: int,
    bandwidth_gbps: float,
    log: Callable[[str], None] = print,
    device: torch.device | str = "cpu",
    compile_options: CompileOptions | None = None,
    include_eager: bool = True,
    meter: ContentionMeter | None = None,
) -> list[BenchResult]:
    """Benchmark every (context, batch) for every cache; repetitions interleaved across caches.

    With `compile_options`, the compileable caches (``ring``, ``static``) are timed through ``torch.compile``d
    decode steps (one compiled function per cache and mask mode per (context, batch), after
    ``torch._dynamo.reset()``); `include_eager` adds the eager rows of `caches` in the same interleaved reps.
    `meter` (default: one for torch's threads) records the load during each row's runs.
    """
    meter = meter or ContentionMeter()
    dtype_name = str(dtype).replace("torch.", "")
    config = text_config(model)
    vocab = config.vocab_size
    weights = parameter_bytes(model)
    device_name = str(torch.device(device))
    eager_caches = list(caches) if (compile_options is None or include_eager) else []
    compiled_specs: list[tuple[str, str]] = []
    if compile_options is not None:
        skipped = [c for c in caches if c not in COMPILEABLE_CACHES]
        if skipped:
            log(f"  --compile: skipping {', '.join(skipped)} (not compileable: it grows, shapes change every step)")
        if warmup < 1:
            raise ValueError("--compile needs --warmup >= 1 (the first warm-up step compiles)")
        compiled_specs = [(c, m) for m in compile_options.masks for c in caches if c in COMPILEABLE_CACHES]
    results = []
    for context in contexts:
        for batch in batches:
            source = random_prefill(model, batch, context, dtype)
            variants: list[tuple[str, Any]] = [(c, None) for c in eager_caches]
            if compiled_specs:
                torch._dynamo.reset()  # every (context, batch) compiles afresh: graphs are counted per cache
                variants += [(name, new_compiled(model, name, mask, compile_options)) for name, mask in compiled_specs]
            runs: dict[int, dict[str, list]] = {
                i: {"step": [], "update": [], "mask": []} for i in range(len(variants))
            }
            extra: dict[int, tuple[list[tuple[int, int]], int, dict[str, int]]] = {}
            peaks: dict[int, int | None] = {}
            load = {i: Contention() for i in range(len(variants))}
            eager = [(index, name) for index, (name, compiled) in enumerate(variants) if compiled is None]
            workload = (batch, context, steps, warmup, source, vocab)  # what every eager and compiled run decodes
            for rep in range(reps):
                _reset_peak(device)  # eager caches share the rep: their peak is the rep's
                built = [
                    (index, _DecodeSession(model, name, *workload, count_copies=(rep == 0), device=device))
                    for index, name in eager
                ]
                for index, run in _interleaved_decode(built, steps, meter, load).items():
                    runs[index]["step"] += run.step_ms
                    runs[index]["mask"] += run.mask_ms
                    runs[index]["update"] += run.update_ms
                    peaks[index] = _max_peak(peaks.get(index), _peak(device))
                    if rep == 0:
                        extra[index] = (run.kv_trace, run.copy_bytes, run.copy_bytes_by_op)
                for index, (_, compiled) in enumerate(variants):
                    if compiled is None:
                        continue
                    _reset_peak(device)
                    with meter.track(load[index]):
                        step_ms, mask_ms, held, copies, by_op = compiled_decode_once(
                            model, compiled, *workload, first_rep=(rep == 0), device=device
                        )
                    runs[index]["step"] += step_ms
                    runs[index]["mask"] += mask_ms
                    peaks[index] = _max_peak(peaks.get(index), _peak(device))
                    if rep == 0:
                        extra[index] = ([held], copies, by_op)
            del source
            gc.collect()
            must_read = weights + live_kv_bytes(model, batch, context + warmup + 1 + steps // 2, dtype)
            for index, (cache_name, compiled) in enumerate(variants):
                r = runs[index]
                median = statistics.median(r["step"])
                trace, copies, by_op = extra[index]
                held = trace[-1][1]
                ratios = [b / exact_kv_bytes(model, batch, t, dtype) for t, b in trace if t]
                if compiled is None:
                    cache_ms = [u + m for u, m in zip(r["update"], r["mask"])]
                    cache_med = statistics.median(cache_ms)
                    update_med, mask_med = statistics.median(r["update"]), statistics.median(r["mask"])
                    compile_fields: dict[str, Any] = {}
                else:
                    cache_med = update_med = None  # inside the graph: not separable
                    mask_med = statistics.median(r["mask"]) if r["mask"] else None
                    compile_fields = compiled.result_fields(compile_options)
                result = BenchResult(
                    cache=cache_name,
                    context=context,
                    batch=batch,
                    dtype=dtype_name,
                    model=model_name,
                    window=declared_window(config),
                    steps=steps,
                    reps=reps,
                    ms_per_token_median=median,
                    ms_per_token_min=min(r["step"]),
                    cache_ms_per_step_median=cache_med,
                    update_ms_per_step_median=update_med,
                    mask_ms_per_step_median=mask_med,
                    kv_bytes=held,
                    copy_bytes_per_step=copies,
                    copy_bytes_by_op=by_op,
                    bytes_must_read_per_step=must_read,
                    roofline_pct_of_bandwidth=100.0
                    * (_must_read(cache_name, must_read, weights, held) / (median / 1e3))
                    / (bandwidth_gbps * 1e9),
                    tokens_per_s=1e3 * batch / median,
                    step_times_ms=[round(t, 3) for t in r["step"]],
                    device=device_name,
                    peak_memory_bytes=peaks.get(index),
                    kv_trace=trace,
                    kv_bytes_peak=max(b for _, b in trace),
                    kv_bytes_exact=exact_kv_bytes(model, batch, trace[-1][0], dtype),
                    kv_ratio_to_exact_max=max(ratios) if ratios else None,
                    other_cpu_cores=load[index].other_cores,
                    loadavg_max=load[index].loadavg_max,
                    competing_load=meter.competing(load[index]),
                    **compile_fields,
                )
                results.append(result)
                busy = "  [!] other work competed for the CPUs" if result.competing_load else ""
                if compiled is None:
                    log(
                        f"  {dtype_name:>8} ctx={context:>6} B={batch:>2} {cache_name:>9}: "
                        f"{median:8.2f} ms/tok (min {result.ms_per_token_min:.2f}), cache {cache_med:.3f} "
                        f"ms/step, KV {held / 2**20:.1f} MiB (max {result.kv_ratio_to_exact_max:.3f}x exact), "
                        f"copies {copies / 2**20:.3f} MiB/step, roofline {result.roofline_pct_of_bandwidth:.0f}%, "
                        f"load {result.loadavg_max}{busy}"
                    )
                else:
                    log(
                        f"  {dtype_name:>8} ctx={context:>6} B={batch:>2} {cache_name:>9} compiled "
                        f"(masks {compiled.mask}, dynamic={compiled.dynamic}): {median:8.2f} ms/tok "
                        f"(min {result.ms_per_token_min:.2f}), compile {result.compile_seconds or 0:.1f} s "
                        f"(total {result.compile_seconds_total:.1f} s), graphs {result.graphs}, eager check: "
                        f"max |dlogit| {result.compiled_max_abs_logit_diff}, argmax agree "
                        f"{result.compiled_argmax_agree}{compiled.flags(result)}{busy}"
                    )
    return results
