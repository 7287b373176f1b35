"""The window guard: a cache built for another sliding window than the model's is exact or refuses, never wrong.

A ring holds its newest `capacity` positions. When the model's window (its mask) reaches further back than that, a
step would attend over fewer keys than the no-cache forward: the cache must raise `WindowMismatchError` before
writing anything. Properties, over random model windows, cache windows (smaller, equal, larger), rollback margins,
prompt lengths and chunk schedules (chunks shorter and longer than both windows, one-token steps), Gemma 3 and
Gemma 4, `sdpa` and `eager`:

- every step equals the no-cache forward (fp32, 1e-4) or raises `WindowMismatchError` leaving the cache as it was;
- a cache window at least the model's never raises;
- without padding, the error comes exactly at the first step where a query's window reaches a position the ring no
  longer holds (`first_blind_step`);
- `generate` (with and without `prefill_chunk_size`) gives `DynamicCache`'s tokens or raises.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
from builders import MODEL_BUILDERS, VOCAB, no_cache_logits, random_schedule
from transformers import DynamicCache

from hybrid_cache import HybridRingCache, WindowMismatchError
from hybrid_cache.compat import cache_kwargs

TOLERANCE = 1e-4
CASES = 40  # random geometries per (family, attention) pair


def first_blind_step(schedule: list[int], cache_window: int, capacity: int, model_window: int) -> int | None:
    """Index of the first step whose window reaches a key the cache does not return (no padding), for a ring of
    `capacity` slots (`cache_window` + rollback margin) built for `cache_window`.

    A one-token step at position `p` after the wrap (`p >= capacity`) returns the ring, positions
    `p - capacity + 1 .. p`: the query's window (`model_window` keys including itself) misses `p - capacity` when
    `capacity < model_window`. A multi-token step starting at `p` returns the `cache_window - 1` positions before `p`
    (as transformers' own sliding layer does), so its first query misses `p - cache_window` when that position exists
    and `cache_window < model_window`.
    """
    length = 0
    for index, size in enumerate(schedule):
        if size == 1 and length >= capacity and capacity < model_window:
            return index
        if size > 1 and length >= cache_window and cache_window < model_window:
            return index
        length += size
    return None


def mixed_schedule(rng: random.Random, total: int, largest: int) -> list[int]:
    """Chunk sizes summing to `total`: chunks of 2 to `largest` tokens, mixed with one-token steps in two schedules
    out of three (chunks alone reach the chunk refusal before any one-token step)."""
    one_token_share = rng.choice([0.0, 0.3, 0.6])
    return random_schedule(total, lambda: 1 if rng.random() < one_token_share else rng.randint(2, largest))


def geometry(rng: random.Random) -> tuple[int, int, int, list[int]]:
    """(model window, cache window, rollback margin, schedule)."""
    model_window = rng.randint(2, 9)
    smaller = rng.randint(1, model_window - 1)
    cache_window = rng.choice([smaller, smaller, model_window, rng.randint(model_window, 12)])
    margin = rng.choice([0, 0, 2])
    total = rng.randint(3, 3 * model_window + 8)  # also shorter than the model window: its mask then sees 0
    return model_window, cache_window, margin, mixed_schedule(rng, total, largest=2 * model_window + 3)


def config_with_window(config, window: int):
    """A copy of `config` whose sliding window is `window` (what a user gets from another checkpoint's config)."""
    other = copy.deepcopy(config)
    other.sliding_window = window
    return other


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", sorted(MODEL_BUILDERS))
def test_chunk_schedules_are_exact_or_refused(family, attn, one_thread):
    rng = random.Random(f"{family}-{attn}")
    refused = {"one-token step": 0, "chunk": 0}
    for case in range(CASES):
        model_window, cache_window, margin, schedule = geometry(rng)
        model = MODEL_BUILDERS[family](window=model_window, attn=attn, seed=case % 3)
        ids = torch.randint(3, VOCAB, (1, sum(schedule)), generator=torch.Generator().manual_seed(case))
        expected = no_cache_logits(model, ids)
        cache = HybridRingCache(config_with_window(model.config, cache_window), rollback_margin=margin)
        blind = first_blind_step(schedule, cache_window, cache_window + margin, model_window)
        label = f"case {case}: model window {model_window}, cache window {cache_window}+{margin}, {schedule}"
        position = 0
        with torch.no_grad():
            for index, size in enumerate(schedule):
                chunk = ids[:, position : position + size]
                if index == blind:
                    with pytest.raises(WindowMismatchError, match=f"sliding_window={model_window}"):
                        model(input_ids=chunk, **cache_kwargs(cache))
                    assert cache.get_seq_length() == position, f"{label}: a refused step wrote into the cache"
                    refused["chunk" if size > 1 else "one-token step"] += 1
                    break
                logits = model(input_ids=chunk, **cache_kwargs(cache)).logits
                difference = (logits - expected[:, position : position + size]).abs().max().item()
                assert difference <= TOLERANCE, f"{label}, step {index}: |logit difference| {difference:.3g}"
                position += size
    assert all(refused.values()), f"refusals per step kind {refused}: the property was not exercised for each"


@pytest.mark.parametrize("family", sorted(MODEL_BUILDERS))
def test_left_padded_batches_are_exact_or_refused(family, one_thread):
    """Left padding (longer than both windows in some rows): never a wrong logit for a real token; a cache window at
    least the model's never refuses."""
    rng = random.Random(f"padded-{family}")
    for case in range(CASES // 2):
        model_window, cache_window, margin, schedule = geometry(rng)
        model = MODEL_BUILDERS[family](window=model_window, seed=case % 3)
        total = sum(schedule)
        ids = torch.randint(3, VOCAB, (2, total), generator=torch.Generator().manual_seed(case))
        mask = torch.ones_like(ids)
        mask[1, : rng.randint(1, total - 2)] = 0
        ids[mask == 0] = 0
        expected = no_cache_logits(model, ids, mask)
        cache = HybridRingCache(config_with_window(model.config, cache_window), rollback_margin=margin)
        position = 0
        with torch.no_grad():
            for size in schedule:
                end = position + size
                try:
                    logits = model(
                        input_ids=ids[:, position:end], attention_mask=mask[:, :end], **cache_kwargs(cache)
                    ).logits
                except WindowMismatchError:
                    assert cache_window < model_window, f"case {case}: refused with a large enough cache window"
                    assert cache.get_seq_length() == position
                    break
                real = mask[:, position:end].bool()
                difference = (logits[real] - expected[:, position:end][real]).abs().max().item()
                assert difference <= TOLERANCE, f"case {case}, {schedule}: |logit difference| {difference:.3g}"
                position = end


@pytest.mark.parametrize("family", sorted(MODEL_BUILDERS))
def test_generate_is_exact_or_refused(family, one_thread):
    """`generate` with a prompt longer than the cache window, with and without chunked prefill: DynamicCache's
    tokens (the model's own window) or `WindowMismatchError`; a cache window at least the model's never refuses, and
    a smaller one always refuses once the generation is longer than both windows."""
    rng = random.Random(f"generate-{family}")
    for case in range(8):
        model_window = rng.randint(3, 8)
        cache_window = rng.choice([rng.randint(1, model_window - 1), model_window, model_window + 2])
        model = MODEL_BUILDERS[family](window=model_window, seed=case % 3)
        prompt = torch.randint(3, VOCAB, (1, rng.randint(model_window + 1, 3 * model_window)))
        kwargs = dict(input_ids=prompt, max_new_tokens=model_window + 2, do_sample=False, pad_token_id=0)
        chunking = rng.choice([{}, {"prefill_chunk_size": rng.randint(2, model_window + 2)}])
        with torch.no_grad():
            expected = model.generate(**kwargs, **chunking, **cache_kwargs(DynamicCache(config=model.config)))
            cache = HybridRingCache(config_with_window(model.config, cache_window))
            if cache_window < model_window:
                with pytest.raises(WindowMismatchError):
                    model.generate(**kwargs, **chunking, **cache_kwargs(cache))
            else:
                assert torch.equal(model.generate(**kwargs, **chunking, **cache_kwargs(cache)), expected), (
                    case,
                    chunking,
                )
