"""Decode ms/token of a chunked-attention model (tiny Llama 4): HybridRingCache against DynamicCache, side by side.

A random tiny `Llama4ForCausalLM` (chunked layers and every fourth layer full), a prompt of `--context` tokens, then
`--steps` one-token steps per cache, the caches interleaved over `--rounds` rounds; prints each round's median
ms/token, the medians of the rounds, their ratio, and the load average before and after. Run it on an idle machine.

    python benchmarks/chunked_decode.py --context 4096 --chunk 512
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from transformers import DynamicCache, Llama4ForCausalLM, Llama4TextConfig

from hybrid_cache import HybridRingCache, cache_kwargs


def tiny_llama4(chunk: int, layers: int, width: int) -> Llama4ForCausalLM:
    torch.manual_seed(0)
    config = Llama4TextConfig(
        vocab_size=1000,
        hidden_size=width,
        intermediate_size=2 * width,
        intermediate_size_mlp=2 * width,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=width // 8,
        attention_chunk_size=chunk,
        num_local_experts=2,
        max_position_embeddings=1 << 20,
        attn_implementation="sdpa",
    )
    return Llama4ForCausalLM(config).eval()


@torch.inference_mode()
def decode_ms(model, cache, ids: torch.Tensor, context: int, steps: int) -> float:
    model(input_ids=ids[:, :context], **cache_kwargs(cache), use_cache=True)
    times = []
    for index in range(context, context + steps):
        start = time.perf_counter()
        model(input_ids=ids[:, index : index + 1], **cache_kwargs(cache), use_cache=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=4096, help="prompt tokens before the decode steps")
    parser.add_argument("--chunk", type=int, default=512, help="attention_chunk_size")
    parser.add_argument("--layers", type=int, default=8, help="decoder layers (every fourth full)")
    parser.add_argument("--width", type=int, default=256, help="hidden size")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = tiny_llama4(args.chunk, args.layers, args.width)
    ids = torch.randint(3, 1000, (1, args.context + args.steps), generator=torch.Generator().manual_seed(0))
    caches = {
        "HybridRingCache": lambda: HybridRingCache(model.config),
        "DynamicCache": lambda: DynamicCache(config=model.config),
    }
    load_before = os.getloadavg()
    results: dict[str, list[float]] = {name: [] for name in caches}
    for _ in range(args.rounds):
        for name, make in caches.items():
            results[name].append(decode_ms(model, make(), ids, args.context, args.steps))
    load_after = os.getloadavg()
    print(
        f"tiny Llama 4: {args.layers} layers, width {args.width}, chunk {args.chunk}, context {args.context}, "
        f"{args.steps} steps x {args.rounds} rounds, {args.threads} threads, torch {torch.__version__}"
    )
    for name, values in results.items():
        rounds = " ".join(f"{value:.3f}" for value in values)
        print(f"  {name:16s} median {statistics.median(values):.3f} ms/token (rounds: {rounds})")
    ratio = statistics.median(results["HybridRingCache"]) / statistics.median(results["DynamicCache"])
    print(f"  ratio ring / DynamicCache: {ratio:.3f}")
    print(f"  load average before {load_before[0]:.2f}, after {load_after[0]:.2f}")


if __name__ == "__main__":
    main()
