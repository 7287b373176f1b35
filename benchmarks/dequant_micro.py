"""Micro-benchmark: the cost of dequantizing one full layer's history per decode step, against its attention.

Shapes of the decode benchmark's largest point (Gemma 3 270M full layer: 1 KV head x 256, 16384 tokens, batch 8,
bf16 by default). Prints min / median ms of:

- `KVQuantizer.dequantize_into` into a preallocated buffer (what the cache does) for int8 / int4 / fp8;
- the alternatives it avoids: a fresh output per call (page faults), torch's mixed-dtype `int8 * bf16` multiply;
- one SDPA call over exact K and V with transformers' packed-GQA layout (4 query heads, 1 step, a boolean mask).

    python benchmarks/dequant_micro.py [--tokens 16384] [--batch 8] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybrid_cache.quantizer import KVQuantizer  # noqa: E402


def timed(function, repeats: int = 5) -> str:
    function()
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        function()
        times.append(time.perf_counter() - began)
    times.sort()
    return f"{times[0] * 1e3:7.1f} / {times[len(times) // 2] * 1e3:7.1f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    shape = (args.batch, 1, args.tokens, 256)
    x = torch.randn(shape, dtype=dtype)
    out = torch.empty_like(x)
    print(f"shape {shape} {args.dtype}, threads {torch.get_num_threads()}; min / median of 5")
    for mode in ("int8", "int4", "fp8"):
        quantizer = KVQuantizer(mode, 256)
        codes, scales = quantizer.quantize(x)
        scratch = torch.empty_like(codes)  # the int4 unpacking buffer the cache keeps in its workspace
        run = lambda q=quantizer, c=codes, s=scales, buf=scratch: q.dequantize_into(c, s, out, buf)  # noqa: E731
        print(f"{mode:5s} dequantize_into (preallocated): {timed(run)}")
        if mode == "int8":
            fresh = lambda q=quantizer, c=codes, s=scales: q.dequantize_into(c, s, torch.empty_like(x))  # noqa: E731
            print(f"int8  dequantize_into (fresh output):  {timed(fresh)}")
            grouped_scales = scales.unsqueeze(-1)

            def mixed(c=codes, g=grouped_scales):
                return torch.mul(c.unflatten(-1, (4, 64)), g, out=out.unflatten(-1, (4, 64)))

            print(f"int8  mixed-dtype torch.mul:           {timed(mixed)}")
    query = torch.randn(args.batch, 1, 4, 256, dtype=dtype)
    mask = torch.ones(args.batch, 1, 4, args.tokens, dtype=torch.bool)
    attention = lambda: torch.nn.functional.scaled_dot_product_attention(query, x, x, attn_mask=mask)  # noqa: E731
    print(f"SDPA over exact K and V (one layer):   {timed(attention)}")


if __name__ == "__main__":
    main()
