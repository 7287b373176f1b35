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
from builders import (
    MODEL_BUILDERS,
    VOCAB,
    assert_matches_oracle,
    chunked_logits,
    get_model,
    needs_exact_rollback,
    no_cache_logits,
    oracle_chunk_sizes,
    random_padded_batch,
    random_schedule,
    reference_cache_kwargs,
    tiny_gemma4,
)
from safetensors import safe_open
from safetensors.torch import save_file

from hybrid_cache import CacheCheckpoint, HybridRingCache, RollbackError
from hybrid_cache.compat import cache_kwargs
from hybrid_cache.snapshot import RESERVED_PREFIX, read_metadata

SEEDS = int(os.environ.get("HYBRID_CACHE_SNAPSHOT_SEEDS", "12"))
REPO = Path(__file__).resolve().parents[2]


pytestmark = pytest.mark.usefixtures("one_thread")


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
            outputs.append(model(input_ids=chunk, attention_mask=mask, **cache_kwargs(cache), use_cache=True).logits)
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
    padded = random_padded_batch(rng, rng.randint(1, 3), total, window)
    input_ids, attention_mask = padded["input_ids"], padded["attention_mask"]
    other_ids = input_ids.clone()
    other_ids[:, prefix:] = torch.randint(3, VOCAB, (input_ids.shape[0], total - prefix))
    kwargs = {"rollback_margin": rng.choice([0, 0, 1, 3])}
    if rng.random() < 0.35:
        kwargs["max_cache_len"] = total + rng.randint(0, 3)
    prefix_schedule = random_schedule(prefix, lambda: rng.choice(oracle_chunk_sizes(window)))
    schedule = random_schedule(total - prefix, lambda: rng.choice(oracle_chunk_sizes(window)))
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
    # The same K/V bytes; the saved cache's last-step record (`ring.SlotUndo`) is not part of its state.
    assert loaded.memory_report().kv_bytes == saved_memory.kv_bytes
    assert loaded.memory_report().extra_bytes <= saved_memory.extra_bytes
    got = continue_logits(model, loaded, input_ids, attention_mask, prefix, schedule)
    assert torch.equal(got, uninterrupted), label

    cache.restore(checkpoint)
    assert_same_state(held_state(cache, capacities=False), saved_without_capacity)
    got = continue_logits(model, cache, input_ids, attention_mask, prefix, schedule)
    assert torch.equal(got, uninterrupted), label

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


# --- generate from a loaded / restored cache ------------------------------------------------------------------------
WINDOW = 6


def generate(model, input_ids, attention_mask, cache, new_tokens=12):
    out = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        **cache_kwargs(cache),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
    )
    assert out.shape[1] == input_ids.shape[1] + new_tokens
    return out


@pytest.mark.parametrize("prefix", [4, 17], ids=["before-wrap", "after-wrap"])
def test_generate_from_loaded_and_restored_cache(model_name, prefix, tmp_path):
    """A batch with left padding longer than the window: prefix, then generate a question's answer three ways."""
    model = get_model(model_name, WINDOW)
    padded = random_padded_batch(random.Random(prefix), 3, prefix + 5, WINDOW)
    input_ids, attention_mask = padded["input_ids"], padded["attention_mask"]
    attention_mask[2, : min(prefix, WINDOW + 1)] = 0
    input_ids[2, : min(prefix, WINDOW + 1)] = 0
    cache = HybridRingCache(model.config)
    mask = attention_mask[:, :prefix]
    # The position ids `generate` gives a left-padded batch (it continues from them).
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    with torch.no_grad():
        model(input_ids=input_ids[:, :prefix], attention_mask=mask, position_ids=positions, **cache_kwargs(cache))
    cache.save(tmp_path / "p.safetensors")
    checkpoint = cache.checkpoint()

    uninterrupted = generate(model, input_ids, attention_mask, cache)
    loaded = generate(model, input_ids, attention_mask, HybridRingCache.load(tmp_path / "p.safetensors", model.config))
    cache.restore(checkpoint)
    restored = generate(model, input_ids, attention_mask, cache)
    scratch = generate(model, input_ids, attention_mask, HybridRingCache(model.config))
    no_cache = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        **reference_cache_kwargs(model),
        max_new_tokens=12,
        min_new_tokens=12,
        do_sample=False,
    )
    assert torch.equal(loaded, uninterrupted) and torch.equal(restored, uninterrupted)
    assert torch.equal(scratch, uninterrupted) and torch.equal(no_cache, uninterrupted)


