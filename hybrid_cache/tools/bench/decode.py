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

from ..compare import RING_CACHE_OPTIONS, kv_bytes_held, make_cache, text_config
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
    if RING_CACHE_OPTIONS.get(cache_name, {}).get("full_layer_quantization"):
        return min(exact_must_read, weights + held)
    return exact_must_read


@dataclass(frozen=True)
class _Setup:
    """What every (context, batch) of one `run_benchmark` call shares."""

    model: Any
    model_name: str
    dtype: torch.dtype
    steps: int
    warmup: int
    reps: int
    bandwidth_gbps: float
    log: Callable[[str], None]
    device: torch.device | str
    compile_options: CompileOptions | None
    meter: ContentionMeter
    window: int | None  # the model's sliding window (`declared_window`)
    vocab: int
    weights: int  # parameter bytes

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).replace("torch.", "")


@dataclass
class _Measured:
    """What the repetitions of one variant (a cache, eager or compiled) measured at one (context, batch)."""

    step_ms: list[float] = field(default_factory=list)
    update_ms: list[float] = field(default_factory=list)  # eager only
    mask_ms: list[float] = field(default_factory=list)
    kv_trace: list[tuple[int, int]] = field(default_factory=list)  # the first repetition's
    copy_bytes: int = 0  # the first repetition's
    copy_bytes_by_op: dict[str, int] = field(default_factory=dict)
    peak: int | None = None
    load: Contention = field(default_factory=Contention)

    def keep_first(self, kv_trace: list[tuple[int, int]], copy_bytes: int, by_op: dict[str, int]) -> None:
        """Keep what the first repetition measured of the K/V held and of the bytes copied."""
        self.kv_trace, self.copy_bytes, self.copy_bytes_by_op = kv_trace, copy_bytes, by_op


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
    config = text_config(model)
    setup = _Setup(
        model=model,
        model_name=model_name,
        dtype=dtype,
        steps=steps,
        warmup=warmup,
        reps=reps,
        bandwidth_gbps=bandwidth_gbps,
        log=log,
        device=device,
        compile_options=compile_options,
        meter=meter or ContentionMeter(),
        window=declared_window(config),
        vocab=config.vocab_size,
        weights=parameter_bytes(model),
    )
    eager_caches = list(caches) if (compile_options is None or include_eager) else []
    compiled_specs = _compiled_specs(caches, warmup, compile_options, log)
    results = []
    for context in contexts:
        for batch in batches:
            results += _benchmark_point(setup, context, batch, eager_caches, compiled_specs)
    return results


def _compiled_specs(
    caches: Sequence[str], warmup: int, compile_options: CompileOptions | None, log: Callable[[str], None]
) -> list[tuple[str, str]]:
    """(cache, mask mode) of every compiled variant: the compileable caches, once per mask mode."""
    if compile_options is None:
        return []
    skipped = [c for c in caches if c not in COMPILEABLE_CACHES]
    if skipped:
        log(f"  --compile: skipping {', '.join(skipped)} (not compileable: it grows, shapes change every step)")
    if warmup < 1:
        raise ValueError("--compile needs --warmup >= 1 (the first warm-up step compiles)")
    return [(c, m) for m in compile_options.masks for c in caches if c in COMPILEABLE_CACHES]


