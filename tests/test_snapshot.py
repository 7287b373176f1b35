"""Persistence and snapshots: `save` / `load` (one safetensors file) and `checkpoint` / `restore`.

The oracles, written first: (1) the uninterrupted run of the same cache with the same chunk schedule — a loaded or
restored cache must give bit-identical logits (every dtype) and the same `generate` tokens; (2) the no-cache forward
over the whole sequence (fp32, 1e-4 on real tokens). Property style: seeded random windows, rollback margins,
fixed capacity (`max_cache_len`), batch sizes, left paddings (longer than the window too), split points before and
after the first wrap, chunk schedules and dtypes, on tiny Gemma 3 and Gemma 4 (KV-shared layers, per-type head sizes
and KV heads). Then the error cases: a failed call leaves the cache (and the file system) as it was.
"""

from __future__ import annotations

import copy
import functools
import gc
import json
import os
import random
import struct
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
from conftest import MODEL_BUILDERS, VOCAB, chunked_logits, no_cache_logits, tiny_gemma3, tiny_gemma4
from safetensors import safe_open
from safetensors.torch import save_file
from test_oracle import assert_matches_oracle, left_padded_batch, random_schedule

from hybrid_cache import CacheCheckpoint, HybridRingCache, RollbackError, read_metadata
from hybrid_cache.snapshot import RESERVED_PREFIX

SEEDS = int(os.environ.get("HYBRID_CACHE_SNAPSHOT_SEEDS", "12"))
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@functools.cache
def get_model(name: str, window: int, dtype: torch.dtype = torch.float32):
    return MODEL_BUILDERS[name](window=window).to(dtype)


def held_state(cache: HybridRingCache, capacities: bool = True) -> list:
    """What a cache holds, per layer: length, oldest position, capacity (unless `capacities=False`: a restored full
    layer keeps the capacity it grew to) and the K/V content of the slots that hold tokens."""
    state = []
    for layer in cache.layers:
        if not hasattr(layer, "cumulative_length") or not layer.is_initialized:  # KV-shared, or never used
            state.append(None)
            continue
        length = int(layer.cumulative_length)
        oldest = int(getattr(layer, "_oldest", 0))
        ring = hasattr(layer, "max_slots")
        slots = length if oldest == 0 and (not ring or length <= layer.max_slots) else layer.max_slots
        capacity = layer.capacity if capacities or ring else None
        state.append((length, oldest, capacity, layer.keys[:, :, :slots].clone(), layer.values[:, :, :slots].clone()))
    return state


def assert_same_state(got: list, expected: list) -> None:
    assert len(got) == len(expected)
    for index, (a, b) in enumerate(zip(got, expected)):
        assert (a is None) == (b is None), index
        if a is not None:
            assert a[:3] == b[:3], (index, a[:3], b[:3])
            assert torch.equal(a[3], b[3]) and torch.equal(a[4], b[4]), f"layer {index} content differs"


def continue_logits(model, cache, input_ids, attention_mask, start, schedule):
    """Feed `input_ids[:, start:]` in chunks of `schedule` into `cache` (which holds the first `start` tokens)."""
    outputs, position = [], start
    with torch.no_grad():
        for size in schedule:
            chunk = input_ids[:, position : position + size]
            mask = attention_mask[:, : position + size]
            outputs.append(model(input_ids=chunk, attention_mask=mask, cache=cache, use_cache=True).logits)
            position += size
    assert position == input_ids.shape[1]
    return torch.cat(outputs, dim=1)


# --- the property test: save/load and checkpoint/restore continue exactly ------------------------------------------
@pytest.mark.parametrize("seed", range(SEEDS), ids=lambda s: f"seed{s}")
def test_save_load_and_restore_continue_exactly(model_name, seed, tmp_path):
    rng = random.Random(f"snapshot-{model_name}-{seed}")
    window = rng.choice([3, 4, 6])
    dtype = torch.bfloat16 if seed % 4 == 3 else torch.float32
    model = get_model(model_name, window, dtype)
    prefix = rng.choice([rng.randint(1, window - 1), rng.randint(window, 4 * window)])  # before / after the wrap
    total = prefix + rng.randint(1, 3 * window)
    input_ids, attention_mask = left_padded_batch(rng, rng.randint(1, 3), total, window)
    other_ids = input_ids.clone()
    other_ids[:, prefix:] = torch.randint(3, VOCAB, (input_ids.shape[0], total - prefix))
    kwargs = {"rollback_margin": rng.choice([0, 0, 1, 3])}
    if rng.random() < 0.35:
        kwargs["max_cache_len"] = total + rng.randint(0, 3)
    prefix_schedule = random_schedule(rng, prefix, window)
    schedule = random_schedule(rng, total - prefix, window)
    label = f"W={window} {dtype} prefix={prefix_schedule} continuation={schedule} {kwargs}"

    cache = HybridRingCache(model.config, **kwargs)
    with torch.no_grad():
        chunked_logits(model, cache, input_ids[:, :prefix], prefix_schedule, attention_mask[:, :prefix])
    saved_state, saved_memory = held_state(cache), cache.memory_report()
    saved_without_capacity = held_state(cache, capacities=False)
    path = tmp_path / "prefix.safetensors"
    cache.save(path, metadata={"label": label})
    checkpoint = cache.checkpoint()

    uninterrupted = continue_logits(model, cache, input_ids, attention_mask, prefix, schedule)

    loaded = HybridRingCache.load(path, model.config)
    assert_same_state(held_state(loaded), saved_state)  # bit-identical tensors, same counters and capacities
    assert loaded.memory_report().total_bytes == saved_memory.total_bytes
    assert torch.equal(continue_logits(model, loaded, input_ids, attention_mask, prefix, schedule), uninterrupted), label

    cache.restore(checkpoint)
    assert_same_state(held_state(cache, capacities=False), saved_without_capacity)
    assert torch.equal(continue_logits(model, cache, input_ids, attention_mask, prefix, schedule), uninterrupted), label

    # A second branch from the same checkpoint equals computing prefix + that branch from scratch.
    cache.restore(checkpoint)
    branch = continue_logits(model, cache, other_ids, attention_mask, prefix, schedule)
    scratch = HybridRingCache(model.config, **kwargs)
    with torch.no_grad():
        chunked_logits(model, scratch, other_ids[:, :prefix], prefix_schedule, attention_mask[:, :prefix])
    assert torch.equal(continue_logits(model, scratch, other_ids, attention_mask, prefix, schedule), branch), label

    if dtype == torch.float32:
        expected = no_cache_logits(model, input_ids, attention_mask)[:, prefix:]
        assert_matches_oracle(uninterrupted, expected, attention_mask[:, prefix:], label)
        expected = no_cache_logits(model, other_ids, attention_mask)[:, prefix:]
        assert_matches_oracle(branch, expected, attention_mask[:, prefix:], label)
