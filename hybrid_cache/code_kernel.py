"""The native CPU kernel of attention on the codes: the two loops over a compressed history (scores from the key
codes, the value sum from the value codes) in C with AVX-512 VNNI (`csrc/code_attention.c`), for x86-64.

`hybrid_cache.code_attention` computes the same two loops with torch operations; this module is its faster path, used
when all of these hold (`kernel_usable`): the CPU has AVX-512 F/BW/VL/VNNI (read from `/proc/cpuinfo`), a C compiler
built the kernel, the tensors are on the CPU without autograd and outside `torch.compile`, and the geometry fits
(head size and group size multiples of 64, heads of at most 1024 channels, int4 heads a multiple of 128: Gemma 3's
256 and Gemma 4's 256 / 512 with the default group of 64). Otherwise the torch path runs; the result is the same up to
float32 summation order (tests/test_code_kernel.py holds both to `reference_attention`).

Building: on first use, `$CC` (default `cc`) compiles the source once per source, compiler and flags into
`$HYBRID_CACHE_KERNEL_DIR` (default `$XDG_CACHE_HOME/hybrid_cache` or `~/.cache/hybrid_cache`), in well under a
second; later processes load the library from there. The file is written under a temporary name and renamed, so
concurrent processes never load half a library.

Switch: the environment variable `HYBRID_CACHE_CODE_KERNEL`, read at every call: `auto` (the default: use the kernel
where it can run), `off` (always the torch path), `on` (raise `CodeKernelError` where it cannot run, with the reason).
`kernel_status()` says which applies and why (building the kernel if needed); the benchmarks print it.

Threads: `torch.get_num_threads()` threads per call (the caller and workers of a pool the library keeps between calls;
a forked child starts its own), each taking whole (batch x head, token range) items; calls are serialized, and the
call releases the GIL (ctypes).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
from transformers.utils import is_torchdynamo_compiling

from .errors import CodeKernelError

__all__ = ["KERNEL_ENV", "CodeKernelError", "history_scores", "history_values", "kernel_status", "kernel_usable"]

logger = logging.getLogger(__name__)

KERNEL_ENV = "HYBRID_CACHE_CODE_KERNEL"
_SOURCE = Path(__file__).with_name("csrc") / "code_attention.c"
_COMPILE_FLAGS = ("-O3", "-shared", "-fPIC", "-pthread", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni")
_COMPILE_FLAGS += ("-mf16c", "-mfma")
_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "f16c", "fma")
_SCALE_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_BLOCK = 64  # channels per vector of codes
_MAX_CHANNELS = 1024
_MAX_THREADS = 256
# Shortest token range a thread is given when batch x heads is smaller than the thread count.
_MIN_SPLIT_TOKENS = 512


def _mode() -> str:
    mode = os.environ.get(KERNEL_ENV, "auto").strip().lower() or "auto"
    if mode not in ("auto", "on", "off"):
        raise CodeKernelError(f"{KERNEL_ENV}={mode!r} is not a setting; use auto (the default), on or off.")
    return mode


def _missing_cpu_flags() -> list[str]:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return [f"an x86-64 CPU (this is {platform.machine()})"]
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return ["/proc/cpuinfo (to read the CPU's flags)"]
    return [flag for flag in _CPU_FLAGS if flag not in flags]


def _cache_dir() -> Path:
    if os.environ.get("HYBRID_CACHE_KERNEL_DIR"):
        return Path(os.environ["HYBRID_CACHE_KERNEL_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hybrid_cache"


def _build() -> Path:
    """Compile the kernel (once per source, compiler and flags) and return the library's path."""
    compiler = os.environ.get("CC", "cc")
    if shutil.which(compiler) is None:
        raise CodeKernelError(f"no C compiler: `{compiler}` is not on PATH (install gcc, or set CC)")
    source = _SOURCE.read_bytes()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout
    key = hashlib.sha256(source + version.encode() + " ".join(_COMPILE_FLAGS).encode()).hexdigest()[:16]
    directory = _cache_dir()
    library = directory / f"code_attention-{key}.so"
    if library.exists():
        return library
    directory.mkdir(parents=True, exist_ok=True)
    handle, partial = tempfile.mkstemp(dir=directory, prefix=library.stem, suffix=".tmp")
    os.close(handle)
    try:
        result = subprocess.run(
            [compiler, *_COMPILE_FLAGS, str(_SOURCE), "-o", partial], capture_output=True, text=True, check=False
        )
        if result.returncode:
            raise CodeKernelError(f"`{compiler}` could not build {_SOURCE.name}: {result.stderr.strip()[-600:]}")
        os.replace(partial, library)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    return library


