"""One torchrun rank of the distributed tests: load each model with a `DistributedConfig`, run the scenarios of
`dist_scenarios.RUNS[layout]`, save what every run produced to `<out>/rank<R>.pt`.

    torchrun --standalone --nproc-per-node 2 tests/distributed/dist_worker.py --layout tp --out OUT MODEL_DIR...

Bounded by construction: gloo's process-group timeout is short (`HYBRID_CACHE_PG_TIMEOUT`, seconds), any exception
ends this process at once with a non-zero status (torchrun then stops the other ranks, and their pending
collectives fail on the closed connection instead of waiting), and a watchdog ends a rank that outlives
`3 x` the timeout whatever it is doing.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

LAYOUTS = {"tp": {"tp_size": 2}, "pp": {"pp_size": 2}, "tp_pp": {"tp_size": 2, "pp_size": 2}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layout", choices=sorted(LAYOUTS), required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--runs", default=None, help="comma-separated scenario:cache pairs (default: the layout's)")
    parser.add_argument("models", nargs="+", type=Path)
    args = parser.parse_args()

    timeout = float(os.environ.get("HYBRID_CACHE_PG_TIMEOUT", "120"))
    faulthandler.dump_traceback_later(3 * timeout, exit=True)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout))
    rank = dist.get_rank()
    try:
        results = run_all(args)
    except BaseException:  # noqa: BLE001 - any failure must end this rank now, never leave it waiting in a collective
        message = traceback.format_exc()
        (args.out / f"rank{rank}.error").write_text(message)
        print(f"[rank {rank}] {message}", file=sys.stderr, flush=True)
        os._exit(1)
    torch.save(results, args.out / f"rank{rank}.pt")
    dist.destroy_process_group()


def run_all(args: argparse.Namespace) -> dict:
    import dist_scenarios
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    from hybrid_cache import stage_layers

    runs = dist_scenarios.RUNS[args.layout]
    if args.runs:
        runs = [tuple(pair.split(":")) for pair in args.runs.split(",")]
    results: dict = {"rank": dist.get_rank()}
    for model_dir in args.models:
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, distributed_config=DistributedConfig(**LAYOUTS[args.layout]), dtype=torch.float32
        ).eval()
        results[(model_dir.name, "stage_layers")] = stage_layers(model)
        for scenario, cache in runs:
            results[(model_dir.name, scenario, cache)] = dist_scenarios.run(model, scenario, cache)
    return results


if __name__ == "__main__":
    main()
