"""Where a banded prefill's time goes (issue 37, item 5): the seconds inside the sliding and full layers' attention
(`banded.banded_attention`, or transformers' causal SDPA for a plain full layer), the seconds of the per-block SDPA
calls inside the band loop, and the band's FLOP count, for one whole-prompt `generate` on the embedded Gemma 3 270M
with `HybridRingCache` (fp32).

    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 python benchmarks/banded_flops.py --context 8192 --threads 2

Prints the attention's share of the prefill, the Python loop's overhead (band time minus its SDPA calls) and the
band's GFLOP/s beside a plain matmul's on the same threads: the question whether the band would pay in a C kernel.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from hybrid_cache import HybridRingCache, banded, cache_kwargs, code_attention
from hybrid_cache.tools.bench.machine import loadavg, machine_info
from hybrid_cache.tools.bench.workload import load_bench_model


def matmul_gflops(rows: int, inner: int, cols: int, reps: int = 50) -> float:
    a, b = torch.randn(rows, inner), torch.randn(inner, cols)
    for _ in range(3):
        a @ b
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * rows * inner * cols * reps / (time.perf_counter() - start) / 1e9


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Runs the measurement and prints it; returns the totals (seconds, FLOPs) for tests."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default", help="the embedded Gemma 3 270M (default), a path, or `tiny`.")
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    machine = machine_info()
    print(
        f"machine: {machine['cpu_model']} ({', '.join(machine['cpu_flags'])}), {machine['affinity_cpus']} CPUs; "
        f"torch {machine['torch']} ({torch.get_num_threads()} threads); load average {loadavg()}"
    )
    model = load_bench_model(args.model, torch.float32)
    totals = {"band": 0.0, "band_sdpa": 0.0, "band_flop": 0.0}
    sdpa, attention = F.scaled_dot_product_attention, code_attention.banded_attention

    def counted_sdpa(query, key, value, *a, **k):  # the band loop's per-block call
        start = time.perf_counter()
        out = sdpa(query, key, value, *a, **k)
        totals["band_sdpa"] += time.perf_counter() - start
        b, h, q, d = query.shape
        flop = 2 * b * h * q * key.shape[2] * (d + value.shape[-1])
        totals["band_flop"] += flop / 2 if k.get("is_causal") else flop  # a causal call skips the upper half
        return out

    def timed_attention(*a, **k):
        start = time.perf_counter()
        out = attention(*a, **k)
        totals["band"] += time.perf_counter() - start
        return out

    ids = torch.randint(10, model.config.vocab_size, (1, args.context), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode(), code_attention.use_code_attention(model):
        model.generate(ids[:, :1024], max_new_tokens=1, do_sample=False)  # warm-up
        banded.F.scaled_dot_product_attention = counted_sdpa
        code_attention.banded_attention = timed_attention
        try:
            cache = HybridRingCache(model.config)
            start = time.perf_counter()
            model.generate(ids, **cache_kwargs(cache), max_new_tokens=1, do_sample=False)
            total = time.perf_counter() - start
        finally:
            banded.F.scaled_dot_product_attention = sdpa
            code_attention.banded_attention = attention
    peak = matmul_gflops(512, 256, 1024)
    band_rate = totals["band_flop"] / totals["band_sdpa"] / 1e9
    print(f"prompt {args.context} tokens: {total:.2f} s to the first token; load average {loadavg()}")
    print(
        f"banded attention (band loops of every layer that took one): {totals['band']:.2f} s "
        f"({totals['band'] / total:.0%} of the prefill), of which per-block SDPA {totals['band_sdpa']:.2f} s: the "
        f"Python loop costs {totals['band'] - totals['band_sdpa']:.2f} s"
    )
    print(
        f"band FLOPs (QK^T + PV as computed, the aligned key ranges): {totals['band_flop'] / 1e9:.1f} GFLOP, "
        f"{band_rate:.0f} GFLOP/s in SDPA; a 512 x 256 x 1024 fp32 matmul here: {peak:.0f} GFLOP/s "
        f"(the band at {band_rate / peak:.2f}x of it)"
    )
    return {"total": total, **totals}


if __name__ == "__main__":
    main()
