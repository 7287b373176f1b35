"""Decode benchmark: `HybridRingCache` against transformers' `DynamicCache` and `StaticCache`.

Run ``python -m hybrid_cache.bench --help`` (or the ``hybrid-cache-bench`` console script). See
``docs/benchmarks.md`` for the exact commands, the meaning of every column and measured results.

What is measured, per (dtype, context, batch, cache):

- **ms/token**: wall time of one decode step (one new token for every sequence of the batch) through the model,
  ``model(input_ids=[B, 1], position_ids=..., cache=cache, use_cache=True)``, after a synthesized prefill
  of ``context`` tokens and ``warmup`` untimed steps. Median and min over all timed steps of all repetitions.
  Repetitions are interleaved across caches (``for rep: for cache: prefill + decode``) so that machine noise hits
  every cache alike.
- **cache ms/step**: the part of a step spent in cache operations: ``cache.update`` (all layers; the instance's
  method is wrapped) plus mask creation (``create_causal_mask`` / ``create_sliding_window_causal_mask`` as named in
  the model's modeling module, patched for the duration of the benchmark only, then restored).
- **KV bytes**: bytes of key/value storage the cache holds after the decode (distinct storages, so a view that keeps
  a larger tensor alive counts the whole tensor).
- **copy bytes/step**: bytes written by tensor operations inside ``cache.update`` during one decode step, counted
  by a ``TorchDispatchMode`` (every aten op's output bytes; for in-place index copies only the source bytes), i.e.
  measured, not estimated; an analytic estimate is given in the docs.
- **roofline**: bytes one decode step must read (every parameter once + the live K/V each layer attends to) divided
  by the step time, as a percentage of this machine's copy bandwidth measured in the same run (``dst.copy_(src)`` of
  1 GiB, read + written bytes / time).

The prefill is synthesized: random K/V of the right shape written through each cache's own
``update(k, v, layer_idx)``, one call per layer with the whole context. (A `HybridRingCache` refuses a multi-token
update to a wrapped ring unless the mask was built through the model; a single whole-context update into an empty
ring is the "fresh prompt" path and is accepted.) Decode cost does not depend on the K/V values.

``--compile`` times compiled decode steps instead (``ring`` = ``HybridRingCache(config, max_cache_len=...)``, its
compileable mode, and ``static``; ``dynamic`` is not compileable and is skipped): ``torch.compile(model.forward,
fullgraph=True)`` per cache, compiled during untimed warm-up steps (first call = ``compile_seconds``), graphs counted
by a counting backend wrapper (``graphs``; more than one per cache is a recompilation), the first compiled steps
checked against an eager run of the same cache type on the same inputs. ``--device cuda`` runs everything on the GPU
(``torch.cuda.synchronize`` around each timed step, ``torch.cuda.max_memory_allocated`` as ``peak_memory_bytes``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import shlex
import statistics
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .compare import CACHE_NAMES, kv_bytes_held, layer_kv_geometry, make_cache, peak_rss_bytes, text_config

__all__ = [
    "BenchResult",
    "CompileOptions",
    "build_tiny_model",
    "count_update_copy_bytes",
    "machine_info",
    "main",
    "make_cache",
    "measure_bandwidth",
    "prefill_chunk_check",
    "run_benchmark",
    "random_prefill",
    "synthesize_prefill",
]

COMPILEABLE_CACHES = ("ring", "static")
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
MASK_FUNCTION_NAMES = ("create_causal_mask", "create_sliding_window_causal_mask")


# --------------------------------------------------------------------------------------------------------------------
# Machine
# --------------------------------------------------------------------------------------------------------------------
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _cpu_flags() -> list[str]:
    wanted = {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "fma"}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return sorted(wanted & set(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return []


def _mem_total_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal"):
                    return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def machine_info() -> dict[str, Any]:
    """nproc, CPU model and flags, memory, torch threads and library versions."""
    import transformers

    return {
        "nproc": os.cpu_count(),
        "affinity_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_model": _cpu_model(),
        "cpu_flags": _cpu_flags(),
        "mem_total_gib": _mem_total_gib(),
        "torch_threads": torch.get_num_threads(),
        "loadavg_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def _sync(device: torch.device | str) -> None:
    """Wait for queued kernels (CUDA); a no-op on CPU."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def measure_bandwidth(nbytes: int = 2**30, repeats: int = 5, device: torch.device | str = "cpu") -> dict[str, float]:
    """Memory copy bandwidth on `device`: best of `repeats` ``dst.copy_(src)`` of `nbytes` (read + written bytes / time).

    Returns:
        ``{"bytes": nbytes, "best_s": ..., "gbps": (2 * nbytes) / best_s / 1e9}`` (GB/s, 10^9 bytes).
    """
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    src.fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - start)
    del src, dst
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return {"bytes": nbytes, "best_s": best, "gbps": 2 * nbytes / best / 1e9}


def current_rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


class RssSampler:
    """Samples the RSS every `interval` seconds in a thread; `.peak` is the highest value seen."""

    def __init__(self, interval: float = 0.005) -> None:
        self.interval = interval
        self.peak = current_rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, current_rss_bytes())
            self._stop.wait(self.interval)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, current_rss_bytes())


# --------------------------------------------------------------------------------------------------------------------
# Models and caches
# --------------------------------------------------------------------------------------------------------------------
def build_tiny_model(window: int = 512, dtype: torch.dtype = torch.float32, layers: int = 6, hidden: int = 64,
                     head_dim: int = 256, seed: int = 0) -> Any:
    """A small random Gemma 3 text model that isolates cache overhead.

    Same K/V geometry per layer as Gemma 3 270M (1 KV head of ``head_dim`` 256, 4 query heads, 5 sliding : 1 full
    layers) but ``hidden`` 64 and a 512-token vocabulary, so weights cost almost nothing.
    """
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    config = Gemma3TextConfig(
        vocab_size=512, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=1, head_dim=head_dim, sliding_window=window,
        max_position_embeddings=1 << 17, attn_implementation="sdpa", pad_token_id=0, bos_token_id=2, eos_token_id=1,
    )
    return Gemma3ForCausalLM(config).eval().to(dtype)


