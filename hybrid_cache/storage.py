"""The base of every per-layer storage: lazy allocation, growth, writability, counters, crop and batch operations.

Every storage class (`ring.py`, `full.py`, `quantized.py`, `streaming.py`) follows transformers' `CacheLayerMixin`
protocol (`update`, `get_mask_sizes`, `get_seq_length`, `crop`, ...) through `StorageLayer`, and exports and restores
its own state through `state()` / `meta_state()` / `load_state()`. Tensors are `[batch, kv_heads, slots, head_dim]`.

Positions are absolute cache positions: the number of tokens written before a token (padding tokens included),
exactly what transformers calls `cache_position`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch
from transformers.utils import is_torchdynamo_compiling

from .compat import CacheLayerMixin
from .errors import RollbackError
from .state import LayerState
from .steps import check_capacity

__all__ = [
    "GROWTH_FACTOR",
    "IN_PLACE",
    "FixedCapacityLayer",
    "NOTHING_WRITTEN",
    "SlotWrites",
    "StorageLayer",
    "capacity_after_decoding",
    "check_fixed_capacity",
    "check_shapes",
    "grown_capacity",
    "mark_static",
    "prepare_fixed_capacity_step",
    "refuse_static_autograd",
    "resolve_crop_length",
    "same_layout",
    "tensor_counter",
    "writable",
]


def writable(tensor: torch.Tensor | None) -> contextlib.AbstractContextManager:
    """Where `tensor` can be written in place: tensors made under `torch.inference_mode()` only inside it, others
    under `no_grad`."""
    return torch.inference_mode() if tensor is not None and tensor.is_inference() else torch.no_grad()


def check_shapes(layer: StorageLayer, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
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
# tokens' worth of copying per full layer per step (docs/design.md), against the whole window
# StaticCache rolls and the whole history DynamicCache copies at every step.
GROWTH_FACTOR = 1 + 1 / 64


def grown_capacity(capacity: int, needed: int, query_length: int, limit: int | None = None) -> int:
    """Slots a time-ordered buffer of `capacity` slots grows to when a step of `query_length` tokens needs `needed`.

    The growth rule of `StorageLayer._grow`, also used by `capacity_after` (the memory planner): one-token steps grow
    by `GROWTH_FACTOR`, multi-token steps to exactly `needed`; never beyond `limit`.
    """
    if needed <= capacity:
        return capacity
    new_capacity = needed if query_length > 1 else max(needed, math.floor(capacity * GROWTH_FACTOR))
    return new_capacity if limit is None else min(new_capacity, limit)


def capacity_after_decoding(first: int, total_length: int, limit: int | None = None) -> int:
    """Slots held after a first allocation of `first` slots and one-token steps up to `total_length` tokens.

    A buffer grows only when a one-token step finds it full (`length == capacity`), so jumping from one growth to the
    next gives the same capacity as replaying every step, in O(log total_length) iterations.
    """
    capacity = first
    while capacity < total_length and (limit is None or capacity < limit):
        capacity = grown_capacity(capacity, capacity + 1, 1, limit)
    return capacity


def same_layout(layer: StorageLayer, key_states: torch.Tensor, value_states: torch.Tensor) -> bool:
    return (
        tuple(key_states.shape[:2]) == (layer.batch_size, layer.num_heads)
        and key_states.shape[-1] == layer.k_head_dim
        and value_states.shape[-1] == layer.v_head_dim
        and key_states.dtype == layer.dtype
        and key_states.device == layer.device
    )


def tensor_counter(tensor_name: str) -> property:
    """A Python-int view of a 0-d counter tensor; while compiling, a copy of the tensor.

    Compiled decode steps must never specialize on a Python integer that changes every step (transformers #44609):
    the fixed-capacity layers keep their counters in tensors with static addresses, updated in place. What the getter
    returns is a snapshot in both cases: the counter's value when read, not a view that a later write in the same
    graph (the step's own advance) would change under its reader.
    """

    def getter(self: Any) -> int | torch.Tensor:
        tensor = getattr(self, tensor_name)
        return tensor.clone() if is_torchdynamo_compiling() else int(tensor)

    def setter(self: Any, value: int) -> None:
        getattr(self, tensor_name).fill_(value)

    return property(getter, setter)


def mark_static(*tensors: torch.Tensor) -> None:
    # Static addresses let compiled graphs (and CUDA graphs) reuse the same buffers; impossible while tracing.
    if not is_torchdynamo_compiling():
        for tensor in tensors:
            torch._dynamo.mark_static_address(tensor)


# `write_floor` when nothing was written since it was last cleared (any position compares above it).
NOTHING_WRITTEN = 2**62


class SlotWrites:
    """How fixed-capacity layers write slots of their storage tensors: here in place, as eager and compiled steps
    (and an exported program whose state is mutable buffers) do. `hybrid_cache.export` gives the layers of a program
    whose state is graph inputs and outputs a functional writer instead, that rebinds the attribute."""

    def index(self, layer: Any, name: str, index: torch.Tensor, rows: torch.Tensor) -> None:
        """Write `rows` `[batch, heads, n, head_dim]` at slots `index` `[n]` of the tensor `layer.<name>`."""
        getattr(layer, name).index_copy_(2, index, rows)

    def replace(self, layer: Any, name: str, take: torch.Tensor, rows: torch.Tensor) -> None:
        """Every slot where `take` (`[slots]`, bool) is set takes `rows` (`[batch, heads, slots, head_dim]`) into
        `layer.<name>`; the other slots keep theirs."""
        tensor = getattr(layer, name)
        tensor.copy_(torch.where(take.view(1, 1, -1, 1), rows, tensor))


IN_PLACE = SlotWrites()


class StorageLayer(CacheLayerMixin):
    """Shared allocation logic: lazy allocation from the first `update`, on the tensors' own device and dtype.

    What the container asks a layer (class attributes; `False` for storage that does not declare them): whether its
    steps may return keys out of time order, described by a `RingLayout` (`ring_ordered`, `needs_ring_layout`); its
    `update` takes `return_codes=` (`attends_on_codes`); it can keep what undoes its last multi-token step
    (`records_steps`: `activate_past_recording` / `deactivate_past_recording`); it keeps fewer tokens than its
    attention's window, so the mask's window is not checked against it (`drops_tokens_by_design`).
    """

    # Set by `_allocate`. transformers types `keys` / `values` `Tensor | None` (None before allocation): they and the
    # layout are read only once `is_initialized` (behind that check, or `_prepare`, which allocates): always tensors.
    keys: torch.Tensor
    values: torch.Tensor
    batch_size: int
    num_heads: int
    k_head_dim: int
    v_head_dim: int
    dtype: torch.dtype
    device: torch.device

    is_croppable = True
    ring_ordered = False
    attends_on_codes = False
    records_steps = False
    drops_tokens_by_design = False
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

    #: What a layer keeps about its last step rather than its tokens (what undoes it, what it returned): the step
    #: journal saves it before each journaled write and puts it back when the step is undone (`steps.StepJournal`).
    _step_fields: tuple[str, ...] = ()

    def step_bookkeeping(self) -> tuple[Any, ...]:
        """The values of `_step_fields`, for `restore_step_bookkeeping`."""
        return tuple(getattr(self, name) for name in self._step_fields)

    def restore_step_bookkeeping(self, saved: tuple[Any, ...]) -> None:
        for name, value in zip(self._step_fields, saved):
            setattr(self, name, value)

    def key_positions(self) -> torch.Tensor:
        """Absolute position of every key the last `update` returned, in the order returned (`-1`: empty slot):
        time-ordered storage returns `[0, length)`. Column `j` of the layer's attention weights belongs to position
        `key_positions()[j]` (see `hybrid_cache.attention_in_time_order`)."""
        device = self.storage_tensors()[0].device if self.is_initialized else None
        return torch.arange(int(self.cumulative_length), device=device)

    def returned_key_count(self, query_length: int) -> int:
        """How many keys `update` returns for a step of `query_length` tokens: the width of this step's mask
        (`get_mask_sizes`' first value), without building a layout. Layers whose layout is a tensor override it."""
        return int(self.get_mask_sizes(query_length)[0])

    def check_fits(self, query_length: int) -> None:
        """Raise `CacheCapacityError` (changing nothing) if a step of `query_length` tokens cannot be stored. Asked of
        every layer when a step starts, before the first one writes; storage that grows always fits."""

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
        elif self.get_seq_length() == 0 and not same_layout(self, key_states, value_states):
            # An empty (new or reset) cache may take any batch size / dtype / device: reallocate.
            self.lazy_initialization(key_states, value_states)
        else:
            check_shapes(self, key_states, value_states)
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

    def _map_storage(self, function: Callable[[torch.Tensor], torch.Tensor]) -> None:
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

    # --- state (hybrid_cache.snapshot): what a layer needs to continue exactly, as tensors and scalars ------------
    #: The `kind` its state is tagged with (`"sliding_attention"` rings, `"full_attention"` exact full layers,
    #: `"quantized_full_attention"`, `"sink_window_full_attention"`); `None`: this storage exports no state.
    state_kind: str | None = None
    #: Whether an in-memory checkpoint keeps only this layer's length: time-ordered storage whose tokens are never
    #: rewritten in place while held (every write is recorded by `note_write`), so cutting it back is exact as long
    #: as the write floor stays above the length. Rings (`ring.UndoableStepLayer`) overwrite slots: their state is copied.
    restores_by_length = True

    def held_from(self) -> int:
        """Lowest position the layer still holds (time-ordered storage holds every position from 0)."""
        return 0

    def held_slots(self) -> int:
        """How many slots (from slot 0) hold content worth keeping: the length for time-ordered storage."""
        return int(self.cumulative_length)

    def state_settings(self) -> dict[str, Any]:
        """The storage settings a state is taken with and must be loaded with, named as the `HybridRingCache`
        options that set them (`{"full_layer_quantization": "int8", ...}`); empty for exact storage."""
        return {}

    def meta_state(self) -> dict[str, Any] | None:
        """The layer's `LayerState` (`state.py`) as a dict (its counters, `COUNTER_FIELDS`, then its `state_settings()`), or
        `None` while it holds no tokens."""
        if self.state_kind is None:
            raise NotImplementedError(f"{type(self).__name__} does not export its state.")
        if not self.is_initialized or int(self.cumulative_length) == 0:
            return None
        slots = self.held_slots()
        if slots > self.capacity:  # an invariant of the storage; never export less than the layer holds
            raise RuntimeError(
                f"A {self.state_kind} layer holds {slots} slots of content but only {self.capacity} are allocated."
            )
        state = LayerState(
            kind=self.state_kind,
            length=int(self.cumulative_length),
            oldest=self.held_from(),
            capacity=self.capacity,
            slots=slots,
            batch_size=int(self.batch_size),
            num_heads=int(self.num_heads),
            k_head_dim=int(self.k_head_dim),
            v_head_dim=int(self.v_head_dim),
            dtype=self.dtype,
            settings=tuple(self.state_settings().items()),
        )
        return state.meta()

    def state(self) -> dict[str, torch.Tensor]:
        """The layer's content as named tensors, `load_state(meta, **state())`'s keyword arguments: here views of
        the held slots `[0, meta_state()["slots"])` of `keys` and `values`, `[batch, kv_heads, slots, head_dim]`
        (slot order: a wrapped ring's slots are not in time order). Compressed storage names its codes, scales and
        calibration instead (`state_layout`)."""
        slots = self.held_slots()
        return {"keys": self.keys[:, :, :slots], "values": self.values[:, :, :slots]}

    def state_layout(self, meta: Mapping[str, Any]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The `(shape, dtype)` of every tensor of a state with these counters, by name (what a file must hold)."""
        shape = (meta["batch_size"], meta["num_heads"], meta["slots"])
        return {
            "keys": ((*shape, meta["k_head_dim"]), meta["dtype"]),
            "values": ((*shape, meta["v_head_dim"]), meta["dtype"]),
        }

    def state_mismatch(self, meta: Mapping[str, Any]) -> str | None:
        """`None` when this layer's settings are those the state was taken with, else the first difference as
        `"<option>: file <value>, cache <value>"` (the caller names the fix)."""
        settings = self.state_settings()
        for name, value in settings.items():
            if meta.get(name) != value:
                return f"{name}: state {meta.get(name)!r}, this cache {value!r}"
        return None

    def accepts_state(self, meta: Mapping[str, Any]) -> bool:
        """Whether this layer can hold a state with these counters (checked before anything is loaded)."""
        return meta["oldest"] == 0 and meta["slots"] == meta["length"] <= meta["capacity"]

    def same_state_layout(self, meta: Mapping[str, Any]) -> bool:
        """Whether the layer is allocated with the batch size, heads, head sizes and dtype of `meta`."""
        return bool(self.is_initialized) and (
            (self.batch_size, self.num_heads, self.k_head_dim, self.v_head_dim, self.dtype)
            == (meta["batch_size"], meta["num_heads"], meta["k_head_dim"], meta["v_head_dim"], meta["dtype"])
        )

    def _allocate_for_state(self, meta: Mapping[str, Any], device: torch.device) -> bool:
        """Reallocate (through the layer's own `lazy_initialization`) unless already allocated for `meta` on
        `device`; returns whether it reallocated."""
        if self.same_state_layout(meta) and self.capacity == meta["capacity"] and self.device == device:
            return False
        template = torch.empty((), dtype=meta["dtype"], device=device)
        shape = (meta["batch_size"], meta["num_heads"], meta["capacity"])
        self.lazy_initialization(
            template.expand(*shape, meta["k_head_dim"]), template.expand(*shape, meta["v_head_dim"])
        )
        return True

    def load_state(self, meta: Mapping[str, Any], keys: torch.Tensor, values: torch.Tensor) -> None:
        """Hold exactly the state `meta` with slots `[0, slots)` from `keys` / `values` (the tensors of `state()`).

        A layer already allocated with the same layout and capacity is written in place (compiled graphs keep their
        static addresses); otherwise it is reallocated, through its own `lazy_initialization`, on `keys`' device.
        Pending undo state is dropped through `reset()`.
        """
        self._allocate_for_state(meta, keys.device)
        slots = meta["slots"]
        with writable(self.keys):
            self.reset()
            self.keys[:, :, :slots].copy_(keys)
            self.values[:, :, :slots].copy_(values)
            self._load_counters(meta)

    def _first_storage_tensor(self) -> torch.Tensor | None:
        """A storage tensor (`writable` follows its inference mode), None before allocation."""
        return self.storage_tensors()[0] if self.is_initialized else None

    def _load_counters(self, meta: Mapping[str, Any]) -> None:
        self.cumulative_length = meta["length"]

    def set_length(self, length: int) -> None:
        """Set the length of time-ordered storage whose tokens before `length` are intact (a checkpoint's restore:
        see `take_write_floor`)."""
        with writable(self._first_storage_tensor()):
            self.cumulative_length = length

    def clear(self) -> None:
        """`reset()`, also for storage made under `torch.inference_mode()`."""
        with writable(self._first_storage_tensor()):
            self.reset()

    def take_write_floor(self) -> int:
        """The lowest position written since the last call (`NOTHING_WRITTEN` if none), then forget it (see
        `note_write`)."""
        floor = int(self.write_floor)
        if floor != NOTHING_WRITTEN:
            with writable(getattr(self, "floor_tensor", None)):
                self.write_floor = NOTHING_WRITTEN
        return floor

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def reset(self) -> None:
        """Forget all tokens; keep the allocation for reuse (a new batch size / dtype / device reallocates)."""
        self.cumulative_length = 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            beam = beam_idx.to(self.device)
            self._map_storage(lambda tensor: tensor.index_select(0, beam))
            self.note_write(0)

    def _reorder_in_place(self, beam_idx: torch.LongTensor) -> None:
        # In place, to keep the static addresses that compiled graphs captured.
        if self.is_initialized:
            self._make_writable()
            beam = beam_idx.to(self.device)
            for tensor in self.storage_tensors():
                tensor.copy_(tensor.index_select(0, beam))
            self.note_write(0)

    def check_crop(self, tokens_to_remove: int) -> None:
        """Raise (changing nothing) if `crop(tokens_to_remove)` cannot be exact; the container checks every layer
        first so that a refused crop leaves the whole cache as it was."""
        resolve_crop_length(tokens_to_remove, self.cumulative_length)

    def crop(self, tokens_to_remove: int) -> None:
        """Time-ordered storage: a rollback only moves the length (negative: tokens to remove; positive, legacy:
        the length to keep)."""
        self.cumulative_length = resolve_crop_length(tokens_to_remove, self.cumulative_length)

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


class FixedCapacityLayer(Protocol):
    """What `prepare_fixed_capacity_step` reads: a `StorageLayer` with `full.FixedCapacityCounters` mixed in."""

    max_cache_len: int
    cumulative_length: int

    def _prepare(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None: ...


def prepare_fixed_capacity_step(
    layer: FixedCapacityLayer, key_states: torch.Tensor, value_states: torch.Tensor
) -> int:
    """Eager checks before a fixed-capacity (`max_cache_len`) full layer's step: shapes / allocation, then capacity.
    Returns the length after the step; raises `CacheCapacityError` (changing nothing) when it would not fit."""
    layer._prepare(key_states, value_states)
    return check_fixed_capacity(layer, key_states.shape[-2])


def check_fixed_capacity(layer: FixedCapacityLayer, query_length: int) -> int:
    """The length after a step of `query_length` tokens, or `CacheCapacityError` when it exceeds `max_cache_len`
    (`steps.check_capacity`)."""
    return check_capacity(int(layer.cumulative_length), query_length, layer.max_cache_len)


def resolve_crop_length(tokens_to_remove: int, length: int) -> int:
    """The length after `crop(tokens_to_remove)`: negative removes tokens (transformers' convention), positive is the
    legacy "length to keep"; raises when that is not a length the cache has."""
    if tokens_to_remove > 0:
        if tokens_to_remove > length:
            raise ValueError(f"Cannot crop to {tokens_to_remove} tokens: only {length} are cached.")
        return tokens_to_remove
    if length + tokens_to_remove < 0:
        raise RollbackError(f"Cannot remove {-tokens_to_remove} tokens: only {length} are cached.")
    return length + tokens_to_remove


def refuse_static_autograd() -> None:
    """The fixed-capacity layers write in place into static buffers (captured by compiled graphs and CUDA graphs):
    recording gradients through them would need a copy of every buffer at every step."""
    raise RuntimeError(
        "A fixed-capacity HybridRingCache (max_cache_len=...) cannot record gradients: it writes in place into static "
        "buffers for torch.compile. Run it under torch.no_grad() / torch.inference_mode(), or use the default growing "
        "mode (HybridRingCache(config) without max_cache_len), which supports gradients through the cache."
    )
