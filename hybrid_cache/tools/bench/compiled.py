"""Compiled decode steps (``--compile``): ``torch.compile(model.forward, fullgraph=True)`` per compileable cache,
graphs counted by a backend wrapper, the first compiled steps checked against eager steps of the same cache type."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from hybrid_cache import cache_kwargs

from ..compare import kv_bytes_held, make_cache
from .instrument import count_update_copy_bytes
from .machine import sync
from .workload import PrefillSource, step_inputs, synthesize_prefill

__all__ = ["COMPILEABLE_CACHES", "CompileOptions", "compiled_decode_once", "new_compiled"]

COMPILEABLE_CACHES = ("ring", "static")


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

    def result_fields(self, options: CompileOptions) -> dict[str, Any]:
        """The `BenchResult` fields of a compiled row."""
        graphs = self.counter.frame_count
        return dict(
            compiled=True,
            compile_backend=options.backend,
            compile_mode=options.mode,
            compile_mask=self.mask,
            compile_dynamic=self.dynamic,
            compile_seconds=self.compile_seconds,
            compile_seconds_total=self.compile_seconds_total,
            graphs=graphs,
            recompiles=max(graphs - 1, 0),
            recompiled_during_timing=self.recompiled_during_timing,
            **self.check,
        )

    @staticmethod
    def flags(result: Any) -> str:
        """What went wrong in a compiled row, for its log line ("" when nothing)."""
        flags = []
        if result.recompiles:
            flags.append(f"RECOMPILED {result.recompiles}x")
        if result.recompiled_during_timing:
            flags.append("COMPILED DURING TIMING")
        if result.compiled_matches_eager is False:
            flags.append("MISMATCH WITH EAGER")
        return f"  [{'; '.join(flags)}]" if flags else ""


def new_compiled(model: Any, cache_name: str, mask: str, options: CompileOptions) -> _Compiled:
    """A fresh ``torch.compile(model.forward, fullgraph=True)`` for one cache and mask mode, its graphs counted."""
    dynamic = options.dynamic_for(cache_name)
    counter = _GraphCounter(options.backend, options.mode, dynamic)
    forward = torch.compile(model.forward, backend=counter, fullgraph=True, dynamic=dynamic)
    return _Compiled(cache_name, mask, dynamic, counter, forward, check_steps=options.check_steps)


def _outside_masks(model: Any, cache: Any, inputs: dict[str, torch.Tensor]) -> Any:
    """The mask mapping ``generate`` builds ahead of a compiled forward (``prepare_inputs_for_generation``)."""
    from transformers.masking_utils import create_masks_for_generate

    build = getattr(model, "create_masks_for_generate", create_masks_for_generate)
    ids = inputs["input_ids"]
    masks = build(
        config=model.config,
        inputs_embeds=torch.empty((*ids.shape[:2], 0), dtype=model.dtype, device=ids.device),
        attention_mask=None,
        **cache_kwargs(cache),
        position_ids=inputs["position_ids"],
    )
    if isinstance(masks, dict):
        return {k: v.contiguous() if v is not None else None for k, v in masks.items()}
    return masks.contiguous() if masks is not None else None


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
    return {
        "compiled_check_steps": len(compiled),
        "compiled_max_abs_logit_diff": max_diff,
        "compiled_argmax_agree": agree / total if total else None,
        "compiled_matches_eager": ok and total > 0,
    }


def compiled_decode_once(
    model: Any,
    compiled: _Compiled,
    batch: int,
    context: int,
    steps: int,
    warmup: int,
    source: PrefillSource,
    vocab: int,
    first_rep: bool,
    device: torch.device | str = "cpu",
) -> tuple[list[float], list[float], tuple[int, int], int, dict[str, int]]:
    """As `_decode_once`, through `compiled.forward`: fresh fixed-size cache + eager prefill (``cache.update``),
    untimed warm-up steps (the first compiles; warm-up continues while steps still compile, at most 8 more), one eager
    step counting copies (first rep), `steps` timed steps. On the first rep the first compiled steps are compared with
    an eager run of a fresh cache of the same type on the same inputs. Returns (step ms, mask ms, (tokens, K/V bytes)
    held at the end, copy bytes of one step, copy bytes by op)."""
    max_cache_len = context + warmup + steps + 16
    seed = context * 31 + batch
    check_steps = min(warmup, compiled.check_steps) if first_rep else 0
    eager_logits: list[torch.Tensor] = []
    if check_steps:
        draw_reference = _seeded_inputs(batch, vocab, seed, device)
        eager_logits = _eager_logits(model, compiled, source, max_cache_len, draw_reference, context, check_steps)
    draw = _seeded_inputs(batch, vocab, seed, device)
    cache = make_cache(compiled.cache, model, max_cache_len, compileable=True)
    synthesize_prefill(cache, source)
    position, compiled_logits = _warm_up(model, compiled, cache, draw, context, warmup, check_steps, device)
    if check_steps:
        compiled.check = _compare_logits(eager_logits, compiled_logits)
    copy_bytes, by_op = 0, {}
    if first_rep:
        copy_bytes, by_op = _count_copies(model, compiled, cache, draw(position))
        position += 1
    step_ms, mask_ms = _timed_steps(model, compiled, cache, draw, position, steps, device)
    held = (int(cache.get_seq_length()), kv_bytes_held(cache))  # (tokens, K/V bytes) at the end
    del cache
    gc.collect()
    return step_ms, mask_ms, held, copy_bytes, by_op


def _seeded_inputs(
    batch: int, vocab: int, seed: int, device: torch.device | str
) -> Callable[[int], dict[str, torch.Tensor]]:
    """Step inputs at a position, drawn in order from one generator seeded with `seed` (same seed: same tokens)."""
    generator = torch.Generator().manual_seed(seed)
    return lambda position: step_inputs(batch, position, vocab, generator, device)


def _call(model: Any, compiled: _Compiled, forward: Any, cache: Any, inputs: dict[str, torch.Tensor]) -> Any:
    """One decode step through `forward`; with the "outside" mask mode, the masks built first as ``generate`` does."""
    if compiled.mask == "outside":
        return forward(
            **inputs, attention_mask=_outside_masks(model, cache, inputs), **cache_kwargs(cache), use_cache=True
        )
    return forward(**inputs, **cache_kwargs(cache), use_cache=True)


def _eager_logits(
    model: Any,
    compiled: _Compiled,
    source: PrefillSource,
    max_cache_len: int,
    draw: Callable[[int], dict[str, torch.Tensor]],
    context: int,
    check_steps: int,
) -> list[torch.Tensor]:
    """The last-position logits of `check_steps` eager steps through a fresh cache of the compiled one's type."""
    reference = make_cache(compiled.cache, model, max_cache_len, compileable=True)
    synthesize_prefill(reference, source)
    logits = []
    with torch.inference_mode():
        for i in range(check_steps):
            out = _call(model, compiled, model.forward, reference, draw(context + i))
            logits.append(out.logits[:, -1:].detach().clone())
    del reference, out
    gc.collect()
    return logits