def _benchmark_point(
    setup: _Setup, context: int, batch: int, eager_caches: list[str], compiled_specs: list[tuple[str, str]]
) -> list[BenchResult]:
    """The rows of one (context, batch): every variant measured in the same interleaved repetitions."""
    model = setup.model
    source = random_prefill(model, batch, context, setup.dtype)
    variants: list[tuple[str, Any]] = [(c, None) for c in eager_caches]
    if compiled_specs:
        torch._dynamo.reset()  # every (context, batch) compiles afresh: graphs are counted per cache
        variants += [(name, new_compiled(model, name, mask, setup.compile_options)) for name, mask in compiled_specs]
    workload = (batch, context, setup.steps, setup.warmup, source, setup.vocab)  # what every run decodes
    measured = [_Measured() for _ in variants]
    for rep in range(setup.reps):
        _eager_rep(setup, variants, workload, measured, first=(rep == 0))
        _compiled_rep(setup, variants, workload, measured, first=(rep == 0))
    del source
    gc.collect()
    must_read = setup.weights + live_kv_bytes(model, batch, context + setup.warmup + 1 + setup.steps // 2, setup.dtype)
    rows = []
    for (cache_name, compiled), measure in zip(variants, measured):
        rows.append(_result(setup, cache_name, compiled, measure, context, batch, must_read))
        _log_result(setup, rows[-1], compiled)
    return rows


def _eager_rep(
    setup: _Setup, variants: list[tuple[str, Any]], workload: tuple, measured: list[_Measured], first: bool
) -> None:
    """One repetition of the eager variants, their steps interleaved (copies counted in the first)."""
    _reset_peak(setup.device)  # eager caches share the rep: their peak is the rep's
    built = [
        (index, _DecodeSession(setup.model, name, *workload, count_copies=first, device=setup.device))
        for index, (name, compiled) in enumerate(variants)
        if compiled is None
    ]
    load = {index: measured[index].load for index, _ in built}
    for index, run in _interleaved_decode(built, setup.steps, setup.meter, load).items():
        measure = measured[index]
        measure.step_ms += run.step_ms
        measure.mask_ms += run.mask_ms
        measure.update_ms += run.update_ms
        measure.peak = _max_peak(measure.peak, _peak(setup.device))
        if first:
            measure.keep_first(run.kv_trace, run.copy_bytes, run.copy_bytes_by_op)


def _compiled_rep(
    setup: _Setup, variants: list[tuple[str, Any]], workload: tuple, measured: list[_Measured], first: bool
) -> None:
    """One repetition of each compiled variant in turn."""
    for (_, compiled), measure in zip(variants, measured):
        if compiled is None:
            continue
        _reset_peak(setup.device)
        with setup.meter.track(measure.load):
            step_ms, mask_ms, held, copies, by_op = compiled_decode_once(
                setup.model, compiled, *workload, first_rep=first, device=setup.device
            )
        measure.step_ms += step_ms
        measure.mask_ms += mask_ms
        measure.peak = _max_peak(measure.peak, _peak(setup.device))
        if first:
            measure.keep_first([held], copies, by_op)


def _result(
    setup: _Setup, cache_name: str, compiled: Any, measure: _Measured, context: int, batch: int, must_read: int
) -> BenchResult:
    """The row of one variant at one (context, batch), from what its repetitions measured."""
    model, dtype = setup.model, setup.dtype
    median = statistics.median(measure.step_ms)
    trace = measure.kv_trace
    held = trace[-1][1]
    ratios = [b / exact_kv_bytes(model, batch, t, dtype) for t, b in trace if t]
    if compiled is None:
        cache_ms = [u + m for u, m in zip(measure.update_ms, measure.mask_ms)]
        cache_med = statistics.median(cache_ms)
        update_med, mask_med = statistics.median(measure.update_ms), statistics.median(measure.mask_ms)
        compile_fields: dict[str, Any] = {}
    else:
        cache_med = update_med = None  # inside the graph: not separable
        mask_med = statistics.median(measure.mask_ms) if measure.mask_ms else None
        compile_fields = compiled.result_fields(setup.compile_options)
    return BenchResult(
        cache=cache_name,
        context=context,
        batch=batch,
        dtype=setup.dtype_name,
        model=setup.model_name,
        window=setup.window,
        steps=setup.steps,
        reps=setup.reps,
        ms_per_token_median=median,
        ms_per_token_min=min(measure.step_ms),
        cache_ms_per_step_median=cache_med,
        update_ms_per_step_median=update_med,
        mask_ms_per_step_median=mask_med,
        kv_bytes=held,
        copy_bytes_per_step=measure.copy_bytes,
        copy_bytes_by_op=measure.copy_bytes_by_op,
        bytes_must_read_per_step=must_read,
        roofline_pct_of_bandwidth=100.0
        * (_must_read(cache_name, must_read, setup.weights, held) / (median / 1e3))
        / (setup.bandwidth_gbps * 1e9),
        tokens_per_s=1e3 * batch / median,
        step_times_ms=[round(t, 3) for t in measure.step_ms],
        device=str(torch.device(setup.device)),
        peak_memory_bytes=measure.peak,
        kv_trace=trace,
        kv_bytes_peak=max(b for _, b in trace),
        kv_bytes_exact=exact_kv_bytes(model, batch, trace[-1][0], dtype),
        kv_ratio_to_exact_max=max(ratios) if ratios else None,
        other_cpu_cores=measure.load.other_cores,
        loadavg_max=measure.load.loadavg_max,
        competing_load=setup.meter.competing(measure.load),
        **compile_fields,
    )


def _log_result(setup: _Setup, result: BenchResult, compiled: Any) -> None:
    """One progress line per row."""
    busy = "  [!] other work competed for the CPUs" if result.competing_load else ""
    point = f"  {setup.dtype_name:>8} ctx={result.context:>6} B={result.batch:>2} {result.cache:>9}"
    median = result.ms_per_token_median
    if compiled is None:
        setup.log(
            f"{point}: {median:8.2f} ms/tok (min {result.ms_per_token_min:.2f}), cache "
            f"{result.cache_ms_per_step_median:.3f} ms/step, KV {result.kv_bytes / 2**20:.1f} MiB (max "
            f"{result.kv_ratio_to_exact_max:.3f}x exact), copies {result.copy_bytes_per_step / 2**20:.3f} MiB/step, "
            f"roofline {result.roofline_pct_of_bandwidth:.0f}%, load {result.loadavg_max}{busy}"
        )
    else:
        setup.log(
            f"{point} compiled (masks {compiled.mask}, dynamic={compiled.dynamic}): {median:8.2f} ms/tok "
            f"(min {result.ms_per_token_min:.2f}), compile {result.compile_seconds or 0:.1f} s "
            f"(total {result.compile_seconds_total:.1f} s), graphs {result.graphs}, eager check: "
            f"max |dlogit| {result.compiled_max_abs_logit_diff}, argmax agree "
            f"{result.compiled_argmax_agree}{compiled.flags(result)}{busy}"
        )