@functools.lru_cache(maxsize=1)
def _load() -> tuple[ctypes.CDLL | None, str]:
    """(the loaded library or None, why) — tried once per process."""
    missing = _missing_cpu_flags()
    if missing:
        return None, f"unavailable: the CPU lacks {', '.join(missing)}"
    try:
        path = _build()
        library = ctypes.CDLL(str(path))
    except (CodeKernelError, OSError) as error:
        logger.warning("hybrid_cache: the native code-attention kernel is unavailable (%s); using torch ops.", error)
        return None, f"unavailable: {error}"
    pointer, integer = ctypes.c_void_p, ctypes.c_int64
    shared = [pointer, pointer, pointer, pointer, *[integer] * 9]  # `_code_arguments`
    library.hc_scores.argtypes = [*shared, pointer, pointer, integer, integer, pointer, pointer, pointer]
    library.hc_values.argtypes = [*shared, pointer, pointer, integer, ctypes.c_float, pointer]
    library.hc_scores.restype = library.hc_values.restype = ctypes.c_int
    return library, f"loaded from {path}"


def kernel_status() -> str:
    """One line: whether the kernel runs (`on`, `off` or `auto` and its library), or why not."""
    mode = _mode()
    if mode == "off":
        return f"off ({KERNEL_ENV}=off): torch ops"
    return f"{mode}: {_load()[1]}"


