"""``python -m hybrid_cache.tools.cli.bench`` / ``hybrid-cache-bench``: parse the options, check the machine, run one benchmark
(decode, chunked prefill, or the ``generate`` prefill-chunk check), print its tables and write JSON / PNG.

A user's mistake (a ``--model`` path that does not exist or is no model, a Hub id not cached while offline, an output
file in a folder that does not exist) exits with status 2 and one line on stderr, before anything is measured."""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shlex
import sys
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, NoReturn

import torch

from hybrid_cache.specs import declared_window

from .. import compare
from ..bench.compiled import CompileOptions
from ..bench.decode import BenchResult, run_benchmark
from ..bench.machine import ContentionMeter, busy_machine_warning, loadavg, machine_info, measure_bandwidth
from ..bench.prefill import prefill_chunk_check, run_prefill_benchmark
from ..bench.profiling import profile_decode, profile_prefill
from ..bench.report import format_compiled_table, format_memory_table, format_prefill_table, format_table, plot_results
from ..bench.workload import DTYPES, TINY_MODELS, check_bench_model, load_bench_model, parameter_bytes
from ..compare import text_config

__all__ = ["build_parser", "main"]

DECODE_CONTEXTS = [1024, 4096, 16384]
PREFILL_CONTEXTS = [4096, 16384]
PREFILL_CHUNKS = [128, 512, 2048]
CHECK_CHUNKS = [2048]


class _HelpFormatter(argparse.HelpFormatter):
    """Shows each option's default, except where there is none or the help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "(default" in text:
            return text
        default = action.default
        shown = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else str(default)
        return f"{text} (default: {shown})".strip()


def build_parser() -> argparse.ArgumentParser:
    """The options of the command, in the order ``--help`` lists them."""
    p = argparse.ArgumentParser(
        prog="hybrid-cache-bench",
        formatter_class=_HelpFormatter,
        description="Benchmark of HybridRingCache vs DynamicCache vs StaticCache: decode steps (default), chunked "
        "prefill (--prefill), or generate()'s prefill-chunk bound (--prefill-chunk-check). CPU by default "
        "(--device cuda); --compile for torch.compile'd decode steps. Caches run interleaved. Needs a "
        "quiet machine: it measures the load and marks rows measured while other work competed (!).",
        epilog="Commands and results: docs/benchmarks.md.",
    )
    _add_model_options(p)
    _add_workload_options(p)
    _add_repetition_options(p)
    _add_output_options(p)
    _add_profile_options(p)
    _add_prefill_options(p)
    _add_device_option(p)
    _add_compile_options(p)
    return p


def _add_model_options(p: argparse.ArgumentParser) -> None:
    """--model and its dtypes."""
    p.add_argument(
        "--model",
        default="default",
        help="'default' (embedded Gemma 3 270M via hybrid_cache.tools.models.load_model), "
        + ", ".join(
            f"'{n}' (random, {g.source}'s K/V geometry: {g.kv_heads} KV heads x {g.head_dim}, "
            f"window {g.window}, {g.layers} layers)"
            for n, g in TINY_MODELS.items()
        )
        + ", or a path/Hub id accepted by load_model.",
    )
    p.add_argument(
        "--dtypes",
        "--dtype",
        nargs="+",
        default=["float32"],
        choices=sorted(DTYPES),
        metavar="DTYPE",
        help=f"parameter/KV dtypes, from {', '.join(sorted(DTYPES))} (each gets its own rows).",
    )


def _add_workload_options(p: argparse.ArgumentParser) -> None:
    """What is measured: contexts, batches, caches, windows."""
    names = list(compare.CACHE_NAMES)  # read now: names registered in hybrid_cache.tools.compare are benchmarked too
    p.add_argument(
        "--contexts",
        nargs="+",
        type=int,
        default=None,
        help=f"tokens before the timed decode steps (default {' '.join(map(str, DECODE_CONTEXTS))}; 32768 "
        f"optional) or, with --prefill, prompt lengths (default {' '.join(map(str, PREFILL_CONTEXTS))}).",
    )
    p.add_argument(
        "--batch",
        "--batches",
        dest="batches",
        nargs="+",
        type=int,
        default=None,
        help="batch sizes (default 1 8; with --prefill 1).",
    )
    p.add_argument(
        "--caches",
        nargs="+",
        default=list(compare.EXACT_CACHE_NAMES),
        choices=names,
        metavar="CACHE",
        help=f"caches to compare, from {', '.join(names)} (the default: the exact ones; the others are the "
        f"approximate storage modes of docs/quantization.md).",
    )
    p.add_argument(
        "--window",
        nargs="+",
        type=int,
        default=None,
        help="sliding window(s) of a random model (default: the model's own; ignored for a real model), "
        "e.g. --window 1024 4096.",
    )


def _add_repetition_options(p: argparse.ArgumentParser) -> None:
    """Steps, repetitions and threads."""
    p.add_argument("--steps", type=int, default=16, help="timed decode steps per repetition.")
    p.add_argument("--warmup", type=int, default=2, help="untimed decode steps before the timed ones.")
    p.add_argument("--reps", type=int, default=3, help="repetitions (interleaved across caches).")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch.set_num_threads (default: torch's choice, one per core). On a machine shared with other "
        "work, fewer threads than cores keeps them from waiting on each other.",
    )


def _add_output_options(p: argparse.ArgumentParser) -> None:
    """What is written: JSON, tables, plot; the bandwidth test's size."""
    p.add_argument("--json", default=None, help="write results as JSON to this path (with the full tables).")
    p.add_argument(
        "--full-table",
        action="store_true",
        help="print the full tables (per cache median/min, cache ms, KV and copy MiB, compile seconds, ...; "
        "about 225 characters wide) instead of the compact ones (the median per cache and the ratios).",
    )
    p.add_argument("--plot", default=None, help="write a PNG of ms/token vs context to this path.")
    p.add_argument("--bandwidth-bytes", type=int, default=2**30, help="size of the bandwidth copy test (bytes).")


