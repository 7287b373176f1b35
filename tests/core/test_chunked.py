"""Chunked attention (Llama 4's `chunked_attention` layers) in a ring of `attention_chunk_size` slots.

A query sees the keys of its own chunk only, each within the last `attention_chunk_size` positions, so a chunked
layer is a ring of that many slots; the mask hook evaluates the model's own chunked mask (its chunk boundaries, shifted
by each row's left padding) at the ring's positions. Properties over random chunk sizes, schedules (prompts and steps
shorter and longer than a chunk, boundaries inside a step, decode across many chunks) and left padding:

- every step's logits equal the no-cache forward (`builders.TOLERANCE`); `generate` (greedy, beams, prompt lookup,
  a second turn) gives `DynamicCache`'s tokens;
- the K/V bytes held (storages alive) never pass `DynamicCache`'s plus the full layers' growth room, at every step:
  a ring holds `C` slots, and `DynamicCache` keeps a `C`-token storage alive per chunked layer (its `C - 1` tokens
  are a view of the step's `cat`); the full layers grow at most 1/64 above their tokens;
- compile's fixed mode, checkpoint / restore, save / load and crop continue exactly; `memory_report` names the
  chunked layers.

Chunks of 1 are left out: transformers' own chunked mask is wrong there (`DynamicCache` fails with a shape error).
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch
from builders import (
    LLAMA4_IMAGE_TOKEN,
    VOCAB,
    assert_matches_oracle,
    needs_exact_rollback,
    no_cache_logits,
    one_torch_thread,
    random_padded_batch,
    tiny_llama4,
    tiny_llama4_multimodal,
    tokens,
)
from transformers import DynamicCache

from hybrid_cache import HybridRingCache, cache_kwargs
from hybrid_cache.full import GrowableFullLayer
from hybrid_cache.storage import GROWTH_FACTOR
from hybrid_cache.tools.compare import kv_bytes_held


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    with one_torch_thread(), torch.no_grad():
        yield


def growth_room(cache: HybridRingCache) -> int:
    """Bytes the full layers hold above their tokens (their amortized growth: at most 1/64)."""
    room = 0
    for layer in cache.layers:
        if isinstance(layer, GrowableFullLayer) and layer.is_initialized:
            per_slot = layer.keys[:, :, :1].nbytes + layer.values[:, :, :1].nbytes
            room += (layer.capacity - int(layer.cumulative_length)) * per_slot
    return room


def schedule(rng: random.Random, chunk: int, total: int) -> list[int]:
    steps = []
    while sum(steps) < total:
        steps.append(rng.choice([1, 1, 1, chunk - 1, chunk, chunk + 1, 2 * chunk + 1, 3]))
    steps[-1] -= sum(steps) - total
    return [step for step in steps if step > 0]


@pytest.mark.parametrize("seed", range(8))
def test_every_step_is_exact_and_holds_no_more_than_dynamic_cache(seed):
    rng = random.Random(seed)
    chunk = rng.choice([2, 3, 4, 5, 8])
    model = tiny_llama4(chunk=chunk, seed=seed, attn=rng.choice(["sdpa", "eager"]))
    batch = rng.choice([1, 1, 2, 3])
    inputs = random_padded_batch(rng, batch, rng.randint(2 * chunk + 2, 8 * chunk + 6), chunk)
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    expected = no_cache_logits(model, ids, mask)
    ring, dynamic = HybridRingCache(model.config), DynamicCache(config=model.config)
    start = 0
    for count in schedule(rng, chunk, ids.shape[1]):
        step = {"input_ids": ids[:, start : start + count], "attention_mask": mask[:, : start + count]}
        got = model(**step, **cache_kwargs(ring), use_cache=True).logits
        model(**step, **cache_kwargs(dynamic), use_cache=True)
        label = f"chunk {chunk}, batch {batch}, step of {count} at {start}"
        assert_matches_oracle(got, expected[:, start : start + count], mask[:, start : start + count], label)
        assert kv_bytes_held(ring) <= kv_bytes_held(dynamic) + growth_room(ring), label
        start += count
    # Past a few chunks the whole is within 2% of DynamicCache's (the full layer dominates).
    if start >= 16 * chunk:
        assert kv_bytes_held(ring) <= 1.02 * kv_bytes_held(dynamic) + growth_room(ring)


def test_chunked_layers_hold_their_chunk_and_the_report_names_them():
    chunk = 8
    model = tiny_llama4(chunk=chunk)
    cache = HybridRingCache(model.config)
    model(input_ids=tokens(100), **cache_kwargs(cache), use_cache=True)
    for _ in range(20):
        model(input_ids=tokens(1, seed=_), **cache_kwargs(cache), use_cache=True)
    kinds = cache.layer_kinds
    assert kinds == ["chunked_attention"] * 3 + ["full_attention"]
    assert [layer.capacity for layer in cache.layers[:3]] == [chunk] * 3
    assert cache.layers[3].capacity <= 120 * GROWTH_FACTOR + 1
    report = cache.memory_report()
    assert report.slots_by_type["chunked_attention"] == [chunk] * 3
    assert "chunked_attention" in str(report)


@pytest.mark.parametrize(
    "case", ["greedy", "beams", pytest.param("prompt_lookup", marks=needs_exact_rollback), "second_turn"]
)
def test_generate_gives_dynamic_cache_tokens(case):
    chunk = 4
    model = tiny_llama4(chunk=chunk, seed=1)
    batch = 2 if case != "prompt_lookup" else 1
    inputs = random_padded_batch(random.Random(3), batch, 3 * chunk + 3, chunk)
    if case == "prompt_lookup":  # repeated n-grams, so that drafts get accepted and rejected across chunks
        inputs = {"input_ids": tokens(6, seed=5).repeat(1, 3), "attention_mask": torch.ones(1, 18, dtype=torch.long)}
    options = {"max_new_tokens": 3 * chunk + 1, "do_sample": False, "pad_token_id": 0}
    options.update({"beams": {"num_beams": 2}, "prompt_lookup": {"prompt_lookup_num_tokens": 3}}.get(case, {}))

    def run(cache):
        out = model.generate(**inputs, **cache_kwargs(cache), **options)
        if case != "second_turn":
            return out
        follow = torch.cat([out, tokens(chunk + 1, batch, seed=9)], dim=1)
        mask = torch.cat([inputs["attention_mask"], torch.ones_like(follow[:, inputs["input_ids"].shape[1] :])], 1)
        return model.generate(input_ids=follow, attention_mask=mask, **cache_kwargs(cache), **options)

    assert torch.equal(run(HybridRingCache(model.config)), run(DynamicCache(config=model.config)))


def test_compiled_fixed_mode_decodes_exactly():
    chunk = 4
    model = tiny_llama4(chunk=chunk, seed=2)
    ids = tokens(5 * chunk + 3, seed=4)
    expected = no_cache_logits(model, ids)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager", dynamic=False)
    cache = HybridRingCache(model.config, max_cache_len=ids.shape[1])
    compiled(input_ids=ids[:, : 2 * chunk + 1], **cache_kwargs(cache), use_cache=True)
    for position in range(2 * chunk + 1, ids.shape[1]):
        got = compiled(input_ids=ids[:, position : position + 1], **cache_kwargs(cache), use_cache=True).logits
        assert (got[:, -1] - expected[:, position]).abs().max().item() <= 1e-4, position


def test_checkpoint_save_load_and_crop_continue_exactly(tmp_path):
    chunk = 4
    model = tiny_llama4(chunk=chunk, seed=3)
    ids = tokens(6 * chunk, seed=6)
    expected = no_cache_logits(model, ids)
    cache = HybridRingCache(model.config)
    model(input_ids=ids[:, : 3 * chunk + 1], **cache_kwargs(cache), use_cache=True)
    checkpoint = cache.checkpoint()
    cache.save(tmp_path / "chunked.safetensors")
    model(input_ids=ids[:, 3 * chunk + 1 : 4 * chunk + 2], **cache_kwargs(cache), use_cache=True)
    cache.crop(-1)  # back by one token: the ring still holds the chunk
    for held in (cache, HybridRingCache.load(tmp_path / "chunked.safetensors", model.config)):
        if held is not cache:
            start = 3 * chunk + 1
        else:
            start = 4 * chunk + 1
        got = model(input_ids=ids[:, start:], **cache_kwargs(held), use_cache=True).logits
        assert (got - expected[:, start:]).abs().max().item() <= 1e-4
    cache.restore(checkpoint)
    got = model(input_ids=ids[:, 3 * chunk + 1 :], **cache_kwargs(cache), use_cache=True).logits
    assert (got - expected[:, 3 * chunk + 1 :]).abs().max().item() <= 1e-4


def test_a_config_without_a_chunk_size_is_refused():
    model = tiny_llama4(chunk=4)
    config = model.config
    config.attention_chunk_size = None
    with pytest.raises(ValueError, match="attention_chunk_size"):
        HybridRingCache(config)
    assert VOCAB == config.vocab_size


@pytest.mark.parametrize("image_at", [1, 6])
def test_multimodal_llama4_with_an_image_across_a_chunk_boundary(image_at):
    """`Llama4ForConditionalGeneration` with a 4-token image at position `image_at` (chunks of 4: across a boundary at
    6): the prompt, then decode steps, against the no-cache forward; `generate` gives `DynamicCache`'s tokens."""
    model = tiny_llama4_multimodal(chunk=4)
    ids = tokens(20, seed=11)
    ids[0, image_at : image_at + 4] = LLAMA4_IMAGE_TOKEN
    pixel_values = torch.randn(1, 3, 56, 56, generator=torch.Generator().manual_seed(0))
    expected = model(input_ids=ids, pixel_values=pixel_values, use_cache=False).logits
    cache = HybridRingCache(model.config)
    got = model(input_ids=ids[:, :12], pixel_values=pixel_values, **cache_kwargs(cache), use_cache=True).logits
    assert (got - expected[:, :12]).abs().max().item() <= 1e-4
    for position in range(12, 20):
        got = model(input_ids=ids[:, position : position + 1], **cache_kwargs(cache), use_cache=True).logits
        assert (got[:, -1] - expected[:, position]).abs().max().item() <= 1e-4, position
    options = {"pixel_values": pixel_values, "max_new_tokens": 9, "do_sample": False, "pad_token_id": 0}
    ring = model.generate(input_ids=ids[:, :12], **cache_kwargs(HybridRingCache(model.config)), **options)
    dynamic = model.generate(input_ids=ids[:, :12], **cache_kwargs(DynamicCache(config=model.config)), **options)
    assert torch.equal(ring, dynamic)
