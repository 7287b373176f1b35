"""Reuse a long prefix: build its cache once, save it to one file, answer several questions from it.

Usage::

    HF_HUB_OFFLINE=1 python examples/prefix_cache.py [--text FILE] [--prefix-tokens 1024] [--model PATH]

On the embedded Gemma 3 270M (offline): the first ``--prefix-tokens`` tokens of a document (default: the 1911
Britannica article on Shakespeare) are prefilled into a ``HybridRingCache`` and saved with ``cache.save``; each
question is then answered twice -- from scratch (cold) and from ``HybridRingCache.load`` of the file (warm) -- and the
script prints both times to the first token, checks that the answers are identical, and finally branches several
continuations from one in-memory ``checkpoint()``. The prefix is far longer than the 512-token sliding window, so
every ring has wrapped: this is the case other prefix caches cannot reuse exactly.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

# Nothing may come from the Hugging Face Hub: the model and text are local.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

QUESTIONS = (
    "\n\nQuestion: Where was Shakespeare born?\nAnswer:",
    "\n\nQuestion: Who was Shakespeare's wife?\nAnswer:",
    "\n\nQuestion: Which plays did Shakespeare write?\nAnswer:",
)


def main(argv: Sequence[str] | None = None) -> int:
    """Build, save and reuse a prefix cache; print times to the first token and the file size.

    Args:
        argv: command-line arguments (default ``sys.argv[1:]``).

    Returns:
        Process exit status (1 if a warm answer differs from the cold one).
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: embedded Gemma 3 270M")
    parser.add_argument("--text", default=None, help="a text file (default: the Britannica article)")
    parser.add_argument("--prefix-tokens", type=int, default=1024)
    parser.add_argument("--max-new-tokens", type=int, default=20)
    parser.add_argument("--questions", type=int, default=len(QUESTIONS), help="how many of the questions to ask")
    args = parser.parse_args(argv)

    from hybrid_cache import HybridRingCache
    from hybrid_cache.snapshot import read_metadata
    from hybrid_cache.tools.models import load_model
    from hybrid_cache.tools.prefix import prefill, time_to_first_token
    from hybrid_cache.tools.text import load_text

    model, tokenizer = load_model(args.model)
    text, description = load_text(args.text)
    prefix = tokenizer(text, return_tensors="pt").input_ids[:, : args.prefix_tokens]

    # 1. Build the prefix cache once and save it (one safetensors file, your metadata in its header).
    cache = HybridRingCache(model.config)
    started = time.perf_counter()
    prefill(model, cache, prefix)
    print(f"prefilled {prefix.shape[1]} tokens of {description} in {time.perf_counter() - started:.1f} s")
    path = Path(tempfile.mkdtemp()) / "prefix.safetensors"
    cache.save(path, metadata={"source": description, "tokens": str(prefix.shape[1])})
    print(
        f"saved {path}: {path.stat().st_size / 2**20:.1f} MiB (K/V held: "
        f"{cache.memory_report().total_bytes / 2**20:.1f} MiB), metadata {read_metadata(path)}\n"
    )

    # 2. Answer each question cold (recompute the prefix) and warm (load the file): same tokens, far sooner.
    status = 0
    for question in QUESTIONS[: args.questions]:
        ids = torch.cat([prefix, tokenizer(question, add_special_tokens=False, return_tensors="pt").input_ids], 1)
        cold, expected = time_to_first_token(model, ids, lambda: HybridRingCache(model.config), args.max_new_tokens)
        warm, answer = time_to_first_token(
            model, ids, lambda: HybridRingCache.load(path, model.config), args.max_new_tokens
        )
        same = torch.equal(answer, expected)
        status |= not same
        print(f"{question.strip()} {tokenizer.decode(answer[0, ids.shape[1] :], skip_special_tokens=True).strip()!r}")
        print(
            f"  time to first token: cold {cold:.2f} s, warm {warm:.3f} s ({warm / cold:.3f}x); "
            f"answers {'identical' if same else 'DIFFERENT'}"
        )

    # 3. Branch in memory: one checkpoint (the rings only), many continuations, each exact.
    checkpoint = cache.checkpoint()
    print(
        f"\ncheckpoint: {checkpoint.nbytes() / 2**20:.1f} MiB of ring slots (the cache holds "
        f"{cache.memory_report().total_bytes / 2**20:.1f} MiB)"
    )
    for question in QUESTIONS[: min(2, args.questions)]:
        cache.restore(checkpoint)
        ids = torch.cat([prefix, tokenizer(question, add_special_tokens=False, return_tensors="pt").input_ids], 1)
        seconds, answer = time_to_first_token(model, ids, lambda: cache, args.max_new_tokens)
        print(f"  restored, then {question.strip()!r}: first token after {seconds:.3f} s")
    path.unlink()
    path.parent.rmdir()
    return status


if __name__ == "__main__":
    sys.exit(main())