def load_bench_model(name: str, dtype: torch.dtype, window: int, device: str = "cpu") -> Any:
    """``tiny`` -> :func:`build_tiny_model`; anything else -> :func:`hybrid_cache.models.load_model` (lazy import)."""
    if name == "tiny":
        return build_tiny_model(window=window, dtype=dtype).to(device)
    from hybrid_cache.models import load_model  # lazy: only the real-model path needs it

    model, _ = load_model(None if name in ("default", "") else name, dtype=dtype, attn_implementation="sdpa")
    return model.eval().to(device)


PrefillSource = dict[int, tuple[torch.Tensor, torch.Tensor]]


def random_prefill(model: Any, batch: int, context: int, dtype: torch.dtype) -> PrefillSource:
    """Random K/V `[batch, kv_heads, context, head_dim]` for every storing layer, by layer index (layers of the same
    geometry share one tensor pair: Gemma 4's sliding and full layers differ, KV-shared layers get none)."""
    device = next(model.parameters()).device
    by_shape: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    source = {}
    for layer_idx, geometry in enumerate(layer_kv_geometry(model)):
        if geometry is None:
            continue
        if geometry not in by_shape:
            heads, head_dim = geometry
            by_shape[geometry] = tuple(
                torch.randn(batch, heads, context, head_dim, dtype=dtype, device=device) for _ in range(2)
            )
        source[layer_idx] = by_shape[geometry]
    return source


def synthesize_prefill(cache: Any, source: PrefillSource) -> None:
    """Write a prefill into every storing layer through ``cache.update``, one call per layer with the whole context.

    One `source` (see `random_prefill`) is reused across the caches compared; every cache copies what it keeps.
    A whole-context update into an empty ring is its "fresh prompt" path (returns the input, keeps the newest slots).
    """
    with torch.inference_mode():
        for layer_idx, (keys, values) in source.items():
            cache.update(keys, values, layer_idx)


def live_kv_bytes(model: Any, batch: int, length: int, dtype: torch.dtype) -> int:
    """K/V bytes the attention must read in one decode step at cache length `length` (window-limited)."""
    config = text_config(model)
    element = torch.empty((), dtype=dtype).element_size()
    layer_types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    total = 0
    for layer_type, geometry in zip(layer_types, layer_kv_geometry(model)):
        if geometry is None:
            continue
        heads, head_dim = geometry
        tokens = min(length, window) if (layer_type == "sliding_attention" and window) else length
        total += 2 * batch * heads * head_dim * element * tokens
    return total


