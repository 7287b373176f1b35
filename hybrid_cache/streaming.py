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

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from .errors import RollbackError
from .mask_hook import RingLayout
from .ring import UndoableStepLayer
from .slots import SlotRuns, advance_oldest, ring_runs, slot_positions, window_reaches

__all__ = ["SinkWindowFullLayer"]


@dataclasses.dataclass(eq=False)
class SinkWindowStepUndo:
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
    _step_fields: tuple[str, ...] = ("_undo", "record_past", "_returned")

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
        self._returned: tuple[str, int, int] = ("ordered", 0, 0)  # the last step's kind, length and query length

    @property
    def ring_slots(self) -> int:
        return self.window + self.rollback_margin

    @property
    def max_slots(self) -> int:
        return self.sink_tokens + self.ring_slots

    # --- allocation -----------------------------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self._allocate(key_states, value_states, self.max_slots)

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
        sinks = torch.arange(self.sink_tokens, device=self.device)
        sinks = torch.where(sinks < length, sinks, -1)
        start = self.sink_tokens
        ring = slot_positions(length, self.ring_slots, first=start, device=self.device)
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
            return self.returned_key_count(query_length), RingLayout(
                self._slot_positions(length + 1, length + 1 - self.window)
            )
        held = self._slot_positions(length, length + 1 - self.window)
        new = torch.arange(length, length + query_length, device=held.device)
        return self.returned_key_count(query_length), RingLayout(torch.cat([held, new]))

    def returned_key_count(self, query_length: int) -> int:
        kind = self._step_kind(query_length)
        if kind in ("ordered", "fresh"):
            return super().returned_key_count(query_length)  # get_mask_sizes' ints: no layout built
        return self.max_slots + (query_length if kind != "decode" else 0)

    # --- update ---------------------------------------------------------------------------------------------------
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens; return keys/values in the layout of `get_mask_sizes` (`[batch, kv_heads, slots,
        head_dim]`)."""
        self._prepare(key_states, value_states)
        length, query_length = self.cumulative_length, key_states.shape[-2]
        kind = self._step_kind(query_length)
        self._ends_recording()  # the recorded step was not rolled back: speculation is over (as in the rings)
        self._returned = (kind, length, query_length)
        if kind == "ordered":
            end = length + query_length
            self.keys[:, :, length:end].copy_(key_states)
            self.values[:, :, length:end].copy_(value_states)
            self._advance(query_length)
            return self.keys[:, :, :end], self.values[:, :, :end]
        if kind == "decode":
            self._keep_overwritten(self._newest_runs(1), 1)
            self._write_newest(key_states, value_states)
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
        else:
            self._keep_overwritten(self._newest_runs(query_length), query_length)
        self._write_newest(key_states, value_states)
        return returned_keys, returned_values

    def key_positions(self) -> torch.Tensor:
        """Absolute position of every key the last `update` returned, in the order returned (`-1`: an empty slot, or
        one the step's query did not see)."""
        kind, length, query_length = self._returned
        device = self.keys.device if self.is_initialized else None
        if kind == "ordered":
            return torch.arange(length + query_length, device=device)
        new = torch.arange(length, length + query_length, device=device)
        if kind == "fresh":
            return new
        if kind == "decode":
            return self._slot_positions(length + 1, length + 1 - self.window)
        return torch.cat([self._slot_positions(length, length + 1 - self.window), new])

    def _newest_runs(self, query_length: int) -> SlotRuns:
        """The new tokens that stay held: sink positions, then the last `ring_slots` ring positions."""
        length = self.cumulative_length
        sink_end = min(max(self.sink_tokens - length, 0), query_length)  # new tokens that are sinks
        runs = [(length, sink_end, 0)] if sink_end else []
        first = max(sink_end, query_length - self.ring_slots)
        start = self.sink_tokens
        for slot, count, offset in ring_runs(length + first - start, query_length - first, self.ring_slots):
            runs.append((start + slot, count, first + offset))
        return runs

    def _advance(self, query_length: int) -> None:
        self.cumulative_length += query_length
        self._oldest = advance_oldest(self._oldest, self.cumulative_length, self.ring_slots)

    # --- protocol -------------------------------------------------------------------------------------------------
    def _reaches(self, new_length: int, oldest: int) -> bool:
        """Exact when the window the next query sees is still held."""
        return window_reaches(new_length, oldest, self.window, first=self.sink_tokens)

    def _recorded_end(self, undo: SinkWindowStepUndo) -> int:
        return undo.length + undo.new_keys.shape[-2]

    def _rollback_error(self, new_length: int) -> RollbackError:
        return RollbackError(
            f"Cannot roll back to {new_length} tokens of a bounded full layer exactly: its window ({self.window} "
            f"tokens + margin {self.rollback_margin}) already overwrote tokens the next query needs. Create the cache "
            f"with `rollback_margin=N` for N >= {self.cumulative_length - new_length - 1}, or call "
            f"`cache.activate_past_recording()` before the speculative step."
        )

    def _undo_recorded_step(self, undo: SinkWindowStepUndo, new_length: int) -> None:
        if undo.held_keys is not None and undo.held_values is not None:  # both, or neither (a "fresh" step)
            self.keys.copy_(undo.held_keys)
            self.values.copy_(undo.held_values)
        self.cumulative_length, self._oldest = undo.length, undo.oldest
        kept = new_length - undo.length
        if kept > 0:
            self._write_newest(undo.new_keys[:, :, :kept], undo.new_values[:, :, :kept])
        else:
            self.cumulative_length = new_length

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
