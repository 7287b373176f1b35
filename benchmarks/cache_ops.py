"""Cache operations alone, per decode step: `update` of every layer + the two masks the model builds.

Isolates what a cache costs per step from the model's compute, to check that the ring's cost depends neither on the
context length nor on the window (512 vs 4096), and what its growing full layer costs once amortized: the mean over
all steps includes the steps on which the full layer grows (by 1/64: one every ~context/64 steps, copying the history),
the median does not. Gemma 3 geometry (5 sliding : 1 full, 4 query heads over 1 KV head of size 256), bf16, synthetic
K/V, one thread, interleaved repetitions; prints median and mean ms per step and the window ratio.

    python benchmarks/cache_ops.py [--contexts 1024 16384] [--batch 1 8] [--steps 200] [--reps 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import Gemma3TextConfig
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from hybrid_cache.tools.compare import make_cache

LAYERS, HEAD_DIM, HIDDEN = 6, 256, 64


def config_for(window: int) -> Gemma3TextConfig:
    return Gemma3TextConfig(
        num_hidden_layers=LAYERS,
        sliding_window=window,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=HEAD_DIM,
        hidden_size=HIDDEN,
        attn_implementation="sdpa",
    )


def time_steps(kind: str, window: int, context: int, batch: int, steps: int) -> list[float]:
    """ms of every step of: both masks (as the model builds them) + `update` of every layer with one token."""
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
        times.append(1e3 * (time.perf_counter() - start))
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 16384], help="tokens before the steps")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="batch sizes")
    parser.add_argument("--windows", type=int, nargs="+", default=[512, 4096], help="sliding windows")
    parser.add_argument("--caches", nargs="+", default=["ring", "static", "dynamic"], help="caches to time")
    parser.add_argument("--steps", type=int, default=200, help="decode steps per repetition")
    parser.add_argument("--reps", type=int, default=5, help="repetitions (interleaved)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # cache ops are small: one thread, no OpenMP scheduling noise

    results: dict[tuple, list[list[float]]] = {}
    for _ in range(args.reps):  # interleaved: every configuration once per repetition
        for context in args.contexts:
            for batch in args.batch:
                for window in args.windows:
                    for kind in args.caches:
                        key = (kind, context, batch, window)
                        results.setdefault(key, []).append(time_steps(kind, window, context, batch, args.steps))

    header = f"{'cache':<8}{'ctx':>7}{'B':>3}" + "".join(
        f"{'W=' + str(w) + ' med / mean ms':>24}" for w in args.windows
    )
    print(header + f"{'W ratio (med)':>15}")
    for kind in args.caches:
        for context in args.contexts:
            for batch in args.batch:
                cells, medians = "", []
                for w in args.windows:
                    runs = results[(kind, context, batch, w)]
                    # Median over reps of each rep's median / mean: the mean keeps the growth steps (amortized cost).
                    median = statistics.median(statistics.median(r) for r in runs)
                    mean = statistics.median(statistics.fmean(r) for r in runs)
                    medians.append(median)
                    cells += f"{median:>15.3f} / {mean:>6.3f}"
                print(f"{kind:<8}{context:>7}{batch:>3}{cells}{medians[-1] / medians[0]:>14.2f}x")


if __name__ == "__main__":
    main()