def _add_profile_options(p: argparse.ArgumentParser) -> None:
    """--profile and its settings."""
    p.add_argument(
        "--profile",
        action="store_true",
        help="also run torch.profiler: a few decode steps per cache at --profile-context/--profile-batch, "
        "or with --prefill one chunked prefill per cache at --profile-context/--profile-chunk.",
    )
    p.add_argument("--profile-context", type=int, default=16384, help="context of the profiled decode or prefill.")
    p.add_argument("--profile-batch", type=int, default=8, help="batch of the profiled decode steps.")
    p.add_argument("--profile-steps", type=int, default=3, help="profiled decode steps per cache.")
    p.add_argument("--profile-chunk", type=int, default=512, help="chunk size of the profiled prefill.")
    p.add_argument("--profile-out", default=None, help="write the profiler tables to this text file.")


def _add_prefill_options(p: argparse.ArgumentParser) -> None:
    """The two prefill benchmarks and their prompt / chunk sizes."""
    p.add_argument(
        "--prefill",
        action="store_true",
        help="instead of the decode benchmark: time a chunked prefill (model(chunk, cache=..., "
        "logits_to_keep=1) per chunk, as generate's prefill_chunk_size) of every --contexts prompt with "
        "every --chunk-size into every cache.",
    )
    p.add_argument(
        "--prefill-chunk-check",
        action="store_true",
        help="instead of the decode benchmark: generate() with prefill_chunk_size into a HybridRingCache "
        "and report the longest sliding-layer update and peak memory.",
    )
    p.add_argument("--prompt-length", type=int, default=32768, help="prompt length of --prefill-chunk-check.")
    p.add_argument(
        "--chunk-size",
        nargs="+",
        type=int,
        default=None,
        help=f"prefill chunk size(s) (default {' '.join(map(str, PREFILL_CHUNKS))} with --prefill, "
        f"{' '.join(map(str, CHECK_CHUNKS))} with --prefill-chunk-check).",
    )