def test_generate_many_continuations_from_one_checkpoint(model_name):
    """One prefix, many continuations (greedy and sampled), each equal to computing it from scratch."""
    model = get_model(model_name, WINDOW)
    prefix = torch.randint(3, VOCAB, (1, 20), generator=torch.Generator().manual_seed(1))
    cache = HybridRingCache(model.config)
    with torch.no_grad():
        model(input_ids=prefix, **cache_kwargs(cache))
    checkpoint = cache.checkpoint()
    for turn in range(4):
        question = torch.randint(3, VOCAB, (1, 3 + turn), generator=torch.Generator().manual_seed(10 + turn))
        input_ids = torch.cat([prefix, question], dim=1)
        mask = torch.ones_like(input_ids)
        sample = {"do_sample": True, "top_k": 0} if turn % 2 else {"do_sample": False}
        cache.restore(checkpoint)
        torch.manual_seed(turn)
        got = model.generate(
            input_ids=input_ids,
            attention_mask=mask,
            **cache_kwargs(cache),
            max_new_tokens=15,
            min_new_tokens=15,
            **sample,
        )
        torch.manual_seed(turn)
        expected = model.generate(
            input_ids=input_ids,
            attention_mask=mask,
            **reference_cache_kwargs(model),
            max_new_tokens=15,
            min_new_tokens=15,
            **sample,
        )
        assert torch.equal(got, expected), f"turn {turn}"


def test_batch_of_continuations_from_a_batch_one_prefix(model_name, tmp_path):
    """A batch-1 prefix (loaded from a file, or deep-copied) expanded to B rows, B different continuations."""
    model = get_model(model_name, WINDOW)
    prefix = torch.randint(3, VOCAB, (1, 15), generator=torch.Generator().manual_seed(2))
    cache = HybridRingCache(model.config)
    with torch.no_grad():
        model(input_ids=prefix, **cache_kwargs(cache))
    cache.save(tmp_path / "p.safetensors")
    continuations = torch.randint(3, VOCAB, (3, 4), generator=torch.Generator().manual_seed(3))
    input_ids = torch.cat([prefix.expand(3, -1), continuations], dim=1)
    mask = torch.ones_like(input_ids)
    expected = torch.cat([generate(model, row[None], mask[:1], HybridRingCache(model.config)) for row in input_ids])
    for branch in (HybridRingCache.load(tmp_path / "p.safetensors", model.config), copy.deepcopy(cache)):
        branch.batch_repeat_interleave(3)
        assert torch.equal(generate(model, input_ids, mask, branch), expected)
    assert cache.layers[0].batch_size == 1  # the deep-copied prefix itself is untouched


def test_num_return_sequences_from_a_loaded_prefix(tmp_path):
    """`generate` expands the prompt, not a cache that already holds tokens: expand the loaded cache first."""
    model = get_model("gemma3", WINDOW)
    prefix = torch.randint(3, VOCAB, (1, 14), generator=torch.Generator().manual_seed(4))
    cache = HybridRingCache(model.config)
    feed(model, cache, prefix)
    cache.save(tmp_path / "p.safetensors")
    input_ids = torch.cat([prefix, torch.tensor([[5, 6, 7]])], dim=1)
    kwargs = {"max_new_tokens": 10, "min_new_tokens": 10, "do_sample": True, "num_return_sequences": 3}
    loaded = HybridRingCache.load(tmp_path / "p.safetensors", model.config)
    loaded.batch_repeat_interleave(3)
    torch.manual_seed(0)
    got = model.generate(input_ids=input_ids, **cache_kwargs(loaded), **kwargs)
    torch.manual_seed(0)
    expected = model.generate(input_ids=input_ids, **reference_cache_kwargs(model), **kwargs)
    assert torch.equal(got, expected)


