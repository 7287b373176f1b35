"""Which path a decode step of a compressed full layer takes where the native kernel cannot run: attention on the
codes with torch ops, or dequantizing, whichever is faster on this machine (`HYBRID_CACHE_CODE_FALLBACK`).

Where the kernel runs (`code_kernel.kernel_usable`) a decode step attends on the codes. Elsewhere the torch code path
can be several times slower than dequantizing (an AVX2 CPU without the kernel: docs/quantization.md), so the choice
is measured once per machine and geometry and cached beside the kernel's build, so that attention on the codes is
never slower than the dequantizing path it replaces.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from transformers.utils import is_torchdynamo_compiling

from . import code_kernel
from .code_attention import code_domain_attention
from .errors import CodeAttentionError

__all__ = ["FALLBACK_ENV", "codes_preferred", "fallback_status", "measure_fallback"]


FALLBACK_ENV = "HYBRID_CACHE_CODE_FALLBACK"
# The measured step: one batch row, the layer's KV heads and head sizes, 4 query heads per KV head (Gemma 3 270M / 1B;
# the larger Gemma 3 have 2), a history of this many tokens.
_FALLBACK_TOKENS = 4096
_FALLBACK_REP = 4
_FALLBACK_REPS = 5
# Attention on the codes is taken only when it measured at least this much faster: within the noise of a few timed
# steps (and of a busy machine), the dequantizing path is kept, whose speed is that of torch's own SDPA.
_CODES_MARGIN = 0.8
_CHOICE_RULE = 2  # part of the cached key: choices stored under an earlier rule are measured again
_fallback_choices: dict[str, dict[str, Any]] = {}


def _fallback_setting() -> str:
    setting = os.environ.get(FALLBACK_ENV, "auto").strip().lower() or "auto"
    if setting not in ("auto", "codes", "dequantize"):
        raise CodeAttentionError(
            f"{FALLBACK_ENV}={setting!r} is not a setting; use auto (the default: the faster of the two, measured "
            f"once), codes or dequantize."
        )
    return setting


def fallback_status() -> str:
    """One line: what a decode step does where the native kernel cannot run (`HYBRID_CACHE_CODE_FALLBACK`)."""
    setting = _fallback_setting()
    if setting == "codes":
        return f"where it cannot run: torch ops on the codes ({FALLBACK_ENV}=codes)"
    if setting == "dequantize":
        return f"where it cannot run: dequantizing ({FALLBACK_ENV}=dequantize)"
    return f"where it cannot run: the faster of torch ops on the codes and dequantizing, measured once ({FALLBACK_ENV}=auto)"


def codes_preferred(layer: Any) -> bool:
    """Whether a decode step of `layer` (a `QuantizedFullLayer` holding int8 / int4 codes) should attend on its codes.

    True where the native kernel runs for its key and value codes (`code_kernel.kernel_usable`; with
    `HYBRID_CACHE_CODE_KERNEL=on` a layer it cannot take raises `CodeKernelError` there). Elsewhere the torch path
    would run, and `HYBRID_CACHE_CODE_FALLBACK` decides: `codes` (always), `dequantize` (never), `auto` (the default):
    the torch code path where it measured at least 20% faster than the dequantizing path (`measure_fallback`, once per process,
    machine and geometry; cached on disk beside the kernel's build). Inside `torch.compile` the answer is True (no
    measurement while tracing)."""
    if is_torchdynamo_compiling():
        return True
    (key_codes, key_scales), (value_codes, value_scales) = layer.stored_codes("keys"), layer.stored_codes("values")
    if code_kernel.kernel_usable(key_codes, key_scales, layer.mode) and code_kernel.kernel_usable(
        value_codes, value_scales, layer.mode
    ):
        return True
    setting = _fallback_setting()
    if setting != "auto":
        return setting == "codes"
    return measure_fallback(layer)["choice"] == "codes"


def _fallback_key(layer: Any) -> tuple[str, dict[str, Any]]:
    geometry = {
        "device": layer.device.type,
        "mode": layer.mode,
        "kv_heads": layer.num_heads,
        "key_head_dim": layer.k_head_dim,
        "value_head_dim": layer.v_head_dim,
        "group_size": layer.group_size,
        "rotate": bool(layer.rotate),
        "calibration": bool(layer.key_calibration),
        "dtype": str(layer.dtype),
        "threads": torch.get_num_threads(),
        "kernel": code_kernel.kernel_status(),
        "cpu": _cpu_name(),
        "torch": torch.__version__,
        "rule": _CHOICE_RULE,
    }
    return hashlib.sha256(json.dumps(geometry, sort_keys=True).encode()).hexdigest()[:20], geometry


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return platform.processor()


def measure_fallback(layer: Any, force: bool = False) -> dict[str, Any]:
    """Time one decode step both ways on a random history of `layer`'s geometry (`_FALLBACK_TOKENS` tokens, one batch
    row, `_FALLBACK_REP` query heads per KV head): attention on the codes as it would run here (`code_domain_attention`)
    and the dequantizing path (`update` without codes, then SDPA); "codes" only when it took at most `_CODES_MARGIN`
    of the dequantizing time. Returns {"choice": "codes" | "dequantize",
    "codes_ms", "dequantize_ms" (best of `_FALLBACK_REPS`, interleaved), "geometry"}: cached per process and in
    `code_path.json` in the kernel's build directory (`force=True` measures again). Takes a few seconds at most; on a
    busy machine it can pick the slower path (set `HYBRID_CACHE_CODE_FALLBACK` then)."""
    key, geometry = _fallback_key(layer)
    if not force and key in _fallback_choices:
        return _fallback_choices[key]
    path = code_kernel.build_dir() / "code_path.json"
    stored = _read_choices(path)
    if not force and key in stored:
        _fallback_choices[key] = stored[key]
        return stored[key]
    timings = _time_both_paths(layer)
    choice = "codes" if timings["codes_ms"] <= _CODES_MARGIN * timings["dequantize_ms"] else "dequantize"
    result = {**timings, "geometry": geometry, "choice": choice}
    _fallback_choices[key] = result
    stored = _read_choices(path)
    stored[key] = result
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, partial = tempfile.mkstemp(dir=path.parent, prefix="code_path", suffix=".tmp")
        with os.fdopen(handle, "w") as f:
            json.dump(stored, f, indent=1, sort_keys=True)
        os.replace(partial, path)
    except OSError:  # an unwritable cache directory: measured again by the next process
        pass
    return result


def _read_choices(path: Any) -> dict[str, Any]:
    try:
        with open(path) as f:
            stored = json.load(f)
        return stored if isinstance(stored, dict) else {}
    except (OSError, ValueError):
        return {}


@torch.no_grad()
def _time_both_paths(layer: Any) -> dict[str, float]:
    heads, device, dtype = layer.num_heads, layer.device, layer.dtype
    key_dim, value_dim = layer.k_head_dim, layer.v_head_dim
    generator = torch.Generator().manual_seed(0)

    def states(tokens: int, dim: int) -> torch.Tensor:
        return torch.randn(1, heads, tokens, dim, generator=generator).to(device=device, dtype=dtype)

    probe = layer.empty_like()
    probe.update(states(_FALLBACK_TOKENS, key_dim), states(_FALLBACK_TOKENS, value_dim))
    step_keys, step_values = states(1, key_dim), states(1, value_dim)
    query = torch.randn(1, heads * _FALLBACK_REP, 1, key_dim, generator=generator).to(device=device, dtype=dtype)

    def on_codes() -> None:  # what `update(..., return_codes=True)` and the attention function do, less one write
        code_domain_attention(query, probe.compressed_history(_FALLBACK_TOKENS, step_keys, step_values), None)

    def dequantizing() -> None:
        keys, values = probe.update(step_keys, step_values)
        probe.crop(_FALLBACK_TOKENS)
        torch.nn.functional.scaled_dot_product_attention(query, keys, values, enable_gqa=True)

    def timed(function: Callable[[], None]) -> float:
        if device.type != "cpu":
            torch.accelerator.synchronize()
        start = time.perf_counter()
        function()
        if device.type != "cpu":
            torch.accelerator.synchronize()
        return (time.perf_counter() - start) * 1e3

    on_codes()  # warm-up of both paths (workspace, kernel build, first-call costs)
    dequantizing()
    codes_ms, dequantize_ms = [], []
    for _ in range(_FALLBACK_REPS):
        codes_ms.append(timed(on_codes))
        dequantize_ms.append(timed(dequantizing))
    return {"codes_ms": round(min(codes_ms), 3), "dequantize_ms": round(min(dequantize_ms), 3)}