def _add_device_option(p: argparse.ArgumentParser) -> None:
    """--device."""
    p.add_argument(
        "--device",
        default="cpu",
        help="'cpu' or 'cuda' / 'cuda:N': model, caches, inputs and the bandwidth test on that device; timed "
        "steps are bracketed by torch.cuda.synchronize; JSON peak_memory_bytes = "
        "torch.cuda.max_memory_allocated.",
    )


def _add_compile_options(p: argparse.ArgumentParser) -> None:
    """--compile and its settings."""
    p.add_argument(
        "--compile",
        action="store_true",
        help="time torch.compile(model.forward, fullgraph=True)'d decode steps of the compileable caches "
        "(ring = HybridRingCache(config, max_cache_len=context+warmup+steps+16), static); dynamic is "
        "skipped. Compilation happens in the untimed warm-up (JSON compile_seconds, graphs).",
    )
    p.add_argument(
        "--with-eager",
        action="store_true",
        help="with --compile: also time the eager caches in the same interleaved reps (compiled/eager ratios).",
    )
    p.add_argument(
        "--compile-backend", default="inductor", help="torch.compile backend ('eager' checks graph capture only)."
    )
    p.add_argument(
        "--compile-mode",
        default=None,
        help="inductor mode, e.g. 'reduce-overhead' (CUDA graphs, generate's default) or 'max-autotune'.",
    )
    p.add_argument(
        "--compile-masks",
        nargs="+",
        default=["inside"],
        choices=["inside", "outside"],
        help="'inside': the compiled forward builds its masks from the cache; 'outside': they are built "
        "eagerly by create_masks_for_generate and passed as attention_mask (as generate does for "
        "compileable caches). Both: one row each.",
    )
    p.add_argument(
        "--compile-dynamic",
        default="per-cache",
        choices=["per-cache", "false", "auto"],
        help="torch.compile(dynamic=...): 'false' for every cache, 'auto' (None, torch's automatic dynamic "
        "shapes; generate's default), or 'per-cache': False for the ring, None for StaticCache, which "
        "recompiles at every decode step with dynamic=False (its sliding layers branch on a Python int "
        "counter).",
    )
    p.add_argument(
        "--compile-check-steps",
        type=int,
        default=3,
        help="compiled warm-up steps compared with an eager run of the same cache type (<= --warmup).",
    )


def _log(msg: str) -> None:
    print(msg, flush=True)