# --- across processes ----------------------------------------------------------------------------------------------
_SAVE_IN_CHILD = """
import sys, torch
sys.path.insert(0, {tests!r})
from builders import MODEL_BUILDERS
from safetensors.torch import save_file
from hybrid_cache import HybridRingCache, cache_kwargs
torch.set_num_threads(1)  # as in this module: same kernels, same summation order, bit-identical logits
for name in ("gemma3", "gemma4"):
    for dtype in (torch.float32, torch.bfloat16):
        model = MODEL_BUILDERS[name](window=5).to(dtype)
        ids = torch.randint(3, 101, (2, 30), generator=torch.Generator().manual_seed(0))
        cache = HybridRingCache(model.config, rollback_margin=1)
        with torch.no_grad():
            model(input_ids=ids[:, :12], **cache_kwargs(cache))
            for t in range(12, 19):
                model(input_ids=ids[:, t : t + 1], **cache_kwargs(cache))
            cache.save(f"{directory}/{{name}}-{{dtype}}.safetensors", metadata={{"written by": "child"}})
            logits = [model(input_ids=ids[:, 19:22], **cache_kwargs(cache)).logits]
            logits += [model(input_ids=ids[:, t : t + 1], **cache_kwargs(cache)).logits for t in range(22, 30)]
        save_file({{"logits": torch.cat(logits, 1).contiguous()}}, f"{directory}/{{name}}-{{dtype}}.expected")
"""


@pytest.fixture(scope="module")
def saved_by_another_process(tmp_path_factory) -> Path:
    """A child process saves wrapped caches (Gemma 3 / 4, fp32 / bf16) and its own continuations' logits."""
    directory = tmp_path_factory.mktemp("child")
    script = _SAVE_IN_CHILD.format(tests=str(REPO / "tests"), directory=str(directory))
    subprocess.run(
        [sys.executable, "-c", script], check=True, cwd=REPO, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)}
    )
    return directory


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fresh_process_round_trip(model_name, dtype, saved_by_another_process):
    """This process loads what another one saved and continues exactly as that process did (bit-identical)."""
    path = saved_by_another_process / f"{model_name}-{dtype}.safetensors"
    model = MODEL_BUILDERS[model_name](window=5).to(dtype)  # same seed: same weights
    ids = torch.randint(3, 101, (2, 30), generator=torch.Generator().manual_seed(0))
    cache = HybridRingCache.load(path, model.config)
    assert read_metadata(path) == {"written by": "child"}
    assert cache.get_seq_length() == 19 and cache.layers[0].rollback_margin == 1
    with safe_open(saved_by_another_process / f"{model_name}-{dtype}.expected", "pt") as handle:
        expected = handle.get_tensor("logits")
    got = continue_logits(model, cache, ids, torch.ones_like(ids), 19, [3] + [1] * 8)
    assert torch.equal(got, expected)


# --- checkpoint semantics -------------------------------------------------------------------------------------------
def feed(model, cache, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=tokens, **cache_kwargs(cache)).logits


def tokens(length: int, seed: int, batch: int = 1) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    "kwargs", [{}, {"max_cache_len": 64}, {"rollback_margin": 2}], ids=["grow", "fixed", "margin"]
)
def test_restore_after_decode_crop_and_reset(model_name, kwargs):
    """Taken before the first wrap; restored after decoding past it, after a crop, after a reset (nothing new
    written), and many times: each time the next logits equal the uninterrupted ones."""
    model = get_model(model_name, WINDOW)
    cache = HybridRingCache(model.config, **kwargs)
    feed(model, cache, tokens(4, 0))  # 4 < window: the ring has not wrapped
    checkpoint = cache.checkpoint()
    state = held_state(cache, capacities=False)
    question = tokens(3, 1)
    expected = feed(model, copy.deepcopy(cache), question)
    for since in ("decode", "crop", "reset", "decode", "nothing"):
        if since == "decode":
            for step in range(2 * WINDOW):
                feed(model, cache, tokens(1, 100 + step))
        elif since == "crop":
            cache.crop(-1)  # undoes a token of the previous iteration's question
        elif since == "reset":
            cache.reset()
        cache.restore(checkpoint)
        assert_same_state(held_state(cache, capacities=False), state)
        assert cache.get_seq_length() == 4
        assert torch.equal(feed(model, cache, question), expected), since


def test_checkpoint_is_the_exact_rollback_beyond_the_margin(model_name):
    """Speculative decoding: undoing more than the last step plus `rollback_margin + 1` tokens after the wrap raises
    on `crop`; a checkpoint taken before the speculative tokens undoes any number of them exactly."""
    model = get_model(model_name, WINDOW)
    cache = HybridRingCache(model.config, rollback_margin=1)
    feed(model, cache, tokens(20, 0))
    checkpoint = cache.checkpoint()
    expected = feed(model, copy.deepcopy(cache), tokens(2, 5))
    for index in range(5):  # 5 draft tokens decoded one by one, all rejected
        feed(model, cache, tokens(1, 10 + index))
    with pytest.raises(RollbackError):
        copy.deepcopy(cache).crop(-5)
    cache.restore(checkpoint)
    assert torch.equal(feed(model, cache, tokens(2, 5)), expected)


