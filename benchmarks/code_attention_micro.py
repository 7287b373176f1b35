"""One full layer's decode step: SDPA on model-dtype K/V against attention on the int8 / int4 codes.

Geometry of Gemma 3 270M's full layers by default (1 KV head of 256, 4 query heads), 16384 keys, batch 8, bf16:

    python benchmarks/code_attention_micro.py [--tokens 16384] [--batch 8] [--dtype bfloat16] [--threads 2]

Rows (min / median ms of `--reps` calls, wall time; CPU time in brackets): `sdpa` on exact K/V (what the exact ring
runs), `dequantize + sdpa` (today's compressed path: the six dequantizations into a workspace, then SDPA), and
`codes` (`hybrid_cache.code_attention.code_domain_attention`) for int8 / int4 and one / two query parts, with the
native kernel and with torch ops (`HYBRID_CACHE_CODE_KERNEL=off`). The load average is printed before and after:
timings on a busy machine measure the competition.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch

from hybrid_cache.code_attention import code_domain_attention
from hybrid_cache.code_kernel import KERNEL_ENV, kernel_status
from hybrid_cache.quantized import DequantWorkspace, QuantizedFullLayer


def _with_kernel(setting: str, function):
    """Run `function` with HYBRID_CACHE_CODE_KERNEL set to `setting` (auto: the native kernel where it runs)."""
    previous = os.environ.get(KERNEL_ENV)
    os.environ[KERNEL_ENV] = setting
    try:
        return function()
    finally:
        if previous is None:
            del os.environ[KERNEL_ENV]
        else:
            os.environ[KERNEL_ENV] = previous


def timed(function, reps: int) -> tuple[float, float, float]:
    function()
    wall, cpu = [], []
    for _ in range(reps):
        start, start_cpu = time.perf_counter(), time.process_time()
        function()
        wall.append((time.perf_counter() - start) * 1e3)
        cpu.append((time.process_time() - start_cpu) * 1e3)
    return min(wall), statistics.median(wall), statistics.median(cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=1)
    parser.add_argument("--query-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=256)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    b, h, t, d = args.batch, args.kv_heads, args.tokens, args.head_dim
    rep = args.query_heads // h
    print(
        f"load average {os.getloadavg()}, torch threads {torch.get_num_threads()}, {b} x {t} tokens, {h} KV heads of "
        f"{d}, {args.query_heads} query heads, {args.dtype}; native kernel {kernel_status()}"
    )
    generator = torch.Generator().manual_seed(0)
    keys = (torch.randn(b, h, t, d, generator=generator) * (1 + 4 * torch.rand(d, generator=generator)) + 1).to(dtype)
    values = torch.randn(b, h, t, d, generator=generator).to(dtype)
    step_keys, step_values = keys[:, :, -1:].clone(), values[:, :, -1:].clone()
    query = torch.randn(b, args.query_heads, 1, d, generator=generator).to(dtype)
    mask = torch.ones(b, 1, 1, t, dtype=torch.bool)
    exact_keys, exact_values = keys.repeat_interleave(rep, 1), values.repeat_interleave(rep, 1)
    packed_query = query.view(b, h, rep, d)  # transformers' packed-GQA decode call on CPU

    def sdpa(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(packed_query, k, v, attn_mask=mask[:, :, :1])

    rows = [("sdpa on exact K/V", lambda: sdpa(keys, values))]
    del exact_keys, exact_values
    for mode in ("int8", "int4"):
        layer = QuantizedFullLayer(mode, DequantWorkspace())
        layer.update(keys[:, :, :-1], values[:, :, :-1])
        dequantizing = copy.deepcopy(layer)

        def dequantize_then_sdpa(layer=dequantizing) -> torch.Tensor:
            length = layer.cumulative_length
            k, v = layer.update(step_keys, step_values)
            layer.crop(length)
            return sdpa(k, v)

        history = layer.compressed_history(t - 1, step_keys, step_values)
        rows.append((f"{mode}: dequantize + sdpa (today)", dequantize_then_sdpa))
        for parts in (1, 2):
            for kernel in ("auto", "off"):
                rows.append(
                    (
                        f"{mode}: codes ({'native' if kernel == 'auto' else 'torch ops'}), parts {parts}",
                        lambda history=history, parts=parts, kernel=kernel: _with_kernel(
                            kernel, lambda: code_domain_attention(query, history, mask, query_parts=parts)
                        ),
                    )
                )
    for name, function in rows:
        best, median, cpu = timed(function, args.reps)
        print(f"{name:<34} {best:8.2f} / {median:8.2f} ms  (cpu {cpu:8.2f} ms)")
    print(f"load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
