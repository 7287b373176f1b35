"""Prefix caches on the embedded model: build one from a text, save it, answer prompts from it, and measure the
time-to-first-token (TTFT) cold (the prefix recomputed) against warm (the saved file loaded).

Commands (``python -m hybrid_cache.prefix`` or ``hybrid-cache-prefix``; ``--model`` goes before or after the command)::

    build TEXT -o prefix.safetensors [--max-tokens 4096]    # TEXT: a text file, or "default" (Britannica)
    ask prefix.safetensors "prompt" ["prompt" ...] [--max-new-tokens 24] [--no-cold]
    bench [--prefix-tokens 4096 --question-tokens 32 --repeats 5] [--json out.json]

``build`` stores the prefix's token ids in the file's metadata (``prefix.token_ids``), so ``ask`` needs only the
file. ``ask`` generates each answer twice, from scratch (cold) and from the loaded file (warm), checks that the tokens
are identical and prints both TTFTs and the file size. ``bench`` measures, interleaved, cold / warm-from-file /
warm-from-checkpoint TTFT for a prefix of the default text and the next ``--question-tokens`` tokens as the question,
plus file bytes against ``memory_report()`` and checkpoint bytes against a deep copy; see docs/prefix.md.

TTFT here is the wall time from having the token ids to having the first generated token: ``model.generate`` with a
streamer that timestamps the first new token. Cold: a fresh cache and the whole prompt (prefix + question). Warm:
``HybridRingCache.load(file)`` (included in the time) and the question's tokens only. Model loading is excluded, and
so are the process's one-off first-call costs: ``ask`` first loads the file once and answers the first prompt once
from it, untimed (``bench`` has its ``--warmup`` rounds), so that neither side of the comparison pays them.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import torch
from transformers.generation.streamers import BaseStreamer

from hybrid_cache import HybridRingCache, cache_kwargs
from hybrid_cache.snapshot import read_metadata

__all__ = ["prefill", "time_to_first_token", "build_prefix", "main"]

#: Metadata keys this tool writes into the files it builds (the user's namespace of the file).
TOKENS_KEY, SOURCE_KEY, MODEL_KEY = "prefix.token_ids", "prefix.source", "prefix.model"

PROG = "hybrid-cache-prefix"


class UsageError(Exception):
    """A mistake of the command line's user (a missing file, a wrong model): `main` prints it as one line."""


def _fail(message: str) -> NoReturn:
    raise UsageError(message)


