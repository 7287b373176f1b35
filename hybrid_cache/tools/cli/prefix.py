"""Prefix caches on the embedded model: build one from a text, save it, answer prompts from it, and measure the
time-to-first-token (TTFT) cold (the prefix recomputed) against warm (the saved file loaded).

Commands (``hybrid-cache-prefix`` or ``python -m hybrid_cache.tools.cli.prefix``; ``--model`` goes before or after the command)::

    build TEXT -o prefix.safetensors [--max-tokens 4096]    # TEXT: a text file, or "default" (Britannica)
    ask prefix.safetensors "prompt" ["prompt" ...] [--max-new-tokens 24] [--no-cold]
    bench [--prefix-tokens 4096 --question-tokens 32 --repeats 5] [--json out.json]

``build`` stores the prefix's token ids in the file's metadata (``prefix.token_ids``), so ``ask`` needs only the
file. ``ask`` generates each answer twice, from scratch (cold) and from the loaded file (warm), checks that the tokens
are identical and prints both TTFTs and the file size; it first loads the file once and answers the first prompt once
from it, untimed, so that neither side of the comparison pays the process's one-off first-call costs. ``bench`` is
`hybrid_cache.tools.prefix.run_bench`; see docs/prefix.md. A user's mistake (a missing file, a wrong model, a text too
short) exits with status 2 and one line on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import torch

from hybrid_cache import HybridRingCache
from hybrid_cache.snapshot import read_metadata

from ..models import load_model
from ..prefix import (
    MODEL_KEY,
    SOURCE_KEY,
    TOKENS_KEY,
    TextTooShort,
    build_prefix,
    format_bench,
    run_bench,
    time_to_first_token,
)
from ..text import load_text

__all__ = ["build_parser", "main"]

PROG = "hybrid-cache-prefix"


class UsageError(Exception):
    """A mistake of the command line's user (a missing file, a wrong model): `main` prints it as one line."""


def _fail(message: str) -> NoReturn:
    raise UsageError(message)


def _load_model(name: str | None) -> tuple[Any, Any]:
    started = time.perf_counter()
    try:
        model, tokenizer = load_model(name)
    except (OSError, ValueError, ImportError) as exc:  # a wrong path, Hub id or argument: one line
        _fail(" ".join(str(exc).split()))
    if tokenizer is None:
        _fail(f"model {name!r} has no tokenizer files; pass a checkpoint directory that has them")
    print(f"model {name or 'Gemma 3 270M (embedded)'} loaded in {time.perf_counter() - started:.1f} s", flush=True)
    return model, tokenizer


def _read_text(source: str | None) -> tuple[str, str]:
    try:
        return load_text(None if source in (None, "default") else source)
    except (OSError, ValueError) as exc:
        _fail(f"{exc} (TEXT is a text file, or 'default' for the Britannica article)")


def _read_prefix_metadata(path: str) -> dict[str, str]:
    """The metadata of a file written by `build`, or one line saying what is wrong with `path` and what to do."""
    hint = f"`ask` reads a file written by `{PROG} build TEXT -o FILE.safetensors`"
    if Path(path).is_dir():
        _fail(f"{path} is a directory; {hint}")
    try:
        metadata = read_metadata(path)
    except FileNotFoundError:
        _fail(f"{path}: no such file; {hint}")
    except (OSError, ValueError) as exc:  # not safetensors ("header too large"), truncated, not a saved cache
        reason = " ".join(str(exc).split())
        if not path.endswith(".safetensors"):  # e.g. the text itself: say how to make a prefix file of it
            _fail(
                f"{reason}; to answer from the text in {path}, first run `{PROG} build {path} -o prefix.safetensors`"
                f", then `{PROG} ask prefix.safetensors ...`"
            )
        _fail(f"{reason}; {hint}")
    if TOKENS_KEY not in metadata:
        _fail(f"{path} is a saved cache without the {TOKENS_KEY!r} metadata (not written by `build`); {hint}")
    return metadata


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


# --- commands ---------------------------------------------------------------------------------------------------
def cmd_build(args: argparse.Namespace) -> int:
    folder = Path(args.output).expanduser().parent
    if not folder.is_dir():
        _fail(f"cannot write {args.output}: the folder {str(folder)!r} does not exist")
    text, description = _read_text(args.text)  # a missing text file fails before the model loads
    model, tokenizer = _load_model(args.model)
    prefix = tokenizer(text, return_tensors="pt").input_ids[:, : args.max_tokens]
    started = time.perf_counter()
    cache = build_prefix(model, prefix)
    built = time.perf_counter() - started
    metadata = {
        TOKENS_KEY: json.dumps(prefix[0].tolist()),
        SOURCE_KEY: description,
        MODEL_KEY: args.model or "default",
    }
    try:
        cache.save(args.output, metadata=metadata)
    except OSError as exc:
        _fail(f"cannot write {args.output}: {exc}")
    print(f"prefix: {prefix.shape[1]} tokens of {description}, prefilled in {built:.2f} s")
    print(cache.memory_report())
    print(f"saved {args.output}: {_mib(os.path.getsize(args.output))}")
    return 0


