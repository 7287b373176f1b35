"""Exported programs on the embedded Gemma 3 270M, side by side in one run (docs/export.md):

1. KV bytes held by the exported program against transformers' `TorchExportableModuleWithHybridCache` (every layer
   `max_cache_len` slots) and against a ring of `2 x window` slots (ExecuTorch's and optimum-executorch's rings), at
   `max_cache_len` 2048, 4096 and 32768: the bytes of the state each one allocates (built, not exported).
2. Decode ms/token at context ~4096 in ExecuTorch's runtime, this program's `.pte` against transformers' module
   exported to `.pte` the same way (torch.export, XNNPACK, re-inplace pass); ONNX Runtime (this program's `.onnx`)
   against eager PyTorch with the ring (`HybridRingCache`, fixed mode) at the same context. A decode step's work does
   not depend on what the slots hold, so the timings other than the `.pte`'s run at position `--context` without
   feeding that many tokens (the counters say where the step is); the `.pte` holds its counters and is fed the
   context once. Steps interleaved, medians. (ExecuTorch's own runner on the README's workload:
   benchmarks/stock_runner.py.)
3. The files' sizes and export times.

    python benchmarks/export.py [--context 4096] [--steps 20] [--out /tmp/hc-export] [--json out.json] [--model DIR]
        [--kv-only]

Needs the `export` extra. Prints the machine line (CPU, threads, load average before and after).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
import warnings
from pathlib import Path

import torch

warnings.filterwarnings("ignore")


def cpu_line() -> str:
    model = next(
        (line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?"
    )
    flags = next((line for line in open("/proc/cpuinfo") if line.startswith("flags")), "")
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    return f"{model} ({isa}), {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads"


def state_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def kv_table(model, lengths: list[int]) -> list[dict]:
    """KV bytes of the three caches at each `max_cache_len` (allocated for real, then freed)."""
    from transformers.integrations.executorch import TorchExportableModuleWithHybridCache

    from hybrid_cache.export.step import ProgramModule

    window = model.config.sliding_window
    rows = []
    for length in lengths:
        ours = ProgramModule(model, length)
        tensors = [tensor for _, tensor in ours.state()]
        ours_bytes = state_bytes(tensors)
        # The same state with 2 x window slots per ring (a ring tensor is the one with `window` slots).
        ring2w = sum(
            state_bytes([t]) // t.shape[2] * (min(2 * window, length) if t.shape[2] == window else t.shape[2])
            for t in tensors
        )
        del ours, tensors
        theirs = TorchExportableModuleWithHybridCache(model, batch_size=1, max_cache_len=length)
        theirs_bytes = state_bytes(b for n, b in theirs.named_buffers() if n.startswith(("key_cache", "value_cache")))
        del theirs
        rows.append({"max_cache_len": length, "program": ours_bytes, "transformers": theirs_bytes, "ring_2w": ring2w})
    return rows


def timed(run, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        began = time.perf_counter()
        run()
        times.append(1000 * (time.perf_counter() - began))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default="/tmp/hc-export")
    parser.add_argument("--json", default=None)
    parser.add_argument("--reuse", action="store_true", help="reuse the files of an earlier run in --out")
    parser.add_argument("--kv-only", action="store_true", help="section 1 only (seconds: nothing is exported)")
    parser.add_argument("--model", default=None, help="a local checkpoint (default: the embedded Gemma 3 270M)")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import ExecutorchBackendConfig, to_edge_transform_and_lower
    from executorch.runtime import Runtime
    from transformers.integrations.executorch import TorchExportableModuleWithHybridCache

    from hybrid_cache import HybridRingCache, cache_kwargs
    from hybrid_cache.export import export_program, load_program
    from hybrid_cache.tools.models import load_model

    load_before = os.getloadavg()
    print(f"machine: {cpu_line()}; {platform.platform()}; load average {load_before[0]:.2f}")
    model, _ = load_model(args.model)
    model.set_attn_implementation("sdpa")
    model.eval()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    length = args.context + 2 * args.steps + 8  # room for the timed steps

    print("\n1. KV bytes held (state allocated)")
    kv = kv_table(model, [2048, 4096, 32768])
    print("  max_cache_len | this program | transformers' exported module | ratio | 2W ring | ratio")
    for row in kv:
        print(
            f"  {row['max_cache_len']:>13} | {row['program'] / 2**20:9.1f} MiB | {row['transformers'] / 2**20:26.1f} MiB"
            f" | {row['program'] / row['transformers']:.3f}x | {row['ring_2w'] / 2**20:5.1f} MiB | "
            f"{row['program'] / row['ring_2w']:.3f}x"
        )
    if args.kv_only:
        return

    files: dict[str, dict] = {}
    with torch.no_grad():
        for suffix in ("pte", "onnx"):
            path = out / f"program_{length}.{suffix}"
            if not (args.reuse and path.is_file()):
                report = export_program(model, path, max_cache_len=length, chunk_size=64)
                files[suffix] = {"path": str(path), "bytes": report.nbytes, "seconds": report.seconds}
            else:
                files[suffix] = {"path": str(path), "bytes": path.stat().st_size, "seconds": None}
        theirs_path = out / f"transformers_{length}.pte"
        if not (args.reuse and theirs_path.is_file()):
            began = time.perf_counter()
            module = TorchExportableModuleWithHybridCache(model, batch_size=1, max_cache_len=length)
            inputs = {"input_ids": torch.tensor([[5]]), "cache_position": torch.tensor([0])}
            exported = torch.export.export(module, (), inputs, strict=True)
            program = to_edge_transform_and_lower(exported, partitioner=[XnnpackPartitioner()]).to_executorch(
                ExecutorchBackendConfig(run_reinplace_pass=True)
            )
            with open(theirs_path, "wb") as file:
                program.write_to_file(file)
            files["transformers_pte"] = {
                "path": str(theirs_path),
                "bytes": theirs_path.stat().st_size,
                "seconds": time.perf_counter() - began,
            }
        else:
            files["transformers_pte"] = {
                "path": str(theirs_path),
                "bytes": theirs_path.stat().st_size,
                "seconds": None,
            }

    print(f"\n2. decode ms/token at position {args.context} (medians of {args.steps} interleaved steps)")
    token = torch.tensor([[7]])
    window = model.config.sliding_window
    ours_pte = load_program(files["pte"]["path"]).backend
    # The .pte keeps its counters in its state and refuses a step past the tokens it holds: it gets the context first,
    # in one call, as ExecuTorch's runner would send it.
    ours_pte.step(torch.full((1, args.context), 7), 0, 0)
    ours_onnx = load_program(files["onnx"]["path"]).backend
    theirs = Runtime.get().load_program(files["transformers_pte"]["path"]).load_method("forward")
    eager = HybridRingCache(model.config, max_cache_len=length)
    with torch.no_grad():
        model(input_ids=torch.ones(1, 8, dtype=torch.long), **cache_kwargs(eager), use_cache=True)  # allocate
    position = {"n": args.context}

    def eager_step() -> None:
        for layer in eager.layers:  # put the counters at the timed position (what the slots hold does not matter)
            if hasattr(layer, "length_tensor"):
                layer.length_tensor.fill_(position["n"])
            if hasattr(layer, "oldest_tensor"):
                layer.oldest_tensor.fill_(position["n"] - window)
        with torch.no_grad():
            model(input_ids=token, **cache_kwargs(eager), use_cache=True, logits_to_keep=1)

    runs = {
        "program .pte (ExecuTorch)": lambda: ours_pte.step(token, position["n"], position["n"] - window),
        "transformers .pte (ExecuTorch)": lambda: theirs.execute([token, torch.tensor([position["n"]])]),
        "program .onnx (ONNX Runtime)": lambda: ours_onnx.step(token, position["n"], position["n"] - window),
        "eager ring (PyTorch)": eager_step,
    }
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for run in runs.values():  # warm-up
        for _ in range(3):
            run()
    for step in range(args.steps):
        position["n"] = args.context + step
        for name, run in runs.items():
            samples[name] += timed(run, 1)
    medians = {name: statistics.median(values) for name, values in samples.items()}
    for name, value in medians.items():
        print(f"  {name:32} {value:8.1f} ms/token")
    print(
        f"  ExecuTorch: program / transformers' module = "
        f"{medians['program .pte (ExecuTorch)'] / medians['transformers .pte (ExecuTorch)']:.2f}x; "
        f"ONNX Runtime / eager ring = {medians['program .onnx (ONNX Runtime)'] / medians['eager ring (PyTorch)']:.2f}x"
    )

    print("\n3. files")
    for name, info in files.items():
        seconds = "reused" if info["seconds"] is None else f"exported in {info['seconds']:.0f} s"
        print(f"  {name:18} {info['bytes'] / 2**20:8.1f} MiB  {seconds}  ({info['path']})")
    load_after = os.getloadavg()
    print(f"\nload average: {load_before[0]:.2f} before, {load_after[0]:.2f} after")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "machine": cpu_line(),
                    "kv": kv,
                    "ms_per_token": medians,
                    "files": files,
                    "load": [load_before[0], load_after[0]],
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
