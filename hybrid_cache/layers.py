"""Per-layer storage: a ring buffer for sliding-window layers and append-only storage for full-attention layers.

Both follow transformers' `CacheLayerMixin` protocol (`update`, `get_mask_sizes`, `get_seq_length`, `crop`, ...),
so the `HybridRingCache` container only forwards to them. Tensors are `[batch, kv_heads, slots, head_dim]`.

Positions are absolute cache positions: the number of tokens written before a token (padding tokens included),
exactly what transformers calls `cache_position`. A ring of `capacity` slots keeps position `p` in slot
`p % capacity`; `_oldest` is the lowest position still held, so the ring holds positions `[_oldest, length)`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from transformers.cache_utils import CacheLayerMixin
from transformers.utils import is_torchdynamo_compiling

from .mask_hook import RingLayout

__all__ = [
    "CacheCapacityError",
    "GrowableFullLayer",
    "RingSlidingLayer",
    "RollbackError",
    "StaticFullLayer",
    "StaticRingSlidingLayer",
]


class CacheCapacityError(RuntimeError):
    """Raised when a fixed-capacity layer is asked to hold more tokens than it was allocated for."""


class RollbackError(RuntimeError):
    """Raised when `crop` would need tokens a ring buffer has already overwritten."""


def _check_shapes(layer: CacheLayerMixin, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
    """Refuse updates whose batch size / heads / head size differ from the storage (never silently mix batches)."""
    expected = (layer.batch_size, layer.num_heads)
    if tuple(key_states.shape[:2]) != expected or tuple(value_states.shape[:2]) != expected:
        raise ValueError(
            f"HybridRingCache layer holds batch_size={layer.batch_size}, kv_heads={layer.num_heads} but received "
            f"keys of shape {tuple(key_states.shape)}. The batch size (or model) changed without resetting the "
            f"cache: call `cache.reset()` before reusing it for a new batch, or create a new HybridRingCache."
        )
    if key_states.dtype != layer.dtype or key_states.device != layer.device:
        raise ValueError(
            f"HybridRingCache layer holds {layer.dtype} on {layer.device} but received {key_states.dtype} on "
            f"{key_states.device}. Call `cache.reset()` before running the model in another dtype or device."
        )
    if key_states.shape[-1] != layer.k_head_dim or value_states.shape[-1] != layer.v_head_dim:
        raise ValueError(
            f"HybridRingCache layer was allocated for head sizes (k={layer.k_head_dim}, v={layer.v_head_dim}) but "
            f"received (k={key_states.shape[-1]}, v={value_states.shape[-1]}). Use one cache per model."
        )


# Growth of time-ordered buffers on one-token steps: to `floor(capacity * GROWTH_FACTOR)` slots (at least the one
# needed). A buffer then never holds more than 1/64 (1.6%) above its tokens, so the cache stays within 2% of an exactly
# sized one (a StaticCache holding the same tokens) at every decode step, while a growth still copies only the held
# prefix and each token is copied at most ~64 times on average over a whole generation: amortized O(1), about 64
# tokens' worth of copying per full layer per step (0.5 MiB at batch 8 in bf16 for Gemma 3), against the whole window
# StaticCache rolls and the whole history DynamicCache copies at every step.
GROWTH_FACTOR = 1 + 1 / 64


def _same_layout(layer: CacheLayerMixin, key_states: torch.Tensor, value_states: torch.Tensor) -> bool:
    return (
        tuple(key_states.shape[:2]) == (layer.batch_size, layer.num_heads)
        and key_states.shape[-1] == layer.k_head_dim
        and value_states.shape[-1] == layer.v_head_dim
        and key_states.dtype == layer.dtype
        and key_states.device == layer.device
    )


def _tensor_counter(tensor_name: str) -> property:
    """A Python-int view of a 0-d counter tensor; the tensor itself while compiling.

    Compiled decode steps must never specialize on a Python integer that changes every step (transformers #44609):
    the fixed-capacity layers keep their counters in tensors with static addresses, updated in place.
    """

    def getter(self) -> int | torch.Tensor:
        tensor = getattr(self, tensor_name)
        return tensor if is_torchdynamo_compiling() else int(tensor)

    def setter(self, value: int) -> None:
        getattr(self, tensor_name).fill_(value)

    return property(getter, setter)


def _mark_static(*tensors: torch.Tensor) -> None:
    # Static addresses let compiled graphs (and CUDA graphs) reuse the same buffers; impossible while tracing.
    if not is_torchdynamo_compiling():
        for tensor in tensors:
            torch._dynamo.mark_static_address(tensor)


class _StorageLayer(CacheLayerMixin):
    """Shared allocation logic: lazy allocation from the first `update`, on the tensors' own device and dtype."""

    is_croppable = True

    def __init__(self) -> None:
        super().__init__()
        self.cumulative_length = 0

    def _allocate(self, key_states: torch.Tensor, value_states: torch.Tensor, slots: int) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.batch_size, self.num_heads = key_states.shape[:2]
        self.k_head_dim, self.v_head_dim = key_states.shape[-1], value_states.shape[-1]
        self.keys = key_states.new_zeros((self.batch_size, self.num_heads, slots, self.k_head_dim))
        self.values = value_states.new_zeros((self.batch_size, self.num_heads, slots, self.v_head_dim))
        self.is_initialized = True

    def _grow(self, needed: int, query_length: int, limit: int | None = None) -> None:
        """Make room for `needed` time-ordered slots, copying only the held prefix `[:length]`; never beyond `limit`.

        One-token steps grow to `floor(capacity * GROWTH_FACTOR)` (amortized O(1) per token, at most 1/64 slack).
        Multi-token steps (prompts, prefill chunks) grow to exactly `needed`: their own attention already reads the
        whole history, so one more copy of it costs little, and a prompt or a chunked prefill then leaves no slack.
        """
        if needed <= self.capacity:
            return
        new_capacity = needed if query_length > 1 else max(needed, math.floor(self.capacity * GROWTH_FACTOR))
        if limit is not None:
            new_capacity = min(new_capacity, limit)
        length = self.cumulative_length
        new_keys = self.keys.new_zeros(self.keys.shape[:2] + (new_capacity, self.k_head_dim))
        new_values = self.values.new_zeros(self.values.shape[:2] + (new_capacity, self.v_head_dim))
        new_keys[:, :, :length].copy_(self.keys[:, :, :length])
        new_values[:, :, :length].copy_(self.values[:, :, :length])
        self.keys, self.values = new_keys, new_values

    def _prepare(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        elif self.get_seq_length() == 0 and not _same_layout(self, key_states, value_states):
            # An empty (new or reset) cache may take any batch size / dtype / device: reallocate.
            self.lazy_initialization(key_states, value_states)
        else:
            _check_shapes(self, key_states, value_states)

    @property
    def capacity(self) -> int:
        """Number of token slots currently allocated (0 before the first update)."""
        return self.keys.shape[-2] if self.is_initialized else 0

    def nbytes(self) -> int:
        """Bytes held by this layer's key and value storage (what is actually allocated)."""
        if not self.is_initialized:
            return 0
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values))

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def reset(self) -> None:
        """Forget all tokens; keep the allocation for reuse (a new batch size / dtype / device reallocates)."""
        self.cumulative_length = 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            beam_idx = beam_idx.to(self.device)
            self.keys = self.keys.index_select(0, beam_idx)
            self.values = self.values.index_select(0, beam_idx)

    def _reorder_in_place(self, beam_idx: torch.LongTensor) -> None:
        # In place, to keep the static addresses that compiled graphs captured.
        if self.is_initialized:
            beam_idx = beam_idx.to(self.device)
            self.keys.copy_(self.keys.index_select(0, beam_idx))
            self.values.copy_(self.values.index_select(0, beam_idx))

    def crop(self, tokens_to_remove: int) -> None:
        """Time-ordered storage: a rollback only moves the length (negative: tokens to remove; positive, legacy:
        the length to keep)."""
        if tokens_to_remove > 0:
            tokens_to_remove = tokens_to_remove - self.cumulative_length
        self.cumulative_length = max(0, self.cumulative_length + min(tokens_to_remove, 0))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self.keys = self.keys.repeat_interleave(repeats, dim=0)
            self.values = self.values.repeat_interleave(repeats, dim=0)
            self.batch_size = self.keys.shape[0]

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self.keys = self.keys[indices, ...]
            self.values = self.values[indices, ...]
            self.batch_size = self.keys.shape[0]


