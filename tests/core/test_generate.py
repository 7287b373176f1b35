"""`generate` parity: `HybridRingCache` gives exactly the sequences `DynamicCache(config=...)` gives.

Every scenario uses prompts longer than the sliding window (window 6) and generations that wrap the ring several
times (15-token prompts, 20-30 new tokens), with `min_new_tokens == max_new_tokens` so that eos can never stop a
generation early (every sequence runs its full length, which is asserted). Every scenario is also checked against the
no-cache oracle `generate(use_cache=False)` (the model's own sliding-window mask over the whole sequence; sampling
with the same seed draws the same tokens), and plain greedy decoding also compares every step's raw logits.
"""

from __future__ import annotations

import contextlib
import copy
import functools

import pytest
import torch
import transformers
from builders import get_model, left_padded_batch, prompt, repetitive_prompt, tiny_gemma3, tokens
from transformers import DynamicCache

from hybrid_cache import HybridRingCache, RollbackError
from hybrid_cache.compat import (
    CACHE_KEYWORD,
    DYNAMIC_SLIDING_CROP_SINCE,
    PAST_RECORDING_SINCE,
    ROLLBACK_SINCE,
    TRANSFORMERS_VERSION,
    UnsupportedReleaseError,
    cache_kwargs,
    no_cache_forward_is_exact,
    rollback_supported,
)
from hybrid_cache.ring import RingSlidingLayer

WINDOW = 6
PROMPT_LEN = 15
NEW_TOKENS = 30
PAD = 0


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: faster, stable wall time on 2 cores


@functools.cache
def get_assistant():
    # Same vocabulary (101 ids, same special tokens), different weights, fewer layers.
    return tiny_gemma3(window=WINDOW, layers=2, seed=7)


def padded_prompts(lengths=(PROMPT_LEN + 3, 2, 10), seed: int = 10) -> dict[str, torch.Tensor]:
    """Prompts of different lengths, left-padded with id 0; the shortest has more padding than the window."""
    assert max(lengths) - min(lengths) > WINDOW
    return left_padded_batch([tokens(length, seed=seed + row)[0] for row, length in enumerate(lengths)])


def make_cache(kind: str, model, **kwargs):
    if kind == "ring":
        return HybridRingCache(model.config, **kwargs)
    if kind == "dynamic":
        return DynamicCache(config=model.config)
    raise ValueError(kind)


@torch.no_grad()
def generate(
    model,
    inputs,
    cache="ring",
    new_tokens: int = NEW_TOKENS,
    seed: int | None = None,
    with_logits: bool = False,
    **kwargs,
):
    """`model.generate` with `cache` in {'ring', 'dynamic', 'none'} or a cache object; runs exactly `new_tokens`.

    Returns the sequences, or `(sequences, logits)` with `with_logits` (raw logits of every step, stacked).
    """
    if seed is not None:
        torch.manual_seed(seed)
    if cache == "none" and not no_cache_forward_is_exact(model.config):
        kwargs.update(cache_kwargs(make_cache("dynamic", model)))  # see builders.no_cache_logits
    elif cache == "none":
        kwargs["use_cache"] = False
    elif isinstance(cache, str):
        kwargs.update(cache_kwargs(make_cache(cache, model)))
    else:
        kwargs.update(cache_kwargs(cache))
    if with_logits:
        kwargs.update(return_dict_in_generate=True, output_logits=True)
    out = model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=PAD, **kwargs)
    sequences = out.sequences if with_logits else out
    assert sequences.shape[-1] == inputs["input_ids"].shape[-1] + new_tokens, "generation stopped early"
    return (sequences, torch.stack(out.logits, dim=1)) if with_logits else sequences


