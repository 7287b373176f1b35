"""Bounded full layers (`full_layer_window` + `full_layer_sink_tokens`): approximate by design, so the oracle is a
no-cache forward with the documented visibility written out as explicit masks.

Documented semantics (hybrid_cache/streaming.py): a query at position `q` of a step starting at `L` sees, in full
layers, the sinks `[0, S)` and the positions `[L - R + 1, q]`; sliding layers are unchanged. The oracle passes a dict
of 4D boolean masks (one per layer type) to the model's no-cache forward, which transformers uses as given.
"""

from __future__ import annotations

import pytest
import torch
from builders import (
    MODEL_BUILDERS,
    VOCAB,
    chunked_logits,
    generate_case_params,
    get_model,
    needs_exact_rollback,
    no_cache_logits,
    random_schedule,
    reference_cache_kwargs,
    seeded_chunk_sizes,
)

from hybrid_cache import HybridRingCache, RollbackError
from hybrid_cache.compat import cache_kwargs
from hybrid_cache.streaming import SinkWindowFullLayer

WINDOW = 6  # sliding window of the tiny models


pytestmark = pytest.mark.usefixtures("one_thread")


@torch.no_grad()
def bounded_oracle_logits(model, ids: torch.Tensor, schedule: list[int], sinks: int, window: int) -> torch.Tensor:
    length = ids.shape[1]
    chunk_start = torch.cat([torch.full((size,), sum(schedule[:i])) for i, size in enumerate(schedule)])
    q, k = torch.arange(length)[:, None], torch.arange(length)[None, :]
    causal = k <= q
    full = causal & ((k < sinks) | (k >= chunk_start[:, None] - window + 1))
    sliding = causal & (k > q - WINDOW)
    batch = ids.shape[0]
    masks = {
        "full_attention": full.expand(batch, 1, length, length),
        "sliding_attention": sliding.expand(batch, 1, length, length),
    }
    return model(input_ids=ids, attention_mask=masks, **reference_cache_kwargs(model)).logits


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(
    ("sinks", "window"), [(0, 3), (2, 5), (4, 9), (1, 1)], ids=["S0-R3", "S2-R5", "S4-R9", "S1-R1"]
)
def test_chunked_logits_equal_the_masked_oracle(model_name, sinks, window, seed):
    model = get_model(model_name)
    ids = torch.randint(3, VOCAB, (2, 44), generator=torch.Generator().manual_seed(seed))
    schedule = random_schedule(ids.shape[1], seeded_chunk_sizes(seed, one_token_share=0.6, high=12))
    cache = HybridRingCache(model.config, full_layer_sink_tokens=sinks, full_layer_window=window)
    actual = chunked_logits(model, cache, ids, schedule)
    expected = bounded_oracle_logits(model, ids, schedule, sinks, window)
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-4)
    for layer in cache.layers:
        if isinstance(layer, SinkWindowFullLayer):
            assert layer.capacity == sinks + window  # bounded, whatever the stream length


def test_exact_while_the_stream_fits_the_budget(model_name):
    model = get_model(model_name)
    ids = torch.randint(3, VOCAB, (1, 20), generator=torch.Generator().manual_seed(0))
    cache = HybridRingCache(model.config, full_layer_sink_tokens=4, full_layer_window=16)
    actual = chunked_logits(model, cache, ids, [7, 1, 1, 5, 1, 5])
    torch.testing.assert_close(actual, no_cache_logits(model, ids), rtol=0, atol=1e-4)


def test_slot_contents_and_layout():
    """S=2, R=3, margin 1 (4 ring slots; head size 1, positions as values): prefill [0..4] -> slots [0,1,2,3,4,_];
    decode 5 -> [0,1,2,3,4,5], layout [0,1,-1,3,4,5] (2 is held but outside query 5's window [3, 5]);
    decode 6 -> [0,1,6,3,4,5], layout [0,1,6,-1,4,5]; a 3-token step at 7 sees sinks, [5, 6] and itself."""
    layer = SinkWindowFullLayer(2, 3, rollback_margin=1)

    def tokens(*positions):
        return torch.tensor(positions, dtype=torch.float32).view(1, 1, -1, 1)

    assert layer.get_mask_sizes(5) == (5, 0)
    keys, _ = layer.update(tokens(0, 1, 2, 3, 4), tokens(0, 1, 2, 3, 4))
    assert keys.flatten().tolist() == [0, 1, 2, 3, 4]
    length, layout = layer.get_mask_sizes(1)
    assert length == 6 and layout.positions.tolist() == [0, 1, -1, 3, 4, 5]
    keys, _ = layer.update(tokens(5), tokens(5))
    assert keys.flatten().tolist() == [0, 1, 2, 3, 4, 5]
    _, layout = layer.get_mask_sizes(1)
    assert layout.positions.tolist() == [0, 1, 6, -1, 4, 5]
    keys, _ = layer.update(tokens(6), tokens(6))
    assert keys.flatten().tolist() == [0, 1, 6, 3, 4, 5]
    length, layout = layer.get_mask_sizes(3)
    assert length == 9 and layout.positions.tolist() == [0, 1, 6, -1, -1, 5, 7, 8, 9]
    keys, _ = layer.update(tokens(7, 8, 9), tokens(7, 8, 9))
    assert keys.flatten().tolist() == [0, 1, 6, 3, 4, 5, 7, 8, 9]
    assert layer.keys.flatten().tolist() == [0, 1, 6, 7, 8, 9]
    layer.crop(-2)  # margin 1: two tokens can be undone; the next query (7+1) needs [6, 7], still held
    assert layer.get_mask_sizes(1)[1].positions.tolist() == [0, 1, 6, 7, 8, -1]


