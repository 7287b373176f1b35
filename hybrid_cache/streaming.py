"""Bounded full-attention layers (StreamingLLM-style, opt-in, approximate): attention sinks + a recent window.

With `HybridRingCache(config, full_layer_sink_tokens=S, full_layer_window=R)` every full-attention layer keeps the
first `S` tokens ("sinks") and the last `R` tokens, so the whole cache has a fixed size for endless streams. This
changes what the model sees: it is **not** exact (the sliding layers stay exact).

- Keys keep their absolute RoPE positions; nothing is ever moved or re-rotated (trap 1). StreamingLLM re-assigns
  positions inside the cache and re-rotates; keeping absolute positions is what a third-party audit of the Hub sink
  cache found better (perplexity 14.9 -> 10.0), and it needs no per-model RoPE code.
- The slots are not contiguous in time, so the layer describes them to the model's own mask function through the
  project's mask hook (`RingLayout`: the absolute position of every slot, `-1` for a slot the query must not see).
  The full layers' mask function is plain causality, so a slot is visible iff its layout position is valid.
- A one-token step at position `L` sees the sinks and the `R` tokens `L - R + 1 .. L` (itself included, as sliding
  windows count). A multi-token step `[L, L + n)` sees the sinks, the `R - 1` tokens before it and its own tokens up
  to each query (causal); its first query therefore sees exactly what a one-token step would.
- Rollback (`crop`) follows the sliding ring: exact for up to `rollback_margin + 1` tokens after the wrap, and the
  last multi-token step can be undone while past recording is on (assisted / prompt-lookup decoding).

Slot layout: position `p < S` lives in slot `p`; position `p >= S` in slot `S + (p - S) % C`, `C = R + margin`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from .errors import RollbackError
from .mask_hook import RingLayout
from .ring import UndoableStepLayer
from .storage import resolve_crop_length

__all__ = ["SinkWindowFullLayer"]


class SinkWindowStepUndo(NamedTuple):
    length: int
    oldest: int
    held_keys: torch.Tensor | None  # the slots before the step (None: nothing was held)
    held_values: torch.Tensor | None
    new_keys: torch.Tensor
    new_values: torch.Tensor


class SinkWindowFullLayer(UndoableStepLayer[SinkWindowStepUndo]):
    """A full-attention layer bounded to `sink_tokens` + `window` tokens (approximate; see the module docstring).

    Args:
        sink_tokens (`int`): first tokens kept forever (>= 0).
        window (`int`): recent tokens a one-token step sees, itself included (>= 1).
        rollback_margin (`int`, defaults to 0): extra ring slots making `crop(-n)` exact for `n <= margin + 1`.

    Example (token ids as values, `S=2, R=3`): prefill `[0..4]` -> slots `[0, 1, 2, 3, 4]` (in time order); decode 5
    -> slots `[0, 1, 5, 3, 4]`, layout `[0, 1, 5, 3, 4]`; decode 6 -> slots `[0, 1, 5, 6, 4]`, layout
    `[0, 1, 5, 6, -1]`: position 4 is held but outside the window of query 6.
    """

    is_sliding = False
    drops_tokens_by_design = True

    def __init__(self, sink_tokens: int, window: int, rollback_margin: int = 0) -> None:
        super().__init__()
        if sink_tokens < 0 or window < 1 or rollback_margin < 0:
            raise ValueError(
                f"Bounded full layers need full_layer_sink_tokens >= 0, full_layer_window >= 1 and rollback_margin "
                f">= 0; got {sink_tokens}, {window}, {rollback_margin}."
            )
        self.sink_tokens, self.window, self.rollback_margin = int(sink_tokens), int(window), int(rollback_margin)
        self._oldest = 0  # lowest position >= sink_tokens still held by the ring part
        self.record_past = False
        self._undo = None

    @property
    def ring_slots(self) -> int:
        return self.window + self.rollback_margin

    @property
    def max_slots(self) -> int:
        return self.sink_tokens + self.ring_slots

    # --- allocation -----------------------------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self._allocate(key_states, value_states, self.max_slots)
        self._slot_ids = torch.arange(self.ring_slots, device=self.device)

    # --- layout ---------------------------------------------------------------------------------------------------
    def _step_kind(self, query_length: int) -> str:
        length = self.cumulative_length
        if self._oldest <= self.sink_tokens and length + query_length <= self.sink_tokens + self.window:
            return "ordered"  # slot == position for every token so far, and nothing is outside the window yet
        if length == 0:
            return "fresh"
        return "decode" if query_length == 1 else "concat"

    def needs_ring_layout(self, query_length: int) -> bool:
        return self._step_kind(query_length) in ("decode", "concat")

    def _slot_positions(self, length: int, visible_from: int) -> torch.Tensor:
        """Absolute position of every slot once `length` tokens are written, `-1` where empty, stale or not visible
        (ring positions below `visible_from`)."""
        sinks = torch.arange(self.sink_tokens, device=self._slot_ids.device)
        sinks = torch.where(sinks < length, sinks, -1)
        start = self.sink_tokens
        ring = (length - 1) - torch.remainder((length - 1 - start) - self._slot_ids, self.ring_slots)
        valid = (ring >= max(start, self._oldest, visible_from)) & (ring < length)
        return torch.cat([sinks, torch.where(valid, ring, -1)])

    # transformers declares `-> tuple[int, int]`: keys returned out of time order put a `RingLayout` in the
    # offset's place, which this package's mask hook (mask_hook.py) reads; hence the wider return type.
    def get_mask_sizes(self, query_length: int) -> tuple[int, int | RingLayout]:  # type: ignore[override]
        length, kind = self.cumulative_length, self._step_kind(query_length)
        if kind == "ordered":
            return length + query_length, 0
        if kind == "fresh":
            return query_length, 0
        if kind == "decode":
            return self.max_slots, RingLayout(self._slot_positions(length + 1, length + 1 - self.window))
        held = self._slot_positions(length, length + 1 - self.window)
        new = torch.arange(length, length + query_length, device=held.device)
        return self.max_slots + query_length, RingLayout(torch.cat([held, new]))

    def _slot(self, position: int) -> int:
        if position < self.sink_tokens:
            return position
        return self.sink_tokens + (position - self.sink_tokens) % self.ring_slots

    # --- update ---------------------------------------------------------------------------------------------------
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens; return keys/values in the layout of `get_mask_sizes` (`[batch, kv_heads, slots,
        head_dim]`)."""
        self._prepare(key_states, value_states)
        length, query_length = self.cumulative_length, key_states.shape[-2]
        kind = self._step_kind(query_length)
        if self._undo is not None and self.record_past:
            self.record_past = False  # the recorded step was not rolled back: speculation is over (as in the rings)
        self._undo = None
        if kind == "ordered":
            end = length + query_length
            self.keys[:, :, length:end].copy_(key_states)
            self.values[:, :, length:end].copy_(value_states)
            self._advance(query_length)
            return self.keys[:, :, :end], self.values[:, :, :end]
        if kind == "decode":
            slot = self._slot(length)
            self.keys[:, :, slot : slot + 1].copy_(key_states)
            self.values[:, :, slot : slot + 1].copy_(value_states)
            self._advance(1)
            return self.keys, self.values
        if kind == "fresh":
            returned_keys, returned_values = key_states, value_states
            held_keys = held_values = None  # nothing held: an undo only resets the length
        else:
            # The held slots must be copied out before the writes below overwrite them.
            returned_keys = torch.cat([self.keys, key_states], dim=-2)
            returned_values = torch.cat([self.values, value_states], dim=-2)
            held_keys, held_values = returned_keys[:, :, : self.max_slots], returned_values[:, :, : self.max_slots]
        if self.record_past:
            # Speculative step (a prompt plus candidates, or candidates): keep what `crop` needs to undo it.
            self._undo = SinkWindowStepUndo(length, self._oldest, held_keys, held_values, key_states, value_states)
        self._write_newest(key_states, value_states)
        return returned_keys, returned_values

    def _write_newest(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Write the new tokens that stay held: sink positions, then the last `ring_slots` ring positions."""
        length, query_length = self.cumulative_length, key_states.shape[-2]
        sink_end = min(max(self.sink_tokens - length, 0), query_length)  # new tokens that are sinks
        if sink_end:
            self.keys[:, :, length : length + sink_end].copy_(key_states[:, :, :sink_end])
            self.values[:, :, length : length + sink_end].copy_(value_states[:, :, :sink_end])
        first = max(sink_end, query_length - self.ring_slots)
        position = length + first
        while first < query_length:  # at most two contiguous pieces
            slot = self._slot(position)
            count = min(query_length - first, self.max_slots - slot)
            self.keys[:, :, slot : slot + count].copy_(key_states[:, :, first : first + count])
            self.values[:, :, slot : slot + count].copy_(value_states[:, :, first : first + count])
            first, position = first + count, position + count
        self._advance(query_length)

    def _advance(self, query_length: int) -> None:
        self.cumulative_length += query_length
        self._oldest = max(self._oldest, self.cumulative_length - self.ring_slots)

    # --- protocol -------------------------------------------------------------------------------------------------
    def _crop_plan(self, tokens_to_remove: int) -> tuple[int, bool]:
        """`(new length, undo the last step?)` for `crop(tokens_to_remove)`, or raise `RollbackError` changing
        nothing: exact when the window the next query sees is still held, or from the last recorded step."""
        new_length = resolve_crop_length(tokens_to_remove, self.cumulative_length)
        if self._oldest <= max(self.sink_tokens, new_length - self.window + 1):
            return new_length, False
        if self._undo is not None and self._undo.length <= new_length:
            return new_length, True
        raise RollbackError(
            f"Cannot roll back to {new_length} tokens of a bounded full layer exactly: its window ({self.window} "
            f"tokens + margin {self.rollback_margin}) already overwrote tokens the next query needs. Create the cache "
            f"with `rollback_margin=N` for N >= {self.cumulative_length - new_length - 1}, or call "
            f"`cache.activate_past_recording()` before the speculative step."
        )

    def _undo_step(self, undo: SinkWindowStepUndo, new_length: int) -> None:
        if undo.held_keys is not None and undo.held_values is not None:  # both, or neither (a "fresh" step)
            self.keys.copy_(undo.held_keys)
            self.values.copy_(undo.held_values)
        self.cumulative_length, self._oldest = undo.length, undo.oldest
        kept = new_length - undo.length
        if kept:
            self._write_newest(undo.new_keys[:, :, :kept], undo.new_values[:, :, :kept])

    # --- state (see `StorageLayer.meta_state`): the slots as they are, in slot order, with the two counters --------
    state_kind = "sink_window_full_attention"

    def held_from(self) -> int:
        return int(self._oldest)

    def held_slots(self) -> int:
        """Slots ever written: positions `[0, length)` fill slots `[0, length)` until the ring part wraps."""
        return min(int(self.cumulative_length), self.max_slots)

    def state_settings(self) -> dict[str, Any]:
        return {
            "full_layer_sink_tokens": self.sink_tokens,
            "full_layer_window": self.window,
            "rollback_margin": self.rollback_margin,
        }

    def accepts_state(self, meta: Mapping[str, Any]) -> bool:
        length, oldest = meta["length"], meta["oldest"]
        return (
            max(0, length - self.ring_slots) <= oldest <= max(length, self.sink_tokens)
            and meta["slots"] == min(length, self.max_slots)
            and meta["capacity"] == self.max_slots
        )

    def extra_nbytes(self) -> int:
        """Counters plus what is kept to undo the last speculative step (while recording past)."""
        undo = self._undo
        kept = [] if undo is None else [t for t in undo[2:] if t is not None]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in kept}
        return super().extra_nbytes() + sum(storages.values())