def _usage_error(message: str) -> NoReturn:
    """A user's mistake: one line on stderr, exit status 2 (as the other commands of the package)."""
    print(f"hybrid-cache-bench: error: {' '.join(message.split())}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def _check_inputs(args: argparse.Namespace) -> None:
    """--model and the output files, before the machine is measured: a mistake found only when the model loads (after
    the bandwidth test) or when the JSON is written (after the whole run) would cost the user that time."""
    try:
        check_bench_model(args.model)
    except (OSError, ValueError) as exc:
        _usage_error(str(exc))
    for option, path in (("--json", args.json), ("--plot", args.plot), ("--profile-out", args.profile_out)):
        if not path:
            continue
        folder = Path(path).expanduser().absolute().parent
        if Path(path).is_dir():
            _usage_error(f"{option} {path!r} is a directory; expected the path of a file to write")
        if not folder.is_dir():
            _usage_error(f"cannot write {option} {path!r}: the folder {str(folder)!r} does not exist")


def _windows(args: argparse.Namespace) -> list[int | None]:
    """The windows to build models for: --window for a random model, else the model's own (None)."""
    return list(args.window) if (args.model in TINY_MODELS and args.window) else [None]


def _models(args: argparse.Namespace, device: str):
    """Yield (dtype name, dtype, window, model) for every dtype and window, freeing each model after use."""
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        for window in _windows(args):
            try:
                model = load_bench_model(args.model, dtype, window, device=device)
            except (OSError, ValueError, ImportError) as exc:  # a wrong path or Hub id: one line, no traceback
                _usage_error(str(exc))
            config = text_config(model)
            _log(
                f"model {args.model} {dtype_name}: {config.num_hidden_layers} layers, window "
                f"{declared_window(config)}, weights {parameter_bytes(model) / 2**20:.0f} MiB"
            )
            yield dtype_name, dtype, window, model
            del model
            gc.collect()


def _write_profiles(profiles: dict[str, str], path: str | None) -> None:
    text = "\n\n".join(f"== {k} ==\n{v}" for k, v in profiles.items())
    if path:
        with open(path, "w") as f:
            f.write(text)
    else:
        _log(text)


def _busy_summary(rows: Sequence[Any], meter: ContentionMeter) -> None:
    busy = [r for r in rows if getattr(r, "competing_load", False)]
    if busy:
        _log(
            f"\nWARNING: {len(busy)} of {len(rows)} rows were measured while other processes competed for the "
            f"{meter.cpus} CPUs (marked '!'; up to {max(r.other_cpu_cores or 0 for r in busy):.1f} CPUs busy with "
            "other work on average): their timings and ratios are not trustworthy. Re-run them on a quiet machine"
            + (" or with --threads 1." if meter.threads > 1 else ".")
        )


def _run_chunk_check(args: argparse.Namespace, payload: dict[str, Any]) -> int:
    checks = []
    for _, _, _, model in _models(args, args.device):
        for chunk in args.chunk_size or CHECK_CHUNKS:
            result = prefill_chunk_check(model, prompt_length=args.prompt_length, chunk_size=chunk)
            result.update(model=args.model, dtype=str(next(model.parameters()).dtype).replace("torch.", ""))
            checks.append(result)
            _log(
                f"prefill check {args.model} {result['dtype']} window={result['sliding_window']} "
                f"N={args.prompt_length} chunk={chunk}: longest sliding update "
                f"{result['max_sliding_update_returned_tokens']} tokens (bound capacity+chunk = "
                f"{result['bound_capacity_plus_chunk']}: {'OK' if result['within_bound'] else 'EXCEEDED'}), "
                f"KV held {result['kv_bytes'] / 2**20:.1f} MiB, RSS peak +{result['rss_peak_delta_bytes'] / 2**20:.0f} "
                f"MiB over {result['rss_before_bytes'] / 2**20:.0f} MiB (ru_maxrss "
                f"{result['ru_maxrss_bytes'] / 2**20:.0f} MiB), {result['seconds']:.1f} s"
            )
    payload["prefill_chunk_check"] = checks
    return 0 if all(c["within_bound"] for c in checks) else 1


def _run_prefill(args: argparse.Namespace, payload: dict[str, Any], meter: ContentionMeter) -> int:
    rows, profiles = [], {}
    for dtype_name, dtype, window, model in _models(args, args.device):
        for batch in args.batches or [1]:
            rows += run_prefill_benchmark(
                model,
                model_name=args.model,
                dtype=dtype,
                contexts=args.contexts or PREFILL_CONTEXTS,
                chunks=args.chunk_size or PREFILL_CHUNKS,
                caches=args.caches,
                reps=args.reps,
                batch=batch,
                log=_log,
                meter=meter,
            )
        if args.profile:
            for name, table in profile_prefill(
                model, args.caches, context=args.profile_context, chunk=args.profile_chunk
            ).items():
                profiles[
                    f"{args.model} w={window} {dtype_name} ctx={args.profile_context} "
                    f"chunk={args.profile_chunk} {name}"
                ] = table
    payload["prefill_table"] = format_prefill_table(rows, args.caches)
    _log("\n" + (payload["prefill_table"] if args.full_table else format_prefill_table(rows, args.caches, full=False)))
    payload["results"] = [asdict(r) for r in rows]
    if profiles:
        payload["profiles"] = profiles
        _write_profiles(profiles, args.profile_out)
    _busy_summary(rows, meter)
    return 0


def _measure_device(args: argparse.Namespace, payload: dict[str, Any]) -> tuple[torch.device, float]:
    """Describe the device in ``payload["machine"]`` and measure its copy bandwidth (the roofline's denominator)."""
    machine = payload["machine"]
    device = torch.device(args.device)
    machine["device"] = str(device)
    if device.type == "cuda":
        machine["gpu"] = torch.cuda.get_device_name(device)
        machine["cuda"] = torch.version.cuda
        machine["gpu_mem_total_gib"] = round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1)
    bandwidth = measure_bandwidth(args.bandwidth_bytes, device=device)
    machine["copy_bandwidth_gbps"] = round(bandwidth["gbps"], 2)
    payload["bandwidth"] = bandwidth
    _log(
        f"copy bandwidth ({device}): {bandwidth['gbps']:.2f} GB/s (best of 5 copies of "
        f"{args.bandwidth_bytes / 2**20:.0f} MiB, read + written bytes)"
    )
    return device, bandwidth["gbps"]