def _warm_up(
    model: Any,
    compiled: _Compiled,
    cache: Any,
    draw: Callable[[int], dict[str, torch.Tensor]],
    context: int,
    warmup: int,
    check_steps: int,
    device: torch.device | str,
) -> tuple[int, list[torch.Tensor]]:
    """The untimed compiled steps: `warmup`, then up to 8 more while a step still compiles (compile time recorded
    in `compiled`). Returns the next position and the logits of the first `check_steps` steps."""
    position = context
    logits: list[torch.Tensor] = []
    with torch.inference_mode():
        extra = i = 0
        compiled_did_compile = False
        while i < warmup or (extra < 8 and compiled_did_compile):
            if i >= warmup:
                extra += 1
            graphs_before = compiled.counter.frame_count
            sync(device)
            start = time.perf_counter()
            out = _call(model, compiled, compiled.forward, cache, draw(position))
            sync(device)
            elapsed = time.perf_counter() - start
            compiled_did_compile = compiled.counter.frame_count > graphs_before
            if compiled_did_compile:
                compiled.compile_seconds_total += elapsed
                if compiled.compile_seconds is None:
                    compiled.compile_seconds = elapsed
            if i < check_steps:
                logits.append(out.logits[:, -1:].detach().clone())
            position += 1
            i += 1
        del out
    return position, logits


def _count_copies(
    model: Any, compiled: _Compiled, cache: Any, inputs: dict[str, torch.Tensor]
) -> tuple[int, dict[str, int]]:
    """An eager step through the same cache: the bytes its `update` writes (the graph runs the same ops)."""
    if compiled.mask != "outside":
        return count_update_copy_bytes(model, cache, dict(inputs))
    with torch.inference_mode():
        mask = _outside_masks(model, cache, inputs)
    return count_update_copy_bytes(model, cache, dict(inputs, attention_mask=mask))


def _timed_steps(
    model: Any,
    compiled: _Compiled,
    cache: Any,
    draw: Callable[[int], dict[str, torch.Tensor]],
    position: int,
    steps: int,
    device: torch.device | str,
) -> tuple[list[float], list[float]]:
    """`steps` timed compiled steps from `position`: (step ms, mask ms); the "outside" masks are built inside the
    clock, as ``generate`` builds them each step. A graph compiled meanwhile marks `compiled`."""
    outside = compiled.mask == "outside"
    step_ms, mask_ms = [], []
    graphs_before = compiled.counter.frame_count
    with torch.inference_mode():
        for _ in range(steps):
            inputs = draw(position)
            sync(device)
            start = time.perf_counter()
            if outside:
                masks = _outside_masks(model, cache, inputs)
                mask_done = time.perf_counter()
                compiled.forward(**inputs, attention_mask=masks, **cache_kwargs(cache), use_cache=True)
            else:
                compiled.forward(**inputs, **cache_kwargs(cache), use_cache=True)
            sync(device)
            end = time.perf_counter()
            step_ms.append((end - start) * 1e3)
            if outside:
                mask_ms.append((mask_done - start) * 1e3)
            position += 1
    if compiled.counter.frame_count > graphs_before:
        compiled.recompiled_during_timing = True
    return step_ms, mask_ms