def parameter_bytes(model: Any) -> int:
    """Bytes of every distinct parameter (tied embeddings counted once: the LM head reads them in full)."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


# --------------------------------------------------------------------------------------------------------------------
# Instrumentation
# --------------------------------------------------------------------------------------------------------------------
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
        config = text_config(model)
        layer_types = getattr(config, "layer_types", None) or []
        original_update = cache.update
        timer = self

        def timed_update(key_states, value_states, layer_idx, *args, **kwargs):
            start = time.perf_counter()
            out = original_update(key_states, value_states, layer_idx, *args, **kwargs)
            timer.update_s += time.perf_counter() - start
            timer.update_calls += 1
            if layer_idx < len(layer_types) and layer_types[layer_idx] == "sliding_attention":
                timer.max_sliding_returned = max(timer.max_sliding_returned, out[0].shape[-2])
            return out

        modules = {sys.modules[type(m).__module__] for m in model.modules()
                   if type(m).__module__.startswith("transformers.models.")}
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
_NO_WRITE_OPS = {"view", "_unsafe_view", "slice", "select", "as_strided", "expand", "t", "transpose", "unsqueeze",
                 "squeeze", "alias", "detach", "permute", "split", "split_with_sizes", "unbind", "lift_fresh",
                 "empty", "empty_like", "detach_", "new_empty", "empty_strided", "new_empty_strided", "sym_size", "sym_stride",
                 "is_same_size", "_local_scalar_dense", "item", "sym_numel", "sym_storage_offset"}


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


def count_update_copy_bytes(model: Any, cache: Any, step_inputs: dict[str, torch.Tensor]) -> tuple[int, dict[str, int]]:
    """Run one decode step and count the bytes written by tensor ops inside ``cache.update`` (all layers)."""
    counter = _CopyCounter()
    original_update = cache.update

    def counted_update(*args, **kwargs):
        with counter:
            return original_update(*args, **kwargs)

    cache.update = counted_update
    try:
        with torch.inference_mode():
            model(**step_inputs, cache=cache, use_cache=True)
    finally:
        del cache.update
    return counter.bytes, counter.by_op


# --------------------------------------------------------------------------------------------------------------------
# Decode benchmark
# --------------------------------------------------------------------------------------------------------------------
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
    peak_memory_bytes: int | None = None  # CUDA: torch.cuda.max_memory_allocated during the run (max over reps)
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
class CompileOptions:
    """How `--compile` compiles the decode step.

    Attributes:
        backend: torch.compile backend (``inductor``; ``eager`` / ``aot_eager`` for a quick check of graph capture).
        mode: inductor mode (``None``, ``default``, ``reduce-overhead`` (CUDA graphs), ``max-autotune``...).
        masks: ``inside`` (the compiled forward builds its masks from the cache, as in a plain model call) and/or
            ``outside`` (``create_masks_for_generate`` builds the mask mapping eagerly, as ``generate`` does for
            compileable caches, and the forward gets it as ``attention_mask``).
        dynamic: ``"false"`` (``dynamic=False`` for every cache), ``"auto"`` (``dynamic=None``, torch's automatic
            dynamic shapes, ``generate``'s default) or ``"per-cache"``: ``False`` for the ring, ``None`` for
            ``StaticCache``, whose sliding layers keep a Python ``int`` counter that ``dynamic=False`` specializes
            on at every step (one recompilation per decode step).
        check_steps: compiled steps compared with an eager run (fresh cache of the same type, same inputs).
    """

    backend: str = "inductor"
    mode: str | None = None
    masks: tuple[str, ...] = ("inside",)
    dynamic: str = "per-cache"
    check_steps: int = 3

    def dynamic_for(self, cache_name: str) -> bool | None:
        if self.dynamic == "false":
            return False
        if self.dynamic == "auto":
            return None
        return False if cache_name == "ring" else None


class _GraphCounter:
    """A torch.compile backend that counts the graphs it is asked to compile and forwards them to `backend`
    (like ``torch._dynamo.testing.CompileCounterWithBackend``, but also taking an inductor ``mode``)."""

    def __init__(self, backend: str, mode: str | None = None, dynamic: bool | None = None) -> None:
        from torch._dynamo.backends.registry import lookup_backend

        if backend == "inductor" and mode not in (None, "default"):
            self._backend = torch._TorchCompileInductorWrapper(mode, None, dynamic)
        else:
            self._backend = lookup_backend(backend)
        self.frame_count = 0
        self.op_count = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        self.frame_count += 1
        self.op_count += sum(1 for node in gm.graph.nodes if "call" in node.op)
        return self._backend(gm, example_inputs)


@dataclass
class _Compiled:
    """One compiled decode step (per cache and mask mode) for one (context, batch): reused across reps."""

    cache: str
    mask: str
    dynamic: bool | None
    counter: _GraphCounter
    forward: Any
    check_steps: int = 3
    compile_seconds: float | None = None
    compile_seconds_total: float = 0.0
    recompiled_during_timing: bool = False
    check: dict[str, Any] = field(default_factory=dict)


def _step_inputs(batch: int, position: int, vocab: int, generator: torch.Generator,
                 device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    ids = torch.randint(3, vocab, (batch, 1), generator=generator)
    positions = torch.full((batch, 1), position, dtype=torch.long)
    if torch.device(device).type != "cpu":
        ids, positions = ids.to(device), positions.to(device)
    return {"input_ids": ids, "position_ids": positions}


def _outside_masks(model: Any, cache: Any, inputs: dict[str, torch.Tensor]) -> Any:
    """The mask mapping ``generate`` builds ahead of a compiled forward (``prepare_inputs_for_generation``)."""
    from transformers.masking_utils import create_masks_for_generate

    build = getattr(model, "create_masks_for_generate", create_masks_for_generate)
    ids = inputs["input_ids"]
    masks = build(config=model.config, inputs_embeds=torch.empty((*ids.shape[:2], 0), dtype=model.dtype, device=ids.device),
                  attention_mask=None, cache=cache, position_ids=inputs["position_ids"])
    if isinstance(masks, dict):
        return {k: v.contiguous() if v is not None else None for k, v in masks.items()}
    return masks.contiguous() if masks is not None else None


def _reset_peak(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device: torch.device | str) -> int | None:
    return int(torch.cuda.max_memory_allocated(device)) if torch.device(device).type == "cuda" else None


def _decode_once(model: Any, cache_name: str, batch: int, context: int, steps: int, warmup: int,
                 source: PrefillSource, vocab: int, count_copies: bool,
                 device: torch.device | str = "cpu",
                 ) -> tuple[list[float], list[float], list[float], int, int, dict[str, int]]:
    """Fresh cache + prefill, `warmup` untimed steps (+1 counted step), `steps` timed steps."""
    generator = torch.Generator().manual_seed(context * 31 + batch)
    cache = make_cache(cache_name, model, context + warmup + steps + 2)
    synthesize_prefill(cache, source)
    position = context
    with torch.inference_mode():
        for _ in range(warmup):
            model(**_step_inputs(batch, position, vocab, generator, device), cache=cache, use_cache=True)
            position += 1
    copy_bytes, by_op = 0, {}
    if count_copies:
        copy_bytes, by_op = count_update_copy_bytes(model, cache,
                                                    _step_inputs(batch, position, vocab, generator, device))
        position += 1
    step_ms, update_ms, mask_ms = [], [], []
    timer = CacheOpTimer()
    with timer.instrument(model, cache), torch.inference_mode():
        for _ in range(steps):
            inputs = _step_inputs(batch, position, vocab, generator, device)
            timer.reset()
            _sync(device)
            start = time.perf_counter()
            model(**inputs, cache=cache, use_cache=True)
            _sync(device)
            step_ms.append((time.perf_counter() - start) * 1e3)
            update_ms.append(timer.update_s * 1e3)
            mask_ms.append(timer.mask_s * 1e3)
            position += 1
    held = kv_bytes_held(cache)
    del cache
    gc.collect()
    return step_ms, update_ms, mask_ms, held, copy_bytes, by_op


def _compare_logits(eager: list[torch.Tensor], compiled: list[torch.Tensor]) -> dict[str, Any]:
    """Compiled vs eager logits of the same steps: max |diff|, argmax agreement, near-tie tolerant match
    (relative tolerance 1e-4 in float32, 2e-2 in 16-bit dtypes, of the largest |eager logit|)."""
    rtol = 1e-4 if eager and eager[0].dtype == torch.float32 else 2e-2
    max_diff, agree, total, ok = 0.0, 0, 0, True
    for e, c in zip(eager, compiled):
        e, c = e.float()[:, -1], c.float()[:, -1]  # [B, vocab]
        ok &= bool(torch.isfinite(c).all())
        max_diff = max(max_diff, float((e - c).abs().max()))
        e_arg, c_arg = e.argmax(-1), c.argmax(-1)
        agree += int((e_arg == c_arg).sum())
        total += e_arg.numel()
        # Where the argmax differs, accept a near-tie: the eager logit of the compiled choice within a fixed relative
        # tolerance of the eager maximum (bf16 rounding can flip exact ties). Not derived from the observed
        # difference, which would accept any mismatch.
        tolerance = rtol * max(1.0, float(e.abs().max()))
        chosen = e.gather(-1, c_arg[:, None])[:, 0]
        ok &= bool((chosen >= e.max(-1).values - tolerance).all())
    return {"compiled_check_steps": len(compiled), "compiled_max_abs_logit_diff": max_diff,
            "compiled_argmax_agree": agree / total if total else None, "compiled_matches_eager": ok and total > 0}


def _compiled_decode_once(model: Any, compiled: _Compiled, batch: int, context: int, steps: int, warmup: int,
                          source: PrefillSource, vocab: int, first_rep: bool,
                          device: torch.device | str = "cpu",
                          ) -> tuple[list[float], list[float], int, int, dict[str, int]]:
    """As `_decode_once`, through `compiled.forward`: fresh fixed-size cache + eager prefill (``cache.update``),
    untimed warm-up steps (the first compiles; warm-up continues while steps still compile, at most 8 more), one eager
    step counting copies (first rep), `steps` timed steps. On the first rep the first compiled steps are compared with
    an eager run of a fresh cache of the same type on the same inputs."""
    max_cache_len = context + warmup + steps + 16
    seed = context * 31 + batch
    outside = compiled.mask == "outside"

    def call(forward, cache, inputs):
        if outside:
            return forward(**inputs, attention_mask=_outside_masks(model, cache, inputs), cache=cache,
                           use_cache=True)
        return forward(**inputs, cache=cache, use_cache=True)

    check_steps = min(warmup, compiled.check_steps) if first_rep else 0
    eager_logits: list[torch.Tensor] = []
    if check_steps:
        reference = make_cache(compiled.cache, model, max_cache_len, compileable=True)
        synthesize_prefill(reference, source)
        generator = torch.Generator().manual_seed(seed)
        with torch.inference_mode():
            for i in range(check_steps):
                out = call(model.forward, reference, _step_inputs(batch, context + i, vocab, generator, device))
                eager_logits.append(out.logits[:, -1:].detach().clone())
        del reference, out
        gc.collect()

    generator = torch.Generator().manual_seed(seed)
    cache = make_cache(compiled.cache, model, max_cache_len, compileable=True)
    synthesize_prefill(cache, source)
    position = context
    compiled_logits: list[torch.Tensor] = []
    with torch.inference_mode():
        extra = i = 0
        compiled_did_compile = False
        while i < warmup or (extra < 8 and compiled_did_compile):
            if i >= warmup:
                extra += 1
            graphs_before = compiled.counter.frame_count
            _sync(device)
            start = time.perf_counter()
            out = call(compiled.forward, cache, _step_inputs(batch, position, vocab, generator, device))
            _sync(device)
            elapsed = time.perf_counter() - start
            compiled_did_compile = compiled.counter.frame_count > graphs_before
            if compiled_did_compile:
                compiled.compile_seconds_total += elapsed
                if compiled.compile_seconds is None:
                    compiled.compile_seconds = elapsed
            if i < check_steps:
                compiled_logits.append(out.logits[:, -1:].detach().clone())
            position += 1
            i += 1
        del out
    if check_steps:
        compiled.check = _compare_logits(eager_logits, compiled_logits)
    copy_bytes, by_op = 0, {}
    if first_rep:  # an eager step through the same cache: the bytes its `update` writes (the graph runs the same ops)
        inputs = _step_inputs(batch, position, vocab, generator, device)
        with torch.inference_mode():
            mask = _outside_masks(model, cache, inputs) if outside else None
        copy_bytes, by_op = count_update_copy_bytes(model, cache, dict(inputs, **({"attention_mask": mask} if outside else {})))
        position += 1
    step_ms, mask_ms = [], []
    graphs_before = compiled.counter.frame_count
    with torch.inference_mode():
        for _ in range(steps):
            inputs = _step_inputs(batch, position, vocab, generator, device)
            _sync(device)
            start = time.perf_counter()
            if outside:
                masks = _outside_masks(model, cache, inputs)
                mask_done = time.perf_counter()
                compiled.forward(**inputs, attention_mask=masks, cache=cache, use_cache=True)
            else:
                compiled.forward(**inputs, cache=cache, use_cache=True)
            _sync(device)
            end = time.perf_counter()
            step_ms.append((end - start) * 1e3)
            if outside:
                mask_ms.append((mask_done - start) * 1e3)
            position += 1
    if compiled.counter.frame_count > graphs_before:
        compiled.recompiled_during_timing = True
    held = kv_bytes_held(cache)
    del cache
    gc.collect()
    return step_ms, mask_ms, held, copy_bytes, by_op


def run_benchmark(model: Any, *, model_name: str, dtype: torch.dtype, contexts: Sequence[int],
                  batches: Sequence[int], caches: Sequence[str], steps: int, warmup: int, reps: int,
                  bandwidth_gbps: float, log=print, device: torch.device | str = "cpu",
                  compile_options: CompileOptions | None = None, include_eager: bool = True) -> list[BenchResult]:
    """Benchmark every (context, batch) for every cache; repetitions interleaved across caches.

    With `compile_options`, the compileable caches (``ring``, ``static``) are timed through ``torch.compile``d
    decode steps (one compiled function per cache and mask mode per (context, batch), after
    ``torch._dynamo.reset()``); `include_eager` adds the eager rows of `caches` in the same interleaved reps.
    """
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
            variants: list[tuple[str, _Compiled | None]] = [(c, None) for c in eager_caches]
            if compiled_specs:
                torch._dynamo.reset()  # every (context, batch) compiles afresh: graphs are counted per cache
                for cache_name, mask in compiled_specs:
                    dynamic = compile_options.dynamic_for(cache_name)
                    counter = _GraphCounter(compile_options.backend, compile_options.mode, dynamic)
                    forward = torch.compile(model.forward, backend=counter, fullgraph=True, dynamic=dynamic)
                    variants.append((cache_name, _Compiled(cache_name, mask, dynamic, counter, forward,
                                                           check_steps=compile_options.check_steps)))
            runs: dict[int, dict[str, list]] = {i: {"step": [], "update": [], "mask": []} for i in range(len(variants))}
            extra: dict[int, tuple[int, int, dict[str, int]]] = {}
            peaks: dict[int, int | None] = {}
            for rep in range(reps):
                for index, (cache_name, compiled) in enumerate(variants):
                    _reset_peak(device)
                    if compiled is None:
                        step_ms, update_ms, mask_ms, held, copies, by_op = _decode_once(
                            model, cache_name, batch, context, steps, warmup, source, vocab, count_copies=(rep == 0),
                            device=device)
                        runs[index]["update"] += update_ms
                    else:
                        step_ms, mask_ms, held, copies, by_op = _compiled_decode_once(
                            model, compiled, batch, context, steps, warmup, source, vocab, first_rep=(rep == 0),
                            device=device)
                    runs[index]["step"] += step_ms
                    runs[index]["mask"] += mask_ms
                    peak = _peak(device)
                    peaks[index] = peak if peaks.get(index) is None else max(peaks[index], peak or 0)
                    if rep == 0:
                        extra[index] = (held, copies, by_op)
            del source
            gc.collect()
            must_read = weights + live_kv_bytes(model, batch, context + warmup + 1 + steps // 2, dtype)
            for index, (cache_name, compiled) in enumerate(variants):
                r = runs[index]
                median = statistics.median(r["step"])
                held, copies, by_op = extra[index]
                if compiled is None:
                    cache_ms = [u + m for u, m in zip(r["update"], r["mask"])]
                    cache_med = statistics.median(cache_ms)
                    update_med, mask_med = statistics.median(r["update"]), statistics.median(r["mask"])
                    compile_fields: dict[str, Any] = {}
                else:
                    cache_med = update_med = None  # inside the graph: not separable
                    mask_med = statistics.median(r["mask"]) if r["mask"] else None
                    graphs = compiled.counter.frame_count
                    compile_fields = dict(
                        compiled=True, compile_backend=compile_options.backend, compile_mode=compile_options.mode,
                        compile_mask=compiled.mask, compile_dynamic=compiled.dynamic,
                        compile_seconds=compiled.compile_seconds, compile_seconds_total=compiled.compile_seconds_total,
                        graphs=graphs, recompiles=max(graphs - 1, 0),
                        recompiled_during_timing=compiled.recompiled_during_timing, **compiled.check)
                result = BenchResult(
                    cache=cache_name, context=context, batch=batch, dtype=dtype_name, model=model_name,
                    window=getattr(config, "sliding_window", None), steps=steps, reps=reps,
                    ms_per_token_median=median, ms_per_token_min=min(r["step"]),
                    cache_ms_per_step_median=cache_med, update_ms_per_step_median=update_med,
                    mask_ms_per_step_median=mask_med,
                    kv_bytes=held, copy_bytes_per_step=copies, copy_bytes_by_op=by_op,
                    bytes_must_read_per_step=must_read,
                    roofline_pct_of_bandwidth=100.0 * (must_read / (median / 1e3)) / (bandwidth_gbps * 1e9),
                    tokens_per_s=1e3 * batch / median, step_times_ms=[round(t, 3) for t in r["step"]],
                    device=device_name, peak_memory_bytes=peaks.get(index), **compile_fields,
                )
                results.append(result)
                if compiled is None:
                    log(f"  {dtype_name:>8} ctx={context:>6} B={batch:>2} {cache_name:>7}: "
                        f"{median:8.2f} ms/tok (min {result.ms_per_token_min:.2f}), cache {cache_med:.3f} "
                        f"ms/step, KV {held / 2**20:.1f} MiB, copies {copies / 2**20:.3f} MiB/step")
                else:
                    flags = []
                    if result.recompiles:
                        flags.append(f"RECOMPILED {result.recompiles}x")
                    if result.recompiled_during_timing:
                        flags.append("COMPILED DURING TIMING")
                    if result.compiled_matches_eager is False:
                        flags.append("MISMATCH WITH EAGER")
                    log(f"  {dtype_name:>8} ctx={context:>6} B={batch:>2} {cache_name:>7} compiled "
                        f"(masks {compiled.mask}, dynamic={compiled.dynamic}): {median:8.2f} ms/tok "
                        f"(min {result.ms_per_token_min:.2f}), compile {result.compile_seconds or 0:.1f} s "
                        f"(total {result.compile_seconds_total:.1f} s), graphs {result.graphs}, eager check: "
                        f"max |dlogit| {result.compiled_max_abs_logit_diff}, argmax agree "
                        f"{result.compiled_argmax_agree}" + (f"  [{'; '.join(flags)}]" if flags else ""))
    return results


# --------------------------------------------------------------------------------------------------------------------
# Reporting
# --------------------------------------------------------------------------------------------------------------------
def format_table(results: Sequence[BenchResult], caches: Sequence[str]) -> str:
    """One row per (model, window, dtype, context, batch); per cache ms/token median/min, cache ms/step, KV MiB."""
    rows: dict[tuple, dict[str, BenchResult]] = {}
    for r in results:
        rows.setdefault((r.model, r.window, r.dtype, r.context, r.batch), {})[r.cache] = r
    header = f"{'model':<8}{'win':>5} {'dtype':<9}{'ctx':>6}{'B':>3}"
    for c in caches:
        header += f" | {c + ' ms/tok med/min':>22}{'cache ms':>9}{'KV MiB':>9}{'copy MiB':>9}"
    ratio_names = [(a, b) for a, b in (("ring", "static"), ("ring", "dynamic")) if a in caches and b in caches]
    for a, b in ratio_names:
        header += f" | {a + '/' + b:>12}"
    lines = [header, "-" * len(header)]
    for key in sorted(rows, key=lambda k: (k[0], k[1] or 0, k[2], k[3], k[4])):
        model, window, dtype, context, batch = key
        line = f"{model:<8}{window or 0:>5} {dtype:<9}{context:>6}{batch:>3}"
        by_cache = rows[key]
        for c in caches:
            r = by_cache.get(c)
            if r is None:
                line += f" | {'-':>22}{'-':>9}{'-':>9}{'-':>9}"
            else:
                line += (f" | {r.ms_per_token_median:>13.2f} / {r.ms_per_token_min:>6.2f}{r.cache_ms_per_step_median:>9.3f}"
                         f"{r.kv_bytes / 2**20:>9.1f}{r.copy_bytes_per_step / 2**20:>9.3f}")
        for a, b in ratio_names:
            ra, rb = by_cache.get(a), by_cache.get(b)
            text = f"{ra.ms_per_token_median / rb.ms_per_token_median:.2f}x" if ra and rb else "-"
            line += f" | {text:>12}"
        lines.append(line)
    return "\n".join(lines)


def format_compiled_table(results: Sequence[BenchResult]) -> str:
    """Compiled rows: per cache ms/token median/min, compile seconds (first call), graphs, eager check; ratio
    ring/static (compiled), and compiled/eager per cache when eager rows of the same point are in `results`."""
    compiled_rows: dict[tuple, dict[str, BenchResult]] = {}
    eager: dict[tuple, dict[str, BenchResult]] = {}
    for r in results:
        point = (r.model, r.window, r.dtype, r.context, r.batch)
        if r.compiled:
            compiled_rows.setdefault(point + (r.compile_mask,), {})[r.cache] = r
        else:
            eager.setdefault(point, {})[r.cache] = r
    caches = [c for c in COMPILEABLE_CACHES if any(c in v for v in compiled_rows.values())]
    header = f"{'model':<8}{'win':>5} {'dtype':<9}{'ctx':>6}{'B':>3} {'masks':<8}"
    for c in caches:
        header += f" | {c + ' ms/tok med/min':>22}{'compile s':>10}{'graphs':>7}{'eager=':>7}"
    header += f" | {'ring/static':>11}"
    for c in caches:
        header += f" | {c + ' c/eager':>14}"
    lines = [header, "-" * len(header)]
    for key in sorted(compiled_rows, key=lambda k: (k[0], k[1] or 0, k[2], k[3], k[4], k[5] or "")):
        model, window, dtype, context, batch, mask = key
        by_cache = compiled_rows[key]
        line = f"{model:<8}{window or 0:>5} {dtype:<9}{context:>6}{batch:>3} {mask or '-':<8}"
        for c in caches:
            r = by_cache.get(c)
            if r is None:
                line += f" | {'-':>22}{'-':>10}{'-':>7}{'-':>7}"
            else:
                match = {True: "yes", False: "NO", None: "-"}[r.compiled_matches_eager]
                line += (f" | {r.ms_per_token_median:>13.2f} / {r.ms_per_token_min:>6.2f}{r.compile_seconds or 0:>10.1f}"
                         f"{r.graphs:>7}{match:>7}")
        ring, static = by_cache.get("ring"), by_cache.get("static")
        text = f"{ring.ms_per_token_median / static.ms_per_token_median:.2f}x" if ring and static else "-"
        line += f" | {text:>11}"
        for c in caches:
            r, e = by_cache.get(c), eager.get(key[:5], {}).get(c)
            text = f"{r.ms_per_token_median / e.ms_per_token_median:.2f}x" if r and e else "-"
            line += f" | {text:>14}"
        lines.append(line)
    return "\n".join(lines)


def plot_results(results: Sequence[BenchResult], path: str) -> None:
    """PNG of ms/token vs context per cache, one panel per (model/window, dtype, batch)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r.model, r.window, r.dtype, r.batch) for r in results}, key=lambda k: (k[0], k[1] or 0, k[2], k[3]))
    cols = min(len(panels), 4) or 1
    rows = (len(panels) + cols - 1) // cols or 1
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        series = sorted({(r.cache, r.compiled, r.compile_mask) for r in results},
                        key=lambda k: (CACHE_NAMES.index(k[0]) if k[0] in CACHE_NAMES else 99, k[1], k[2] or ""))
        many_masks = len({r.compile_mask for r in results if r.compiled}) > 1
        for cache, compiled, mask in series:
            points = sorted((r.context, r.ms_per_token_median) for r in results
                            if (r.model, r.window, r.dtype, r.batch) == panel and r.cache == cache
                            and r.compiled == compiled and r.compile_mask == mask)
            label = cache + ((" compiled" + (f" ({mask})" if many_masks else "")) if compiled else "")
            if points:
                ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label,
                        linestyle="--" if compiled else "-")
        model, window, dtype, batch = panel
        ax.set_title(f"{model} (window {window}) {dtype} B={batch}", fontsize=9)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("ms / decode step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------------------------------------------------
# Profile
# --------------------------------------------------------------------------------------------------------------------
def profile_decode(model: Any, caches: Sequence[str], *, context: int, batch: int, steps: int = 3,
                   row_limit: int = 12) -> dict[str, str]:
    """torch.profiler tables (top ops by self CPU time) of `steps` decode steps per cache."""
    from torch.profiler import ProfilerActivity, profile

    dtype = next(model.parameters()).dtype
    vocab = text_config(model).vocab_size
    device = next(model.parameters()).device
    source = random_prefill(model, batch, context, dtype)
    tables = {}
    for cache_name in caches:
        generator = torch.Generator().manual_seed(0)
        cache = make_cache(cache_name, model, context + steps + 4)
        synthesize_prefill(cache, source)
        position = context
        with torch.inference_mode():
            for _ in range(2):
                model(**_step_inputs(batch, position, vocab, generator, device), cache=cache,
                          use_cache=True)
                position += 1
            with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                for _ in range(steps):
                    model(**_step_inputs(batch, position, vocab, generator, device), cache=cache,
                          use_cache=True)
                    position += 1
        tables[cache_name] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=row_limit,
                                                        max_name_column_width=48)
        tables[cache_name + " (by input shape)"] = prof.key_averages(group_by_input_shape=True).table(
            sort_by="self_cpu_time_total", row_limit=row_limit, max_name_column_width=48, max_shapes_column_width=90)
        del cache
        gc.collect()
    return tables