def _compile_options(args: argparse.Namespace, payload: dict[str, Any]) -> CompileOptions | None:
    """The --compile settings (recorded in ``payload["compile"]``), or None without --compile."""
    if not args.compile:
        return None
    options = CompileOptions(
        backend=args.compile_backend,
        mode=args.compile_mode,
        masks=tuple(dict.fromkeys(args.compile_masks)),
        dynamic=args.compile_dynamic,
        check_steps=max(1, args.compile_check_steps),
    )
    payload["compile"] = asdict(options)
    return options


@contextlib.contextmanager
def _counted_recompiles(compile_options: CompileOptions | None) -> Iterator[None]:
    """While compiling: recompilations must be counted, not hit the limit (a hard error with fullgraph=True)."""
    if compile_options is None:
        yield
        return
    previous_limit = torch._dynamo.config.recompile_limit
    torch._dynamo.config.recompile_limit = max(previous_limit, 64)
    try:
        yield
    finally:
        torch._dynamo.config.recompile_limit = previous_limit


def _decode_every_model(
    args: argparse.Namespace,
    device: torch.device,
    bandwidth_gbps: float,
    compile_options: CompileOptions | None,
    meter: ContentionMeter,
) -> tuple[list[BenchResult], dict[str, str]]:
    """The decode benchmark (and --profile's tables) of every dtype and window."""
    results: list[BenchResult] = []
    profiles: dict[str, str] = {}
    with _counted_recompiles(compile_options):
        for dtype_name, dtype, window, model in _models(args, str(device)):
            results += run_benchmark(
                model,
                model_name=args.model,
                dtype=dtype,
                contexts=args.contexts or DECODE_CONTEXTS,
                batches=args.batches or [1, 8],
                caches=args.caches,
                steps=args.steps,
                warmup=args.warmup,
                reps=args.reps,
                bandwidth_gbps=bandwidth_gbps,
                log=_log,
                device=device,
                compile_options=compile_options,
                include_eager=args.with_eager,
                meter=meter,
            )
            if args.profile:
                for name, table in profile_decode(
                    model,
                    args.caches,
                    context=args.profile_context,
                    batch=args.profile_batch,
                    steps=args.profile_steps,
                ).items():
                    profiles[
                        f"{args.model} w={window} {dtype_name} ctx={args.profile_context} "
                        f"B={args.profile_batch} {name}"
                    ] = table
    return results, profiles


