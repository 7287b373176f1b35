"""Quality of approximate caches against an exact one: KL divergence of next-token distributions, top-1 agreement.

Perplexity alone hides how far an approximate cache moves the model's predictions (errors in both directions cancel
in the mean NLL), so compressed and bounded caches are measured the way llama.cpp's `--kl-divergence` does: the text
is streamed chunk by chunk through a **reference** cache (the exact ring) and every compared cache in lockstep, and
for every predicted position

- `KL(p_ref || p_cache) = sum_v p_ref(v) (log p_ref(v) - log p_cache(v))` (nats), reported as mean and 99th
  percentile over positions;
- top-1 agreement: the fraction of positions whose argmax token is the same;
- the perplexity of each cache, its KV bytes and the seconds of its own forwards and losses.

Logits are computed `logits_slice` positions at a time (the vocabulary is 262144 wide), never for the whole text.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hybrid_cache import cache_kwargs

from .compare import kv_bytes_held, peak_rss_bytes
from .perplexity import PerplexityResult, final_logits, make_cache

__all__ = ["evaluate_against_reference", "plot_quality"]


def _log_probs(model: Any, hidden: torch.Tensor) -> torch.Tensor:
    """`[n, vocab]` float32 log-probabilities of `[n, hidden]` final hidden states."""
    return torch.log_softmax(final_logits(model, hidden), dim=-1)


@torch.inference_mode()
def evaluate_against_reference(
    model: Any,
    input_ids: torch.Tensor,
    cache_names: Sequence[str],
    reference: str = "ring",
    chunk_size: int = 512,
    *,
    logits_slice: int = 256,
    progress: bool = True,
) -> list[PerplexityResult]:
    """Stream `input_ids` through `reference` and every cache of `cache_names` in lockstep.

    Args:
        model: a causal LM with a `.model` base (transformers `*ForCausalLM`).
        input_ids: `[T]` or `[1, T]` token ids (batch size 1).
        cache_names: caches to compare (names of `hybrid_cache.tools.compare.CACHE_NAMES`; `reference` may be
            among them).
        reference: the exact cache the distributions are compared against.
        chunk_size: tokens per forward.
        logits_slice: positions per log-softmax slice (peak extra memory about `3 x slice x vocab x 4` bytes).
        progress: show a tqdm bar.

    Returns:
        One `PerplexityResult` per cache, the reference first, with `kl_mean`, `kl_p99` and `top1_agreement` set
        (0, 0 and 1 for the reference itself).
    """
    from tqdm.auto import tqdm

    if chunk_size < 1:
        raise ValueError(f"chunk size must be >= 1, got {chunk_size}")
    ids = input_ids.reshape(1, -1).to(next(model.parameters()).device)
    n_tokens = ids.shape[1]
    if n_tokens < chunk_size + 1:
        raise ValueError(f"the text has {n_tokens} tokens, fewer than one chunk + 1 ({chunk_size} + 1)")
    names = [reference] + [name for name in cache_names if name != reference]
    caches = {name: make_cache(name, model, n_tokens) for name in names}
    if any(cache is None for cache in caches.values()):
        raise ValueError("'none' cannot take part in a lockstep comparison; compare cached runs only")
    tallies = {name: _Tally() for name in names}
    bar = tqdm(total=n_tokens, desc="lockstep", unit="tok", disable=not progress, leave=False)
    for start in range(0, n_tokens, chunk_size):
        chunk = ids[:, start : start + chunk_size]
        hidden = _forward_chunk(model, chunk, caches, tallies, start)
        n_pred = min(chunk.shape[1], n_tokens - 1 - start)
        for s in range(0, n_pred, logits_slice):
            stop = min(s + logits_slice, n_pred)
            targets = ids[0, start + 1 + s : start + 1 + stop]
            _score_slice(model, {name: h[s:stop] for name, h in hidden.items()}, targets, reference, tallies)
        bar.update(chunk.shape[1])
    bar.close()
    return [_result(name, tallies[name], caches[name], reference, n_tokens, chunk_size) for name in names]


@dataclass
class _Tally:
    """What one cache's lockstep run has summed so far."""

    nll: float = 0.0
    seconds: float = 0.0  # its own forwards and losses
    agree: int = 0  # positions whose argmax is the reference's
    kl_parts: list[torch.Tensor] = field(default_factory=list)  # KL per position, slice by slice
    trace: list[tuple[int, int]] = field(default_factory=list)  # (tokens seen, K/V bytes held) after each chunk