# --------------------------------------------------------------------------------------------------------------------
# Chunked prefill check
# --------------------------------------------------------------------------------------------------------------------
def prefill_chunk_check(model: Any, *, prompt_length: int = 32768, chunk_size: int = 2048,
                        max_new_tokens: int = 2) -> dict[str, Any]:
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
        output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), cache=cache,
                                max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                                prefill_chunk_size=chunk_size)
    elapsed = time.perf_counter() - start
    sliding_caps = [layer.capacity for layer, kind in zip(cache.layers, cache.layer_kinds) if kind == "sliding_attention"]
    window = getattr(config, "sliding_window", None)
    report = cache.memory_report()
    return {
        "prompt_length": prompt_length,
        "chunk_size": chunk_size,
        "generated": int(output.shape[-1] - prompt_length),
        "sliding_window": window,
        "sliding_capacity_max": max(sliding_caps) if sliding_caps else 0,
        "max_sliding_update_returned_tokens": timer.max_sliding_returned,
        "bound_capacity_plus_chunk": (max(sliding_caps) if sliding_caps else 0) + chunk_size,
        "within_bound": timer.max_sliding_returned <= (max(sliding_caps) if sliding_caps else 0) + chunk_size,
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


# --------------------------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hybrid-cache-bench",
        description="Decode-time benchmark of HybridRingCache vs DynamicCache vs StaticCache (CPU by default; "
                    "--device cuda; --compile for torch.compile'd decode steps).",
    )
    p.add_argument("--model", default="default",
                   help="'default' (embedded Gemma 3 270M via hybrid_cache.models.load_model), 'tiny' (small random "
                        "Gemma 3 isolating cache cost), or a path/Hub id accepted by load_model.")
    p.add_argument("--dtypes", "--dtype", nargs="+", default=["float32"], choices=sorted(DTYPES),
                   help="parameter/KV dtypes (each gets its own rows). Default: float32.")
    p.add_argument("--contexts", nargs="+", type=int, default=[1024, 4096, 16384],
                   help="prefill lengths before the timed decode steps (32768 optional).")
    p.add_argument("--batch", "--batches", dest="batches", nargs="+", type=int, default=[1, 8])
    p.add_argument("--caches", nargs="+", default=list(CACHE_NAMES), choices=CACHE_NAMES)
    p.add_argument("--window", nargs="+", type=int, default=[512],
                   help="sliding window(s) of the tiny model (ignored for a real model). e.g. --window 512 4096.")
    p.add_argument("--steps", type=int, default=16, help="timed decode steps per repetition.")
    p.add_argument("--warmup", type=int, default=2, help="untimed decode steps before the timed ones.")
    p.add_argument("--reps", type=int, default=3, help="repetitions (interleaved across caches).")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice).")
    p.add_argument("--json", default=None, help="write results as JSON to this path.")
    p.add_argument("--plot", default=None, help="write a PNG of ms/token vs context to this path.")
    p.add_argument("--bandwidth-bytes", type=int, default=2**30, help="size of the bandwidth copy test (bytes).")
    p.add_argument("--profile", action="store_true",
                   help="also run torch.profiler on a few decode steps per cache at --profile-context/--profile-batch.")
    p.add_argument("--profile-context", type=int, default=16384)
    p.add_argument("--profile-batch", type=int, default=8)
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--profile-out", default=None, help="write the profiler tables to this text file.")
    p.add_argument("--prefill-chunk-check", action="store_true",
                   help="instead of the decode benchmark: generate() with prefill_chunk_size into a HybridRingCache "
                        "and report the longest sliding-layer update and peak memory.")
    p.add_argument("--prompt-length", type=int, default=32768, help="prompt length of --prefill-chunk-check.")
    p.add_argument("--chunk-size", nargs="+", type=int, default=[2048], help="prefill_chunk_size value(s).")
    p.add_argument("--device", default="cpu",
                   help="'cpu' (default) or 'cuda' / 'cuda:N': model, caches, inputs and the bandwidth test on that "
                        "device; timed steps are bracketed by torch.cuda.synchronize; JSON peak_memory_bytes = "
                        "torch.cuda.max_memory_allocated.")
    p.add_argument("--compile", action="store_true",
                   help="time torch.compile(model.forward, fullgraph=True)'d decode steps of the compileable caches "
                        "(ring = HybridRingCache(config, max_cache_len=context+warmup+steps+16), static); dynamic is "
                        "skipped. Compilation happens in the untimed warm-up (JSON compile_seconds, graphs).")
    p.add_argument("--with-eager", action="store_true",
                   help="with --compile: also time the eager caches in the same interleaved reps (compiled/eager ratios).")
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend (default inductor; 'eager' "
                                                                 "checks graph capture only).")
    p.add_argument("--compile-mode", default=None,
                   help="inductor mode, e.g. 'reduce-overhead' (CUDA graphs, generate's default) or 'max-autotune'.")
    p.add_argument("--compile-masks", nargs="+", default=["inside"], choices=["inside", "outside"],
                   help="'inside': the compiled forward builds its masks from the cache; 'outside': they are built "
                        "eagerly by create_masks_for_generate and passed as attention_mask (as generate does for "
                        "compileable caches). Both: one row each.")
    p.add_argument("--compile-dynamic", default="per-cache", choices=["per-cache", "false", "auto"],
                   help="torch.compile(dynamic=...): 'false' for every cache, 'auto' (None, torch's automatic dynamic "
                        "shapes; generate's default), or 'per-cache' (default): False for the ring, None for "
                        "StaticCache, which recompiles at every decode step with dynamic=False (its sliding layers "
                        "branch on a Python int counter).")
    p.add_argument("--compile-check-steps", type=int, default=3,
                   help="compiled warm-up steps compared with an eager run of the same cache type (<= --warmup).")
    return p