def cmd_ask(args: argparse.Namespace) -> int:
    from ..bench.machine import loadavg  # the benchmark harness's reading

    metadata = _read_prefix_metadata(args.cache)
    saved_model = metadata.get(MODEL_KEY)
    model, tokenizer = _load_model(args.model or (None if saved_model == "default" else saved_model))
    prefix = torch.tensor([json.loads(metadata[TOKENS_KEY])])
    size = os.path.getsize(args.cache)
    questions = [tokenizer(p, add_special_tokens=False, return_tensors="pt").input_ids for p in args.prompts]
    # Untimed warm-up, so that warm and cold measure the same kind of work: the first load of the file (it may come
    # from disk rather than the page cache; this also checks it against the model) and the process's first `generate`
    # (first forward: thread pool, kernels, allocations). Timed first, these one-off costs fell on the first warm answer
    # alone and made it look slower than cold.
    started = time.perf_counter()
    try:
        HybridRingCache.load(args.cache, model.config)
    except ValueError as exc:  # another model's cache: the message names the field that differs
        _fail(f"{' '.join(str(exc).split())} (the file was built with --model {saved_model!r})")
    first_load = time.perf_counter() - started
    first_run, _ = time_to_first_token(
        model, torch.cat([prefix, questions[0]], dim=1), lambda: HybridRingCache.load(args.cache, model.config)
    )
    print(f"{args.cache}: {_mib(size)}, {prefix.shape[1]} prefix tokens of {metadata.get(SOURCE_KEY, '?')}")
    print(
        f"untimed warm-up: first load of the file {first_load * 1000:.1f} ms, first warm answer "
        f"{first_run * 1000:.1f} ms; load average {loadavg()}\n",
        flush=True,
    )
    for prompt, question in zip(args.prompts, questions):
        input_ids = torch.cat([prefix, question], dim=1)
        warm, answer = time_to_first_token(
            model, input_ids, lambda: HybridRingCache.load(args.cache, model.config), args.max_new_tokens
        )
        line = f"TTFT warm (load {_mib(size)} + {question.shape[1]} prompt tokens): {warm * 1000:8.1f} ms"
        if not args.no_cold:
            cold, expected = time_to_first_token(
                model, input_ids, lambda: HybridRingCache(model.config), args.max_new_tokens
            )
            same = "identical" if torch.equal(answer, expected) else "DIFFERENT"
            line += (
                f" | cold ({input_ids.shape[1]} tokens): {cold * 1000:8.1f} ms | {warm / cold:.3f}x | answers {same}"
            )
        print(f"> {prompt}")
        print(tokenizer.decode(answer[0, input_ids.shape[1] :], skip_special_tokens=True).strip())
        print(f"  {line}\n", flush=True)
    print(f"load average at the end: {loadavg()}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    _read_text(args.text)  # a missing text fails before the model loads, as in `build`
    model, tokenizer = _load_model(args.model)
    with tempfile.TemporaryDirectory(prefix="hybrid-cache-prefix-") as workdir:
        try:
            result = run_bench(
                model,
                tokenizer,
                prefix_tokens=args.prefix_tokens,
                question_tokens=args.question_tokens,
                repeats=args.repeats,
                workdir=Path(workdir),
                text=args.text,
                warmup=args.warmup,
            )
        except TextTooShort as exc:
            _fail(f"{exc}; pass fewer --prefix-tokens / --question-tokens or a longer --text")
    print(format_bench(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0 if result["same_first_token"] else 1


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    description = " ".join(__doc__.split("\n\n")[0].split())  # the docstring's whole first paragraph
    parser = argparse.ArgumentParser(prog=PROG, description=description)
    model_help = "a checkpoint directory, .gguf file or cached Hub id (default: the embedded Gemma 3 270M)"
    parser.add_argument("--model", default=None, help=model_help)
    commands = parser.add_subparsers(dest="command", required=True)

    def command(name: str, summary: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=summary, description=summary)
        # --model after the command as well; SUPPRESS keeps a --model given before it when this one is absent.
        sub.add_argument("--model", default=argparse.SUPPRESS, help=model_help)
        return sub

    build = command("build", "prefill a text's first tokens and save the cache")
    build.add_argument("text", help="a text file, or 'default' (1911 Britannica article on Shakespeare)")
    build.add_argument("-o", "--output", required=True, help="the .safetensors file to write")
    build.add_argument("--max-tokens", type=_positive, default=4096, help="prefix length in tokens (default 4096)")
    build.set_defaults(run=cmd_build)
    ask = command("ask", "answer prompts from a saved prefix, printing TTFT cold vs warm")
    ask.add_argument("cache", help="a file written by `build`")
    ask.add_argument("prompts", nargs="+")
    ask.add_argument("--max-new-tokens", type=_positive, default=24)
    ask.add_argument("--no-cold", action="store_true", help="skip the from-scratch run (and the comparison)")
    ask.set_defaults(run=cmd_ask)
    bench = command("bench", "TTFT cold vs warm, file and checkpoint bytes (JSON with --json)")
    bench.add_argument("--text", default=None, help="default: the Britannica article")
    bench.add_argument("--prefix-tokens", type=_positive, default=4096)
    bench.add_argument("--question-tokens", type=_positive, default=32)
    bench.add_argument("--repeats", type=_positive, default=5)
    bench.add_argument("--warmup", type=_non_negative, default=1, help="untimed rounds first")
    bench.add_argument("--threads", type=_positive, default=None, help="torch threads (default: torch's own choice)")
    bench.add_argument("--json", default=None, help="write the result here")
    bench.set_defaults(run=cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    # The model and the text are local: nothing from the Hub (set when the command runs, never at import).
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except UsageError as exc:
        parser.exit(2, f"{PROG}: error: {exc}\n")


if __name__ == "__main__":
    sys.exit(main())
