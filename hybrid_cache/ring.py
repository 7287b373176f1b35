"""Sliding-window storage: a ring buffer of `sliding_window + rollback_margin` slots (`RingSlidingLayer`) and its
compileable variant with static addresses and tensor counters (`StaticRingSlidingLayer`), on `UndoableStepLayer`, the
base of every layer that overwrites slots in place (also `streaming.SinkWindowFullLayer`).

A ring of `capacity` slots keeps position `p` in slot `p % capacity` (the arithmetic: `slots.py`); `_oldest` is the
lowest position still held, so the ring holds positions `[_oldest, length)`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Generic, TypeVar

import torch
from transformers.utils import is_torchdynamo_compiling

from .errors import RollbackError
from .mask_hook import HeldFromOffset, RingLayout
from .slots import SlotRuns, advance_oldest, floor_mod, ring_runs, ring_slots, slot_positions, window_reaches
from .storage import (
    IN_PLACE,
    StorageLayer,
    capacity_after_decoding,
    mark_static,
    refuse_static_autograd,
    resolve_crop_length,
    tensor_counter,
    writable,
)

__all__ = [
    "RingSlidingLayer",
    "RingStepUndo",
    "SlotUndo",
    "StaticRingSlidingLayer",
    "UNDO_SLOTS",
    "UndoableStepLayer",
]


#: Most held slots a step may overwrite and still keep to be undone (`SlotUndo`); a longer step past the wrap (a
#: prefill chunk) keeps none, whose copy would double the rings' bytes at a chunked prefill's peak (docs/api.md).
UNDO_SLOTS = 64

UndoT = TypeVar("UndoT")  # what undoes a recorded step (`ring.RingStepUndo`, `streaming.SinkWindowStepUndo`)


@dataclasses.dataclass(eq=False)
class SlotUndo:
    """What undoes the last step of a layer that overwrites slots in place: the runs of slots it overwrote, as they
    were, and the counters before it. Kept for every step that overwrites at most `UNDO_SLOTS` held slots (one for a
    decode step), until the next step; `crop` back to `length` (or below) writes the runs back, exactly."""

    length: int  # cache length before the step
    oldest: int  # oldest held position before the step
    end: int  # cache length right after the step: the record is only valid while the layer is still there
    runs: tuple[tuple[int, torch.Tensor, torch.Tensor], ...]  # (first slot, keys, values) of each overwritten run


class UndoableStepLayer(StorageLayer, Generic[UndoT]):
    """A layer whose slots are overwritten in place (a ring), and which therefore keeps what undoes its last step
    (`_undo`): the slots it overwrote (`SlotUndo`, for every step), or, while past recording is on, the step's whole
    time-ordered window (`UndoT`), from which any part of a speculative step can be undone. Every crop is planned
    first by `_crop_plan` (raising before anything changes) and then applied, undoing the kept step through
    `_undo_step` where the plan says so. Any batch reshuffle drops the record: it was kept in the old batch order, so
    a later rollback must not restore it.

    Subclasses keep `_oldest` (the lowest overwritable position still held) and `max_slots` (slots allocated), and
    say where a step's newest tokens go (`_newest_runs`) and which lengths the held slots can continue (`_reaches`).
    """

    _undo: UndoT | SlotUndo | None = None
    restores_by_length = False  # slots are overwritten in place: a checkpoint copies them
    ring_ordered = True
    records_steps = True
    _step_fields: tuple[str, ...] = ("_undo", "record_past")

    def load_state(self, meta: Mapping[str, Any], keys: torch.Tensor, values: torch.Tensor) -> None:
        """As `StorageLayer.load_state`, and the slots past the state's are zeroed: a ring's unused slots hold
        nothing, as in the layer that was saved."""
        super().load_state(meta, keys, values)
        with writable(self.keys):
            self.keys[:, :, meta["slots"] :].zero_()
            self.values[:, :, meta["slots"] :].zero_()

    def _load_counters(self, meta: Mapping[str, Any]) -> None:
        self.cumulative_length, self._oldest = meta["length"], meta["oldest"]

    # --- where a step writes, and what undoes it ------------------------------------------------------------------
    def _newest_runs(self, query_length: int) -> SlotRuns:
        """The runs of slots where a step of `query_length` tokens from the current length keeps its tokens."""
        raise NotImplementedError

    def _write_newest(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Write the tokens of a step that stay held (`_newest_runs`) and advance the length."""
        for slot, count, source in self._newest_runs(key_states.shape[-2]):
            self.keys[:, :, slot : slot + count].copy_(key_states[:, :, source : source + count])
            self.values[:, :, slot : slot + count].copy_(value_states[:, :, source : source + count])
        self._advance(key_states.shape[-2])

    def _advance(self, query_length: int) -> None:  # the counters after a step of `query_length` tokens
        raise NotImplementedError

    def _keep_overwritten(self, runs: SlotRuns, query_length: int) -> None:
        """Before a step of `query_length` tokens writes `runs`: keep what they hold and the counters (`SlotUndo`).
        An empty layer holds nothing worth keeping; a step overwriting more than `UNDO_SLOTS` slots keeps nothing."""
        length = int(self.cumulative_length)
        kept = () if length == 0 else runs
        if sum(count for _, count, _ in kept) > UNDO_SLOTS:
            self._undo = None
            return
        saved = tuple(
            (slot, self.keys[:, :, slot : slot + count].clone(), self.values[:, :, slot : slot + count].clone())
            for slot, count, _ in kept
        )
        self._undo = SlotUndo(length, int(self._oldest), length + query_length, saved)

    def _reaches(self, new_length: int, oldest: int) -> bool:
        """Whether a layer holding every position from `oldest` on can continue at `new_length` exactly."""
        raise NotImplementedError

    def _recorded_end(self, undo: UndoT) -> int:
        """The cache length right after the recorded step `undo`."""
        raise NotImplementedError

    def _undo_recorded_step(self, undo: UndoT, new_length: int) -> None:
        """Restore the state before the recorded step `undo`, then rewrite its first tokens up to `new_length`."""
        raise NotImplementedError

    def _rollback_error(self, new_length: int) -> RollbackError:
        raise NotImplementedError

    def _crop_plan(self, tokens_to_remove: int) -> tuple[int, bool]:
        """`(new length, undo the last step?)` for `crop(tokens_to_remove)`, or raise changing nothing.

        A crop back to the start of the last step or before it writes back the slots that step overwrote, when they
        reach the new length; otherwise the held slots must reach it (every key the next query needs still held);
        else, within a recorded step, its kept window rewrites the positions up to the new length. A record is used
        only while the layer is where its step left it (compiled steps keep none)."""
        length = int(self.cumulative_length)
        new_length = resolve_crop_length(tokens_to_remove, length)
        undo = self._undo
        if isinstance(undo, SlotUndo):
            if undo.end == length and new_length <= undo.length and self._reaches(new_length, undo.oldest):
                return new_length, True
        if self._reaches(new_length, int(self._oldest)):
            return new_length, False
        if undo is not None and not isinstance(undo, SlotUndo) and self._recorded_end(undo) == length:
            if undo.length <= new_length or self._reaches(new_length, undo.oldest):  # type: ignore[attr-defined]
                return new_length, True
        raise self._rollback_error(new_length)

    def _undo_step(self, undo: UndoT | SlotUndo, new_length: int) -> None:
        if isinstance(undo, SlotUndo):
            for slot, keys, values in undo.runs:
                self.keys[:, :, slot : slot + keys.shape[-2]].copy_(keys)
                self.values[:, :, slot : slot + values.shape[-2]].copy_(values)
            self.cumulative_length, self._oldest = new_length, undo.oldest
        else:
            self._undo_recorded_step(undo, new_length)

    def undo_tensors(self) -> list[torch.Tensor]:
        """The tensors kept to undo the last step (the slots it overwrote, or a recorded step's window)."""
        undo = self._undo
        if isinstance(undo, SlotUndo):
            return [tensor for _, keys, values in undo.runs for tensor in (keys, values)]
        return [] if undo is None else [field for field in vars(undo).values() if isinstance(field, torch.Tensor)]

    def extra_nbytes(self) -> int:
        """Counters plus what undoes the last step (the slots it overwrote, or a recorded step's window)."""
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in self.undo_tensors()}
        return super().extra_nbytes() + sum(storages.values())

    def activate_past_recording(self) -> None:
        """Called by assisted / prompt-lookup decoding before steps that may be rolled back with `crop(-n)`.

        While recording, a multi-token step that overwrites slots keeps what undoes it (for rings, the time-ordered
        window it returns, a `cat` it makes anyway) until the next `update` or `crop`, so `crop` can undo any part of
        it exactly without growing the storage; tokens of earlier steps roll back only within `rollback_margin + 1`.
        A recorded step kept from before is released: recording starts with the next step."""
        self.record_past = True
        if not isinstance(self._undo, SlotUndo):
            self._undo = None

    def deactivate_past_recording(self) -> None:
        """Stop recording and release a recorded step's window (the slots of the last step stay: they are small)."""
        self.record_past = False
        self._undo = self._undo if isinstance(self._undo, SlotUndo) else None

    def _ends_recording(self) -> None:
        """An update follows a recorded step that was never rolled back: speculative decoding (update, crop, update,
        crop, ...) is over, so stop recording instead of keeping a window copy alive after every later step."""
        if self._undo is not None and self.record_past and not isinstance(self._undo, SlotUndo):
            self.record_past = False
        self._undo = None

    @property
    def max_slots(self) -> int:  # slots once all are allocated: each subclass's own, from its settings
        raise NotImplementedError

    def get_max_length(self) -> int:
        return self.max_slots

    def reset(self) -> None:
        """Forget every token and the last step's record; past recording (a mode of the cache, set by
        `activate_past_recording`) stays as it is, as in transformers' own layers."""
        super().reset()
        self._oldest = 0
        self._undo = None

    def check_crop(self, tokens_to_remove: int) -> None:
        self._crop_plan(tokens_to_remove)

    def crop(self, tokens_to_remove: int) -> None:
        """Roll back tokens (negative: how many, transformers' convention; positive: the length to keep), exactly or
        not at all: a refused crop raises `RollbackError` and changes nothing. Any crop resolves the last step, so
        what was kept to undo it is released."""
        new_length, undo_step = self._crop_plan(tokens_to_remove)
        undo, self._undo = self._undo, None
        if not undo_step:
            self.cumulative_length = new_length
            return
        assert undo is not None  # `_crop_plan` asks for the undo only when a step was kept
        self._make_writable()
        self._undo_step(undo, new_length)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self._undo = None

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self._undo = None

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self._undo = None


