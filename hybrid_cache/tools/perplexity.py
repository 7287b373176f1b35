"""Streaming perplexity with different KV caches: the exactness (and memory) check for ``HybridRingCache``.

The text is tokenized once and fed to the model chunk by chunk through one cache; the negative log-likelihood
of every token ``t+1`` given tokens ``<= t`` is summed across chunk boundaries (the last position of chunk ``k``
predicts the first token of chunk ``k+1``), so every cache sees exactly the same prediction problem as a single
no-cache forward over the whole text. An exact cache gives the same perplexity as that forward, up to float
rounding (the attention is computed in different block shapes).

Logits are never materialized for the whole sequence (4096 x 262144 fp32 is 4.3 GB): we run the base model
(``model.model``) for hidden states and apply the LM head (+ final logit soft-capping, if the model has one) in
slices of ``--logits-slice`` positions.

Caches (``--caches``):

* ``ring``: ``hybrid_cache.cache.HybridRingCache(config)`` (ring buffers for sliding-window layers).
* ``dynamic``: ``transformers.DynamicCache(config=config)``.
* ``static``: ``transformers.StaticCache(config=config, max_cache_len=tokens)``.
* ``none``: one forward over the whole text with ``use_cache=False`` (the reference).

The command line (``hybrid-cache-perplexity``, ``python -m hybrid_cache.tools.cli.perplexity``) is
`hybrid_cache.tools.cli.perplexity`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hybrid_cache import cache_kwargs, specs

from . import compare
from .compare import kv_bytes_held, peak_rss_bytes, text_config
from .progress import Progress, layer_progress

__all__ = [
    "CACHE_NAMES",
    "PerplexityResult",
    "evaluate_perplexity",
    "final_logits",
    "format_table",
    "has_sliding_layers",
    "kv_bytes",
    "make_cache",
    "plot_memory",
    "sliced_nll",
]

CACHE_NAMES = (*compare.CACHE_NAMES, "none")


@dataclass
class PerplexityResult:
    """Outcome of one streaming run.

    Attributes:
        cache: cache name (``ring``, ``dynamic``, ``static``, ``none``).
        ppl: ``exp(nll / predicted)``.
        nll: summed negative log-likelihood (nats) over all predicted tokens.
        predicted: number of predicted tokens (``tokens - 1``).
        tokens: number of input tokens.
        chunk_size: tokens per forward (``tokens`` for ``none``).
        seconds: wall time of the forward passes and the loss.
        kv_bytes: KV bytes held by the cache after the last chunk (0 for ``none``).
        peak_rss_bytes: process-wide peak resident set size after this run (a high-water mark: it never goes
            down, so runs later in the same process include earlier peaks).
        kv_trace: ``(tokens processed, KV bytes held)`` after each chunk.
        memory_report: ``str(cache.memory_report())`` when the cache has one.
        reference: with ``--reference``: the exact cache the next three fields compare against (else ``None``).
        kl_mean: mean over predicted positions of ``KL(p_reference || p_cache)`` in nats.
        kl_p99: 99th percentile of that KL.
        top1_agreement: fraction of positions whose most likely next token is the reference's.
    """

    cache: str
    ppl: float
    nll: float
    predicted: int
    tokens: int
    chunk_size: int
    seconds: float
    kv_bytes: int
    peak_rss_bytes: int
    kv_trace: list[tuple[int, int]] = field(default_factory=list)
    memory_report: str | None = None
    reference: str | None = None
    kl_mean: float | None = None
    kl_p99: float | None = None
    top1_agreement: float | None = None

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("nan")


def kv_bytes(cache: Any) -> int:
    """Bytes of K/V storage a cache holds (see `hybrid_cache.tools.compare.kv_bytes_held`); 0 for ``None`` (no cache).

    For `HybridRingCache` this equals ``memory_report().total_bytes`` (tested).
    """
    return kv_bytes_held(cache)


def has_sliding_layers(config: Any) -> bool:
    """Whether the model has any sliding-window attention layers (otherwise a ring cache saves nothing): a model or
    its config (`hybrid_cache.specs.has_sliding_layers`)."""
    return specs.has_sliding_layers(text_config(config))


def make_cache(name: str, model: Any, max_tokens: int) -> Any:
    """The named cache for ``model`` (`hybrid_cache.tools.compare.make_cache`), or ``None`` for ``"none"``.

    Args:
        name: one of :data:`CACHE_NAMES`.
        model: the causal LM.
        max_tokens: total tokens to be processed (StaticCache's ``max_cache_len``).
    """
    return None if name == "none" else compare.make_cache(name, model, max_tokens)


def final_logits(model: Any, hidden: torch.Tensor) -> torch.Tensor:
    """float32 logits of `[n, hidden_size]` final hidden states, as the model's forward computes them (its output
    embeddings, then `final_logit_softcapping` when the config sets it)."""
    logits = model.get_output_embeddings()(hidden).float()
    softcap = getattr(text_config(model), "final_logit_softcapping", None)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


@torch.inference_mode()
def sliced_nll(model: Any, hidden: torch.Tensor, targets: torch.Tensor, slice_size: int = 512) -> float:
    """Summed NLL of ``targets`` given ``hidden`` states, computing logits ``slice_size`` positions at a time.

    Args:
        model: the causal LM (its output embeddings and ``final_logit_softcapping`` are used, as in its forward).
        hidden: ``[n, hidden_size]`` final hidden states (after the final norm).
        targets: ``[n]`` next-token ids.
        slice_size: positions per logits slice (peak extra memory ``slice_size * vocab * 4`` bytes).

    Returns:
        The summed negative log-likelihood in nats, accumulated in float64.
    """
    total = 0.0
    for s in range(0, hidden.shape[0], slice_size):
        logits = final_logits(model, hidden[s : s + slice_size])
        total += torch.nn.functional.cross_entropy(
            logits, targets[s : s + slice_size].to(logits.device), reduction="sum"
        ).item()
    return total


@torch.inference_mode()
def evaluate_perplexity(
    model: Any,
    input_ids: torch.Tensor,
    cache_name: str,
    chunk_size: int,
    *,
    logits_slice: int = 512,
    progress: bool = True,
) -> PerplexityResult:
    """Stream ``input_ids`` through ``model`` with one cache and return the perplexity.

    No attention mask is passed (all tokens are real), so every run uses the model's plain causal /
    sliding-window masks: exactly the semantics of the single no-cache forward.

    Args:
        model: a causal LM with a ``.model`` base (transformers ``*ForCausalLM``).
        input_ids: ``[T]`` or ``[1, T]`` token ids (batch size 1).
        cache_name: one of :data:`CACHE_NAMES`.
        chunk_size: tokens per forward for the cached runs (ignored by ``none``).
        logits_slice: positions per logits slice.
        progress: show progress on stderr (`hybrid_cache.tools.progress.Progress`).

    Returns:
        A :class:`PerplexityResult`.

    Raises:
        ValueError: unknown cache, ``chunk_size < 1``, or fewer than ``chunk_size + 1`` tokens.
    """
    ids = _checked_ids(input_ids, cache_name, chunk_size).to(next(model.parameters()).device)
    n_tokens = ids.shape[1]
    cache = make_cache(cache_name, model, n_tokens)
    start_time = time.perf_counter()
    if cache is None:
        nll, trace = _no_cache_nll(model, ids, cache_name, logits_slice, progress)
        step = n_tokens
    else:
        nll, trace = _streamed_nll(model, ids, cache, cache_name, chunk_size, logits_slice, progress)
        step = chunk_size
    seconds = time.perf_counter() - start_time
    predicted = n_tokens - 1
    report = str(cache.memory_report()) if hasattr(cache, "memory_report") else None
    return PerplexityResult(
        cache=cache_name,
        ppl=math.exp(nll / predicted),
        nll=nll,
        predicted=predicted,
        tokens=n_tokens,
        chunk_size=step,
        seconds=seconds,
        kv_bytes=trace[-1][1],
        peak_rss_bytes=peak_rss_bytes(),
        kv_trace=trace,
        memory_report=report,
    )


def _checked_ids(input_ids: torch.Tensor, cache_name: str, chunk_size: int) -> torch.Tensor:
    """`input_ids` as `[1, T]`, once the cache name, the chunk size and the length are checked."""
    if cache_name not in CACHE_NAMES:
        raise ValueError(f"unknown cache {cache_name!r}; expected one of {', '.join(CACHE_NAMES)}")
    if chunk_size < 1:
        raise ValueError(f"chunk size must be >= 1, got {chunk_size}")
    ids = input_ids.reshape(1, -1) if input_ids.dim() == 1 else input_ids
    if ids.shape[0] != 1:
        raise ValueError(f"batch size must be 1, got input_ids of shape {tuple(input_ids.shape)}")
    n_tokens = ids.shape[1]
    if n_tokens < chunk_size + 1:
        raise ValueError(
            f"the text has {n_tokens} tokens, fewer than one chunk + 1 ({chunk_size} + 1): "
            "use a longer text or a smaller --chunk-size"
        )
    return ids


def _no_cache_nll(
    model: Any, ids: torch.Tensor, cache_name: str, logits_slice: int, progress: bool
) -> tuple[float, list[tuple[int, int]]]:
    """(summed NLL, K/V trace) of one forward over the whole text without a cache."""
    n_tokens = ids.shape[1]
    # One forward over the whole text: its layers are the only steps to show.
    layers = text_config(model).num_hidden_layers
    desc = f"{cache_name:>7} (one forward of {n_tokens} tokens)"
    with Progress(layers, desc, "layers", enabled=progress, rate=False) as bar, layer_progress(model, bar):
        hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state[0]
    return sliced_nll(model, hidden[:-1], ids[0, 1:], logits_slice), [(n_tokens, 0)]


def _streamed_nll(
    model: Any, ids: torch.Tensor, cache: Any, cache_name: str, chunk_size: int, logits_slice: int, progress: bool
) -> tuple[float, list[tuple[int, int]]]:
    """(summed NLL, K/V bytes held after each chunk) of the text streamed through `cache` `chunk_size` tokens at a
    time."""
    n_tokens = ids.shape[1]
    nll = 0.0
    trace: list[tuple[int, int]] = []
    bar = Progress(n_tokens, f"{cache_name:>7}", "tok", enabled=progress)
    for start in range(0, n_tokens, chunk_size):
        chunk = ids[:, start : start + chunk_size]
        hidden = model.model(input_ids=chunk, **cache_kwargs(cache), use_cache=True).last_hidden_state[0]
        # Position p of this chunk predicts token start+p+1; the very last token of the text predicts nothing.
        n_pred = min(chunk.shape[1], n_tokens - 1 - start)
        if n_pred > 0:
            nll += sliced_nll(model, hidden[:n_pred], ids[0, start + 1 : start + 1 + n_pred], logits_slice)
        trace.append((start + chunk.shape[1], kv_bytes(cache)))
        bar.update(chunk.shape[1])
    bar.close()
    return nll, trace


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f}"


def format_table(results: Sequence[PerplexityResult], full_bytes: int | None = None) -> str:
    """Render results as a fixed-width table.

    Args:
        results: one per cache.
        full_bytes: KV bytes a full cache of every layer would hold for the same tokens (extra line), if given.

    Returns:
        The table as a string.
    """
    quality = any(r.kl_mean is not None for r in results)
    width = max([8, *(len(r.cache) for r in results)])
    head = (
        f"{'cache':<{width}} {'ppl':>12} {'tokens':>7} {'chunk':>6} {'seconds':>8} {'tok/s':>8} {'KV MiB':>9} "
        f"{'peak RSS MiB':>13}"
    )
    if quality:
        head += f" {'ppl vs ref':>10} {'KL mean':>9} {'KL p99':>9} {'top-1':>7}"
    lines = [head, "-" * len(head)]
    reference = next((r for r in results if r.reference is not None and r.cache == r.reference), None)
    for r in results:
        line = (
            f"{r.cache:<{width}} {r.ppl:>12.6f} {r.tokens:>7} {r.chunk_size:>6} {r.seconds:>8.2f} "
            f"{r.tokens_per_second:>8.1f} {_mib(r.kv_bytes):>9} {_mib(r.peak_rss_bytes):>13}"
        )
        if quality and r.kl_mean is not None and reference is not None:
            line += (
                f" {100 * (r.ppl / reference.ppl - 1):>+9.3f}% {r.kl_mean:>9.2e} {r.kl_p99:>9.2e} "
                f"{100 * r.top1_agreement:>6.2f}%"
            )
        lines.append(line)
    if full_bytes is not None:
        lines.append(
            f"(a full cache of every layer would hold {_mib(full_bytes)} MiB of KV for these tokens; "
            "peak RSS is a process-wide high-water mark)"
        )
    return "\n".join(lines)


def plot_memory(results: Sequence[PerplexityResult], full_bytes_per_token: int, path: str, title: str = "") -> None:
    """Write a PNG of KV bytes held vs tokens processed, one line per cache plus the full-cache line.

    Args:
        results: runs with their ``kv_trace``.
        full_bytes_per_token: see `hybrid_cache.tools.compare.full_cache_bytes_per_token`.
        path: output PNG path.
        title: plot title.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    max_tokens = max((r.tokens for r in results), default=0)
    ax.plot([0, max_tokens], [0, full_bytes_per_token * max_tokens / 2**20], "k--", label="full cache of every layer")
    for r in results:
        if r.cache == "none":
            continue  # holds no cache; its transient K/V are not a cache
        xs = [0] + [t for t, _ in r.kv_trace]
        ys = [0] + [b / 2**20 for _, b in r.kv_trace]
        ax.plot(xs, ys, marker="o", markersize=3, label=r.cache)
    ax.set_xlabel("tokens processed")
    ax.set_ylabel("KV bytes held (MiB)")
    ax.set_title(title or "KV cache memory")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
