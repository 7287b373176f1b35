"""Sliding-window storage: a ring buffer of `sliding_window + rollback_margin` slots (`RingSlidingLayer`) and its
compileable variant with static addresses and tensor counters (`StaticRingSlidingLayer`), on `UndoableStepLayer`, the
base of every layer that overwrites slots in place (also `streaming.SinkWindowFullLayer`).

A ring of `capacity` slots keeps position `p` in slot `p % capacity`; `_oldest` is the lowest position still held, so
the ring holds positions `[_oldest, length)`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Generic, NamedTuple, TypeVar

import torch
from transformers.utils import is_torchdynamo_compiling

from .errors import RollbackError
from .mask_hook import HeldFromOffset, RingLayout
from .storage import (
    StorageLayer,
    capacity_after_decoding,
    mark_static,
    refuse_static_autograd,
    resolve_crop_length,
    tensor_counter,
    writable,
)

__all__ = ["RingSlidingLayer", "RingStepUndo", "StaticRingSlidingLayer", "UndoableStepLayer", "ring_slots"]


def ring_slots(length: int, oldest: int, max_slots: int) -> int:
    """Slots of a ring worth keeping: `[0, length)` while in time order (`oldest == 0`, `length <= max_slots`), else
    every slot (in slot order, not time order)."""
    return length if oldest == 0 and length <= max_slots else max_slots


UndoT = TypeVar("UndoT")  # what undoes a layer's last step (`ring.RingStepUndo`, `streaming.SinkWindowStepUndo`)


class UndoableStepLayer(StorageLayer, Generic[UndoT]):
    """A layer whose slots are overwritten in place (a ring), and which may therefore keep a copy to undo its last
    speculative step (`_undo`, while past recording is on). Every crop is planned first by `_crop_plan` (raising
    before anything changes) and then applied, undoing the kept step through `_undo_step` where the plan says so.
    Any batch reshuffle drops the copy: it was kept in the old batch order, so a later rollback must not restore it.

    Subclasses keep `_oldest` (the lowest overwritable position still held) and `max_slots` (slots allocated).
    """

    _undo: UndoT | None = None
    restores_by_length = False  # slots are overwritten in place: a checkpoint copies them
    ring_ordered = True
    records_steps = True

    def load_state(self, meta: Mapping[str, Any], keys: torch.Tensor, values: torch.Tensor) -> None:
        """As `StorageLayer.load_state`, and the slots past the state's are zeroed: a ring's unused slots hold
        nothing, as in the layer that was saved."""
        super().load_state(meta, keys, values)
        with writable(self.keys):
            self.keys[:, :, meta["slots"] :].zero_()
            self.values[:, :, meta["slots"] :].zero_()

    def _load_counters(self, meta: Mapping[str, Any]) -> None:
        self.cumulative_length, self._oldest = meta["length"], meta["oldest"]

    def _crop_plan(self, tokens_to_remove: int) -> tuple[int, bool]:
        """`(new length, undo the last step?)` for `crop(tokens_to_remove)`, or raise changing nothing."""
        raise NotImplementedError

    def _undo_step(self, undo: UndoT, new_length: int) -> None:
        """Restore the state before the kept step `undo`, then rewrite its first tokens up to `new_length`."""
        raise NotImplementedError

    def activate_past_recording(self) -> None:
        """Called by assisted / prompt-lookup decoding before steps that may be rolled back with `crop(-n)`.

        While recording, a multi-token step that overwrites slots keeps what is needed to undo it (for rings, the
        time-ordered window it returns, a `cat` it makes anyway) until the next `update` or `crop`, so `crop` can
        undo any part of that step exactly without growing the storage. Rollback of tokens from earlier steps is
        limited to `rollback_margin + 1` tokens.
        """
        self.record_past = True

    def deactivate_past_recording(self) -> None:
        """Stop recording and release the kept step (see `HybridRingCache.deactivate_past_recording`)."""
        self.record_past = False
        self._undo = None

    @property
    def max_slots(self) -> int:  # slots once all are allocated: each subclass's own, from its settings
        raise NotImplementedError

    def get_max_length(self) -> int:
        return self.max_slots

    def reset(self) -> None:
        super().reset()
        self._oldest = 0
        self.record_past = False
        self._undo = None

    def check_crop(self, tokens_to_remove: int) -> None:
        self._crop_plan(tokens_to_remove)

    def crop(self, tokens_to_remove: int) -> None:
        """Roll back tokens (negative: how many, transformers' convention; positive: the length to keep), exactly or
        not at all: a refused crop raises `RollbackError` and changes nothing. Any crop resolves the last speculative
        step, so the copy kept to undo it is released."""
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


class RingStepUndo(NamedTuple):
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
        slot_ids = torch.arange(self.max_slots, device=self.keys.device if self.is_initialized else None)
        positions = (length - 1) - torch.remainder((length - 1) - slot_ids, self.max_slots)
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
        length, kind = self.cumulative_length, self._step_kind(query_length)
        if kind == "decode":  # the ring after writing position `length`
            return self.max_slots, RingLayout(self._slot_positions(length + 1), end=length + 1)
        # Time-ordered keys from `first` on; the hook checks that the model's window does not reach further back.
        first = self._first_returned(query_length)
        return length - first + query_length, HeldFromOffset(first) if first else 0

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
        if self._undo is not None and self.record_past:
            # The last recorded step was never rolled back: speculative decoding (update, crop, update, crop, ...)
            # is over, so stop recording instead of keeping a window copy alive after every later step.
            self.record_past = False
        self._undo = None
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
            slot = length % self.max_slots
            self.keys[:, :, slot : slot + 1].copy_(key_states)
            self.values[:, :, slot : slot + 1].copy_(value_states)
            self._advance(1)
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
        self._write_newest(key_states, value_states)
        self._returned = ("range", first, length + query_length)
        skip = first - copied_from
        return window_keys[:, :, skip:], window_values[:, :, skip:]

    def _held_in_time_order(self, start_position: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Views of the slots holding positions `[start_position, length)` (all held), oldest first: one piece, or
        two across the end of the ring."""
        capacity = self.max_slots
        count = self.cumulative_length - start_position
        start = start_position % capacity
        pieces = [(start, min(start + count, capacity))]
        if start + count > capacity:
            pieces.append((0, start + count - capacity))
        return [self.keys[:, :, a:b] for a, b in pieces], [self.values[:, :, a:b] for a, b in pieces]

    def _write_newest(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Write `n` tokens as positions `[length, length + n)`, keeping the newest `min(n, capacity)` at
        `position % capacity` (at most two contiguous pieces), and advance the length."""
        query_length = key_states.shape[-2]
        capacity = self.max_slots
        kept = min(query_length, capacity)
        first_position = self.cumulative_length + query_length - kept
        start = first_position % capacity
        head = min(kept, capacity - start)
        source = query_length - kept
        self.keys[:, :, start : start + head].copy_(key_states[:, :, source : source + head])
        self.values[:, :, start : start + head].copy_(value_states[:, :, source : source + head])
        if kept > head:
            self.keys[:, :, : kept - head].copy_(key_states[:, :, source + head :])
            self.values[:, :, : kept - head].copy_(value_states[:, :, source + head :])
        self._advance(query_length)

    def _advance(self, query_length: int) -> None:
        self.cumulative_length += query_length
        self._oldest = max(self._oldest, self.cumulative_length - self.max_slots)

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
    def extra_nbytes(self) -> int:
        """Counters plus the window kept for undoing the last speculative step (while recording past)."""
        undo = self._undo
        storages = (
            {}
            if undo is None
            else {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in (undo.keys, undo.values)}
        )
        return super().extra_nbytes() + sum(storages.values())

    def reset(self) -> None:
        super().reset()
        self._returned = ("range", 0, 0)

    def _crop_plan(self, tokens_to_remove: int) -> tuple[int, bool]:
        """`(new length, undo the last step?)` for `crop(tokens_to_remove)`, or raise without changing anything.

        The next query (at the new length `L`) needs positions `L - W + 1 .. L - 1`; they are all still held iff
        `_oldest <= max(0, L - W + 1)`. Otherwise, if `L` falls inside the last recorded multi-token step, that step
        is undone from its kept window; else the rollback cannot be exact and we raise.
        """
        new_length = resolve_crop_length(tokens_to_remove, self.cumulative_length)
        if self._oldest <= max(0, new_length - self.sliding_window + 1):
            return new_length, False
        if self._undo is not None and self._undo.length <= new_length:
            return new_length, True
        raise RollbackError(
            f"Cannot roll back to {new_length} tokens exactly: the sliding-window ring ({self.max_slots} slots = "
            f"window {self.sliding_window} + margin {self.rollback_margin}) already overwrote tokens the next query "
            f"needs (it can undo at most {self.rollback_margin + 1} tokens after the wrap). Create the cache with "
            f"`HybridRingCache(config, rollback_margin=N)` for N >= {self.cumulative_length - new_length - 1}, call "
            f"`cache.activate_past_recording()` before the speculative step, or use `cache.checkpoint()` / "
            f"`cache.restore()` for longer rollbacks."
        )

    def _undo_step(self, undo: RingStepUndo, new_length: int) -> None:
        # Rewrite positions [oldest, new_length) from the step's time-ordered window; the newest `capacity` stay.
        self.cumulative_length, self._oldest = undo.oldest, undo.oldest
        self._write_newest(undo.keys[:, :, : new_length - undo.oldest], undo.values[:, :, : new_length - undo.oldest])


class StaticRingSlidingLayer(RingSlidingLayer):
    """The ring of `RingSlidingLayer` with static addresses and tensor counters, for compiled decode steps.

    A one-token step always writes slot `length % capacity` with `index_copy_` and returns the whole ring (also
    before the wrap: empty slots get position `-1` and are masked), so every compiled decode step has the same
    shapes and no branch on the cache length. Multi-token steps (prefill, not compiled) behave as in the parent.
    """

    is_compileable = True
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

    # transformers declares `-> tuple[int, int]`: keys returned out of time order put a `RingLayout` in the
    # offset's place, which this package's mask hook (mask_hook.py) reads; hence the wider return type.
    def get_mask_sizes(self, query_length: int) -> tuple[int, int | RingLayout]:  # type: ignore[override]
        if query_length != 1:
            return super().get_mask_sizes(query_length)
        # Positions after writing position `length` at slot `length % capacity`; computed from the tensors alone.
        end = self.length_tensor + 1
        positions = self._slot_positions(end, self.oldest_tensor)
        return self.max_slots, RingLayout(positions, end=end if is_torchdynamo_compiling() else int(end))

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if key_states.shape[-2] != 1:
            return super().update(key_states, value_states, *args, **kwargs)
        if not is_torchdynamo_compiling():
            self._prepare(key_states, value_states)
            self._undo = None
            self._returned = ("counters", 0, 0)  # positions from the counters (see `key_positions`)
        slot = torch.remainder(self.length_tensor, self.max_slots).view(1)
        self.keys.index_copy_(2, slot, key_states)
        self.values.index_copy_(2, slot, value_states)
        self.length_tensor.add_(1)
        torch.maximum(self.oldest_tensor, self.length_tensor - self.max_slots, out=self.oldest_tensor)
        return self.keys, self.values

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