def _geometry_fits(codes: torch.Tensor, scales: torch.Tensor, mode: str) -> bool:
    channels = _channels(codes, mode)
    groups = scales.shape[-1]
    return (
        mode in ("int8", "int4")
        and codes.dim() == 4
        and codes.dtype == torch.int8
        and scales.dtype in _SCALE_DTYPES
        and channels % _BLOCK == 0
        and channels <= _MAX_CHANNELS
        and (channels // _BLOCK) % groups == 0
        and (mode != "int4" or channels % (2 * _BLOCK) == 0)
        and codes.stride(-1) == 1
        and scales.stride(-1) == 1
    )


def kernel_usable(codes: torch.Tensor, scales: torch.Tensor, mode: str, *others: torch.Tensor) -> bool:
    """Whether `history_scores` / `history_values` can run on these codes (`[b, h, L, packed]`) and group scales
    (`[b, h, L, G]`): the switch, the CPU and compiler, the device, autograd, `torch.compile` and the geometry.
    With `HYBRID_CACHE_CODE_KERNEL=on`, a case the kernel cannot take raises `CodeKernelError` instead of False."""
    mode_setting = _mode()
    if mode_setting == "off":
        return False
    tensors = (codes, scales, *others)
    reasons = []
    if _load()[0] is None:
        reasons.append(_load()[1])
    if any(t.device.type != "cpu" for t in tensors):
        reasons.append("the tensors are not on the CPU")
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        reasons.append("autograd is recording (the kernel has no backward)")
    if is_torchdynamo_compiling():
        reasons.append("torch.compile is tracing")
    if not _geometry_fits(codes, scales, mode):
        reasons.append(
            f"{mode} codes {tuple(codes.shape)} with {scales.shape[-1]} groups do not fit (head and group sizes "
            f"multiples of 64, at most {_MAX_CHANNELS} channels, int4 heads a multiple of 128)"
        )
    if reasons and mode_setting == "on":
        raise CodeKernelError(
            f"{KERNEL_ENV}=on, but the native kernel cannot run here: {'; '.join(reasons)}. Set {KERNEL_ENV}=auto "
            f"to fall back to torch ops."
        )
    return not reasons


def _splits(batch_heads: int, length: int) -> tuple[int, int]:
    """(token ranges per batch x head, threads) for a call."""
    threads = max(1, min(torch.get_num_threads(), _MAX_THREADS))
    if batch_heads >= threads:
        return 1, threads
    return max(1, min(-(-threads // batch_heads), length // _MIN_SPLIT_TOKENS)), threads


def _loaded_for(codes: torch.Tensor, scales: torch.Tensor, mode: str) -> ctypes.CDLL:
    """The library, after checking that it is loaded and that the codes and scales are what the kernel reads."""
    library = _load()[0]
    if library is None:
        raise CodeKernelError(f"the native kernel is {_load()[1]}; check `kernel_usable` before calling it.")
    if not _geometry_fits(codes, scales, mode) or codes.device.type != "cpu" or scales.device.type != "cpu":
        raise ValueError(
            f"The native kernel does not take {mode} codes {codes.dtype} {list(codes.shape)} with scales "
            f"{scales.dtype} {list(scales.shape)} on {codes.device}; check `kernel_usable` before calling it."
        )
    _require(scales, (*codes.shape[:3], scales.shape[-1]), "scales")
    return library


def _channels(codes: torch.Tensor, mode: str) -> int:
    return codes.shape[-1] * (2 if mode == "int4" else 1)


def _require(tensor: torch.Tensor, shape: tuple[int, ...], name: str, dtype: torch.dtype | None = None) -> None:
    """The kernel reads raw memory: a tensor of another shape or dtype than the codes imply is refused here."""
    if tuple(tensor.shape) != shape or (dtype is not None and tensor.dtype != dtype) or tensor.device.type != "cpu":
        wanted = f"{dtype} " if dtype is not None else ""
        raise ValueError(
            f"`{name}` must be a CPU {wanted}tensor of shape {list(shape)} for these codes, got {tensor.dtype} "
            f"{list(tensor.shape)} on {tensor.device}."
        )


def _code_arguments(codes: torch.Tensor, scales: torch.Tensor, mode: str, splits: int, threads: int) -> tuple:
    """The arguments both entry points start with: the codes and scales with their strides, the geometry, the work
    split."""
    batch, heads, length, _ = codes.shape
    return (
        codes.data_ptr(),
        _strides(codes),
        scales.data_ptr(),
        _strides(scales),
        _SCALE_DTYPES[scales.dtype],
        batch,
        heads,
        length,
        _channels(codes, mode),
        scales.shape[-1],
        int(mode == "int4"),
        splits,
        threads,
    )


def _strides(tensor: torch.Tensor) -> ctypes.Array:
    return (ctypes.c_int64 * 3)(*tensor.stride()[:3])


def _check(status: int, name: str) -> None:
    if status:  # the Python checks above make this unreachable; it guards against a mismatched library
        raise CodeKernelError(f"the native kernel refused the geometry in {name} (status {status}).")


def history_scores(
    codes: torch.Tensor,
    scales: torch.Tensor,
    mode: str,
    query_codes: torch.Tensor,
    query_weights: torch.Tensor,
    row_constants: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """Write the scores of the query rows against the key codes into `out` `[b, h, m, L]` float32 (any strides with
    contiguous tokens, e.g. the history's columns of a step's score matrix).

    `codes` `[b, h, L, packed]` int8 and `scales` `[b, h, L, G]` as the layer stores them (views with any token
    stride); `query_codes` `[b, h, R, D]` int8 (one row per query and part, parts outermost) and `query_weights`
    `[b, h, R, G]` (the query's group scales, already divided by the codes' factor and, for a second part, by its
    levels); row `r` adds into output row `r % m`, and `row_constants` `[b, h, m]` is added to every score of its
    row. Call only where `kernel_usable` said True.
    """
    library = _loaded_for(codes, scales, mode)
    batch, heads, length, _ = codes.shape
    groups = scales.shape[-1]
    rows, out_rows = query_codes.shape[2], out.shape[2]
    _require(query_codes, (batch, heads, rows, _channels(codes, mode)), "query_codes", torch.int8)
    _require(query_weights, (batch, heads, rows, groups), "query_weights")
    _require(row_constants, (batch, heads, out_rows), "row_constants")
    _require(out, (batch, heads, out_rows, length), "out", torch.float32)
    if rows % out_rows or out.stride(-1) != 1:
        raise ValueError(f"{rows} query rows must be a multiple of out's {out_rows}, and out's tokens contiguous.")
    if not length:
        return
    query_codes = query_codes.contiguous()
    query_weights = query_weights.float().contiguous()
    row_constants = row_constants.float().contiguous()
    splits, threads = _splits(batch * heads, length)
    status = library.hc_scores(
        *_code_arguments(codes, scales, mode, splits, threads),
        query_codes.data_ptr(),
        query_weights.data_ptr(),
        rows,
        out_rows,
        row_constants.data_ptr(),
        out.data_ptr(),
        _strides(out),
    )
    _check(status, "history_scores")


def history_values(
    codes: torch.Tensor, scales: torch.Tensor, mode: str, probabilities: torch.Tensor, factor: float
) -> torch.Tensor:
    """`sum_t p_t * factor * scale_(t, g) * codes_t` `[b, h, m, D]` float32 for probabilities `[b, h, m, L]` float32
    (any strides but contiguous tokens). `codes` / `scales` as in `history_scores`. Call only where `kernel_usable`
    said True."""
    library = _loaded_for(codes, scales, mode)
    batch, heads, length, _ = codes.shape
    rows = probabilities.shape[2]
    channels = _channels(codes, mode)
    _require(probabilities, (batch, heads, rows, length), "probabilities")
    if not length:
        return torch.zeros((batch, heads, rows, channels), dtype=torch.float32)
    if probabilities.stride(-1) != 1 or probabilities.dtype != torch.float32:
        probabilities = probabilities.float().contiguous()
    splits, threads = _splits(batch * heads, length)
    partial = torch.empty((batch, heads, splits, rows, channels), dtype=torch.float32)  # the kernel writes every one
    status = library.hc_values(
        *_code_arguments(codes, scales, mode, splits, threads),
        probabilities.data_ptr(),
        _strides(probabilities),
        rows,
        factor,
        partial.data_ptr(),
    )
    _check(status, "history_values")
    return partial.sum(2) if splits > 1 else partial.squeeze(2)
