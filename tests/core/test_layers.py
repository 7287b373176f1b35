"""Exact-content layer tests: head size 1, token positions as key values (value = key + 1000), asserted with tolist().

Scenario notation: `W` window, `M` rollback margin; slots are listed in slot order, `_` is an empty slot.
"""

from __future__ import annotations

import random

import pytest
import torch

from hybrid_cache import RollbackError
from hybrid_cache.errors import CacheCapacityError
from hybrid_cache.full import GrowableFullLayer, StaticFullLayer
from hybrid_cache.mask_hook import RingLayout
from hybrid_cache.ring import RingSlidingLayer


def kv(start: int, count: int, batch: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys hold their own absolute positions; values are keys + 1000."""
    keys = torch.arange(start, start + count, dtype=torch.float32).view(1, 1, count, 1).expand(batch, 1, count, 1)
    return keys.contiguous(), keys + 1000


def as_list(tensor: torch.Tensor) -> list[int]:
    return [int(x) for x in tensor[0, 0, :, 0].tolist()]


def positions_of(layer: RingSlidingLayer, query_length: int) -> list[int]:
    """Absolute positions of the keys `update` will return for a step of `query_length` tokens."""
    kv_length, kv_offset = layer.get_mask_sizes(query_length)
    if isinstance(kv_offset, RingLayout):
        assert kv_offset.positions.shape[0] == kv_length
        return kv_offset.positions.tolist()
    return list(range(kv_offset, kv_offset + kv_length))


def step(layer: RingSlidingLayer, start: int, count: int) -> tuple[list[int], list[int]]:
    """One update; returns (returned key values, positions the mask was told). They must agree slot by slot."""
    positions = positions_of(layer, count)
    keys, values = layer.update(*kv(start, count))
    returned = as_list(keys)
    assert len(returned) == len(positions), "K/V length disagrees with the mask size (trap 3)"
    for key, value, position in zip(returned, as_list(values), positions):
        if position >= 0:  # empty slots (-1) are masked, their content is irrelevant
            assert key == position, f"slot holds {key} but the mask was told {position}"
            assert value == key + 1000
    return returned, positions


def held(layer: RingSlidingLayer) -> list[int]:
    """Ring content in slot order, `-1` for slots the ring does not count as held."""
    positions = layer._slot_positions(layer.cumulative_length).tolist()
    contents = as_list(layer.keys) + [-1] * (layer.max_slots - layer.capacity)  # slots not allocated yet
    return [c if p >= 0 else -1 for c, p in zip(contents, positions)]


class TestRingContents:
    def test_prefill_below_window(self):
        """W=4: prefill [0,1,2] -> slots [0,1,2,_], returned in time order."""
        layer = RingSlidingLayer(4)
        returned, positions = step(layer, 0, 3)
        assert returned == [0, 1, 2] and positions == [0, 1, 2]
        assert held(layer) == [0, 1, 2, -1]

    def test_prefill_at_window(self):
        """W=4: prefill [0,1,2,3] -> slots [0,1,2,3]."""
        layer = RingSlidingLayer(4)
        returned, _ = step(layer, 0, 4)
        assert returned == [0, 1, 2, 3] and held(layer) == [0, 1, 2, 3]

    def test_prefill_above_window(self):
        """W=4: prefill [0..9] -> all 10 keys returned in order; ring keeps the newest 4 at pos % 4: [8,9,6,7]."""
        layer = RingSlidingLayer(4)
        returned, positions = step(layer, 0, 10)
        assert returned == list(range(10)) and positions == list(range(10))
        assert held(layer) == [8, 9, 6, 7]
        assert layer.capacity == 4

    def test_decode_across_several_wraps(self):
        """W=4: prefill [0,1,2]; decode 3..14 one by one: each step writes one slot and the ring holds the last 4."""
        layer = RingSlidingLayer(4)
        step(layer, 0, 3)
        for position in range(3, 15):
            returned, positions = step(layer, position, 1)
            expected = {p % 4: p for p in range(max(0, position - 3), position + 1)}
            assert held(layer) == [expected.get(slot, -1) for slot in range(4)]
            assert sorted(p for p in positions if p >= 0) == list(range(max(0, position - 3), position + 1))
            if position == 3:
                storage = layer.keys.data_ptr()  # all 4 slots allocated from here on
            assert layer.keys.data_ptr() == storage, "decode must write in place (no reallocation)"
        assert held(layer) == [12, 13, 14, 11]

    def test_ring_grows_up_to_window_then_wraps(self):
        """W=8: prefill 2 -> 2 slots; decode grows the (time-ordered) buffer one slot at a time (a small buffer: 65/64
        of it rounds down to itself) up to 8 slots, never more."""
        layer = RingSlidingLayer(8)
        step(layer, 0, 2)
        capacities = []
        for position in range(2, 12):
            step(layer, position, 1)
            capacities.append(layer.capacity)
        assert capacities == [3, 4, 5, 6, 7, 8, 8, 8, 8, 8]
        assert held(layer) == [8, 9, 10, 11, 4, 5, 6, 7]

    def test_chunk_wraps_a_small_ring(self):
        """W=8: prefill 3 (3 slots), then a 7-token chunk crosses the window: returned [0..9] in time order (the held
        positions, then the chunk); the ring takes all 8 slots at once and keeps 2..9."""
        layer = RingSlidingLayer(8)
        step(layer, 0, 3)
        returned, positions = step(layer, 3, 7)
        assert returned == positions == list(range(10))
        assert layer.capacity == 8 and held(layer) == [8, 9, 2, 3, 4, 5, 6, 7]

    def test_chunk_after_wrap_returns_time_order(self):
        """W=4: prefill 0..5 (slots [4,5,2,3]); a 3-token chunk returns the W - 1 = 3 positions before it (3..5) in
        time order, then 6..8, as an integer offset (transformers' own mask, no ring layout): what transformers' own
        sliding layer returns. The ring then holds [8,5,6,7]."""
        layer = RingSlidingLayer(4)
        step(layer, 0, 6)
        assert layer.get_mask_sizes(3) == (6, 3)
        returned, positions = step(layer, 6, 3)
        assert returned == positions == list(range(3, 9))
        assert held(layer) == [8, 5, 6, 7]

    def test_margin_chunk_returns_window_minus_one(self):
        """W=4, M=3 (capacity 7): a chunk before and after the wrap returns only the W - 1 positions before it, also
        while the ring is in time order (slots 0..4 hold 0..4: a 2-token chunk returns 2..6); recording the step for a
        rollback copies from the oldest held position but still returns the same keys."""
        layer = RingSlidingLayer(4, rollback_margin=3)
        step(layer, 0, 5)
        returned, _ = step(layer, 5, 2)
        assert returned == [2, 3, 4, 5, 6]
        returned, _ = step(layer, 7, 3)
        assert returned == [4, 5, 6, 7, 8, 9]
        layer.activate_past_recording()
        returned, _ = step(layer, 10, 2)
        assert returned == [7, 8, 9, 10, 11]
        layer.crop(-2)
        returned, _ = step(layer, 10, 2)
        assert returned == [7, 8, 9, 10, 11]

    def test_decode_returns_ring_itself(self):
        """After the wrap a one-token step returns the ring storage (no copy of the window)."""
        layer = RingSlidingLayer(4)
        step(layer, 0, 6)
        keys, _ = layer.update(*kv(6, 1))
        assert keys.data_ptr() == layer.keys.data_ptr() and keys.shape[-2] == 4

    @pytest.mark.parametrize("chunk", [2, 3, 4, 5, 9], ids=lambda c: f"chunk{c}")
    def test_overflowing_chunks(self, chunk):
        """W=4: prefill [0,1,2], then chunks: returned = the W - 1 positions before the chunk + new tokens; ring =
        newest 4."""
        layer = RingSlidingLayer(4)
        step(layer, 0, 3)
        position = 3
        for _ in range(4):
            before = [p for p in held(layer) if p >= 0]
            returned, positions = step(layer, position, chunk)
            # Every query in the chunk must find its whole window among the returned keys.
            valid = {p for p in positions if p >= 0}
            for query in range(position, position + chunk):
                assert set(range(max(0, query - 3), query + 1)) <= valid
            assert set(sorted(before)[-3:]) <= valid
            position += chunk
            assert sorted(p for p in held(layer) if p >= 0) == list(range(position - 4, position))

    def test_margin_slots(self):
        """W=3, M=2: capacity 5; decode keeps the newest 5 positions."""
        layer = RingSlidingLayer(3, rollback_margin=2)
        step(layer, 0, 2)
        for position in range(2, 9):
            step(layer, position, 1)
        assert layer.capacity == 5
        assert held(layer) == [5, 6, 7, 8, 4]


class TestRollback:
    def test_crop_before_wrap(self):
        """W=4: prefill [0,1,2]; crop(-2) -> length 1; rewrite 1,2 -> same content as never rolled back."""
        layer = RingSlidingLayer(4)
        step(layer, 0, 3)
        layer.crop(-2)
        assert layer.get_seq_length() == 1
        step(layer, 1, 2)
        assert held(layer) == [0, 1, 2, -1]

    def test_crop_after_wrap_within_margin(self):
        """W=4, M=2: positions 0..11 (ring of 6 holds 6..11); crop(-3) -> 9; the window of 9 is 6..9 -> intact."""
        layer = RingSlidingLayer(4, rollback_margin=2)
        step(layer, 0, 8)
        for position in range(8, 12):
            step(layer, position, 1)
        layer.crop(-3)
        assert layer.get_seq_length() == 9
        _, positions = step(layer, 9, 1)
        visible = sorted(p for p in positions if p >= 0 and p > 9 - 4)
        assert visible == [6, 7, 8, 9]
        assert held(layer)[9 % 6] == 9

    def test_crop_after_multi_token_step(self):
        """Speculative pattern: decode after the wrap, verify 4 tokens at once, keep 1: exact with M=3."""
        layer = RingSlidingLayer(4, rollback_margin=3)
        step(layer, 0, 10)
        step(layer, 10, 4)  # candidates 10..13
        layer.crop(-3)  # reject 11..13
        returned, positions = step(layer, 11, 1)
        window = {p: k for p, k in zip(positions, returned) if 11 - 4 < p <= 11}
        assert window == {8: 8, 9: 9, 10: 10, 11: 11}

    def test_crop_beyond_margin_raises(self):
        """W=4, M=0: after the wrap only 1 token can be undone; 2 raises a RollbackError naming the fix."""
        layer = RingSlidingLayer(4)
        step(layer, 0, 10)
        with pytest.raises(RollbackError, match="rollback_margin"):
            layer.crop(-2)
        layer.crop(-1)  # W-1 = 3 past keys are still held for the query at 9
        assert layer.get_seq_length() == 9

    def test_recording_undoes_last_step_without_growing(self):
        """activate_past_recording(), W=4, M=0: verify a 5-token step after the wrap, keep 1 of it: exact, and the
        ring stays 4 slots (the step's own copy of the window is what makes the rollback exact)."""
        layer = RingSlidingLayer(4)
        step(layer, 0, 10)
        layer.activate_past_recording()
        step(layer, 10, 5)  # 10..14, ring now holds 11..14
        layer.crop(-4)  # keep only 10
        assert layer.capacity == 4 and layer.get_seq_length() == 11
        assert held(layer) == [8, 9, 10, 7]
        returned, positions = step(layer, 11, 1)
        assert {p: k for p, k in zip(positions, returned) if 7 < p <= 11} == {8: 8, 9: 9, 10: 10, 11: 11}

    def test_recording_stays_on_across_crops(self):
        """transformers activates recording once per generate: it must survive crop(0) and rollbacks (prompt lookup
        with a short prompt first proposes 1 candidate, later 4)."""
        layer = RingSlidingLayer(6)
        layer.activate_past_recording()
        step(layer, 0, 2)
        layer.crop(0)
        for position in range(2, 10):
            step(layer, position, 1)
            layer.crop(0)
        step(layer, 10, 5)
        layer.crop(-4)
        assert layer.get_seq_length() == 11 and layer.capacity == 6
        _, positions = step(layer, 11, 1)
        assert sorted(p for p in positions if p > 11 - 6) == [6, 7, 8, 9, 10, 11]

    @pytest.mark.parametrize("record", [False, True], ids=["margin-only", "recording"])
    def test_random_schedule_with_rollbacks_matches_reference(self, record):
        """Property test: random steps and rollbacks; every query's whole window is returned, and a rollback raises
        exactly when neither the margin, nor the slots the last step overwrote (kept for every step that overwrites
        held slots: back to its start or before, within the margin it started with), nor (while recording) the last
        step's saved window (any part of the step, or before it within that margin) can make it exact."""
        rng = random.Random(0)
        for trial in range(200):
            window, margin = rng.randint(1, 6), rng.randint(0, 4)
            layer = RingSlidingLayer(window, rollback_margin=margin)
            if record:
                layer.activate_past_recording()
            history: list[int] = []  # reference: every token position currently in the sequence
            recording = record
            kept_step = (
                None  # (start, oldest before) of the last recorded step after the wrap, while its window is kept
            )
            last_step = None  # (start, oldest before it) of the last step that overwrote held slots
            for _ in range(25):
                if history and rng.random() < 0.3:
                    undo = min(rng.randint(1, 2 * window + 2), len(history))
                    new_length = len(history) - undo
                    by_margin = layer._oldest <= max(0, new_length - window + 1)
                    by_undo = kept_step is not None and (
                        new_length >= kept_step[0] or kept_step[1] <= max(0, new_length - window + 1)
                    )
                    by_record = last_step is not None and new_length <= last_step[0]
                    by_record = by_record and last_step[1] <= max(0, new_length - window + 1)
                    state = (layer.cumulative_length, layer._oldest, held(layer))
                    try:
                        layer.crop(-undo)
                    except RollbackError:
                        assert not (by_margin or by_undo or by_record), f"trial {trial}: legal rollback refused"
                        assert (layer.cumulative_length, layer._oldest, held(layer)) == state, "refused crop changed"
                        continue
                    assert by_margin or by_undo or by_record, f"trial {trial}: rollback accepted but not exact"
                    del history[-undo:]
                    kept_step = last_step = None  # any crop resolves the last step and releases its record
                    assert layer.extra_nbytes() == 0
                    continue
                count = rng.choice([1, 1, 1, 2, window, window + 1, 2 * window + 1])
                start = len(history)
                if kept_step is not None:  # a recorded step was not rolled back: speculation is over
                    recording = False
                kind, oldest = layer._step_kind(count), layer._oldest
                returned, positions = step(layer, start, count)
                kept_step = (start, oldest) if recording and kind == "window" else None
                # A step that may overwrite held slots keeps them (nothing when the ring was empty: no bytes).
                recorded = kind != "ordered" and kept_step is None
                last_step = (start, oldest) if recorded else None
                assert layer.record_past == recording
                kept_bytes = kept_step is not None or (recorded and start > 0)
                assert (layer.extra_nbytes() > 0) == kept_bytes, "kept record not counted"
                history.extend(range(start, start + count))
                present = {p for p in positions if p >= 0}
                for query in range(start, start + count):
                    needed = set(range(max(0, query - window + 1), query + 1))
                    assert needed <= present, f"trial {trial}: query {query} misses {needed - present}"
                assert layer.capacity <= window + margin
                if layer._oldest > 0:  # wrapped: all slots allocated, never more
                    assert layer.capacity == window + margin


class TestFullLayers:
    def test_growable_appends_and_grows_by_a_64th(self):
        """Prefill 8 -> capacity 8; decode 8 tokens -> one slot at a time while 8 * 65 / 64 < 9 (copying <= 64 tokens);
        content in time order."""
        layer = GrowableFullLayer()
        keys, _ = layer.update(*kv(0, 8))
        assert as_list(keys) == list(range(8)) and layer.capacity == 8
        capacities = []
        for position in range(8, 16):
            keys, _ = layer.update(*kv(position, 1))
            capacities.append(layer.capacity)
        assert as_list(keys) == list(range(16))
        assert capacities == list(range(9, 17))

    @pytest.mark.parametrize("prompt", [1, 63, 64, 640, 1000])
    def test_growable_slack_and_amortized_copies(self, prompt):
        """Decoding 3 x prompt tokens (at least 300): at every step capacity <= floor(tokens * 65 / 64) (the whole
        slack is 1/64 of the tokens, so a cache stays within 2% of a StaticCache holding the same tokens), and the
        tokens copied by all growths together are a constant per appended token (amortized O(1)): a growth from C
        slots copies C tokens and makes room for floor(C / 64), so at most 128 per token from 64 slots on (-> 64 for
        large buffers: <= 70 from 640 slots on), plus the one-slot-at-a-time growths below 64 (1 + 2 + ... + 64)."""
        layer = GrowableFullLayer()
        layer.update(*kv(0, prompt))
        copied, storage = 0, layer.keys.data_ptr()
        steps = max(300, 3 * prompt)
        for position in range(prompt, prompt + steps):
            keys, _ = layer.update(*kv(position, 1))
            tokens = position + 1
            assert tokens <= layer.capacity <= max(tokens, tokens * 65 // 64)
            if layer.keys.data_ptr() != storage:  # grew: the held prefix was copied
                copied, storage = copied + position, layer.keys.data_ptr()
        assert as_list(keys) == list(range(prompt + steps))
        assert copied <= (70 if prompt >= 640 else 128) * steps + 64 * 65 // 2

    def test_growable_chunks_leave_no_slack(self):
        """Multi-token steps (prompt, prefill chunks) grow to exactly the tokens held: 5 -> 8 -> 12 -> 13 (decode)."""
        layer = GrowableFullLayer()
        capacities = []
        for start, count in [(0, 5), (5, 3), (8, 4)]:
            layer.update(*kv(start, count))
            capacities.append(layer.capacity)
        assert capacities == [5, 8, 12]
        keys, _ = layer.update(*kv(12, 1))
        assert layer.capacity == 13 and as_list(keys) == list(range(13))

    def test_growable_decode_writes_in_place(self):
        """Prefill 640; the first decode step grows to 640 * 65 / 64 = 650 slots; the next 9 tokens are written in place."""
        layer = GrowableFullLayer()
        layer.update(*kv(0, 640))
        layer.update(*kv(640, 1))
        assert layer.capacity == 650
        storage = layer.keys.data_ptr()
        for position in range(641, 650):
            layer.update(*kv(position, 1))
        assert layer.keys.data_ptr() == storage

    def test_growable_crop(self):
        layer = GrowableFullLayer()
        layer.update(*kv(0, 6))
        layer.crop(-2)
        keys, _ = layer.update(*kv(4, 1))
        assert as_list(keys) == [0, 1, 2, 3, 4]

    def test_static_capacity(self):
        """max_cache_len=6: returns the whole buffer; the 7th token raises CacheCapacityError naming the fix."""
        layer = StaticFullLayer(6)
        keys, _ = layer.update(*kv(0, 4))
        assert as_list(keys)[:4] == [0, 1, 2, 3] and keys.shape[-2] == 6
        layer.update(*kv(4, 2))
        with pytest.raises(CacheCapacityError, match="max_cache_len"):
            layer.update(*kv(6, 1))
        assert layer.get_seq_length() == 6


class TestBatchOps:
    def test_reorder_and_select(self):
        layer = RingSlidingLayer(3)
        keys = torch.arange(2 * 5, dtype=torch.float32).view(2, 1, 5, 1)
        layer.update(keys, keys)
        layer.reorder_cache(torch.tensor([1, 1]))
        assert layer.keys[0].equal(layer.keys[1])
        layer.batch_select_indices(torch.tensor([0]))
        assert layer.batch_size == 1
        layer.batch_repeat_interleave(3)
        assert layer.keys.shape[0] == 3

    def test_batch_size_change_without_reset_raises(self):
        layer = RingSlidingLayer(3)
        layer.update(*kv(0, 2, batch=2))
        with pytest.raises(ValueError, match="reset"):
            layer.update(*kv(2, 1, batch=3))

    def test_window_required(self):
        with pytest.raises(ValueError, match="sliding_window"):
            RingSlidingLayer(None)