def _forward_chunk(
    model: Any, chunk: torch.Tensor, caches: dict[str, Any], tallies: dict[str, _Tally], start: int
) -> dict[str, torch.Tensor]:
    """`chunk` through every cache (base model only): each one's `[chunk, hidden]` final hidden states."""
    hidden = {}
    for name, cache in caches.items():
        began = time.perf_counter()
        hidden[name] = model.model(input_ids=chunk, **cache_kwargs(cache), use_cache=True).last_hidden_state[0]
        tallies[name].seconds += time.perf_counter() - began
        tallies[name].trace.append((start + chunk.shape[1], kv_bytes_held(cache)))
    return hidden


def _score_slice(
    model: Any, hidden: dict[str, torch.Tensor], targets: torch.Tensor, reference: str, tallies: dict[str, _Tally]
) -> None:
    """The NLL of `targets`, the KL against the reference and the top-1 agreement of one slice of positions."""
    began = time.perf_counter()
    reference_logp = _log_probs(model, hidden[reference])
    reference_p = reference_logp.exp()
    reference_top = reference_logp.argmax(-1)
    tallies[reference].seconds += time.perf_counter() - began
    for name, tally in tallies.items():
        began = time.perf_counter()
        logp = reference_logp if name == reference else _log_probs(model, hidden[name])
        tally.nll -= logp.gather(-1, targets[:, None]).double().sum().item()
        kl = (reference_p * (reference_logp - logp)).sum(-1).clamp(min=0)  # rounding can give -1e-9
        tally.kl_parts.append(kl.double().cpu())
        tally.agree += int((logp.argmax(-1) == reference_top).sum())
        tally.seconds += time.perf_counter() - began


def _result(name: str, tally: _Tally, cache: Any, reference: str, n_tokens: int, chunk_size: int) -> PerplexityResult:
    """One cache's `PerplexityResult` of the lockstep run."""
    predicted = n_tokens - 1
    kl = torch.cat(tally.kl_parts)
    report = cache.memory_report() if hasattr(cache, "memory_report") else None
    return PerplexityResult(
        cache=name,
        ppl=math.exp(tally.nll / predicted),
        nll=tally.nll,
        predicted=predicted,
        tokens=n_tokens,
        chunk_size=chunk_size,
        seconds=tally.seconds,
        kv_bytes=tally.trace[-1][1],
        peak_rss_bytes=peak_rss_bytes(),
        kv_trace=tally.trace,
        memory_report=None if report is None else str(report),
        reference=reference,
        kl_mean=float(kl.mean()),
        kl_p99=float(torch.quantile(kl, 0.99)),
        top1_agreement=tally.agree / predicted,
    )


def plot_quality(results: Sequence[PerplexityResult], path: str, title: str = "") -> None:
    """Write a PNG of quality against KV bytes: perplexity change vs the reference (left), mean KL (right).

    Args:
        results: runs from `evaluate_against_reference` (the reference is the one with `kl_mean == 0`).
        path: output PNG path.
        title: figure title.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reference = next(r for r in results if r.cache == r.reference)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.2))
    for r in results:
        mib = r.kv_bytes / 2**20
        change = 100 * (r.ppl / reference.ppl - 1)
        left.scatter(mib, change)
        left.annotate(r.cache, (mib, change), textcoords="offset points", xytext=(4, 4), fontsize=8)
        right.scatter(mib, max(r.kl_mean, 1e-6))
        right.annotate(r.cache, (mib, max(r.kl_mean, 1e-6)), textcoords="offset points", xytext=(4, 4), fontsize=8)
    left.axhline(0, color="k", lw=0.5)
    left.set_xlabel("KV bytes held (MiB)")
    left.set_ylabel(f"perplexity vs {reference.cache} (%)")
    right.set_yscale("log")
    right.set_xlabel("KV bytes held (MiB)")
    right.set_ylabel(f"mean KL vs {reference.cache} (nats; ref at 1e-6)")
    for axis in (left, right):
        axis.grid(alpha=0.3)
    fig.suptitle(title or "quality vs KV bytes")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