def prefill(
    model: Any,
    cache: HybridRingCache,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Run `input_ids` through `model` into `cache` so that `generate` can continue from it.

    The position ids are the ones `generate` gives the same tokens (`attention_mask.cumsum(-1) - 1`, 0 at left
    padding): a left-padded prefix built with plain `model(...)` calls would otherwise use other positions.

    Args:
        model: a causal LM.
        cache: the cache to fill (it may already hold earlier tokens; `attention_mask` then covers them too).
        input_ids (`torch.Tensor` of shape `[batch, tokens]`): the new tokens.
        attention_mask (`torch.Tensor` of shape `[batch, cached + tokens]`, *optional*): 0 at padding.
        chunk_size (`int`, *optional*): feed at most this many tokens per forward (default: all at once).

    Returns:
        `torch.Tensor` of shape `[batch, vocab]`: the logits of the last position.
    """
    start, length = cache.get_seq_length(), input_ids.shape[1]
    if attention_mask is None:
        positions = torch.arange(start, start + length, device=input_ids.device).expand(input_ids.shape[0], -1)
    else:
        positions = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)[:, start:]
    step = chunk_size or length
    # no_grad, not inference_mode: tensors made under inference mode cannot be written by a later `generate`.
    with torch.no_grad():
        for begin in range(0, length, step):
            end = min(begin + step, length)
            mask = None if attention_mask is None else attention_mask[:, : start + end]
            logits = model(
                input_ids=input_ids[:, begin:end],
                attention_mask=mask,
                position_ids=positions[:, begin:end],
                **cache_kwargs(cache),
                logits_to_keep=1,
            ).logits
    return logits[:, -1]


class _FirstTokenClock(BaseStreamer):
    """A `generate` streamer that notes when the first new token arrives (the first `put` is the prompt)."""

    def __init__(self) -> None:
        self.puts = 0
        self.first_token_at: float | None = None

    def put(self, value: torch.Tensor) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        pass


def time_to_first_token(
    model: Any, input_ids: torch.Tensor, make_cache: Callable[[], HybridRingCache], max_new_tokens: int = 1
) -> tuple[float, torch.Tensor]:
    """Greedy `generate` of one sequence with the cache `make_cache()` returns; the clock starts before
    `make_cache` (so loading a file counts) and stops at the first new token.

    Args:
        model: a causal LM.
        input_ids (`torch.Tensor` of shape `[1, tokens]`): the whole prompt (generate skips what the cache holds).
        make_cache: builds the cache (fresh, loaded from a file, or restored).
        max_new_tokens: tokens to generate (the answer).

    Returns:
        `(seconds to the first new token, generated ids [1, tokens + new])`.
    """
    clock = _FirstTokenClock()
    start = time.perf_counter()
    cache = make_cache()
    output = model.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        **cache_kwargs(cache),
        streamer=clock,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        top_p=None,
        top_k=None,
    )
    assert clock.first_token_at is not None
    return clock.first_token_at - start, output


def build_prefix(model: Any, prefix_ids: torch.Tensor, **cache_kwargs: Any) -> HybridRingCache:
    """A `HybridRingCache` holding `prefix_ids` (`[1, tokens]`), ready to save or to continue."""
    cache = HybridRingCache(model.config, **cache_kwargs)
    prefill(model, cache, prefix_ids)
    return cache


def _load_model(name: str | None) -> tuple[Any, Any]:
    from .models import load_model

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
    from .text import load_text

    try:
        return load_text(None if source in (None, "default") else source)
    except (OSError, ValueError) as exc:
        _fail(f"{exc} (TEXT is a text file, or 'default' for the Britannica article)")


def _tokenize_text(tokenizer: Any, source: str | None) -> tuple[torch.Tensor, str]:
    text, description = _read_text(source)
    return tokenizer(text, return_tensors="pt").input_ids, description


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
    from .bench.machine import loadavg  # the benchmark harness's reading

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


class _TextTooShort(ValueError):
    pass


def run_bench(
    model: Any,
    tokenizer: Any,
    *,
    prefix_tokens: int,
    question_tokens: int,
    repeats: int,
    workdir: Path,
    text: str | None = None,
    warmup: int = 1,
) -> dict[str, Any]:
    """The TTFT benchmark (see the module docstring); returns everything measured, for the JSON."""
    from .bench.machine import loadavg  # the benchmark harness's reading (imported only when benchmarking)

    ids, description = _tokenize_text(tokenizer, text)
    if ids.shape[1] < prefix_tokens + question_tokens:
        raise _TextTooShort(f"the text has {ids.shape[1]} tokens, fewer than {prefix_tokens} + {question_tokens}")
    prefix, input_ids = ids[:, :prefix_tokens], ids[:, : prefix_tokens + question_tokens]
    path = workdir / "prefix.safetensors"
    loadavg_start = loadavg()

    started = time.perf_counter()
    cache = build_prefix(model, prefix)
    build_seconds = time.perf_counter() - started
    started = time.perf_counter()
    cache.save(path)
    save_seconds = time.perf_counter() - started
    report = cache.memory_report()
    checkpoint = cache.checkpoint()
    deep_copy_bytes = copy.deepcopy(cache).memory_report().total_bytes

    makers = {
        "cold": lambda: HybridRingCache(model.config),
        "warm_file": lambda: HybridRingCache.load(path, model.config),
        "warm_checkpoint": lambda: (cache.restore(checkpoint), cache)[1],
    }
    times: dict[str, list[float]] = {name: [] for name in makers}
    first_tokens: dict[str, list[int]] = {name: [] for name in makers}
    order = list(makers)
    for repeat in range(-warmup, repeats):  # negative: warm-up rounds (first calls allocate), not recorded
        for name in order if repeat % 2 == 0 else order[::-1]:  # interleaved, alternating order
            seconds, output = time_to_first_token(model, input_ids, makers[name])
            print(
                f"  {'warm-up' if repeat < 0 else f'repeat {repeat}'}: {name:<16} {seconds * 1000:9.1f} ms", flush=True
            )
            first_tokens[name].append(int(output[0, -1]))
            if repeat >= 0:
                times[name].append(seconds)
    loaded = HybridRingCache.load(path, model.config)
    started = time.perf_counter()
    HybridRingCache.load(path, model.config)
    load_seconds = time.perf_counter() - started
    cold_logits = prefill(model, HybridRingCache(model.config), input_ids)
    warm_logits = prefill(model, loaded, input_ids[:, prefix_tokens:])
    summary = {
        name: {"median_ms": 1000 * statistics.median(v), "min_ms": 1000 * min(v), "all_ms": [1000 * t for t in v]}
        for name, v in times.items()
    }
    file_bytes = path.stat().st_size
    return {
        "command": " ".join(["python -m hybrid_cache.prefix", *sys.argv[1:]]) if sys.argv else None,
        "text": description,
        "prefix_tokens": prefix_tokens,
        "question_tokens": question_tokens,
        "repeats": repeats,
        "warmup": warmup,
        "dtype": str(next(model.parameters()).dtype),
        "torch_threads": torch.get_num_threads(),
        "nproc": os.cpu_count(),
        "loadavg_start": loadavg_start,
        "loadavg_end": loadavg(),
        "ttft": summary,
        "warm_over_cold_median": summary["warm_file"]["median_ms"] / summary["cold"]["median_ms"],
        "warm_over_cold_min": summary["warm_file"]["min_ms"] / summary["cold"]["min_ms"],
        # Each round ran cold and warm back to back: their ratio is the least sensitive to a changing machine load.
        "warm_over_cold_per_round": [w / c for w, c in zip(times["warm_file"], times["cold"])],
        "checkpoint_over_cold_median": summary["warm_checkpoint"]["median_ms"] / summary["cold"]["median_ms"],
        "same_first_token": len({t for v in first_tokens.values() for t in v}) == 1,
        "max_abs_logit_difference_warm_vs_cold": float((cold_logits - warm_logits).abs().max()),
        "prefix_build_s": build_seconds,
        "save_s": save_seconds,
        "load_s": load_seconds,
        "file_bytes": file_bytes,
        "kv_bytes_held": report.total_bytes,
        "file_over_kv_bytes": file_bytes / report.total_bytes,
        "full_cache_bytes": report.full_cache_bytes,
        "checkpoint_bytes": checkpoint.nbytes(),
        "deep_copy_bytes": deep_copy_bytes,
        "checkpoint_over_deep_copy": checkpoint.nbytes() / deep_copy_bytes,
    }


def format_bench(result: dict[str, Any]) -> str:
    """A markdown table of a `run_bench` result."""
    ttft = result["ttft"]
    rows = [
        "| | median | min | / cold (median) |",
        "| --- | --- | --- | --- |",
    ]
    for name, label in (
        ("cold", f"cold: prefill {result['prefix_tokens']} + {result['question_tokens']} tokens"),
        ("warm_file", f"warm: load file + prefill {result['question_tokens']}"),
        ("warm_checkpoint", f"warm: restore checkpoint + prefill {result['question_tokens']}"),
    ):
        ratio = ttft[name]["median_ms"] / ttft["cold"]["median_ms"]
        rows.append(f"| {label} | {ttft[name]['median_ms']:.1f} ms | {ttft[name]['min_ms']:.1f} ms | {ratio:.3f}x |")
    per_round = result["warm_over_cold_per_round"]
    rows += [
        "",
        f"warm / cold per round (file): {', '.join(f'{r:.3f}' for r in per_round)} "
        f"(median {statistics.median(per_round):.3f})",
        f"file {result['file_bytes']:,} B vs K/V held (memory_report) {result['kv_bytes_held']:,} B "
        f"({100 * (result['file_over_kv_bytes'] - 1):+.2f}%); full cache of every layer "
        f"{_mib(result['full_cache_bytes'])}",
        f"checkpoint {result['checkpoint_bytes']:,} B vs deep copy {result['deep_copy_bytes']:,} B "
        f"({result['checkpoint_over_deep_copy']:.3f}x)",
        f"same first token: {result['same_first_token']}; max |logit difference| warm vs cold "
        f"{result['max_abs_logit_difference_warm_vs_cold']:.2e}; load {result['load_s'] * 1000:.1f} ms, "
        f"save {result['save_s'] * 1000:.1f} ms",
        f"load average: start {result['loadavg_start']}, end {result['loadavg_end']}; {result['nproc']} CPUs, "
        f"{result['torch_threads']} torch threads",
    ]
    return "\n".join(rows)


def cmd_bench(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
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
        except _TextTooShort as exc:
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