@pytest.mark.parametrize("margin", [0, 3])
@needs_exact_rollback
def test_crop_is_exact_or_raises(model_name, margin):
    """Rolling back `n` tokens equals never having fed them: within the margin, or by undoing the last recorded
    multi-token step (assisted decoding); anything else raises and leaves the cache unchanged."""
    model = get_model(model_name)
    ids = torch.randint(3, VOCAB, (1, 40), generator=torch.Generator().manual_seed(1))
    kwargs = dict(full_layer_sink_tokens=2, full_layer_window=5, rollback_margin=margin)
    # Undo a 6-token speculative step, keeping 2 of its tokens, then continue.
    cache = HybridRingCache(model.config, **kwargs)
    cache.activate_past_recording()
    position = 0
    for size in [20, 1, 1, 1, 1]:  # as assisted decoding drives it: every forward is followed by a crop
        chunked_logits(model, cache, ids[:, : position + size], [size], start=position)
        cache.crop(0)
        position += size
    chunked_logits(model, cache, ids[:, :30], [6], start=24)
    cache.crop(-4)
    after = chunked_logits(model, cache, ids[:, 26:], [1] * 14)
    reference = HybridRingCache(model.config, **kwargs)
    chunked_logits(model, reference, ids[:, :26], [20, 1, 1, 1, 1, 2])
    expected = chunked_logits(model, reference, ids[:, 26:], [1] * 14)
    torch.testing.assert_close(after, expected, rtol=0, atol=1e-5)
    # Decode steps: margin + 1 tokens can be undone; more raises (atomically).
    cache = HybridRingCache(model.config, **kwargs)
    chunked_logits(model, cache, ids[:, :30], [20] + [1] * 10)
    cache.crop(-(margin + 1))
    assert cache.get_seq_length() == 29 - margin
    if margin == 0:
        with pytest.raises(RollbackError, match="rollback_margin"):
            cache.crop(-3)
        assert cache.get_seq_length() == 29 - margin


GENERATE_CASES = {
    "greedy": {"do_sample": False},
    "sampling": {"do_sample": True, "top_k": 20},
    "beams3": {"num_beams": 3, "do_sample": False},
    "sample_return2": {"do_sample": True, "num_return_sequences": 2},
    "prompt_lookup": {"do_sample": False, "prompt_lookup_num_tokens": 3},
    "assisted": {"do_sample": False, "assistant": True},
}


@pytest.mark.parametrize("case", generate_case_params(GENERATE_CASES))
def test_generate_modes_run_and_stay_bounded(case):
    model = get_model("gemma3")
    kwargs = dict(GENERATE_CASES[case])
    if kwargs.pop("assistant", False):
        kwargs["assistant_model"] = MODEL_BUILDERS["gemma3"](window=WINDOW, layers=2, seed=7)
    pattern = [5, 17, 29, 41, 53, 65, 77]
    ids = torch.tensor([pattern * 3])
    cache = HybridRingCache(model.config, full_layer_sink_tokens=2, full_layer_window=8)
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            **cache_kwargs(cache),
            max_new_tokens=25,
            min_new_tokens=25,
            pad_token_id=0,
            **kwargs,
        )
    assert out.shape[-1] == ids.shape[1] + 25
    assert all(layer.capacity == 10 for layer in cache.layers if isinstance(layer, SinkWindowFullLayer))


def test_greedy_generate_equals_the_masked_oracle():
    """generate = a prompt step then one-token steps: its tokens follow the oracle with that schedule."""
    model = get_model("gemma3")
    ids = torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(2))
    cache = HybridRingCache(model.config, full_layer_sink_tokens=2, full_layer_window=5)
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            **cache_kwargs(cache),
            max_new_tokens=20,
            min_new_tokens=20,
            do_sample=False,
            pad_token_id=0,
        )
    schedule = [ids.shape[1]] + [1] * 19
    oracle = bounded_oracle_logits(model, out[:, :-1], schedule, 2, 5)
    assert torch.equal(oracle[:, ids.shape[1] - 1 :].argmax(-1), out[:, ids.shape[1] :])