class _StepUndo(NamedTuple):
    """What `crop` needs to undo the last multi-token step of a wrapped ring (kept only while recording past)."""

    length: int  # cache length before the step
    oldest: int  # oldest held position before the step
    held_keys: torch.Tensor | None  # the ring's slots before the step (None: nothing was held)
    held_values: torch.Tensor | None
    new_keys: torch.Tensor  # the step's tokens
    new_values: torch.Tensor


class RingSlidingLayer(_StorageLayer):
    """A sliding-window layer stored as a ring of `sliding_window + rollback_margin` slots.

    A one-token step writes its key/value in place at slot `position % capacity` (no copy of the window, no `cat`,
    no `roll`) and returns the whole ring; the ring's slot order is described to the mask by a `RingLayout`.
    A multi-token step returns the held slots followed by the new tokens (so every query sees its full window),
    then keeps only the newest tokens. Keys are never moved to another position, so RoPE stays valid.

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
        self._undo: _StepUndo | None = None
        self._slot_ids = torch.arange(self.max_slots)

    @property
    def max_slots(self) -> int:
        return self.sliding_window + self.rollback_margin

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        # Short sequences never need the whole window: start at the first step's size and grow (while the ring is
        # still in time order) up to `max_slots`, so a 60-token chat holds 60 slots, not 512.
        self._allocate(key_states, value_states, min(self.max_slots, key_states.shape[-2]))
        self._slot_ids = self._slot_ids.to(self.device)

    def activate_past_recording(self) -> None:
        """Called by assisted / prompt-lookup decoding before steps that may be rolled back with `crop(-n)`.

        While recording, a wrapped multi-token step keeps the copy of the window it already makes (`cat` of the held
        slots and the new tokens) until the next update, so `crop` can undo any part of that step exactly without
        growing the ring. Rollback of tokens from earlier steps is limited to `rollback_margin + 1` tokens.
        """
        self.record_past = True

    # --- layout -------------------------------------------------------------------------------------------------
    def _is_time_ordered(self, query_length: int) -> bool:
        """True while slot `i` holds position `i` for every returned slot: the standard mask is then exact."""
        return self._oldest == 0 and self.cumulative_length + query_length <= self.max_slots

    def _step_kind(self, query_length: int) -> str:
        """How a step of `query_length` tokens is stored and returned; `get_mask_sizes` and `update` both use it, so
        the layout told to the mask is always the layout of the returned keys (trap 3).

        - "ordered": the ring has not wrapped and will not: write in place, return slots `[0, length + q)`.
        - "decode": one token into a wrapped ring: write slot `length % capacity`, return the whole ring.
        - "fresh": nothing held (a prompt longer than the ring): return the new tokens, keep the newest.
        - "concat": return the held slots followed by the new tokens, then keep the newest.
        """
        if self._is_time_ordered(query_length):
            return "ordered"
        if query_length == 1:
            return "decode"
        return "fresh" if self.cumulative_length == self._oldest else "concat"

    def needs_ring_layout(self, query_length: int) -> bool:
        """True when the keys returned for this step are not in time order (a `RingLayout` describes them)."""
        return self._step_kind(query_length) in ("decode", "concat")

    def _slot_positions(self, length: int | torch.Tensor, oldest: int | torch.Tensor | None = None) -> torch.Tensor:
        """Absolute position held by every slot when `length` tokens have been written, `-1` where empty/stale.

        `length` and `oldest` (default: the held `_oldest`) may be 0-d tensors: the compiled path passes its counter
        tensors so that no Python integer (nor a device sync) is involved.
        """
        oldest = self._oldest if oldest is None else oldest
        positions = (length - 1) - torch.remainder((length - 1) - self._slot_ids, self.max_slots)
        return torch.where(positions >= oldest, positions, -1)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int | RingLayout]:
        length, kind = self.cumulative_length, self._step_kind(query_length)
        if kind == "ordered":
            return length + query_length, 0
        if kind == "fresh":
            return query_length, length
        if kind == "decode":  # the ring after writing position `length`
            return self.max_slots, RingLayout(self._slot_positions(length + 1))
        new_positions = torch.arange(length, length + query_length, device=self._slot_ids.device)
        return self.max_slots + query_length, RingLayout(torch.cat([self._slot_positions(length), new_positions]))

    # --- update ---------------------------------------------------------------------------------------------------
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens and return the keys/values the attention must see, in the layout of `get_mask_sizes`.

        Args:
            key_states (`torch.Tensor` of shape `[batch, kv_heads, q_len, head_dim]`): new keys (after RoPE).
            value_states (`torch.Tensor` of shape `[batch, kv_heads, q_len, head_dim]`): new values.
        """
        self._prepare(key_states, value_states)
        query_length = key_states.shape[-2]
        length = self.cumulative_length
        self._undo = None
        kind = self._step_kind(query_length)

        if kind == "ordered":  # nothing is overwritten: any rollback stays exact
            end = length + query_length
            self._grow(end, query_length, limit=self.max_slots)
            self.keys[:, :, length:end].copy_(key_states)
            self.values[:, :, length:end].copy_(value_states)
            self._advance(query_length)
            return self.keys[:, :, :end], self.values[:, :, :end]

        # From here on the ring has (or gets) all its slots; the held prefix keeps its slots `p % capacity == p`.
        self._grow(self.max_slots, query_length, limit=self.max_slots)
        if kind == "decode":
            slot = length % self.max_slots
            self.keys[:, :, slot : slot + 1].copy_(key_states)
            self.values[:, :, slot : slot + 1].copy_(value_states)
            self._advance(1)
            return self.keys, self.values

        if kind == "fresh":
            returned_keys, returned_values = key_states, value_states
            held_keys = held_values = None
        else:
            # The held window must be copied out before the write below overwrites it.
            returned_keys = torch.cat([self.keys, key_states], dim=-2)
            returned_values = torch.cat([self.values, value_states], dim=-2)
            held_keys, held_values = returned_keys[:, :, : self.max_slots], returned_values[:, :, : self.max_slots]
        if self.record_past:
            # Speculative step: keep what `crop` needs to undo it (views of tensors that exist anyway).
            self._undo = _StepUndo(length, self._oldest, held_keys, held_values, key_states, value_states)
        self._write_newest(key_states, value_states)
        return returned_keys, returned_values

    def _write_newest(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Write the last `min(n, capacity)` new tokens at `position % capacity` (at most two contiguous pieces)."""
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

    # --- protocol -------------------------------------------------------------------------------------------------
    def get_max_length(self) -> int:
        return self.max_slots

    def reset(self) -> None:
        super().reset()
        self._oldest = 0
        self.record_past = False
        self._undo = None

    def crop(self, tokens_to_remove: int) -> None:
        """Roll back the last `-tokens_to_remove` tokens (negative, transformers' convention), exactly or not at all.

        The next query (at the new length `L`) needs positions `L - W + 1 .. L - 1`; they are all still held iff
        `_oldest <= max(0, L - W + 1)`. Otherwise, if past recording is on and `L` falls inside the last multi-token
        step, that step is undone from its saved copy and its first tokens rewritten; else we raise.
        """
        if tokens_to_remove > 0:
            # Legacy transformers convention: a positive value is the length to keep.
            tokens_to_remove = tokens_to_remove - self.cumulative_length
            if tokens_to_remove > 0:
                raise ValueError(f"Cannot crop to {tokens_to_remove + self.cumulative_length} tokens: only "
                                 f"{self.cumulative_length} are cached.")
        remove = -tokens_to_remove
        if remove == 0:
            return
        new_length = self.cumulative_length - remove
        if new_length < 0:
            raise RollbackError(f"Cannot remove {remove} tokens: only {self.cumulative_length} are cached.")
        if self._oldest <= max(0, new_length - self.sliding_window + 1):
            self.cumulative_length = new_length
            return
        undo = self._undo
        if undo is not None and undo.length <= new_length:
            self._undo = None
            if undo.held_keys is not None:
                self.keys.copy_(undo.held_keys)
                self.values.copy_(undo.held_values)
            self.cumulative_length, self._oldest = undo.length, undo.oldest
            kept = new_length - undo.length
            if kept:
                self._write_newest(undo.new_keys[:, :, :kept], undo.new_values[:, :, :kept])
            return
        raise RollbackError(
            f"Cannot roll back {remove} tokens exactly: the sliding-window ring ({self.max_slots} slots = window "
            f"{self.sliding_window} + margin {self.rollback_margin}) already overwrote tokens the next query "
            f"needs (it can undo at most {self.rollback_margin + 1} tokens after the wrap). Create the cache with "
            f"`HybridRingCache(config, rollback_margin=N)` for N >= {remove - 1}, or call "
            f"`cache.activate_past_recording()` before the speculative step."
        )

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self._undo = None  # saved in the old batch order: a later rollback must not restore it

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self._undo = None

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self._undo = None


class GrowableFullLayer(_StorageLayer):
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

    def __init__(self, initial_capacity: int = 0) -> None:
        super().__init__()
        self.initial_capacity = int(initial_capacity)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self._allocate(key_states, value_states, max(self.initial_capacity, key_states.shape[-2]))

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new tokens; return all tokens so far (`[batch, kv_heads, length, head_dim]` views)."""
        self._prepare(key_states, value_states)
        start = self.cumulative_length
        end = start + key_states.shape[-2]
        self._grow(end, key_states.shape[-2])
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
            length, beam_idx = self.cumulative_length, beam_idx.to(self.device)
            self.keys[:, :, :length] = self.keys[:, :, :length].index_select(0, beam_idx)
            self.values[:, :, :length] = self.values[:, :, :length].index_select(0, beam_idx)


class StaticFullLayer(_StorageLayer):
    """A full-attention layer with a fixed, preallocated capacity (for `torch.compile`; static tensor addresses).

    Like transformers' `StaticLayer`, it returns the whole buffer (`max_cache_len` slots, time-ordered; slots past
    the current length are masked by causality) and keeps its length in a tensor so compiled steps never specialize
    on a Python integer.

    Args:
        max_cache_len (`int`): total tokens (prompt + generated) the layer can hold; exceeding it raises.
    """

    is_sliding = False
    is_compileable = True
    cumulative_length = _tensor_counter("length_tensor")

    def __init__(self, max_cache_len: int) -> None:
        if max_cache_len < 1:
            raise ValueError(f"`max_cache_len` must be >= 1, got {max_cache_len}.")
        self.max_cache_len = int(max_cache_len)
        self.length_tensor = torch.zeros((), dtype=torch.long)
        super().__init__()

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self._allocate(key_states, value_states, self.max_cache_len)
        self.length_tensor = self.length_tensor.to(self.device)
        _mark_static(self.keys, self.values, self.length_tensor)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        query_length = key_states.shape[-2]
        if not is_torchdynamo_compiling():  # shape checks read the counters: eager only
            self._prepare(key_states, value_states)
            end = self.cumulative_length + query_length
            if end > self.max_cache_len:
                raise CacheCapacityError(
                    f"The full-attention layers were allocated for max_cache_len={self.max_cache_len} tokens, but "
                    f"{end} are needed. Create the cache with a larger `max_cache_len` (prompt + max_new_tokens), or "
                    f"leave it unset for storage that grows."
                )
        positions = self.length_tensor + torch.arange(query_length, device=self.device)
        self.keys.index_copy_(2, positions, key_states)
        self.values.index_copy_(2, positions, value_states)
        self.length_tensor.add_(query_length)
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.max_cache_len, 0

    def get_max_length(self) -> int:
        return self.max_cache_len

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._reorder_in_place(beam_idx)


class StaticRingSlidingLayer(RingSlidingLayer):
    """The ring of `RingSlidingLayer` with static addresses and tensor counters, for compiled decode steps.

    A one-token step always writes slot `length % capacity` with `index_copy_` and returns the whole ring (also
    before the wrap: empty slots get position `-1` and are masked), so every compiled decode step has the same
    shapes and no branch on the cache length. Multi-token steps (prefill, not compiled) behave as in the parent.
    """

    is_compileable = True
    cumulative_length = _tensor_counter("length_tensor")
    _oldest = _tensor_counter("oldest_tensor")

    def __init__(self, sliding_window: int, rollback_margin: int = 0) -> None:
        self.length_tensor = torch.zeros((), dtype=torch.long)
        self.oldest_tensor = torch.zeros((), dtype=torch.long)
        super().__init__(sliding_window, rollback_margin)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        # All slots at once: compiled steps need one static buffer for the whole generation.
        self._allocate(key_states, value_states, self.max_slots)
        self._slot_ids = self._slot_ids.to(self.device)
        self.length_tensor = self.length_tensor.to(self.device)
        self.oldest_tensor = self.oldest_tensor.to(self.device)
        _mark_static(self.keys, self.values, self.length_tensor, self.oldest_tensor)

    def needs_ring_layout(self, query_length: int) -> bool:
        return query_length == 1 or super().needs_ring_layout(query_length)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int | RingLayout]:
        if query_length != 1:
            return super().get_mask_sizes(query_length)
        # Positions after writing position `length` at slot `length % capacity`; computed from the tensors alone.
        return self.max_slots, RingLayout(self._slot_positions(self.length_tensor + 1, self.oldest_tensor))

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if key_states.shape[-2] != 1:
            return super().update(key_states, value_states, *args, **kwargs)
        if not is_torchdynamo_compiling():
            self._prepare(key_states, value_states)
            self._undo = None
        slot = torch.remainder(self.length_tensor, self.max_slots).view(1)
        self.keys.index_copy_(2, slot, key_states)
        self.values.index_copy_(2, slot, value_states)
        self.length_tensor.add_(1)
        torch.maximum(self.oldest_tensor, self.length_tensor - self.max_slots, out=self.oldest_tensor)
        return self.keys, self.values

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._reorder_in_place(beam_idx)
        self._undo = None