def _log(msg: str) -> None:
    print(msg, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.threads:
        torch.set_num_threads(args.threads)
    command = "python -m hybrid_cache.bench " + " ".join(
        shlex.quote(a) for a in (sys.argv[1:] if argv is None else list(argv)))
    machine = machine_info()
    _log(f"machine: {machine['cpu_model']}, nproc={machine['nproc']}, torch threads={machine['torch_threads']}, "
         f"load average {machine['loadavg_at_start']}, "
         f"torch {machine['torch']}, transformers {machine['transformers']}")
    payload: dict[str, Any] = {"machine": machine, "command": command, "results": []}

    if args.prefill_chunk_check:
        checks = []
        for dtype_name in args.dtypes:
            dtype = DTYPES[dtype_name]
            for window in (args.window if args.model == "tiny" else [None]):
                model = load_bench_model(args.model, dtype, window or 512, device=args.device)
                for chunk in args.chunk_size:
                    result = prefill_chunk_check(model, prompt_length=args.prompt_length, chunk_size=chunk)
                    result.update(model=args.model, dtype=str(dtype).replace("torch.", ""))
                    checks.append(result)
                    _log(f"prefill check {args.model} {result['dtype']} window={result['sliding_window']} "
                         f"N={args.prompt_length} chunk={chunk}: longest sliding update "
                         f"{result['max_sliding_update_returned_tokens']} tokens (bound capacity+chunk = "
                         f"{result['bound_capacity_plus_chunk']}: {'OK' if result['within_bound'] else 'EXCEEDED'}), "
                         f"KV held {result['kv_bytes'] / 2**20:.1f} MiB, RSS peak +{result['rss_peak_delta_bytes'] / 2**20:.0f} "
                         f"MiB over {result['rss_before_bytes'] / 2**20:.0f} MiB (ru_maxrss "
                         f"{result['ru_maxrss_bytes'] / 2**20:.0f} MiB), {result['seconds']:.1f} s")
                del model
                gc.collect()
        payload["prefill_chunk_check"] = checks
        if args.json:
            with open(args.json, "w") as f:
                json.dump(payload, f, indent=1)
        return 0 if all(c["within_bound"] for c in checks) else 1

    device = torch.device(args.device)
    machine["device"] = str(device)
    if device.type == "cuda":
        machine["gpu"] = torch.cuda.get_device_name(device)
        machine["cuda"] = torch.version.cuda
        machine["gpu_mem_total_gib"] = round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1)
    bandwidth = measure_bandwidth(args.bandwidth_bytes, device=device)
    machine["copy_bandwidth_gbps"] = round(bandwidth["gbps"], 2)
    _log(f"copy bandwidth ({device}): {bandwidth['gbps']:.2f} GB/s (best of 5 copies of "
         f"{args.bandwidth_bytes / 2**20:.0f} MiB, read + written bytes)")
    compile_options = None
    if args.compile:
        compile_options = CompileOptions(backend=args.compile_backend, mode=args.compile_mode,
                                         masks=tuple(dict.fromkeys(args.compile_masks)), dynamic=args.compile_dynamic,
                                         check_steps=max(1, args.compile_check_steps))
        previous_limit = torch._dynamo.config.recompile_limit
        # Recompilations must be counted, not hit the limit (a hard error with fullgraph=True).
        torch._dynamo.config.recompile_limit = max(previous_limit, 64)
        payload["compile"] = asdict(compile_options)
    results: list[BenchResult] = []
    profiles: dict[str, str] = {}
    windows = args.window if args.model == "tiny" else [None]
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        for window in windows:
            model = load_bench_model(args.model, dtype, window or 512, device=str(device))
            config = text_config(model)
            _log(f"model {args.model} {dtype_name}: {config.num_hidden_layers} layers, window "
                 f"{getattr(config, 'sliding_window', None)}, weights {parameter_bytes(model) / 2**20:.0f} MiB")
            results += run_benchmark(model, model_name=args.model, dtype=dtype, contexts=args.contexts,
                                     batches=args.batches, caches=args.caches, steps=args.steps, warmup=args.warmup,
                                     reps=args.reps, bandwidth_gbps=bandwidth["gbps"], log=_log, device=device,
                                     compile_options=compile_options, include_eager=args.with_eager)
            if args.profile:
                for name, table in profile_decode(model, args.caches, context=args.profile_context,
                                                  batch=args.profile_batch, steps=args.profile_steps).items():
                    key = f"{args.model} w={window} {dtype_name} ctx={args.profile_context} B={args.profile_batch} {name}"
                    profiles[key] = table
            del model
            gc.collect()

    eager_results = [r for r in results if not r.compiled]
    table = format_table(eager_results, args.caches) if eager_results else ""
    if table:
        _log("\n" + table)
    compiled_results = [r for r in results if r.compiled]
    if compiled_results:
        payload["compiled_table"] = format_compiled_table(results)
        _log("\ncompiled decode:\n" + payload["compiled_table"])
    payload["bandwidth"] = bandwidth
    if hasattr(os, "getloadavg"):
        machine["loadavg_at_end"] = list(os.getloadavg())
    payload["results"] = [asdict(r) for r in results]
    payload["table"] = table
    if profiles:
        payload["profiles"] = profiles
        text = "\n\n".join(f"== {k} ==\n{v}" for k, v in profiles.items())
        if args.profile_out:
            with open(args.profile_out, "w") as f:
                f.write(text)
        else:
            _log(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=1)
    if args.plot:
        plot_results(results, args.plot)
    if compile_options is not None:
        torch._dynamo.config.recompile_limit = previous_limit
        bad = [r for r in compiled_results if r.compiled_matches_eager is False or r.recompiled_during_timing]
        if bad:
            _log(f"compiled decode: {len(bad)} row(s) did not match eager or compiled during timing (see JSON)")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
