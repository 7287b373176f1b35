"""Multi-turn reuse of a cache with assisted / prompt-lookup decoding on the second turn.

transformers' `_assisted_decoding` feeds its first target forward the whole prompt plus the draft, not cut by the
cache length (a plain `generate` is cut in `_prefill`): on a cache holding the first turn, the conversation is
appended again after it (cache 23 -> 59 tokens for a 29-token prompt, first-step logits off the no-cache run, and
`DynamicCache` identically: a transformers defect, reproduced in docs/traps.md). `HybridRingCache` refuses that step
with `ConversationMismatchError` before anything is written, at every batch size (batch 1 has no padding mask to give
the mismatch away; larger batches are refused by transformers before any forward). What does continue exactly:
the new tokens alone with the whole conversation's mask (positions from the mask), and the whole conversation on a
reset cache.
"""

from __future__ import annotations

import functools

import pytest
import torch
from builders import MODEL_BUILDERS, assert_unchanged, snapshot, tiny_gemma3, tokens
from transformers import DynamicCache

from hybrid_cache import ConversationMismatchError, HybridRingCache
from hybrid_cache.compat import STEP_POSITIONS_SINCE, TRANSFORMERS_VERSION, cache_kwargs, rollback_supported

GREEDY = dict(do_sample=False, pad_token_id=0, max_new_tokens=8, min_new_tokens=8)

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(not rollback_supported(), reason="assisted decoding with a ring needs transformers >= 5.18"),
]


@functools.cache
def target(model_name: str):
    if model_name == "gemma3":  # a full-attention layer early, so duplicated keys show in the first step
        types = ["sliding_attention"] * 3 + ["full_attention"]
        return tiny_gemma3(window=4, layers=4, layer_types=types)
    return MODEL_BUILDERS[model_name](window=4)


def speculation(method: str) -> dict:
    if method == "assistant":
        return {"assistant_model": tiny_gemma3(window=4, layers=2, seed=7)}
    return {"prompt_lookup_num_tokens": 3}


def first_turn(model, cache):
    with torch.no_grad():
        answer = model.generate(input_ids=tokens(16, seed=1), **cache_kwargs(cache), **GREEDY)
    return torch.cat([answer, tokens(5, seed=2)], 1)  # the next user turn appended: the whole conversation


def transformers_feeds_the_conversation_again(model, method: str) -> bool:
    """Whether this release's first assisted step appends the whole conversation to a `DynamicCache` holding the first
    turn (the defect; some releases cut it by the cache length as a plain `generate` does)."""
    cache = DynamicCache(config=model.config)
    conversation = first_turn(model, cache)
    with torch.no_grad():
        model.generate(input_ids=conversation, **cache_kwargs(cache), **GREEDY, **speculation(method))
    return cache.get_seq_length() > conversation.shape[1] + GREEDY["max_new_tokens"]


@pytest.mark.parametrize("method", ["assistant", "prompt_lookup"])
def test_second_turn_feeding_the_conversation_again_is_refused(model_name, method):
    """Where transformers feeds the conversation again (`DynamicCache` grows past it), the ring refuses, unchanged;
    where it does not, the second turn equals the no-cache run."""
    model = target(model_name)
    cache = HybridRingCache(model.config)
    conversation = first_turn(model, cache)
    with torch.no_grad():
        plain = model.generate(input_ids=conversation, use_cache=False, **GREEDY)
    if not transformers_feeds_the_conversation_again(model, method):
        with torch.no_grad():
            second = model.generate(input_ids=conversation, **cache_kwargs(cache), **GREEDY, **speculation(method))
        assert torch.equal(second, plain)
        return
    before, held = snapshot(cache), cache.get_seq_length()
    with torch.no_grad(), pytest.raises(ConversationMismatchError, match=f"already holds {held} tokens"):
        model.generate(input_ids=conversation, **cache_kwargs(cache), **GREEDY, **speculation(method))
    assert_unchanged(before, cache)
    with torch.no_grad():
        # The ways that are exact: plain decoding on the held cache, or speculation from a reset cache.
        assert torch.equal(model.generate(input_ids=conversation, **cache_kwargs(cache), **GREEDY), plain)
        cache.reset()
        again = model.generate(input_ids=conversation, **cache_kwargs(cache), **GREEDY, **speculation(method))
    assert torch.equal(again, plain)


@pytest.mark.parametrize("method", ["assistant", "prompt_lookup"])
def test_new_tokens_with_the_whole_mask_continue_exactly(model_name, method):
    """`generate` given only the new turn and the whole conversation's mask: positions continue at the cached
    length, the first assisted step continues the cache, nothing is refused (from 5.24; before, the cache is not told
    the step's positions and refuses it, unchanged)."""
    model = target(model_name)
    cache = HybridRingCache(model.config)
    conversation = first_turn(model, cache)
    held = cache.get_seq_length()
    mask = torch.ones_like(conversation)
    if TRANSFORMERS_VERSION < STEP_POSITIONS_SINCE:  # the cache cannot tell this step from the conversation fed again
        before = snapshot(cache)
        with torch.no_grad(), pytest.raises(ConversationMismatchError, match="does not pass the step's positions"):
            model.generate(
                input_ids=conversation[:, held:],
                attention_mask=mask,
                **cache_kwargs(cache),
                **GREEDY,
                **speculation(method),
            )
        assert_unchanged(before, cache)
        return
    with torch.no_grad():
        out = model.generate(
            input_ids=conversation[:, held:],
            attention_mask=mask,
            **cache_kwargs(cache),
            **GREEDY,
            **speculation(method),
        )
        plain = model.generate(input_ids=conversation, use_cache=False, **GREEDY)
    assert torch.equal(out, plain[:, held:])
    assert cache.get_seq_length() == plain.shape[1] - 1


def test_padded_batch_is_refused_before_any_step(model_name):
    """Batch 2 (a padded conversation): transformers refuses assisted decoding for batches before its first forward;
    the cache is left as it was."""
    model = target(model_name)
    cache = HybridRingCache(model.config)
    with torch.no_grad():
        model.generate(input_ids=tokens(9, 2, seed=3), **cache_kwargs(cache), **GREEDY)
    before = snapshot(cache)
    conversation = torch.cat([tokens(17, 2, seed=3), tokens(4, 2, seed=4)], 1)
    mask = torch.ones_like(conversation)
    mask[1, :2] = 0
    with torch.no_grad(), pytest.raises((ConversationMismatchError, ValueError)):
        model.generate(
            input_ids=conversation, attention_mask=mask, **cache_kwargs(cache), **GREEDY, prompt_lookup_num_tokens=3
        )
    assert_unchanged(before, cache)


def test_dynamic_cache_continues_wrong(model_name):
    """The defect itself (docs/traps.md): `DynamicCache` takes the conversation twice and its tokens leave the
    no-cache run's. Kept as a test so that a transformers release that fixes it is noticed (then this fails)."""
    model = target(model_name)
    cache = DynamicCache(config=model.config)
    conversation = first_turn(model, cache)
    held = cache.get_seq_length()
    with torch.no_grad():
        out = model.generate(input_ids=conversation, **cache_kwargs(cache), **GREEDY, prompt_lookup_num_tokens=3)
    assert cache.get_seq_length() > held + conversation.shape[1]  # the conversation stored twice
    assert out.shape[1] == conversation.shape[1] + GREEDY["max_new_tokens"]