@needs_exact_rollback
def test_restore_drops_pending_undo_state(model_name):
    """A speculative step's undo state must not survive a restore / load (it describes another history)."""
    model = get_model(model_name, WINDOW)
    cache = HybridRingCache(model.config)
    feed(model, cache, tokens(14, 0))
    cache.activate_past_recording()
    # one token first: before transformers 5.24 a multi-token first step after activation on a held cache is refused
    # (steps.check_assisted_start: it cannot be told from assisted decoding feeding the conversation again)
    feed(model, cache, tokens(1, 3))
    feed(model, cache, tokens(4, 1))  # wrapped multi-token step: undoable while recording
    checkpoint = cache.checkpoint()
    feed(model, cache, tokens(4, 2))
    cache.restore(checkpoint)
    with pytest.raises(RollbackError):
        cache.crop(-3)  # beyond rollback_margin + 1 and no undo state: refused, never silently "undone"
    assert cache.get_seq_length() == 19


def test_checkpoint_holds_the_rings_only():
    """About `sliding layers x window` slots; never the full layers' storage (it is freed when the layer grows)."""
    model = get_model("gemma3", WINDOW)  # 5 sliding layers, 1 full, 2 KV heads of size 8, fp32
    cache = HybridRingCache(model.config)
    feed(model, cache, tokens(40, 0))
    full = next(layer for layer in cache.layers if not hasattr(layer, "max_slots"))
    storage = weakref.ref(full.keys)
    checkpoint = cache.checkpoint()
    assert isinstance(checkpoint, CacheCheckpoint) and checkpoint.length == 40
    assert checkpoint.nbytes() == 5 * WINDOW * 2 * 2 * 8 * 4  # layers x slots x (K, V) x heads x head_dim x 4 bytes
    assert checkpoint.nbytes() < sum(t.numel() * t.element_size() for t in (full.keys, full.values))
    feed(model, cache, tokens(1, 1))  # the full layer grows into new storage
    gc.collect()
    assert storage() is None
    cache.restore(checkpoint)
    assert cache.get_seq_length() == 40


def test_restore_refuses_what_it_cannot_restore_and_changes_nothing(model_name):
    model = get_model(model_name, WINDOW)
    cache = HybridRingCache(model.config)
    feed(model, cache, tokens(10, 0))
    early = cache.checkpoint()
    feed(model, cache, tokens(10, 1))
    late = cache.checkpoint()

    cache.restore(early)  # cut back to 10, then write a different continuation over positions 10..
    feed(model, cache, tokens(3, 2))
    before = held_state(cache)
    with pytest.raises(ValueError, match="full-attention layer .* no longer holds its 20 tokens"):
        cache.restore(late)
    assert_same_state(held_state(cache), before)
    cache.restore(early)  # still fine: nothing before position 10 was rewritten

    cache.reset()
    feed(model, cache, tokens(12, 3))  # a new prompt over the old one
    with pytest.raises(ValueError, match="no longer holds its 10 tokens"):
        cache.restore(early)

    cache.reset()
    feed(model, cache, tokens(12, 3, batch=2))
    before = held_state(cache)
    with pytest.raises(ValueError, match="batch_size=2.*batch_size=1.*same batch size"):
        cache.restore(early)
    assert_same_state(held_state(cache), before)

    with pytest.raises(ValueError, match="another cache"):
        HybridRingCache(model.config).restore(early)
    with pytest.raises(TypeError, match="CacheCheckpoint"):
        cache.restore(held_state(cache))


def test_checkpoints_are_not_copied_or_pickled():
    """A copy the cache does not know about would miss later writes: copies are the checkpoint itself."""
    import pickle

    model = get_model("gemma3", WINDOW)
    cache = HybridRingCache(model.config)
    feed(model, cache, tokens(10, 0))
    checkpoint = cache.checkpoint()
    assert copy.copy(checkpoint) is checkpoint and copy.deepcopy(checkpoint) is checkpoint
    with pytest.raises(TypeError, match="cache.save"):
        pickle.dumps(checkpoint)
    cache.crop(-1)
    feed(model, cache, tokens(4, 1))  # rewrites positions 9..12
    with pytest.raises(ValueError, match="no longer holds its 10 tokens"):
        cache.restore(copy.deepcopy(checkpoint))


