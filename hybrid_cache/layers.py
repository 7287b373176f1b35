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
from transformers.utils import is_torchdynamo_compiling

from .compat import CacheLayerMixin
from .errors import CacheCapacityError, RollbackError
from .mask_hook import HeldFromOffset, RingLayout

__all__ = [
    "CacheCapacityError",
    "GrowableFullLayer",
    "RingSlidingLayer",
    "RollbackError",
    "StaticFullLayer",
    "StaticRingSlidingLayer",
]


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


def grown_capacity(capacity: int, needed: int, query_length: int, limit: int | None = None) -> int:
    """Slots a time-ordered buffer of `capacity` slots grows to when a step of `query_length` tokens needs `needed`.

    The growth rule of `_StorageLayer._grow`, also used by `capacity_after` (the memory planner): one-token steps grow
    by `GROWTH_FACTOR`, multi-token steps to exactly `needed`; never beyond `limit`.
    """
    if needed <= capacity:
        return capacity
    new_capacity = needed if query_length > 1 else max(needed, math.floor(capacity * GROWTH_FACTOR))
    return new_capacity if limit is None else min(new_capacity, limit)


def _capacity_after_decoding(first: int, total_length: int, limit: int | None = None) -> int:
    """Slots held after a first allocation of `first` slots and one-token steps up to `total_length` tokens.

    A buffer grows only when a one-token step finds it full (`length == capacity`), so jumping from one growth to the
    next gives the same capacity as replaying every step, in O(log total_length) iterations.
    """
    capacity = first
    while capacity < total_length and (limit is None or capacity < limit):
        capacity = grown_capacity(capacity, capacity + 1, 1, limit)
    return capacity


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


# `write_floor` when nothing was written since it was last cleared (any position compares above it).
NOTHING_WRITTEN = 2**62