@dataclasses.dataclass(eq=False)
class RingStepUndo:
    """What `crop` needs to undo the last multi-token step of a wrapped ring (kept only while recording past).

    `keys` / `values` are the step's returned tensors: the held positions `[oldest, length)` in time order followed
    by the step's new tokens, a `cat` the step makes anyway; keeping it costs no copy."""

    length: int  # cache length before the step
    oldest: int  # oldest held position before the step
    keys: torch.Tensor  # [batch, kv_heads, length - oldest + q, head_dim], positions oldest .. length + q - 1
    values: torch.Tensor


class RingSlidingLayer(UndoableStepLayer[RingStepUndo]):
    """A sliding-window layer stored as a ring of `sliding_window + rollback_margin` slots.

    A one-token step writes its key/value in place at slot `position % capacity` (no copy of the window, no `cat`,
    no `roll`) and returns the whole ring; the ring's slot order is described to the mask by a `RingLayout`.
    A multi-token step returns the held positions in time order followed by the new tokens (one `cat`, so every
    query sees its full window and the mask is transformers' own with an integer offset), then keeps only the newest
    tokens. Keys are never moved to another position, so RoPE stays valid.

    Args:
        sliding_window (`int`): the model's window `W` (a query sees `W` keys including itself).
        rollback_margin (`int`, defaults to 0): extra slots that make `crop(-n)` exact for `n <= rollback_margin + 1`
            even after the wrap (speculative / assisted decoding).

    Example (head size 1, token ids as values): `W=4`: prefill `[0, 1, 2]` -> slots `[0, 1, 2, _]`; decode 3, 4, 5
    -> slots `[4, 5, 2, 3]`, positions `[4, 5, 2, 3]`, and the query at 5 attends to 2..5.
    """

    is_sliding = True
    _step_fields: tuple[str, ...] = ("_undo", "record_past", "_returned")

    def __init__(self, sliding_window: int, rollback_margin: int = 0) -> None:
        super().__init__()
        if sliding_window is None or int(sliding_window) < 1:
            raise ValueError(
                f"A sliding_attention layer needs a positive `sliding_window`, got {sliding_window!r}. Set "
                f"`config.sliding_window` (or mark the layer 'full_attention' in `config.layer_types`)."
            )
        if rollback_margin < 0:
            raise ValueError(f"`rollback_margin` must be >= 0, got {rollback_margin}.")
        self.sliding_window = int(sliding_window)
        self.rollback_margin = int(rollback_margin)
        self._oldest = 0  # lowest absolute position still held in the ring
        self.record_past = False
        self._undo = None
        # What the last `update` returned, for `key_positions`: ("range", first, end) or ("ring", length, oldest);
        # `StaticRingSlidingLayer`'s decode steps leave ("counters", 0, 0): positions from its counter tensors.
        self._returned: tuple[str, int, int] = ("range", 0, 0)

    @property
    def max_slots(self) -> int:
        return self.sliding_window + self.rollback_margin

    def capacity_after(self, prompt_length: int, total_length: int) -> int:
        # `lazy_initialization` allocates the prompt (at most `max_slots`); time-ordered steps grow it up to there.
        return capacity_after_decoding(min(self.max_slots, prompt_length), total_length, limit=self.max_slots)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        # Short sequences never need the whole window: start at the first step's size and grow (while the ring is
        # still in time order) up to `max_slots`, so a 60-token chat holds 60 slots, not 512.
        self._allocate(key_states, value_states, min(self.max_slots, key_states.shape[-2]))

    # --- layout -------------------------------------------------------------------------------------------------
    def _is_time_ordered(self, query_length: int) -> bool:
        """True while slot `i` holds position `i` for every returned slot: the standard mask is then exact."""
        return self._oldest == 0 and self.cumulative_length + query_length <= self.max_slots

    def _step_kind(self, query_length: int) -> str:
        """How a step of `query_length` tokens is stored and returned; `get_mask_sizes` and `update` both use it, so
        the layout told to the mask is always the layout of the returned keys (trap 3).

        - "ordered": the ring has not wrapped and will not: write in place, return slots `[0, length + q)`.
        - "decode": one token into a wrapped ring: write slot `length % capacity`, return the whole ring.
        - "window": return the held positions `[oldest, length)` in time order followed by the new tokens, then
          keep the newest (a prompt longer than the ring, a chunk after the wrap, a verification step).
        """
        if self._is_time_ordered(query_length):
            return "ordered"
        return "decode" if query_length == 1 else "window"

    def needs_ring_layout(self, query_length: int) -> bool:
        """True when the keys returned for this step are not in time order (a `RingLayout` describes them)."""
        return self._step_kind(query_length) == "decode"

    def _slot_positions(self, length: int | torch.Tensor, oldest: int | torch.Tensor | None = None) -> torch.Tensor:
        """Absolute position held by every slot when `length` tokens have been written, `-1` where empty/stale.

        `length` and `oldest` (default: the held `_oldest`) may be 0-d tensors: the compiled path passes its counter
        tensors so that no Python integer (nor a device sync) is involved.
        """
        oldest = self._oldest if oldest is None else oldest
        positions = slot_positions(length, self.max_slots, device=self.keys.device if self.is_initialized else None)
        return torch.where(positions >= oldest, positions, -1)

    def _first_returned(self, query_length: int) -> int:
        """First position a multi-token step returns: the `sliding_window - 1` positions before it that its first
        query sees (fewer at the start), exactly what transformers' own sliding layer returns. Gemma 4's drafter reads
        these returned keys by index (`[:current_length]`), so returning more (a rollback margin, the whole ring)
        would show it other keys than with `DynamicCache`. One-token steps return every slot written so far."""
        if query_length == 1:  # asked only before the wrap (in time order); a wrapped ring returns the ring itself
            return 0
        return max(self._oldest, self.cumulative_length - (self.sliding_window - 1))

    # transformers declares `-> tuple[int, int]`: keys returned out of time order put a `RingLayout` in the
    # offset's place, which this package's mask hook (mask_hook.py) reads; hence the wider return type.
    def get_mask_sizes(self, query_length: int) -> tuple[int, int | RingLayout]:  # type: ignore[override]
        length, width = self.cumulative_length, self.returned_key_count(query_length)
        if self._step_kind(query_length) == "decode":  # the ring after writing position `length`
            return width, RingLayout(self._slot_positions(length + 1), end=length + 1)
        # Time-ordered keys from `first` on; the hook checks that the model's window does not reach further back.
        first = self._first_returned(query_length)
        return width, HeldFromOffset(first) if first else 0

    def returned_key_count(self, query_length: int) -> int:
        decode = self._step_kind(query_length) == "decode"
        return self.max_slots if decode else self.cumulative_length - self._first_returned(query_length) + query_length

    def key_positions(self) -> torch.Tensor:
        """Absolute position of every key the last `update` returned, in the order returned (`-1`: empty slot).

        Column `j` of this layer's attention weights (`output_attentions=True`) belongs to position
        `key_positions()[j]`; see `hybrid_cache.attention_in_time_order`."""
        kind, first, second = self._returned
        if kind == "ring":
            return self._slot_positions(first, second)
        return torch.arange(first, second, device=self.keys.device if self.is_initialized else None)

    # --- update ---------------------------------------------------------------------------------------------------
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens and return the keys/values the attention must see, in the layout of `get_mask_sizes`.

        Args:
            key_states (`torch.Tensor` of shape `[batch, kv_heads, q_len, head_dim]`): new keys (after RoPE).
            value_states (`torch.Tensor` of shape `[batch, kv_heads, q_len, head_dim]`): new values.
        """
        self._prepare(key_states, value_states)
        query_length = key_states.shape[-2]
        length = self.cumulative_length
        self._ends_recording()
        kind = self._step_kind(query_length)

        if kind == "ordered":  # nothing is overwritten: any rollback stays exact
            first, end = self._first_returned(query_length), length + query_length
            self._grow(end, query_length, limit=self.max_slots)
            self.keys[:, :, length:end].copy_(key_states)
            self.values[:, :, length:end].copy_(value_states)
            self._advance(query_length)
            self._returned = ("range", first, end)
            return self.keys[:, :, first:end], self.values[:, :, first:end]

        # From here on the ring has (or gets) all its slots; the held prefix keeps its slots `p % capacity == p`.
        self._grow(self.max_slots, query_length, limit=self.max_slots)
        if kind == "decode":
            runs = self._newest_runs(1)
            self._keep_overwritten(runs, 1)
            self._write_newest(key_states, value_states)
            self._returned = ("ring", self.cumulative_length, self._oldest)
            return self.keys, self.values

        # The held positions must be copied out (in time order) before the write below overwrites them: from
        # `first` on for the attention, from `_oldest` on when the step may have to be undone.
        oldest, first = self._oldest, self._first_returned(query_length)
        copied_from = oldest if self.record_past else first
        if length > copied_from:
            held_keys, held_values = self._held_in_time_order(copied_from)
            window_keys = torch.cat([*held_keys, key_states], dim=-2)
            window_values = torch.cat([*held_values, value_states], dim=-2)
        else:
            window_keys, window_values = key_states, value_states
        if self.record_past:
            # Speculative step: keep what `crop` needs to undo it (the window, which the step copies anyway).
            self._undo = RingStepUndo(length, oldest, window_keys, window_values)
        else:
            self._keep_overwritten(self._newest_runs(query_length), query_length)
        self._write_newest(key_states, value_states)
        self._returned = ("range", first, length + query_length)
        skip = first - copied_from
        return window_keys[:, :, skip:], window_values[:, :, skip:]

    def _held_in_time_order(self, start_position: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Views of the slots holding positions `[start_position, length)` (all held), oldest first: one piece, or
        two across the end of the ring."""
        runs = ring_runs(start_position, self.cumulative_length - start_position, self.max_slots)
        keys = [self.keys[:, :, slot : slot + count] for slot, count, _ in runs]
        return keys, [self.values[:, :, slot : slot + count] for slot, count, _ in runs]

    def _newest_runs(self, query_length: int) -> SlotRuns:
        """Positions `[length, length + n)` keep their newest `min(n, capacity)` at `position % capacity`."""
        kept = min(query_length, self.max_slots)
        runs = ring_runs(self.cumulative_length + query_length - kept, kept, self.max_slots)
        return [(slot, count, source + query_length - kept) for slot, count, source in runs]

    def _advance(self, query_length: int) -> None:
        self.cumulative_length += query_length
        self._oldest = advance_oldest(self._oldest, self.cumulative_length, self.max_slots)

    # --- state (see `StorageLayer.meta_state`): the slots as they are, in slot order, with the two counters --------
    state_kind = "sliding_attention"

    def held_from(self) -> int:
        return int(self._oldest)

    def held_slots(self) -> int:
        """Slots worth keeping: `[0, length)` while in time order, else every slot."""
        return ring_slots(int(self.cumulative_length), int(self._oldest), self.max_slots)

    def accepts_state(self, meta: Mapping[str, Any]) -> bool:
        length, oldest, slots, capacity = meta["length"], meta["oldest"], meta["slots"], meta["capacity"]
        return (
            max(0, length - self.max_slots) <= oldest <= length
            and slots == ring_slots(length, oldest, self.max_slots) <= capacity <= self.max_slots
        )

    # --- protocol -------------------------------------------------------------------------------------------------
    def reset(self) -> None:
        super().reset()
        self._returned = ("range", 0, 0)

    def _reaches(self, new_length: int, oldest: int) -> bool:
        """The next query (at the new length `L`) needs positions `L - W + 1 .. L - 1`: all held iff
        `oldest <= max(0, L - W + 1)`."""
        return window_reaches(new_length, oldest, self.sliding_window)

    def _recorded_end(self, undo: RingStepUndo) -> int:
        return undo.oldest + undo.keys.shape[-2]

    def _rollback_error(self, new_length: int) -> RollbackError:
        return RollbackError(
            f"Cannot roll back to {new_length} tokens exactly: the sliding-window ring ({self.max_slots} slots = "
            f"window {self.sliding_window} + margin {self.rollback_margin}) already overwrote tokens the next query "
            f"needs (it undoes its last step if that overwrote at most {UNDO_SLOTS} slots, else at most "
            f"{self.rollback_margin + 1} tokens after the wrap). Create "
            f"the cache with `HybridRingCache(config, rollback_margin=N)` for N >= "
            f"{self.cumulative_length - new_length - 1}, call `cache.activate_past_recording()` before the "
            f"speculative step, or use `cache.checkpoint()` / `cache.restore()` for longer rollbacks."
        )

    def _undo_recorded_step(self, undo: RingStepUndo, new_length: int) -> None:
        # Rewrite positions [oldest, new_length) from the step's time-ordered window; the newest `capacity` stay.
        self.cumulative_length, self._oldest = undo.oldest, undo.oldest
        self._write_newest(undo.keys[:, :, : new_length - undo.oldest], undo.values[:, :, : new_length - undo.oldest])