def test_beam_reorder_invalidates_a_checkpoint():
    model = get_model("gemma3", WINDOW)
    cache = HybridRingCache(model.config)
    feed(model, cache, tokens(10, 0, batch=2))
    checkpoint = cache.checkpoint()
    cache.reorder_cache(torch.tensor([1, 0]))
    with pytest.raises(ValueError, match="beam-search reorder"):
        cache.restore(checkpoint)


def test_restore_keeps_static_addresses_for_compiled_graphs():
    model = get_model("gemma4", WINDOW)
    cache = HybridRingCache(model.config, max_cache_len=48)
    feed(model, cache, tokens(9, 0))
    checkpoint = cache.checkpoint()
    storing = [layer for layer in cache.layers if hasattr(layer, "cumulative_length")]
    addresses = [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in storing]
    for step in range(10):
        feed(model, cache, tokens(1, step))
    cache.restore(checkpoint)
    assert addresses == [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in storing]


def test_under_inference_mode(model_name, tmp_path):
    model = get_model(model_name, WINDOW)
    with torch.inference_mode():
        cache = HybridRingCache(model.config)
        model(input_ids=tokens(15, 0), **cache_kwargs(cache))
        checkpoint = cache.checkpoint()
        cache.save(tmp_path / "c.safetensors")
        expected = model(input_ids=tokens(3, 1), **cache_kwargs(cache)).logits
        cache.restore(checkpoint)
        assert torch.equal(model(input_ids=tokens(3, 1), **cache_kwargs(cache)).logits, expected)
        loaded = HybridRingCache.load(tmp_path / "c.safetensors", model.config)
        assert torch.equal(model(input_ids=tokens(3, 1), **cache_kwargs(loaded)).logits, expected)
    cache.restore(checkpoint)  # outside inference mode, into a cache made inside it
    assert cache.get_seq_length() == 15


# --- files: paths, metadata, errors --------------------------------------------------------------------------------
@pytest.fixture
def saved(tmp_path) -> tuple[Path, HybridRingCache]:
    model = get_model("gemma3", WINDOW)
    cache = HybridRingCache(model.config)
    feed(model, cache, tokens(15, 0))
    path = tmp_path / "prefix.safetensors"
    cache.save(path, metadata={"prompt": "système: ünïcode ✓", "tokens": "[1, 2, 3]", "": "empty key"})
    return path, cache


class _PathLike:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __fspath__(self) -> str:
        return str(self.path)


def test_paths_metadata_and_no_leftovers(saved, tmp_path):
    path, cache = saved
    user = {"prompt": "système: ünïcode ✓", "tokens": "[1, 2, 3]", "": "empty key"}
    assert sorted(os.listdir(tmp_path)) == ["prefix.safetensors"]  # one file, no temporary left behind
    assert read_metadata(path) == user
    with safe_open(path, "pt") as handle:  # plain safetensors: any reader sees the user's metadata verbatim
        header = handle.metadata()
    assert {k: v for k, v in header.items() if not k.startswith(RESERVED_PREFIX)} == user
    assert header[RESERVED_PREFIX + "format"] == "HybridRingCache"
    model_info = json.loads(header[RESERVED_PREFIX + "model"])
    assert model_info["sliding_window"][0] == WINDOW and model_info["head_dim"][0] == 8
    assert len(model_info["fingerprint"]) == 64

    for target in (str(tmp_path / "as-str.st"), _PathLike(tmp_path / "as-pathlike.st")):
        cache.save(target)
        assert_same_state(held_state(HybridRingCache.load(target, cache.config)), held_state(cache))
    cache.save(path)  # overwrite in place
    assert read_metadata(path) == {}
    assert sorted(os.listdir(tmp_path)) == ["as-pathlike.st", "as-str.st", "prefix.safetensors"]