def _report_eager(args: argparse.Namespace, payload: dict[str, Any], results: list[BenchResult]) -> None:
    """The eager rows' time and memory tables: full ones in ``payload``, printed full or compact."""
    eager_results = [r for r in results if not r.compiled]
    payload["table"] = format_table(eager_results, args.caches) if eager_results else ""
    if not eager_results:
        return
    payload["memory_table"] = format_memory_table(eager_results, args.caches)
    if args.full_table:
        _log(
            "\n" + payload["table"] + "\n\nK/V bytes held (end of decode / most at any point, and the largest "
            "ratio to an exactly sized cache for the same tokens):\n" + payload["memory_table"]
        )
    else:
        _log(
            "\n" + format_table(eager_results, args.caches, full=False) + "\n\nK/V bytes held at the end of "
            "decode (and ring/dynamic at its worst point):\n"
            + format_memory_table(eager_results, args.caches, full=False)
            + "\n(--full-table for min times, cache ms, copy MiB and peak K/V; the JSON has the full tables)"
        )


def _report_compiled(args: argparse.Namespace, payload: dict[str, Any], results: list[BenchResult]) -> None:
    """The compiled rows' table: the full one in ``payload``, printed full or compact."""
    if any(r.compiled for r in results):
        payload["compiled_table"] = format_compiled_table(results)
        _log(
            "\ncompiled decode:\n"
            + (payload["compiled_table"] if args.full_table else format_compiled_table(results, full=False))
        )


def _run_decode(args: argparse.Namespace, payload: dict[str, Any], meter: ContentionMeter) -> int:
    device, bandwidth_gbps = _measure_device(args, payload)
    compile_options = _compile_options(args, payload)
    results, profiles = _decode_every_model(args, device, bandwidth_gbps, compile_options, meter)
    _report_eager(args, payload, results)
    _report_compiled(args, payload, results)
    payload["results"] = [asdict(r) for r in results]
    if profiles:
        payload["profiles"] = profiles
        _write_profiles(profiles, args.profile_out)
    if args.plot:
        plot_results(results, args.plot)
    _busy_summary(results, meter)
    bad = [r for r in results if r.compiled and (r.compiled_matches_eager is False or r.recompiled_during_timing)]
    if bad:
        _log(f"compiled decode: {len(bad)} row(s) did not match eager or compiled during timing (see JSON)")
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.prefill and args.prefill_chunk_check:
        parser.error("--prefill and --prefill-chunk-check are different benchmarks: choose one")
    if args.window and args.model not in TINY_MODELS:
        _log(f"note: --window applies to the random models ({', '.join(TINY_MODELS)}); {args.model!r} keeps its own")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    _check_inputs(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    command = "python -m hybrid_cache.tools.cli.bench " + " ".join(
        shlex.quote(a) for a in (sys.argv[1:] if argv is None else list(argv))
    )
    machine = machine_info()
    meter = ContentionMeter(threads=torch.get_num_threads())
    probe = meter.probe(1.0)
    machine["other_cpu_cores_at_start"] = probe.other_cores
    _log(
        f"machine: {machine['cpu_model']}, {meter.cpus} CPUs, torch threads={machine['torch_threads']}, "
        f"load average {machine['loadavg_at_start']}, other processes busy on {probe.other_cores or 0:.1f} CPUs, "
        f"torch {machine['torch']}, transformers {machine['transformers']}"
    )
    _log(f"attention on the codes (int8 / int4 caches): native kernel {machine['code_kernel']}")
    warning = busy_machine_warning(meter, probe)
    if warning:
        _log(warning)
    mode = "prefill-chunk-check" if args.prefill_chunk_check else "prefill" if args.prefill else "decode"
    payload: dict[str, Any] = {"machine": machine, "command": command, "mode": mode, "results": []}
    if mode == "decode":
        status = _run_decode(args, payload, meter)
    elif mode == "prefill":
        status = _run_prefill(args, payload, meter)
    else:
        status = _run_chunk_check(args, payload)
    machine["loadavg_at_end"] = loadavg()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=1)
    return status


if __name__ == "__main__":
    sys.exit(main())