class StaticRingSlidingLayer(RingSlidingLayer):
    """The ring of `RingSlidingLayer` with static addresses and tensor counters, for compiled decode steps and
    exported programs.

    A one-token step always writes slot `length % capacity` with `index_copy_` and returns the whole ring (also
    before the wrap: empty slots get position `-1` and are masked), so every compiled decode step has the same
    shapes and no branch on the cache length. Multi-token steps (prefill, not compiled) behave as in the parent,
    unless `tensor_steps` is set (an exported program, `hybrid_cache.export`): then a step of `n` tokens is tensor
    arithmetic of the counters too, for any `n` and length: it returns the ring as it was followed by its own keys
    (`capacity + n` keys, described by a `RingLayout`: a chunk never loses keys its own earlier queries need, however
    long), then keeps its newest tokens, slot by slot (a gather, no duplicate index); the counters are the caller's
    (the program's inputs), never advanced here. `slot_writes` says how slots are written (`storage.SlotWrites`).
    """

    is_compileable = True
    tensor_steps = False  # every step in tensor arithmetic, counters advanced by the caller (`hybrid_cache.export`)
    slot_writes = IN_PLACE
    cumulative_length = tensor_counter("length_tensor")
    _oldest = tensor_counter("oldest_tensor")
    _counter_names = ("length_tensor", "oldest_tensor")

    def __init__(self, sliding_window: int, rollback_margin: int = 0) -> None:
        self.length_tensor = torch.zeros((), dtype=torch.long)
        self.oldest_tensor = torch.zeros((), dtype=torch.long)
        super().__init__(sliding_window, rollback_margin)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        # All slots at once: compiled steps need one static buffer for the whole generation.
        self._allocate(key_states, value_states, self.max_slots)
        self.length_tensor = self.length_tensor.to(self.device)
        self.oldest_tensor = self.oldest_tensor.to(self.device)
        mark_static(self.keys, self.values, self.length_tensor, self.oldest_tensor)

    def needs_ring_layout(self, query_length: int) -> bool:
        return query_length == 1 or super().needs_ring_layout(query_length)

    def accepts_state(self, meta: Mapping[str, Any]) -> bool:
        return super().accepts_state(meta) and meta["capacity"] == self.max_slots

    def capacity_after(self, prompt_length: int, total_length: int) -> int:
        return self.max_slots  # all slots at the first update

    def returned_key_count(self, query_length: int) -> int:
        if query_length == 1 or self.tensor_steps:  # the ring (and a tensor step's own keys)
            return self.max_slots + (query_length if query_length != 1 else 0)
        return super().returned_key_count(query_length)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int | RingLayout]:  # type: ignore[override]
        if query_length != 1 and not self.tensor_steps:  # (the `RingLayout` return type: see the parent's)
            return super().get_mask_sizes(query_length)
        compiling = is_torchdynamo_compiling()
        if query_length != 1:  # the ring as it was, then the step's own keys
            held = self._slot_positions(self.length_tensor, self.oldest_tensor)
            positions = torch.cat([held, self.length_tensor + torch.arange(query_length, device=held.device)])
            end = self.length_tensor + query_length
            return self.returned_key_count(query_length), RingLayout(positions, end=end if compiling else int(end))
        # Positions after writing position `length` at slot `length % capacity`; computed from the tensors alone.
        end = self.length_tensor + 1
        positions = self._slot_positions(end, self.oldest_tensor)
        return self.returned_key_count(1), RingLayout(positions, end=end if compiling else int(end))

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        query_length = key_states.shape[-2]
        if query_length != 1 and not self.tensor_steps:
            return super().update(key_states, value_states, *args, **kwargs)
        # Compiled steps keep no record (`_crop_plan` then ignores older ones); nor do exported ones, whose storage
        # and counters are the program's.
        if not is_torchdynamo_compiling() and not self.tensor_steps:
            self._prepare(key_states, value_states)
            self._ends_recording()
            self._keep_overwritten(self._newest_runs(query_length), query_length)
            self._returned = ("counters", 0, 0)  # positions from the counters (see `key_positions`)
        if query_length != 1:
            return self._tensor_step(key_states, value_states)
        slot = floor_mod(self.length_tensor, self.max_slots).view(1)
        self.slot_writes.index(self, "keys", slot, key_states)
        self.slot_writes.index(self, "values", slot, value_states)
        if not self.tensor_steps:
            self.length_tensor.add_(1)
            self.oldest_tensor.copy_(advance_oldest(self.oldest_tensor, self.length_tensor, self.max_slots))
        return self.keys, self.values

    def _tensor_step(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A step of `n > 1` tokens in tensor arithmetic (`tensor_steps`): returns the ring as it was followed by the
        step's keys, then each slot takes the newest of the step's positions it holds, if any."""
        query_length = key_states.shape[-2]
        returned_keys = torch.cat([self.keys, key_states], dim=-2)
        returned_values = torch.cat([self.values, value_states], dim=-2)
        start = self.length_tensor
        after = slot_positions(start + query_length, self.max_slots, device=key_states.device)
        take = after >= start
        source = (after - start).clamp(0, query_length - 1)
        self.slot_writes.replace(self, "keys", take, key_states.index_select(2, source))
        self.slot_writes.replace(self, "values", take, value_states.index_select(2, source))
        return returned_keys, returned_values

    def key_positions(self) -> torch.Tensor:
        if self._returned[0] == "counters":
            return self._slot_positions(self.length_tensor, self.oldest_tensor)
        return super().key_positions()

    def _check_autograd_allowed(self) -> None:
        refuse_static_autograd()

    def _restatic(self, *tensors: torch.Tensor) -> None:
        mark_static(*tensors)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._reorder_in_place(beam_idx)
        self._undo = None
