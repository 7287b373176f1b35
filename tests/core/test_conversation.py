"""A cache holds one conversation. Inputs that cannot continue what it holds raise `ConversationMismatchError`
before anything is written, wherever the mismatch is visible to the cache:

- `generate` with a prompt so much shorter than the cached tokens that the slice it runs is empty (transformers then
  crashes with "cannot reshape a tensor of 0 elements", `DynamicCache` included);
- a 2D attention mask shorter than the cached tokens plus the new ones (a padded batch, or a manual forward given only
  the new prompt's mask).

An unpadded prompt that is longer than half the cached length but not a continuation is not visible to the cache:
`generate` drops an all-ones mask and slices the prompt by the cached length, with any cache (documented in
docs/api.md). A continuation (the whole conversation, or `reset()` first) still works and equals `DynamicCache`.
"""

from __future__ import annotations

import random

import pytest
import torch
from builders import MODEL_BUILDERS, tokens
from transformers import DynamicCache

from hybrid_cache import ConversationMismatchError, HybridRingCache
from hybrid_cache.compat import cache_kwargs

GENERATE = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)


def snapshot(cache: HybridRingCache) -> list[tuple[int, torch.Tensor | None]]:
    return [
        (layer.get_seq_length(), layer.keys.clone() if getattr(layer, "keys", None) is not None else None)
        for layer in cache.layers
        if hasattr(layer, "get_seq_length")
    ]


def assert_unchanged(before, cache) -> None:
    after = snapshot(cache)
    assert [length for length, _ in before] == [length for length, _ in after]
    assert all(a is None or torch.equal(a, b) for (_, a), (_, b) in zip(before, after))


@pytest.mark.parametrize("model_name", sorted(MODEL_BUILDERS))
def test_generate_with_a_much_shorter_prompt_is_refused(model_name, one_thread):
    rng = random.Random(model_name)
    for case in range(4):
        window = rng.randint(2, 6)
        model = MODEL_BUILDERS[model_name](window=window)
        cache = HybridRingCache(model.config)
        first = tokens(rng.randint(2 * window, 4 * window), seed=case)
        with torch.no_grad():
            model.generate(input_ids=first, **cache_kwargs(cache), **GENERATE)
            held = cache.get_seq_length()
            before = snapshot(cache)
            unrelated = tokens(rng.randint(1, held // 2), seed=case + 100)
            with pytest.raises(ConversationMismatchError, match="one conversation"):
                model.generate(input_ids=unrelated, **cache_kwargs(cache), **GENERATE)
        assert_unchanged(before, cache)


@pytest.mark.parametrize("model_name", sorted(MODEL_BUILDERS))
def test_a_mask_shorter_than_the_cache_is_refused(model_name, one_thread):
    """A padded batch given with a new, shorter prompt, and a manual forward with only the new prompt's mask."""
    model = MODEL_BUILDERS[model_name](window=4)
    cache = HybridRingCache(model.config)
    with torch.no_grad():
        model.generate(input_ids=tokens(9, 2, seed=0), **cache_kwargs(cache), **GENERATE)
        before = snapshot(cache)
        padded = tokens(8, 2, seed=1)
        mask = torch.ones_like(padded)
        padded[1, :3], mask[1, :3] = 0, 0
        with pytest.raises(ConversationMismatchError, match="one conversation"):
            model.generate(input_ids=padded, attention_mask=mask, **cache_kwargs(cache), **GENERATE)
        assert_unchanged(before, cache)
        new = tokens(5, 2, seed=2)
        with pytest.raises(ConversationMismatchError, match="attention mask has 5 columns"):
            model(input_ids=new, attention_mask=torch.ones_like(new), **cache_kwargs(cache))
        assert_unchanged(before, cache)


@pytest.mark.parametrize("model_name", sorted(MODEL_BUILDERS))
def test_continuations_still_work(model_name, one_thread):
    """The whole conversation (cached tokens then new ones, padded or not), and `reset()` then a new prompt, give
    `DynamicCache`'s tokens (a new `DynamicCache` for the new prompt), also right after a refused call."""
    model = MODEL_BUILDERS[model_name](window=4)
    first, follow = tokens(9, 2, seed=0), tokens(3, 2, seed=1)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :2] = 0
    first[1, :2] = 0
    results = {}
    with torch.no_grad():
        for name, cache in (("ring", HybridRingCache(model.config)), ("dynamic", DynamicCache(config=model.config))):
            turn = model.generate(input_ids=first, attention_mask=mask, **cache_kwargs(cache), **GENERATE)
            if name == "ring":
                with pytest.raises(ConversationMismatchError):
                    model(input_ids=follow, attention_mask=torch.ones_like(follow), **cache_kwargs(cache))
            ids = torch.cat([turn, follow], 1)
            full_mask = torch.cat([mask, torch.ones(2, ids.shape[1] - 9, dtype=torch.long)], 1)
            second = model.generate(input_ids=ids, attention_mask=full_mask, **cache_kwargs(cache), **GENERATE)
            if name == "ring":
                cache.reset()
            else:  # a new one: DynamicCache.reset() is not clean on every release of the range (5.5.0)
                cache = DynamicCache(config=model.config)
            fresh = model.generate(input_ids=follow, **cache_kwargs(cache), **GENERATE)
            results[name] = (second, fresh)
    assert all(torch.equal(a, b) for a, b in zip(results["ring"], results["dynamic"]))
