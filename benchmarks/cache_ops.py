"""Cache operations alone, per decode step: `update` of every layer + the two masks the model builds.

Isolates what a cache costs per step from the model's compute, to check that the ring's cost does not depend on the
context length nor on the window (512 vs 4096). Gemma 3 geometry (5 sliding : 1 full, 4 query heads over 1 KV head of
size 256), bf16, synthetic K/V, interleaved repetitions; prints median ms per step and the window ratio.

    python benchmarks/cache_ops.py [--contexts 1024 16384] [--batch 1 8] [--steps 200] [--reps 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache, Gemma3TextConfig, StaticCache
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from hybrid_cache import HybridRingCache

LAYERS, HEAD_DIM, HIDDEN = 6, 256, 64


def config_for(window: int) -> Gemma3TextConfig:
    return Gemma3TextConfig(
        num_hidden_layers=LAYERS, sliding_window=window, num_attention_heads=4, num_key_value_heads=1,
        head_dim=HEAD_DIM, hidden_size=HIDDEN, attn_implementation="sdpa",
    )


def make_cache(kind: str, config: Gemma3TextConfig, max_len: int):
    if kind == "ring":
        return HybridRingCache(config)
    if kind == "dynamic":
        return DynamicCache(config=config)
    return StaticCache(config=config, max_cache_len=max_len)


def time_steps(kind: str, window: int, context: int, batch: int, steps: int) -> float:
    """Median ms per step of: both masks (as the model builds them) + `update` of every layer with one token."""
    config = config_for(window)
    cache = make_cache(kind, config, context + steps + 1)
    prefill = torch.randn(batch, 1, context, HEAD_DIM, dtype=torch.bfloat16)
    for layer in range(LAYERS):
        cache.update(prefill, prefill, layer)
    embeds = torch.zeros(batch, 1, HIDDEN, dtype=torch.bfloat16)
    token = torch.randn(batch, 1, 1, HEAD_DIM, dtype=torch.bfloat16)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        create_causal_mask(config, embeds, None, cache)
        create_sliding_window_causal_mask(config, embeds, None, cache)
        for layer in range(LAYERS):
            cache.update(token, token, layer)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 16384])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--windows", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--caches", nargs="+", default=["ring", "static", "dynamic"])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # cache ops are small: one thread, no OpenMP scheduling noise

    results: dict[tuple, list[float]] = {}
    for _ in range(args.reps):  # interleaved: every configuration once per repetition
        for context in args.contexts:
            for batch in args.batch:
                for window in args.windows:
                    for kind in args.caches:
                        key = (kind, context, batch, window)
                        results.setdefault(key, []).append(time_steps(kind, window, context, batch, args.steps))

    header = f"{'cache':<8}{'ctx':>7}{'B':>3}" + "".join(f"{'W=' + str(w) + ' ms':>12}" for w in args.windows)
    print(header + f"{'ratio':>9}")
    for kind in args.caches:
        for context in args.contexts:
            for batch in args.batch:
                medians = [statistics.median(results[(kind, context, batch, w)]) for w in args.windows]
                cells = "".join(f"{m:>12.3f}" for m in medians)
                print(f"{kind:<8}{context:>7}{batch:>3}{cells}{medians[-1] / medians[0]:>8.2f}x")


if __name__ == "__main__":
    main()
