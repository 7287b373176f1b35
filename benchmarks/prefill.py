"""Time to first token of one whole-prompt ``generate`` on a long prompt, side by side in one run.

    python benchmarks/prefill.py                      # the embedded Gemma 3 270M, fp32, 2048 8192 16384 32000 tokens
    python benchmarks/prefill.py --contexts 2048 8192 --reps 3 --json out/prefill.json --plot docs/img/prefill_ttft.png
    python benchmarks/prefill.py --quick              # smoke run: one 600-token prompt, one rep (not a measurement)
    python benchmarks/prefill.py --from-json a.json b.json --plot docs/img/prefill_ttft.png   # join saved runs

Variants (``--variants``, `hybrid_cache.tools.bench.prefill.TTFT_VARIANTS`): transformers' SDPA with DynamicCache on
the whole prompt (``sdpa``), the same with ``prefill_chunk_size`` 512 / 2048 (``sdpa-chunk512`` / ``sdpa-chunk2048``),
HybridRingCache on SDPA (``ring-sdpa``, the ring before the banded prefill), and HybridRingCache with
``use_code_attention(model)`` (``ring-banded``: the banded prefill, in ``generate``'s prefill steps of 2048 tokens as
``load_model``'s models run by default). Per prompt length every variant runs once per
rep, interleaved (the order rotated each rep), after an untimed warm-up; the table gives medians, the peak RSS rise
of each, whether all first tokens agree, and the ratios of ``ring-banded`` to each other variant. The machine line
(CPU, flags, threads, load average) is printed first; rows measured while other processes competed for the CPUs are
marked ``!``. llama.cpp's time on the same prompt is the one reported in issue 37 (llama-cpp-python is not installed
here), printed as such.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from hybrid_cache.banded import banded_settings
from hybrid_cache.tools.bench.machine import ContentionMeter, busy_machine_warning, loadavg, machine_info
from hybrid_cache.tools.bench.prefill import TTFT_VARIANTS, TtftResult, run_ttft_benchmark
from hybrid_cache.tools.bench.report import format_ttft_table, plot_ttft
from hybrid_cache.tools.bench.workload import DTYPES, load_bench_model

DEFAULT_VARIANTS = ["sdpa", "sdpa-chunk512", "sdpa-chunk2048", "ring-sdpa", "ring-banded"]
#: The defaults of a real run and of ``--quick`` (options given on the command line win over both).
DEFAULTS: dict[str, Any] = {"contexts": [2048, 8192, 16384, 32000], "reps": 2, "warmup_tokens": 1024}
QUICK: dict[str, Any] = {"contexts": [600], "reps": 1, "warmup_tokens": 64}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, the defaults of a real run or of ``--quick`` filled in where an option was not given."""
    args = build_parser().parse_args(argv)
    for name, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default", help="the embedded Gemma 3 270M (default), a path, or `tiny`.")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument(
        "--contexts", type=int, nargs="+", default=None, help="prompt lengths (default 2048 8192 16384 32000)."
    )
    p.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, choices=list(TTFT_VARIANTS))
    p.add_argument("--reps", type=int, default=None, help="timed runs per variant and length (default 2).")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's).")
    p.add_argument(
        "--warmup-tokens", type=int, default=None, help="prompt of the untimed warm-up per variant (default 1024)."
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke run: defaults {QUICK['contexts']} tokens, {QUICK['reps']} rep, a {QUICK['warmup_tokens']}-token "
        "warm-up (shows the script works end to end; its times are no measurement)",
    )
    p.add_argument("--json", default=None, help="write the machine line and every row here.")
    p.add_argument("--plot", default=None, help="write the curves (PNG) here.")
    p.add_argument(
        "--from-json",
        nargs="+",
        default=None,
        metavar="JSON",
        help="measure nothing: the table (and --plot) of the rows saved by earlier --json runs (one machine's runs).",
    )
    return p


def saved_rows(paths: list[str]) -> tuple[list[TtftResult], list[dict[str, Any]]]:
    """The rows and machine records of earlier `--json` runs; raises `SystemExit` with one line for a file that is
    not one."""
    rows: list[TtftResult] = []
    machines: list[dict[str, Any]] = []
    for path in paths:
        try:
            payload = json.loads(Path(path).read_text(encoding="utf-8"))
            rows += [TtftResult(**row) for row in payload["rows"]]
            machines.append(payload["machine"])
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as error:
            raise SystemExit(
                f"error: '{path}' is not a file written by `benchmarks/prefill.py --json` ({error})."
            ) from None
    return rows, machines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json:
        results, machines = saved_rows(args.from_json)
        for machine in machines:
            print(f"machine: {machine['cpu_model']} ({', '.join(machine['cpu_flags'])}), torch {machine['torch']}")
        variants = list(dict.fromkeys(r.variant for r in results))
        print(format_ttft_table(results, variants))
        if args.plot:
            Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
            plot_ttft(results, args.plot)
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    machine = machine_info()
    print(
        f"machine: {machine['cpu_model']} ({', '.join(machine['cpu_flags'])}), {machine['affinity_cpus']} CPUs, "
        f"{machine['mem_total_gib']} GiB; torch {machine['torch']} ({torch.get_num_threads()} threads), "
        f"transformers {machine['transformers']}; load average {loadavg()}; banded prefill "
        f"(min query, block, key alignment) = {banded_settings()}" + ("; --quick: a smoke run" if args.quick else ""),
        flush=True,
    )
    meter = ContentionMeter()
    warning = busy_machine_warning(meter, meter.probe())
    if warning:
        print(warning, flush=True)
    model = load_bench_model(args.model, dtype)
    results = run_ttft_benchmark(
        model,
        contexts=args.contexts,
        variants=args.variants,
        reps=args.reps,
        dtype=dtype,
        meter=meter,
        warmup_tokens=args.warmup_tokens,
        log=lambda line: print(line, flush=True),
    )
    print()
    print(format_ttft_table(results, args.variants))
    print(f"load average at the end: {loadavg()}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        payload = {"machine": machine, "argv": sys.argv[1:], "rows": [asdict(r) for r in results]}
        Path(args.json).write_text(json.dumps(payload, indent=1))
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        plot_ttft(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