def assert_same(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: shapes {tuple(actual.shape)} != {tuple(expected.shape)}"
    if not torch.equal(actual, expected):
        diff = (actual != expected).nonzero()
        row, col = diff[0].tolist()
        raise AssertionError(
            f"{what}: first difference at row {row}, position {col}:\n{actual[row].tolist()}\n{expected[row].tolist()}"
        )


def ring_layers(cache: HybridRingCache) -> list[RingSlidingLayer]:
    return [layer for layer in cache.layers if isinstance(layer, RingSlidingLayer)]


BATCHES = {"single": prompt, "left_padded": padded_prompts}


# --- 1. greedy -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("batch", list(BATCHES))
def test_greedy(model_name, batch):
    model, inputs = get_model(model_name), BATCHES[batch]()
    ring, ring_logits = generate(model, inputs, "ring", do_sample=False, with_logits=True)
    for oracle in ("dynamic", "none"):
        expected, expected_logits = generate(model, inputs, oracle, do_sample=False, with_logits=True)
        assert_same(ring, expected, f"ring vs {oracle}")
        # Tokens of tiny random models are robust to small errors: also hold every step's raw logits to fp32 noise
        # (a ring mask that ignored the padding shifts them by ~1e-2 and would leave gemma3's tokens unchanged).
        torch.testing.assert_close(ring_logits, expected_logits, rtol=0, atol=1e-5, msg=f"logits: ring vs {oracle}")


def test_greedy_ring_really_wrapped(model_name):
    """Sanity: the scenario above exercises the wrapped ring (the ring holds `window` slots, not the sequence)."""
    model, inputs = get_model(model_name), prompt()
    cache = HybridRingCache(model.config)
    out = generate(model, inputs, cache, do_sample=False)
    assert cache.get_seq_length() == out.shape[-1] - 1
    assert all(layer.capacity == WINDOW for layer in ring_layers(cache))
    assert cache.get_seq_length() > 5 * WINDOW


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize(
    "kwargs", [{"do_sample": False}, {"num_beams": 3, "do_sample": False}], ids=["greedy", "beams3"]
)
def test_fixed_capacity_generate(model_name, batch, kwargs):
    """`max_cache_len` (the compileable mode): generate builds its masks ahead of the forward for such caches;
    results still equal DynamicCache and the no-cache oracle, and the rings keep `window` slots."""
    model, inputs = get_model(model_name), BATCHES[batch]()
    cache = HybridRingCache(model.config, max_cache_len=64)
    assert cache.is_compileable
    ring = generate(model, inputs, cache, new_tokens=20, **kwargs)
    assert_same(ring, generate(model, inputs, "dynamic", new_tokens=20, **kwargs), "fixed ring vs DynamicCache")
    assert_same(ring, generate(model, inputs, "none", new_tokens=20, **kwargs), "fixed ring vs no-cache oracle")
    assert all(layer.capacity == WINDOW for layer in ring_layers(cache))


# --- 2. seeded sampling ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("batch", list(BATCHES))
def test_sampling(model_name, batch):
    model, inputs = get_model(model_name), BATCHES[batch]()
    kwargs = {"do_sample": True, "top_k": 20, "temperature": 0.8}
    ring = generate(model, inputs, "ring", seed=1234, **kwargs)
    assert_same(ring, generate(model, inputs, "dynamic", seed=1234, **kwargs), "ring vs DynamicCache")
    assert_same(ring, generate(model, inputs, "none", seed=1234, **kwargs), "ring vs no-cache oracle")
    # The seed matters (so the comparison above is not vacuous).
    assert not torch.equal(ring, generate(model, inputs, "ring", seed=4321, **kwargs))


# --- 3. beam search / num_return_sequences ---------------------------------------------------------------------------
BEAM_CASES = {
    "beams3": ("single", {"num_beams": 3, "do_sample": False}),
    "beams3_return2": ("single", {"num_beams": 3, "num_return_sequences": 2, "do_sample": False}),
    "beams3_left_padded": ("left_padded", {"num_beams": 3, "do_sample": False}),
    "sample_return3": ("single", {"do_sample": True, "top_k": 20, "num_return_sequences": 3}),
}


@pytest.mark.parametrize("case", list(BEAM_CASES))
def test_beams_and_return_sequences(model_name, case):
    batch, kwargs = BEAM_CASES[case]
    model, inputs = get_model(model_name), BATCHES[batch]()
    ring = generate(model, inputs, "ring", new_tokens=20, seed=99, **kwargs)
    expected_rows = inputs["input_ids"].shape[0] * kwargs.get("num_return_sequences", 1)
    assert ring.shape[0] == expected_rows
    assert_same(ring, generate(model, inputs, "dynamic", new_tokens=20, seed=99, **kwargs), "ring vs DynamicCache")
    assert_same(ring, generate(model, inputs, "none", new_tokens=20, seed=99, **kwargs), "ring vs no-cache oracle")


# --- 4. assisted decoding / prompt lookup ----------------------------------------------------------------------------
SPECULATIVE_CASES = {
    "assistant": (prompt, lambda: {"assistant_model": get_assistant()}),
    "prompt_lookup": (repetitive_prompt, lambda: {"prompt_lookup_num_tokens": 3}),
}


def speculative(model, inputs, cache, **kwargs):
    """`generate(model, inputs, cache, **kwargs)` with assisted / prompt-lookup decoding, or `None` where the installed
    release refuses it as documented in `hybrid_cache.compat.rollback_supported` (asserting the error names the release
    that supports it): 5.14-5.17 always, earlier releases when a rollback exceeds the ring's `rollback_margin`."""
    if rollback_supported():
        return generate(model, inputs, cache, **kwargs)
    if TRANSFORMERS_VERSION >= PAST_RECORDING_SINCE:
        with pytest.raises(UnsupportedReleaseError, match=str(ROLLBACK_SINCE)):
            generate(model, inputs, cache, **kwargs)
        return None
    try:
        return generate(model, inputs, cache, **kwargs)
    except RollbackError as error:
        assert str(ROLLBACK_SINCE) in str(error) and "rollback_margin" in str(error)
        return None


def dynamic_cache_can_speculate() -> bool:
    """DynamicCache's own sliding layers refuse crops past the window before 5.15: no reference there."""
    return TRANSFORMERS_VERSION >= DYNAMIC_SLIDING_CROP_SINCE


@pytest.mark.parametrize("rollback_margin", [0, 4], ids=["margin0", "margin4"])
@pytest.mark.parametrize("method", list(SPECULATIVE_CASES))
def test_speculative_greedy(model_name, method, rollback_margin):
    make_inputs, make_kwargs = SPECULATIVE_CASES[method]
    model, inputs = get_model(model_name), make_inputs()
    kwargs = {"do_sample": False, **make_kwargs()}
    cache = HybridRingCache(model.config, rollback_margin=rollback_margin)
    ring = speculative(model, inputs, cache, **kwargs)
    if ring is None:
        assert rollback_margin == 0 or TRANSFORMERS_VERSION >= PAST_RECORDING_SINCE  # margin 4 >= 3-4 draft tokens
        return
    if dynamic_cache_can_speculate():
        assert_same(ring, generate(model, inputs, "dynamic", **kwargs), "ring vs DynamicCache")
    # Speculative greedy decoding must give plain greedy decoding's tokens.
    assert_same(ring, generate(model, inputs, "none", do_sample=False), "ring vs no-cache greedy oracle")
    assert cache.get_seq_length() == ring.shape[-1] - 1
    # Past recording undoes a verification step from the copy of the window that step makes anyway: the rings keep
    # exactly window + rollback_margin slots during speculative decoding (no growth, no lost memory saving).
    for layer in ring_layers(cache):
        assert layer.capacity == WINDOW + rollback_margin


@pytest.mark.parametrize("method", list(SPECULATIVE_CASES))
def test_speculative_fixed_capacity(model_name, method):
    """Speculative decoding with `max_cache_len` (static rings and full layers, masks prepared by generate)."""
    make_inputs, make_kwargs = SPECULATIVE_CASES[method]
    model, inputs = get_model(model_name), make_inputs()
    kwargs = {"do_sample": False, **make_kwargs()}
    ring = speculative(model, inputs, HybridRingCache(model.config, max_cache_len=96), **kwargs)
    if ring is not None:
        assert_same(ring, generate(model, inputs, "none", do_sample=False), "fixed ring vs no-cache greedy oracle")


def test_prompt_lookup_short_prompt_later_longer_candidates(model_name):
    """A 2-token prompt has no n-gram to look up: the first step has no candidate; later steps propose 4 tokens from
    the (repetitive) generated text, and rejecting them after the wrap must still be exact with margin 0. (Past
    recording is activated once per generate and must survive every crop, as in DynamicSlidingWindowLayer.)"""
    model, inputs = get_model(model_name), prompt(length=2, seed=2)
    kwargs = {"do_sample": False, "prompt_lookup_num_tokens": 4}
    expected = generate(model, inputs, "none", do_sample=False)
    if dynamic_cache_can_speculate():
        assert_same(generate(model, inputs, "dynamic", **kwargs), expected, "DynamicCache vs no-cache")
    if TRANSFORMERS_VERSION < PAST_RECORDING_SINCE:
        # These releases' prompt lookup may overshoot max_new_tokens by the last accepted draft (transformers' own
        # behaviour, whatever the cache): compare the tokens both runs have.
        try:
            ring = model.generate(
                **inputs,
                **cache_kwargs(HybridRingCache(model.config)),
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                pad_token_id=PAD,
                **kwargs,
            )
        except RollbackError as error:
            assert str(ROLLBACK_SINCE) in str(error)
            return
        assert_same(ring[:, : expected.shape[1]], expected, "ring vs no-cache")
        return
    ring = speculative(model, inputs, "ring", **kwargs)
    if ring is not None:
        assert_same(ring, expected, "ring vs no-cache")


# --- 5. multi-turn reuse of one cache, deepcopy of a prefix ----------------------------------------------------------
def two_turns(model, inputs, cache, user_tokens: torch.Tensor, **kwargs):
    first = generate(model, inputs, cache, new_tokens=12, **kwargs)
    follow_up = torch.cat([first, user_tokens.expand(first.shape[0], -1)], dim=-1)
    mask = torch.cat([inputs["attention_mask"], torch.ones_like(follow_up[:, inputs["input_ids"].shape[-1] :])], -1)
    turn2 = {"input_ids": follow_up, "attention_mask": mask}
    second = generate(model, turn2, cache, new_tokens=12, **kwargs)
    return first, turn2, second


@pytest.mark.parametrize("batch", list(BATCHES))
def test_multi_turn_same_cache(model_name, batch):
    model, inputs = get_model(model_name), BATCHES[batch]()
    user_tokens = tokens(8, seed=55)  # a new user turn longer than the window
    ring_cache = HybridRingCache(model.config)
    ring_first, turn2, ring_second = two_turns(model, inputs, ring_cache, user_tokens, do_sample=False)
    dyn_cache = DynamicCache(config=model.config)
    dyn_first, _, dyn_second = two_turns(model, inputs, dyn_cache, user_tokens, do_sample=False)
    assert_same(ring_first, dyn_first, "turn 1: ring vs DynamicCache")
    assert_same(ring_second, dyn_second, "turn 2 (same cache): ring vs DynamicCache")
    # Both caches really were reused: they hold the whole conversation (but its last token).
    assert ring_cache.get_seq_length() == dyn_cache.get_seq_length() == ring_second.shape[-1] - 1
    # The second turn equals a fresh run over the whole conversation, and the no-cache oracle.
    assert_same(ring_second, generate(model, turn2, "ring", new_tokens=12, do_sample=False), "turn 2 vs fresh ring")
    assert_same(ring_second, generate(model, turn2, "none", new_tokens=12, do_sample=False), "turn 2 vs no-cache")


@torch.no_grad()
def test_deepcopy_prefix_two_continuations(model_name):
    model = get_model(model_name)
    prefix = tokens(PROMPT_LEN, seed=3)
    prefix_cache = HybridRingCache(model.config)
    model(input_ids=prefix, **cache_kwargs(prefix_cache), use_cache=True)
    assert prefix_cache.get_seq_length() == PROMPT_LEN > WINDOW
    for seed in (41, 42):
        continuation = tokens(4, seed=seed)
        full = torch.cat([prefix, continuation], dim=-1)
        inputs = {"input_ids": full, "attention_mask": torch.ones_like(full)}
        from_copy = generate(model, inputs, copy.deepcopy(prefix_cache), do_sample=False)
        assert_same(from_copy, generate(model, inputs, "ring", do_sample=False), f"copy (seed {seed}) vs fresh ring")
        assert_same(from_copy, generate(model, inputs, "dynamic", do_sample=False), f"copy (seed {seed}) vs dynamic")
    # The original prefix cache was never touched by the continuations.
    assert prefix_cache.get_seq_length() == PROMPT_LEN


# --- 6. both spellings of the cache argument -------------------------------------------------------------------------
@pytest.mark.parametrize("spelling", ["past_key_values", "cache"])
def test_cache_argument_spelling(model_name, spelling):
    """`cache=` is transformers' current name (from 5.24); the deprecated `past_key_values=` still works (with its
    FutureWarning from 5.24; the only name before)."""
    if spelling != CACHE_KEYWORD and spelling == "cache":
        pytest.skip(f"transformers {transformers.__version__} reads no `cache=` (5.24 and later do)")
    model, inputs = get_model(model_name), prompt()
    cache = HybridRingCache(model.config)
    kwargs = {"max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS, "do_sample": False, "pad_token_id": PAD}
    with torch.no_grad():
        if spelling == "cache":
            out = model.generate(**inputs, **cache_kwargs(cache), **kwargs)
        else:
            deprecated = CACHE_KEYWORD == "cache"
            with pytest.warns(FutureWarning, match="past_key_values") if deprecated else contextlib.nullcontext():
                out = model.generate(**inputs, past_key_values=cache, **kwargs)
    assert cache.get_seq_length() == out.shape[-1] - 1, "the cache passed in was not the one used"
    assert_same(out, generate(model, inputs, "dynamic", do_sample=False), "ring vs DynamicCache")