def test_save_errors_leave_no_file(saved, tmp_path, monkeypatch):
    path, cache = saved
    original = path.read_bytes()
    with pytest.raises(TypeError, match="str to str"):
        cache.save(path, metadata={"n": 1})
    with pytest.raises(ValueError, match="reserved prefix"):
        cache.save(path, metadata={RESERVED_PREFIX + "mine": "x"})
    with pytest.raises(IsADirectoryError, match=str(tmp_path)):
        cache.save(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        cache.save(tmp_path / "missing" / "x.safetensors")

    def fail(*args, **kwargs):
        Path(args[1]).write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr("hybrid_cache.snapshot.save_file", fail)
    with pytest.raises(OSError, match="disk full"):
        cache.save(path)
    assert path.read_bytes() == original  # the old file is intact
    assert sorted(os.listdir(tmp_path)) == ["prefix.safetensors"]


def test_empty_and_unused_caches_round_trip(tmp_path):
    model = get_model("gemma4", WINDOW)
    cache = HybridRingCache(model.config, max_cache_len=30)
    cache.save(tmp_path / "empty.st")
    loaded = HybridRingCache.load(tmp_path / "empty.st", model.config)
    assert loaded.get_seq_length() == 0 and loaded.max_cache_len == 30
    expected = feed(model, cache, tokens(8, 0))
    assert torch.equal(feed(model, loaded, tokens(8, 0)), expected)
    cache.reset()
    cache.save(tmp_path / "reset.st")
    assert HybridRingCache.load(tmp_path / "reset.st", model.config).get_seq_length() == 0


def test_composite_config_and_device(tmp_path):
    from transformers import Gemma3Config

    model = get_model("gemma3", WINDOW)
    composite = Gemma3Config(text_config=model.config.to_dict())
    cache = HybridRingCache(composite)
    feed(model, cache, tokens(9, 0))
    cache.save(tmp_path / "c.st")
    loaded = HybridRingCache.load(tmp_path / "c.st", model.config, device="cpu")
    assert_same_state(held_state(loaded), held_state(cache))
    assert all(layer.device == torch.device("cpu") for layer in loaded.layers if hasattr(layer, "cumulative_length"))


@pytest.mark.parametrize(
    ("name", "changes", "field"),
    [
        ("gemma3", {"sliding_window": 8}, "sliding_window"),
        ("gemma3", {"num_hidden_layers": 12, "layer_types": None}, "num_hidden_layers"),
        ("gemma3", {"layer_types": ["full_attention"] + ["sliding_attention"] * 5}, "layer_types"),
        ("gemma3", {"num_key_value_heads": 1}, "num_key_value_heads"),
        ("gemma3", {"head_dim": 16}, "head_dim"),
        ("gemma4", {"global_head_dim": 32}, "global_head_dim"),
        ("gemma4", {"num_global_key_value_heads": 2}, "num_global_key_value_heads"),
        ("gemma4", {"num_kv_shared_layers": 2}, "kv_sharing_modes"),
        ("gemma3", {"rms_norm_eps": 1e-3}, "fingerprint differs.*rms_norm_eps"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_load_names_the_config_field_that_differs(name, changes, field, tmp_path):
    model = get_model(name, WINDOW)
    cache = HybridRingCache(model.config)
    feed(model, cache, tokens(9, 0))
    cache.save(tmp_path / "c.st")
    if name == "gemma4":  # Gemma 4's global head size and KV heads are constructor arguments, not config entries
        config = type(model.config)(**{**_gemma4_kwargs(), **changes})
    else:
        config = type(model.config).from_dict({**model.config.to_dict(), **changes})
    with pytest.raises(ValueError, match=f"{tmp_path / 'c.st'}.*{field}"):
        HybridRingCache.load(tmp_path / "c.st", config)


def _gemma4_kwargs() -> dict:
    config = tiny_gemma4(window=WINDOW).config
    return {
        "vocab_size": VOCAB,
        "vocab_size_per_layer_input": VOCAB,
        "hidden_size": 32,
        "hidden_size_per_layer_input": 8,
        "intermediate_size": 64,
        "num_hidden_layers": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "global_head_dim": 16,
        "num_global_key_value_heads": 1,
        "attention_k_eq_v": True,
        "sliding_window": WINDOW,
        "layer_types": config.layer_types,
        "num_kv_shared_layers": 3,
    }


def _corrupt(path: Path, how: str) -> None:
    data = path.read_bytes()
    header_length = struct.unpack("<Q", data[:8])[0]
    if how == "truncated":
        path.write_bytes(data[: len(data) - 100])
    elif how == "truncated-header":
        path.write_bytes(data[:50])
    elif how == "random":
        path.write_bytes(os.urandom(len(data)))
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "flipped-payload":
        position = 8 + header_length + 123
        path.write_bytes(data[:position] + bytes([data[position] ^ 1]) + data[position + 1 :])
    elif how == "not-json-state":
        header = json.loads(data[8 : 8 + header_length])
        header["__metadata__"][RESERVED_PREFIX + "state"] = "{not json"
        _rewrite(path, header, data[8 + header_length :])
    elif how == "inconsistent-counters":
        header = json.loads(data[8 : 8 + header_length])
        state = json.loads(header["__metadata__"][RESERVED_PREFIX + "state"])
        state["layers"][0]["oldest"] = 2  # oldest > 0 yet the ring claims to be in time order
        header["__metadata__"][RESERVED_PREFIX + "state"] = json.dumps(state)
        _rewrite(path, header, data[8 + header_length :])
    elif how == "missing-tensor":  # a valid safetensors file with one tensor less
        with safe_open(path, "pt") as handle:
            tensors = {name: handle.get_tensor(name) for name in handle.keys() if name != "layers.0.values"}
            metadata = handle.metadata()
        save_file(tensors, path, metadata=metadata)
    elif how == "not-a-cache":
        save_file({"weight": torch.zeros(3)}, path, metadata={"format": "pt"})
    elif how == "other-version":
        header = json.loads(data[8 : 8 + header_length])
        header["__metadata__"][RESERVED_PREFIX + "format_version"] = "99"
        _rewrite(path, header, data[8 + header_length :])


def _rewrite(path: Path, header: dict, payload: bytes) -> None:
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + payload)


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("truncated", "not a readable safetensors file"),
        ("truncated-header", "not a readable safetensors file"),
        ("random", "not a readable safetensors file"),
        ("empty", "not a readable safetensors file"),
        ("flipped-payload", "is damaged: tensor 'layers"),
        ("not-json-state", "not JSON"),
        ("inconsistent-counters", "is damaged: layer 0's counters"),
        ("missing-tensor", "is damaged: the list of parts"),
        ("not-a-cache", "not a saved HybridRingCache"),
        ("other-version", "format version '99'"),
    ],
    ids=lambda v: v if " " not in v else None,
)
def test_load_refuses_broken_files_with_the_path(saved, how, message):
    path, cache = saved
    _corrupt(path, how)
    with pytest.raises(ValueError, match=message) as error:
        HybridRingCache.load(path, cache.config)
    assert str(path) in str(error.value)


def test_missing_file_is_an_os_error_naming_the_path(tmp_path):
    with pytest.raises(OSError, match="nowhere.safetensors"):
        HybridRingCache.load(tmp_path / "nowhere.safetensors", get_model("gemma3", WINDOW).config)
    with pytest.raises(OSError, match="nowhere.safetensors"):
        read_metadata(tmp_path / "nowhere.safetensors")


def test_compiled_decode_checkpoint_restore():
    """Compiled one-token steps (fixed capacity) record their writes too, and a restore does not recompile."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend

    model = get_model("gemma3", 4)
    prompt = tokens(9, 0, batch=2)

    def decode(cache, forward, steps, first):
        out = []
        with torch.no_grad():
            for step in range(steps):
                position = cache.get_seq_length()
                token = torch.full((2, 1), 3 + (first + step) % 90)
                logits = forward(
                    input_ids=token, **cache_kwargs(cache), position_ids=torch.full((2, 1), position), use_cache=True
                ).logits
                out.append(logits)
        return torch.cat(out, 1)

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(model.forward, backend=counter, fullgraph=True)
    cache = HybridRingCache(model.config, max_cache_len=64, rollback_margin=1)
    feed(model, cache, prompt)
    checkpoint = cache.checkpoint()
    expected = decode(cache, compiled, 12, 0)  # three wraps of the ring
    for _ in range(2):
        cache.restore(checkpoint)
        assert torch.equal(decode(cache, compiled, 12, 0), expected)
    assert counter.frame_count == 1
    cache.restore(checkpoint)
    cache.crop(-2)
    decode(cache, compiled, 1, 50)  # a compiled write at position 7 < 9
    with pytest.raises(ValueError, match="no longer holds its 9 tokens"):
        cache.restore(checkpoint)
