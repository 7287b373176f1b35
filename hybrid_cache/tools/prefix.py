"""Prefix caches: fill a `HybridRingCache` with a prefix so that `generate` continues from it exactly, build one to
save, time the first token of an answer, and the benchmark of cold against warm time-to-first-token (TTFT).

TTFT here is the wall time from having the token ids to having the first generated token: ``model.generate`` with a
streamer that timestamps the first new token. Cold: a fresh cache and the whole prompt (prefix + question). Warm:
``HybridRingCache.load(file)`` (included in the time) and the question's tokens only. Model loading is excluded, and
so are the process's one-off first-call costs (`run_bench` has its ``warmup`` rounds). `run_bench` measures,
interleaved, cold / warm-from-file / warm-from-checkpoint TTFT for a prefix of a text and the next
``question_tokens`` tokens as the question, plus file bytes against ``memory_report()`` and checkpoint bytes against a
deep copy; see docs/prefix.md.

The command line (``hybrid-cache-prefix``, ``python -m hybrid_cache.tools.cli.prefix``: ``build``, ``ask``, ``bench``) is
`hybrid_cache.tools.cli.prefix`.
"""

from __future__ import annotations

import copy
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers.generation.streamers import BaseStreamer

from hybrid_cache import HybridRingCache, cache_kwargs

from .text import load_text

__all__ = ["TextTooShort", "build_prefix", "format_bench", "prefill", "run_bench", "time_to_first_token"]

#: Metadata keys the ``build`` command writes into the files it builds (the user's namespace of the file).
TOKENS_KEY, SOURCE_KEY, MODEL_KEY = "prefix.token_ids", "prefix.source", "prefix.model"


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


class TextTooShort(ValueError):
    """The text has fewer tokens than the prefix and the question of `run_bench`."""


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
    """The TTFT benchmark (see the module docstring); returns everything measured, for the JSON.

    Args:
        text: a text source for `hybrid_cache.tools.text.load_text` (`None` or "default": the Britannica article).

    Raises:
        TextTooShort: the text has fewer than `prefix_tokens + question_tokens` tokens.
    """
    from .bench.machine import loadavg  # the benchmark harness's reading (imported only when benchmarking)

    text, description = load_text(None if text in (None, "default") else text)
    ids = tokenizer(text, return_tensors="pt").input_ids
    if ids.shape[1] < prefix_tokens + question_tokens:
        raise TextTooShort(f"the text has {ids.shape[1]} tokens, fewer than {prefix_tokens} + {question_tokens}")
    prefix, input_ids = ids[:, :prefix_tokens], ids[:, : prefix_tokens + question_tokens]
    path = workdir / "prefix.safetensors"
    loadavg_start = loadavg()

    cache, build_seconds, save_seconds = _build_and_save(model, prefix, path)
    report = cache.memory_report()
    checkpoint = cache.checkpoint()
    deep_copy_bytes = copy.deepcopy(cache).memory_report().total_bytes

    makers = {
        "cold": lambda: HybridRingCache(model.config),
        "warm_file": lambda: HybridRingCache.load(path, model.config),
        "warm_checkpoint": lambda: (cache.restore(checkpoint), cache)[1],
    }
    times, first_tokens = _interleaved_ttft(model, input_ids, makers, repeats, warmup)
    load_seconds, warm_vs_cold = _load_and_compare(model, path, input_ids, prefix_tokens)
    summary = {
        name: {"median_ms": 1000 * statistics.median(v), "min_ms": 1000 * min(v), "all_ms": [1000 * t for t in v]}
        for name, v in times.items()
    }
    file_bytes = path.stat().st_size
    return {
        "command": " ".join(["python -m hybrid_cache.tools.cli.prefix", *sys.argv[1:]]) if sys.argv else None,
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
        "max_abs_logit_difference_warm_vs_cold": warm_vs_cold,
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


def _build_and_save(model: Any, prefix: torch.Tensor, path: Path) -> tuple[HybridRingCache, float, float]:
    """The prefix cache, built and saved to `path`: (cache, seconds to build, seconds to save)."""
    started = time.perf_counter()
    cache = build_prefix(model, prefix)
    build_seconds = time.perf_counter() - started
    started = time.perf_counter()
    cache.save(path)
    return cache, build_seconds, time.perf_counter() - started


def _interleaved_ttft(
    model: Any, input_ids: torch.Tensor, makers: dict[str, Callable[[], HybridRingCache]], repeats: int, warmup: int
) -> tuple[dict[str, list[float]], dict[str, list[int]]]:
    """Time to first token with every cache maker, rounds interleaved in alternating order, after `warmup` unrecorded
    rounds (first calls allocate). Returns (seconds per maker, first new token of every round per maker)."""
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
    return times, first_tokens


def _load_and_compare(model: Any, path: Path, input_ids: torch.Tensor, prefix_tokens: int) -> tuple[float, float]:
    """(seconds of one `HybridRingCache.load` of the saved prefix, max |logit difference| of the question's prefill
    after the loaded prefix against a cold prefill of the whole prompt)."""
    loaded = HybridRingCache.load(path, model.config)
    started = time.perf_counter()
    HybridRingCache.load(path, model.config)
    load_seconds = time.perf_counter() - started
    cold_logits = prefill(model, HybridRingCache(model.config), input_ids)
    warm_logits = prefill(model, loaded, input_ids[:, prefix_tokens:])
    return load_seconds, float((cold_logits - warm_logits).abs().max())


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


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB"
