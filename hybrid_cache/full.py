"""Exact full-attention storage: an append-only buffer that grows by `GROWTH_FACTOR` (`GrowableFullLayer`) and a
preallocated, compileable buffer of `max_cache_len` slots (`StaticFullLayer`). Both are time-ordered.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from transformers.utils import is_torchdynamo_compiling

from .storage import (
    IN_PLACE,
    NOTHING_WRITTEN,
    StorageLayer,
    capacity_after_decoding,
    check_fixed_capacity,
    mark_static,
    prepare_fixed_capacity_step,
    refuse_static_autograd,
    tensor_counter,
)

__all__ = ["FixedCapacityCounters", "GrowableFullLayer", "StaticFullLayer"]


if TYPE_CHECKING:
    # A mixin for `StorageLayer` subclasses: the type checker sees the layer it is mixed into (its `_allocate`,
    # `device`, `storage_tensors`); at run time it stays a plain mixin placed before that layer in the bases.
    _MixedInto = StorageLayer
else:
    _MixedInto = object


class FixedCapacityCounters(_MixedInto):
    """The tensor counters of a fixed-capacity layer (for `torch.compile`): its length and its write floor live in
    0-d tensors, so compiled steps never specialize on a Python integer. Mixed into a `StorageLayer` subclass, before
    it in the bases; the layer calls `init_counters(max_cache_len)` in `__init__` and `allocate_fixed(...)` from its
    `lazy_initialization`."""

    cumulative_length = tensor_counter("length_tensor")
    write_floor = tensor_counter("floor_tensor")
    _counter_names = ("length_tensor", "floor_tensor")
    max_cache_len: int
    length_tensor: torch.Tensor
    floor_tensor: torch.Tensor

    def init_counters(self, max_cache_len: int) -> None:
        if max_cache_len < 1:
            raise ValueError(f"`max_cache_len` must be >= 1, got {max_cache_len}.")
        self.max_cache_len = int(max_cache_len)
        self.length_tensor = torch.zeros((), dtype=torch.long)
        self.floor_tensor = torch.full((), NOTHING_WRITTEN, dtype=torch.long)

    def check_fits(self, query_length: int) -> None:
        check_fixed_capacity(self, query_length)

    def note_write(self, position: int | torch.Tensor) -> None:
        # A tensor op, so that compiled decode steps record their writes too.
        position = torch.as_tensor(position, device=self.floor_tensor.device)
        torch.minimum(self.floor_tensor, position, out=self.floor_tensor)

    def key_positions(self) -> torch.Tensor:
        """Absolute position of every key the last `update` returned: the whole buffer, `-1` past the length."""
        positions = torch.arange(self.max_cache_len, device=self.length_tensor.device)
        return torch.where(positions < self.length_tensor, positions, -1)

    def allocate_fixed(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Allocate `max_cache_len` slots like `key_states` / `value_states`, move the counters to their device and
        mark storage and counters as static addresses."""
        self.floor_tensor = self.floor_tensor.to(key_states.device)
        self._allocate(key_states, value_states, self.max_cache_len)
        self.length_tensor = self.length_tensor.to(self.device)
        mark_static(*self.storage_tensors(), self.length_tensor, self.floor_tensor)


class GrowableFullLayer(StorageLayer):
    """A full-attention layer: an append-only buffer that grows geometrically (amortized O(1) per token).

    Returns a time-ordered view `[:, :, :length]`, so transformers' standard causal mask applies unchanged.
    Unlike `DynamicLayer`, a decode step copies only the new token: the history is copied only when the buffer
    grows by `GROWTH_FACTOR` (on average at most ~64 copies of each token over a whole generation, instead of
    `length / 2` for a per-step `torch.cat`).

    Args:
        initial_capacity (`int`, defaults to 0): slots allocated at the first update (or the prompt length if larger).
            With the default, a layer holds at most `floor(tokens x 65 / 64)` slots (1.6% above its tokens).
    """

    is_sliding = False
    state_kind = "full_attention"
    # Only `[:length]` is ever returned: new buffers skip the zero fill, so a prefill chunk writes each byte once.
    _zero_fill = False

    def __init__(self, initial_capacity: int = 0) -> None:
        super().__init__()
        self.initial_capacity = int(initial_capacity)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self._allocate(key_states, value_states, max(self.initial_capacity, key_states.shape[-2]))

    def capacity_after(self, prompt_length: int, total_length: int) -> int:
        return capacity_after_decoding(max(self.initial_capacity, prompt_length), total_length)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new tokens; return all tokens so far (`[batch, kv_heads, length, head_dim]` views)."""
        self._prepare(key_states, value_states)
        start = self.cumulative_length
        end = start + key_states.shape[-2]
        self._grow(end, key_states.shape[-2])
        self.note_write(start)
        self.keys[:, :, start:end].copy_(key_states)
        self.values[:, :, start:end].copy_(value_states)
        self.cumulative_length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cumulative_length + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        # Only the held tokens matter; select them alone so a beam step costs O(length), not O(capacity).
        if self.is_initialized:
            self._make_writable()
            length, beam = self.cumulative_length, beam_idx.to(self.device)
            self.keys[:, :, :length] = self.keys[:, :, :length].index_select(0, beam)
            self.values[:, :, :length] = self.values[:, :, :length].index_select(0, beam)
            self.note_write(0)


class StaticFullLayer(FixedCapacityCounters, StorageLayer):
    """A full-attention layer with a fixed, preallocated capacity (for `torch.compile`; static tensor addresses).

    Like transformers' `StaticLayer`, it returns the whole buffer (`max_cache_len` slots, time-ordered; slots past
    the current length are masked by causality) and keeps its length in a tensor so compiled steps never specialize
    on a Python integer.

    Args:
        max_cache_len (`int`): total tokens (prompt + generated) the layer can hold; exceeding it raises.
    """

    is_sliding = False
    is_compileable = True
    state_kind = "full_attention"
    tensor_steps = False  # an exported program's layer: storage and counters are the program's (`hybrid_cache.export`)
    slot_writes = IN_PLACE

    def __init__(self, max_cache_len: int) -> None:
        self.init_counters(max_cache_len)
        super().__init__()

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.allocate_fixed(key_states, value_states)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        query_length = key_states.shape[-2]
        # An exported program's layer (`tensor_steps`): its runner checked the capacity and advances the counter.
        if not self.tensor_steps:
            if not is_torchdynamo_compiling():  # shape checks read the counters: eager only
                prepare_fixed_capacity_step(self, key_states, value_states)
            self.note_write(self.length_tensor)
        positions = self.length_tensor + torch.arange(query_length, device=self.keys.device)
        self.slot_writes.index(self, "keys", positions, key_states)
        self.slot_writes.index(self, "values", positions, value_states)
        if not self.tensor_steps:
            self.length_tensor.add_(query_length)
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.max_cache_len, 0

    def _check_autograd_allowed(self) -> None:
        refuse_static_autograd()

    def _restatic(self, *tensors: torch.Tensor) -> None:
        mark_static(*tensors)

    def accepts_state(self, meta: Mapping[str, Any]) -> bool:
        return super().accepts_state(meta) and meta["capacity"] == self.max_cache_len

    def capacity_after(self, prompt_length: int, total_length: int) -> int:
        return self.max_cache_len

    def get_max_length(self) -> int:
        return self.max_cache_len

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._reorder_in_place(beam_idx)
