"""The native CPU kernel of attention on the codes: the two loops over a compressed history (scores from the key
codes, the value sum from the value codes) in C (`csrc/code_attention.c`), for x86-64 with AVX-512 VNNI or AVX2 + FMA
+ F16C (with AVX-VNNI where the CPU has it) and for aarch64 with NEON (with the dot-product extension where present).

`hybrid_cache.code_attention` computes the same two loops with torch operations; this module is its faster path, used
when all of these hold (`kernel_usable`): the CPU has one of the instruction sets, a C compiler built the kernel for
it, the tensors are on the CPU without autograd and outside `torch.compile`, and the geometry fits (head size and group
size multiples of 64, heads of at most 1024 channels, int4 heads a multiple of 128: Gemma 3's 256 and Gemma 4's 256 /
512 with the default group of 64). Otherwise the torch path runs (or the layer dequantizes, where that is faster:
`code_path.codes_preferred`); the result is the same up to float32 summation order (tests/core/test_code_kernel.py
holds both to `reference_attention`; scripts/kernel_cross_check.sh holds every instruction set's build to a reference
in plain C, aarch64 under qemu).

Instruction set: `HYBRID_CACHE_CODE_KERNEL_ISA`, read at every call: `auto` (the default: the best set the CPU reports,
in the order avx512, avx2, neon) or one of them, to run and measure a path on a CPU that has more. The CPU's features
come from `/proc/cpuinfo` on Linux and from `sysctl` on macOS (untested: docs/limits.md). A forced set the CPU lacks
leaves the kernel unavailable (under `HYBRID_CACHE_CODE_KERNEL=on`, `kernel_usable` raises `CodeKernelError` naming
what is missing).

Building: on first use of a set, `$CC` (default `cc`) compiles the one source with that set's flags into
`$HYBRID_CACHE_KERNEL_DIR` (default `$XDG_CACHE_HOME/hybrid_cache` or `~/.cache/hybrid_cache`), once per source,
compiler and flags, in about a second; later processes load the library from there. The file is written under a
temporary name and renamed, so concurrent processes never load half a library. The library names the set it was
built for (`hc_isa`), which is checked on loading.

Switch: the environment variable `HYBRID_CACHE_CODE_KERNEL`, read at every call: `auto` (the default: use the kernel
where it can run), `off` (never), `on` (raise `CodeKernelError` where it cannot run, with the reason).
`kernel_status()` says which applies, with the instruction set, or why not (building the kernel if needed); the
benchmarks print it.

Threads: `torch.get_num_threads()` threads per call, each taking whole (batch x head, token range) items; calls are
serialized, and the call releases the GIL (ctypes). Where torch runs its parallel operations on GNU OpenMP (torch's
Linux wheels, which bundle libgomp), the library is built with `-fopenmp` and linked to the very runtime torch loaded,
so a call runs on torch's own OpenMP team: its workers, which spin for a while after each torch operation, take the
kernel's items instead of competing with a second set of threads for the cores (docs/quantization.md, "Speed").
Elsewhere (macOS, another OpenMP runtime, a compiler that cannot build it, a child forked after the library was
loaded) the library keeps its own pool of worker threads between calls. `HYBRID_CACHE_CODE_KERNEL_THREADS=auto|pthreads`
(read at every call, like the two switches above) forces the pool, to measure one against the other.
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
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers.utils import is_torchdynamo_compiling

from .errors import CodeKernelError

__all__ = [
    "build_dir",
    "INSTRUCTION_SETS",
    "ISA_ENV",
    "KERNEL_ENV",
    "THREADS_ENV",
    "CodeKernelError",
    "available_isas",
    "cpu_features",
    "history_scores",
    "history_values",
    "kernel_status",
    "kernel_usable",
    "missing_features",
    "torch_openmp_runtime",
]

logger = logging.getLogger(__name__)

KERNEL_ENV = "HYBRID_CACHE_CODE_KERNEL"
ISA_ENV = "HYBRID_CACHE_CODE_KERNEL_ISA"
THREADS_ENV = "HYBRID_CACHE_CODE_KERNEL_THREADS"
_SOURCE = Path(__file__).with_name("csrc") / "code_attention.c"
_COMMON_FLAGS = ("-O3", "-shared", "-fPIC", "-pthread")


@dataclass(frozen=True)
class _InstructionSet:
    """One build of the kernel: the machine, the CPU features it needs (as Linux's /proc/cpuinfo names them), its
    compiler flags, and an optional extension used where the CPU reports it (its feature, name and flags)."""

    machine: str
    features: tuple[str, ...]
    flags: tuple[str, ...]
    extension: tuple[str, str, tuple[str, ...]] | None = None


# In the order `auto` tries them.
INSTRUCTION_SETS = {
    "avx512": _InstructionSet(
        "x86_64",
        ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "f16c", "fma"),
        ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mf16c", "-mfma"),
    ),
    "avx2": _InstructionSet(
        "x86_64",
        ("avx2", "fma", "f16c"),
        ("-mavx2", "-mfma", "-mf16c"),
        ("avx_vnni", "avx-vnni", ("-mavxvnni",)),
    ),
    "neon": _InstructionSet(
        "aarch64", ("asimd",), ("-march=armv8-a",), ("asimddp", "dotprod", ("-march=armv8.2-a+dotprod",))
    ),
}
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


def _isa_setting() -> str:
    setting = os.environ.get(ISA_ENV, "auto").strip().lower() or "auto"
    if setting != "auto" and setting not in INSTRUCTION_SETS:
        raise CodeKernelError(
            f"{ISA_ENV}={setting!r} is not an instruction set; use auto (the default) or one of "
            f"{', '.join(INSTRUCTION_SETS)}."
        )
    return setting


def _threads_setting() -> str:
    setting = os.environ.get(THREADS_ENV, "auto").strip().lower() or "auto"
    if setting not in ("auto", "pthreads"):
        raise CodeKernelError(
            f"{THREADS_ENV}={setting!r} is not a setting; use auto (the default: torch's OpenMP threads where it can) "
            "or pthreads (the library's own pool)."
        )
    return setting


def _machine() -> str:
    machine = platform.machine().lower()
    return {"amd64": "x86_64", "x64": "x86_64", "arm64": "aarch64"}.get(machine, machine)


# macOS `sysctl` names (upper case, without Linux's underscores) -> the /proc/cpuinfo names used above.
_MACOS_FEATURES = {"avx512vnni": "avx512_vnni", "avxvnni": "avx_vnni", "avx2": "avx2", "fma": "fma", "f16c": "f16c"}


@functools.lru_cache(maxsize=1)
def cpu_features() -> frozenset[str]:
    """The CPU's features as Linux's /proc/cpuinfo names them (x86 `flags`, aarch64 `Features`); on macOS read
    with `sysctl` and renamed to match (untested). Empty where neither can be read."""
    if sys.platform == "darwin":
        return _macos_features()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key = line.split(":", 1)[0].strip().lower()
                if key in ("flags", "features"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _sysctl(name: str) -> str:
    try:
        result = subprocess.run(["sysctl", "-n", name], capture_output=True, text=True, check=False, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return ""
    return result.stdout.strip() if result.returncode == 0 else ""


def _macos_features() -> frozenset[str]:
    if _machine() == "aarch64":  # Apple silicon: NEON always; the dot product from M1 on
        features = {"asimd"}
        if _sysctl("hw.optional.arm.FEAT_DotProd") == "1":
            features.add("asimddp")
        return frozenset(features)
    names = f"{_sysctl('machdep.cpu.features')} {_sysctl('machdep.cpu.leaf7_features')}".lower().split()
    return frozenset(_MACOS_FEATURES.get(name.replace(".", ""), name.replace(".", "")) for name in names)


def missing_features(isa: str) -> list[str]:
    """What this CPU lacks to run the kernel's `isa` build ([] where it can)."""
    spec = INSTRUCTION_SETS[isa]
    if _machine() != spec.machine:
        return [f"an {spec.machine} CPU (this is {platform.machine()})"]
    features = cpu_features()
    if not features:
        return [f"its feature list ({'sysctl' if sys.platform == 'darwin' else '/proc/cpuinfo'} could not be read)"]
    return [feature for feature in spec.features if feature not in features]


def available_isas() -> list[str]:
    """The instruction sets this CPU can run the kernel with, best first (the order `auto` tries)."""
    return [isa for isa in INSTRUCTION_SETS if not missing_features(isa)]


def build_dir() -> Path:
    if os.environ.get("HYBRID_CACHE_KERNEL_DIR"):
        return Path(os.environ["HYBRID_CACHE_KERNEL_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hybrid_cache"


def torch_openmp_runtime() -> tuple[Path | None, str]:
    """(the GNU OpenMP runtime torch's parallel operations run on, or None, and why not): among the process's loaded
    libraries (Linux's /proc/self/maps), the libgomp inside torch's own installation (`torch/lib`, or `torch.libs`
    where the wheel renamed it); other packages (scikit-learn, for one) load libgomps of their own."""
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return None, "torch's parallel backend is not OpenMP"
    try:
        with open("/proc/self/maps") as f:
            loaded = {Path(line.split(maxsplit=5)[-1].strip()) for line in f if "/libgomp" in line}
    except OSError:
        return None, "the loaded libraries cannot be listed (no /proc/self/maps)"
    package = Path(torch.__file__).resolve().parent
    homes = (package, package.parent / "torch.libs")
    torchs = sorted(path for path in loaded if any(path.resolve().is_relative_to(home) for home in homes))
    if len(torchs) == 1:
        return torchs[0], f"torch's OpenMP runtime {torchs[0]}"
    if not loaded:
        return None, "torch's OpenMP runtime is not GNU libgomp"
    return (
        None,
        f"cannot tell which of the loaded GNU OpenMP runtimes is torch's ({', '.join(map(str, sorted(loaded)))})",
    )


def _thread_model(openmp: Path | None) -> str:
    """How a build runs its threads, as its file name and its `hc_threads()` say it."""
    return "pthreads" if openmp is None else "openmp"


def _compile(compiler: str, flags: tuple[str, ...], openmp: Path | None, output: str) -> subprocess.CompletedProcess:
    """One build: with `openmp`, compiled with -fopenmp and linked to that runtime (not the compiler's own)."""
    if openmp is None:
        return subprocess.run(
            [compiler, *flags, str(_SOURCE), "-o", output], capture_output=True, text=True, check=False
        )
    compile_only = [f for f in flags if f != "-shared"]
    obj = f"{output}.o"
    try:
        result = subprocess.run(
            [compiler, *compile_only, "-fopenmp", "-c", str(_SOURCE), "-o", obj],
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode:
            return result
        link = [compiler, "-shared", "-pthread", obj, str(openmp), f"-Wl,-rpath,{openmp.parent}", "-o", output]
        return subprocess.run(link, capture_output=True, text=True, check=False)
    finally:
        if os.path.exists(obj):
            os.remove(obj)


def _build(isa: str, openmp: Path | None = None) -> tuple[Path, str]:
    """Compile the kernel for `isa` (once per source, compiler, flags and OpenMP runtime), on `openmp`'s threads
    where given; return the library's path and the name of the build (the set, with its extension where the CPU has
    it)."""
    spec = INSTRUCTION_SETS[isa]
    flags, name = (*_COMMON_FLAGS, *spec.flags), isa
    if spec.extension is not None and spec.extension[0] in cpu_features():
        flags, name = (*flags, *spec.extension[2]), f"{isa}+{spec.extension[1]}"
    compiler = os.environ.get("CC", "cc")
    if shutil.which(compiler) is None:
        raise CodeKernelError(f"no C compiler: `{compiler}` is not on PATH (install gcc, or set CC)")
    source = _SOURCE.read_bytes()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout
    recipe = " ".join(flags) + (f" -fopenmp {openmp}" if openmp else "")
    key = hashlib.sha256(source + version.encode() + recipe.encode()).hexdigest()[:16]
    directory = build_dir()
    library = directory / f"code_attention-{name}-{_thread_model(openmp)}-{key}.so"
    if library.exists():
        return library, name
    directory.mkdir(parents=True, exist_ok=True)
    handle, partial = tempfile.mkstemp(dir=directory, prefix=library.stem, suffix=".tmp")
    os.close(handle)
    try:
        result = _compile(compiler, flags, openmp, partial)
        if result.returncode:
            threads = " on OpenMP" if openmp else ""
            raise CodeKernelError(
                f"`{compiler}` could not build {_SOURCE.name} for {name}{threads}: {result.stderr.strip()[-600:]}"
            )
        os.replace(partial, library)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    return library, name


def _open(isa: str, openmp: Path | None) -> tuple[ctypes.CDLL, Path, str]:
    """Build (if needed) and load one library, checking that it is the build asked for."""
    path, name = _build(isa, openmp)
    library = ctypes.CDLL(str(path))
    library.hc_isa.restype = library.hc_threads.restype = ctypes.c_char_p
    built, threads = library.hc_isa().decode(), library.hc_threads().decode()
    if built != name or threads != _thread_model(openmp):
        raise CodeKernelError(f"{path} was built for {built} on {threads} (a stale or foreign library)")
    return library, path, name


@functools.cache
def _load(setting: str, threads: str = "auto") -> tuple[ctypes.CDLL | None, str]:
    """(the loaded library or None, what it is or why not) for an `ISA_ENV` and a `THREADS_ENV` setting — tried once
    per process."""
    if setting == "auto":
        usable = available_isas()
        if not usable:
            return None, (
                f"unavailable: the CPU has none of the kernel's instruction sets ({', '.join(INSTRUCTION_SETS)}; "
                f"this is {platform.machine()})"
            )
        isa = usable[0]
    else:
        isa, missing = setting, missing_features(setting)
        if missing:
            return None, f"unavailable: {ISA_ENV}={setting} needs what this CPU lacks: {', '.join(missing)}"
    openmp, why_not = torch_openmp_runtime() if threads == "auto" else (None, f"{THREADS_ENV}=pthreads")
    library = None
    try:
        if openmp is not None:
            try:
                library, path, name = _open(isa, openmp)
                runs_on = "on torch's OpenMP threads"
            except (CodeKernelError, OSError, AttributeError) as error:
                why_not = f"no OpenMP build: {error}"
        if library is None:
            library, path, name = _open(isa, None)
            runs_on = f"on its own threads ({why_not})"
    except (CodeKernelError, OSError, AttributeError) as error:
        logger.warning("hybrid_cache: the native code-attention kernel is unavailable (%s); using torch ops.", error)
        return None, f"unavailable: {error}"
    pointer, integer = ctypes.c_void_p, ctypes.c_int64
    shared: list[type[ctypes.c_void_p] | type[ctypes.c_int64]] = [pointer] * 4 + [integer] * 9  # `_code_arguments`
    library.hc_scores.argtypes = [*shared, pointer, pointer, integer, integer, pointer, pointer, pointer]
    library.hc_values.argtypes = [*shared, pointer, pointer, integer, ctypes.c_float, pointer]
    library.hc_scores.restype = library.hc_values.restype = ctypes.c_int
    return library, f"{name} kernel {runs_on}, loaded from {path}"


def _library() -> tuple[ctypes.CDLL | None, str]:
    return _load(_isa_setting(), _threads_setting())


def kernel_status() -> str:
    """One line: whether the kernel runs (`on`, `off` or `auto`, the instruction set, its threads and its library,
    e.g. "auto: avx2 kernel on torch's OpenMP threads, loaded from ..."), or why not."""
    mode, setting = _mode(), _isa_setting()
    if mode == "off":
        return f"off ({KERNEL_ENV}=off): no native kernel"
    forced = f" ({ISA_ENV}={setting})" if setting != "auto" else ""
    return f"{mode}{forced}: {_library()[1]}"


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
    library, why = _library()
    if library is None:
        reasons.append(why)
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
            f"to fall back to torch ops{' (or another instruction set)' if _isa_setting() != 'auto' else ''}."
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
    library, why = _library()
    if library is None:
        raise CodeKernelError(f"the native kernel is {why}; check `kernel_usable` before calling it.")
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