class _StorageLayer(CacheLayerMixin):
    """Shared allocation logic: lazy allocation from the first `update`, on the tensors' own device and dtype."""

    is_croppable = True
    # Tensors a layer owns besides `keys` / `values` that in-place updates touch (the static layers' counters).
    _counter_names: tuple[str, ...] = ()
    # Whether new buffers start zeroed: layers that can return slots never written (a ring's empty slots, a fixed
    # buffer past its length) need finite values there, since a masked key still enters `q @ k`.
    _zero_fill = True

    def _new_buffer(self, like: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        return like.new_zeros(shape) if self._zero_fill else like.new_empty(shape)

    def __init__(self) -> None:
        super().__init__()
        self.cumulative_length = 0
        self.write_floor = NOTHING_WRITTEN

    def note_write(self, position: int) -> None:
        """Record that the stored tokens from `position` on may have changed.

        `write_floor` is the lowest such position since `hybrid_cache.snapshot` last cleared it (to
        `NOTHING_WRITTEN`): a checkpoint of length `L` can cut a full layer back to `L` only if its tokens before `L`
        were not rewritten since (a crop or reset below `L` followed by new tokens, a beam reorder, a reallocation).
        """
        self.write_floor = min(self.write_floor, position)

    def _allocate(self, key_states: torch.Tensor, value_states: torch.Tensor, slots: int) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.batch_size, self.num_heads = key_states.shape[:2]
        self.k_head_dim, self.v_head_dim = key_states.shape[-1], value_states.shape[-1]
        self.keys = self._new_buffer(key_states, (self.batch_size, self.num_heads, slots, self.k_head_dim))
        self.values = self._new_buffer(value_states, (self.batch_size, self.num_heads, slots, self.v_head_dim))
        self.is_initialized = True
        self.note_write(0)

    def _grow(self, needed: int, query_length: int, limit: int | None = None) -> None:
        """Make room for `needed` time-ordered slots, copying only the held prefix `[:length]`; never beyond `limit`.

        One-token steps grow to `floor(capacity * GROWTH_FACTOR)` (amortized O(1) per token, at most 1/64 slack).
        Multi-token steps (prompts, prefill chunks) grow to exactly `needed`: their own attention already reads the
        whole history, so one more copy of it costs little, and a prompt or a chunked prefill then leaves no slack.
        """
        if needed <= self.capacity:
            return
        new_capacity = grown_capacity(self.capacity, needed, query_length, limit)
        length = self.cumulative_length
        new_keys = self._new_buffer(self.keys, self.keys.shape[:2] + (new_capacity, self.k_head_dim))
        new_values = self._new_buffer(self.values, self.values.shape[:2] + (new_capacity, self.v_head_dim))
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
        self._make_writable(torch.is_grad_enabled() and (key_states.requires_grad or value_states.requires_grad))

    def _make_writable(self, new_states_need_grad: bool = False) -> None:
        """Make the storage safe to write in place, whatever the autograd / inference mode of earlier steps.

        - Tensors allocated under `torch.inference_mode()` (pipelines fill caches that way) cannot be written in
          place outside it: outside inference mode they are replaced once by normal copies.
        - With gradients (chunked training, truncated backprop), an earlier step's attention saved the returned
          keys for backward: writing into them in place would make `backward()` fail. The storage is then copied
          before each write (out of place, like `DynamicCache`'s `cat`), so every saved tensor stays intact.
        """
        if not self.is_initialized:
            return
        outside_inference = not torch.is_inference_mode_enabled()
        storage = self.storage_tensors()
        tracks_grad = new_states_need_grad or any(tensor.requires_grad for tensor in storage)
        if tracks_grad:
            self._check_autograd_allowed()
        if tracks_grad or (outside_inference and any(tensor.is_inference() for tensor in storage)):
            self._map_storage(torch.clone)
            self._restatic(*self.storage_tensors())
        if outside_inference:
            for name in self._counter_names:
                if getattr(self, name).is_inference():
                    setattr(self, name, getattr(self, name).clone())
                    self._restatic(getattr(self, name))

    def storage_tensors(self) -> list[torch.Tensor]:
        """Every tensor holding this layer's tokens (layouts other than dense keys / values override this and
        `_map_storage`)."""
        return [self.keys, self.values] if self.is_initialized else []

    def _map_storage(self, function) -> None:
        """Replace every storage tensor by `function(tensor)`."""
        self.keys, self.values = function(self.keys), function(self.values)

    def _check_autograd_allowed(self) -> None:
        """Layers with static addresses (compiled mode) override this to refuse copying on every step."""

    def _restatic(self, *tensors: torch.Tensor) -> None:
        """Layers with static addresses mark their replacement tensors static again."""

    @property
    def capacity(self) -> int:
        """Number of token slots currently allocated (0 before the first update)."""
        return self.keys.shape[-2] if self.is_initialized else 0

    def nbytes(self) -> int:
        """Bytes held by this layer's storage tensors (what is actually allocated)."""
        return sum(t.numel() * t.element_size() for t in self.storage_tensors())

    def uncompressed_bytes_per_token(self) -> int:
        """Bytes per token of this layer's keys and values stored exactly in the model dtype (`memory_report`'s
        full-cache comparison)."""
        return self.batch_size * self.num_heads * (self.k_head_dim + self.v_head_dim) * self.dtype.itemsize

    def extra_nbytes(self) -> int:
        """Bytes of everything else the layer keeps alive (counters, rollback copies); see `RingSlidingLayer`."""
        if not self.is_initialized:
            return 0
        return sum(getattr(self, name).numel() * getattr(self, name).element_size() for name in self._counter_names)

    # --- planning (hybrid_cache.planner): what `nbytes()` will report, without allocating -------------------------
    def capacity_after(self, prompt_length: int, total_length: int) -> int:
        """Slots this layer holds after a prompt of `prompt_length` tokens (one step) and one-token steps up to
        `total_length` tokens (`prompt_length <= total_length`)."""
        raise NotImplementedError

    def planned_nbytes(
        self,
        batch_size: int,
        num_heads: int,
        k_head_dim: int,
        v_head_dim: int,
        dtype: torch.dtype,
        prompt_length: int,
        total_length: int,
    ) -> int:
        """What `nbytes()` reports after `capacity_after(prompt_length, total_length)`, for K/V of these shapes.
        Storage layouts other than dense `[batch, kv_heads, slots, head_dim]` buffers override both methods."""
        element_size = torch.empty((), dtype=dtype).element_size()
        slots = self.capacity_after(prompt_length, total_length)
        return batch_size * num_heads * slots * (k_head_dim + v_head_dim) * element_size

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def reset(self) -> None:
        """Forget all tokens; keep the allocation for reuse (a new batch size / dtype / device reallocates)."""
        self.cumulative_length = 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            beam_idx = beam_idx.to(self.device)
            self._map_storage(lambda tensor: tensor.index_select(0, beam_idx))
            self.note_write(0)

    def _reorder_in_place(self, beam_idx: torch.LongTensor) -> None:
        # In place, to keep the static addresses that compiled graphs captured.
        if self.is_initialized:
            self._make_writable()
            beam_idx = beam_idx.to(self.device)
            for tensor in self.storage_tensors():
                tensor.copy_(tensor.index_select(0, beam_idx))
            self.note_write(0)

    def check_crop(self, tokens_to_remove: int) -> None:
        """Raise (changing nothing) if `crop(tokens_to_remove)` cannot be exact; the container checks every layer
        first so that a refused crop leaves the whole cache as it was."""
        _resolve_crop_length(tokens_to_remove, self.cumulative_length)

    def crop(self, tokens_to_remove: int) -> None:
        """Time-ordered storage: a rollback only moves the length (negative: tokens to remove; positive, legacy:
        the length to keep)."""
        self.cumulative_length = _resolve_crop_length(tokens_to_remove, self.cumulative_length)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._map_storage(lambda tensor: tensor.repeat_interleave(repeats, dim=0))
            self.batch_size = self.storage_tensors()[0].shape[0]
            self.note_write(0)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._map_storage(lambda tensor: tensor[indices, ...])
            self.batch_size = self.storage_tensors()[0].shape[0]
            self.note_write(0)


def prepare_fixed_capacity_step(layer: _StorageLayer, key_states: torch.Tensor, value_states: torch.Tensor) -> int:
    """Eager checks before a fixed-capacity (`max_cache_len`) full layer's step: shapes / allocation, then capacity.
    Returns the length after the step; raises `CacheCapacityError` (changing nothing) when it would not fit."""
    layer._prepare(key_states, value_states)
    end = layer.cumulative_length + key_states.shape[-2]
    if end > layer.max_cache_len:
        raise CacheCapacityError(
            f"The full-attention layers were allocated for max_cache_len={layer.max_cache_len} tokens, but "
            f"{end} are needed. Create the cache with a larger `max_cache_len` (prompt + max_new_tokens), or "
            f"leave it unset for storage that grows."
        )
    return end


def _resolve_crop_length(tokens_to_remove: int, length: int) -> int:
    """The length after `crop(tokens_to_remove)`: negative removes tokens (transformers' convention), positive is the
    legacy "length to keep"; raises when that is not a length the cache has."""
    if tokens_to_remove > 0:
        if tokens_to_remove > length:
            raise ValueError(f"Cannot crop to {tokens_to_remove} tokens: only {length} are cached.")
        return tokens_to_remove
    if length + tokens_to_remove < 0:
        raise RollbackError(f"Cannot remove {-tokens_to_remove} tokens: only {length} are cached.")
    return length + tokens_to_remove


class _UndoableStepLayer(_StorageLayer):
    """A layer whose slots are overwritten in place (a ring), and which may therefore keep a copy to undo its last
    speculative step (`_undo`, while past recording is on). Every crop is planned first by `_crop_plan` (raising
    before anything changes) and then applied, undoing the kept step through `_undo_step` where the plan says so.
    Any batch reshuffle drops the copy: it was kept in the old batch order, so a later rollback must not restore it.

    Subclasses keep `_oldest` (the lowest overwritable position still held) and `max_slots` (slots allocated).
    """

    _undo = None

    def _crop_plan(self, tokens_to_remove: int) -> tuple[int, bool]:
        """`(new length, undo the last step?)` for `crop(tokens_to_remove)`, or raise changing nothing."""
        raise NotImplementedError

    def _undo_step(self, undo: NamedTuple, new_length: int) -> None:
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


class _StepUndo(NamedTuple):
    """What `crop` needs to undo the last multi-token step of a wrapped ring (kept only while recording past).

    `keys` / `values` are the step's returned tensors: the held positions `[oldest, length)` in time order followed
    by the step's new tokens, a `cat` the step makes anyway; keeping it costs no copy."""

    length: int  # cache length before the step
    oldest: int  # oldest held position before the step
    keys: torch.Tensor  # [batch, kv_heads, length - oldest + q, head_dim], positions oldest .. length + q - 1
    values: torch.Tensor


class RingSlidingLayer(_UndoableStepLayer):
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
        self._undo: _StepUndo | None = None
        # What the last `update` returned, for `key_positions`: ("range", first, end) or ("ring", length, oldest).
        self._returned: tuple[str, int, int] = ("range", 0, 0)

    @property
    def max_slots(self) -> int:
        return self.sliding_window + self.rollback_margin

    def capacity_after(self, prompt_length: int, total_length: int) -> int:
        # `lazy_initialization` allocates the prompt (at most `max_slots`); time-ordered steps grow it up to there.
        return _capacity_after_decoding(min(self.max_slots, prompt_length), total_length, limit=self.max_slots)

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

    def get_mask_sizes(self, query_length: int) -> tuple[int, int | RingLayout]:
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
            self._undo = _StepUndo(length, oldest, window_keys, window_values)
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
        new_length = _resolve_crop_length(tokens_to_remove, self.cumulative_length)
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

    def _undo_step(self, undo: _StepUndo, new_length: int) -> None:
        # Rewrite positions [oldest, new_length) from the step's time-ordered window; the newest `capacity` stay.
        self.cumulative_length, self._oldest = undo.oldest, undo.oldest
        self._write_newest(undo.keys[:, :, : new_length - undo.oldest], undo.values[:, :, : new_length - undo.oldest])


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
    # Only `[:length]` is ever returned: new buffers skip the zero fill, so a prefill chunk writes each byte once.
    _zero_fill = False

    def __init__(self, initial_capacity: int = 0) -> None:
        super().__init__()
        self.initial_capacity = int(initial_capacity)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self._allocate(key_states, value_states, max(self.initial_capacity, key_states.shape[-2]))

    def capacity_after(self, prompt_length: int, total_length: int) -> int:
        return _capacity_after_decoding(max(self.initial_capacity, prompt_length), total_length)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
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

    def key_positions(self) -> torch.Tensor:
        """Absolute position of every key the last `update` returned (time order: `0 .. length - 1`)."""
        return torch.arange(self.cumulative_length, device=self.keys.device if self.is_initialized else None)

    def get_max_length(self) -> int:
        return -1

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        # Only the held tokens matter; select them alone so a beam step costs O(length), not O(capacity).
        if self.is_initialized:
            self._make_writable()
            length, beam_idx = self.cumulative_length, beam_idx.to(self.device)
            self.keys[:, :, :length] = self.keys[:, :, :length].index_select(0, beam_idx)
            self.values[:, :, :length] = self.values[:, :, :length].index_select(0, beam_idx)
            self.note_write(0)


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
    _counter_names = ("length_tensor", "floor_tensor")
    write_floor = _tensor_counter("floor_tensor")

    def __init__(self, max_cache_len: int) -> None:
        if max_cache_len < 1:
            raise ValueError(f"`max_cache_len` must be >= 1, got {max_cache_len}.")
        self.max_cache_len = int(max_cache_len)
        self.length_tensor = torch.zeros((), dtype=torch.long)
        self.floor_tensor = torch.full((), NOTHING_WRITTEN, dtype=torch.long)
        super().__init__()

    def note_write(self, position: int | torch.Tensor) -> None:
        # A tensor op, so that compiled decode steps record their writes too.
        position = torch.as_tensor(position, device=self.floor_tensor.device)
        torch.minimum(self.floor_tensor, position, out=self.floor_tensor)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.floor_tensor = self.floor_tensor.to(key_states.device)
        self._allocate(key_states, value_states, self.max_cache_len)
        self.length_tensor = self.length_tensor.to(self.device)
        _mark_static(self.keys, self.values, self.length_tensor, self.floor_tensor)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        query_length = key_states.shape[-2]
        if not is_torchdynamo_compiling():  # shape checks read the counters: eager only
            prepare_fixed_capacity_step(self, key_states, value_states)
        positions = self.length_tensor + torch.arange(query_length, device=self.device)
        self.note_write(self.length_tensor)
        self.keys.index_copy_(2, positions, key_states)
        self.values.index_copy_(2, positions, value_states)
        self.length_tensor.add_(query_length)
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.max_cache_len, 0

    def key_positions(self) -> torch.Tensor:
        """Absolute position of every key the last `update` returned: the whole buffer, `-1` past the length."""
        positions = torch.arange(self.max_cache_len, device=self.length_tensor.device)
        return torch.where(positions < self.length_tensor, positions, -1)

    def _check_autograd_allowed(self) -> None:
        _refuse_static_autograd()

    def _restatic(self, *tensors: torch.Tensor) -> None:
        _mark_static(*tensors)

    def capacity_after(self, prompt_length: int, total_length: int) -> int:
        return self.max_cache_len

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
        _mark_static(self.keys, self.values, self.length_tensor, self.oldest_tensor)

    def needs_ring_layout(self, query_length: int) -> bool:
        return query_length == 1 or super().needs_ring_layout(query_length)

    def capacity_after(self, prompt_length: int, total_length: int) -> int:
        return self.max_slots  # all slots at the first update

    def get_mask_sizes(self, query_length: int) -> tuple[int, int | RingLayout]:
        if query_length != 1:
            return super().get_mask_sizes(query_length)
        # Positions after writing position `length` at slot `length % capacity`; computed from the tensors alone.
        end = self.length_tensor + 1
        positions = self._slot_positions(end, self.oldest_tensor)
        return self.max_slots, RingLayout(positions, end=end if is_torchdynamo_compiling() else int(end))

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if key_states.shape[-2] != 1:
            return super().update(key_states, value_states, *args, **kwargs)
        if not is_torchdynamo_compiling():
            self._prepare(key_states, value_states)
            self._undo = None
            self._returned = ("ring", None, None)  # positions from the counters (see `key_positions`)
        slot = torch.remainder(self.length_tensor, self.max_slots).view(1)
        self.keys.index_copy_(2, slot, key_states)
        self.values.index_copy_(2, slot, value_states)
        self.length_tensor.add_(1)
        torch.maximum(self.oldest_tensor, self.length_tensor - self.max_slots, out=self.oldest_tensor)
        return self.keys, self.values

    def key_positions(self) -> torch.Tensor:
        if self._returned[0] == "ring":
            return self._slot_positions(self.length_tensor, self.oldest_tensor)
        return super().key_positions()

    def _check_autograd_allowed(self) -> None:
        _refuse_static_autograd()

    def _restatic(self, *tensors: torch.Tensor) -> None:
        _mark_static(*tensors)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._reorder_in_place(beam_idx)
        self._undo = None


def _refuse_static_autograd() -> None:
    """The fixed-capacity layers write in place into static buffers (captured by compiled graphs and CUDA graphs):
    recording gradients through them would need a copy of every buffer at every step."""
    raise RuntimeError(
        "A fixed-capacity HybridRingCache (max_cache_len=...) cannot record gradients: it writes in place into static "
        "buffers for torch.compile. Run it under torch.no_grad() / torch.inference_mode(), or use the default growing "
        "mode (HybridRingCache(config) without max_cache_len), which supports gradients through the cache."
    )
