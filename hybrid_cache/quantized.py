"""Compressed storage for full-attention layers: int8, int4 or fp8 keys/values with per-token group scales.

Why only full layers: once the sliding layers hold `sliding_window` slots, the full-attention layers are almost all of
the cache at long context (docs/perplexity.md). Sliding rings stay exact in the model dtype;
KV-shared layers hold nothing anyway.

Format (per layer, per token, per KV head; "groups" are `group_size` consecutive channels of the head dimension):

| mode | stored per group of `g` channels | what we took from whom |
| --- | --- | --- |
| `int8` | `g` x int8 `round(x / s)`, `s = absmax / 127` (symmetric) + `s` in the model dtype | llama.cpp `q8_0` (symmetric, one scale per block), mlx-lm `QuantizedKVCache` (per-token groups of 64 along the head dimension, scales in the model dtype) |
| `int4` | `g` nibbles `round(x / s)` in [-8, 7], `s = m / -8` with `m` the signed value of largest magnitude (so `m` itself is exact) + `s` | llama.cpp `q4_0` (its scale rule); the two nibbles of a byte are channels `j` and `j + head_dim / 2` so that unpacking is two whole-tensor shifts |
| `fp8` | `g` x `torch.float8_e4m3fn` `x / s`, `s = absmax / 448` + `s` | torch's own dtype; the scale per token group (transformers' `Fp8QuantizedLayer` freezes one scale per tensor at the first update) |

Every token is quantized on its own (groups never span tokens), so storage can be appended to, cropped (only the
length moves), reordered for beams and repeated for `num_return_sequences` without any loss or re-quantization, and a
compiled decode step writes one token with `index_copy_` like the exact layers. The tokens of the current step are
returned exact (they were just computed); only the history is dequantized.

Key calibration (on by default): keys are quantized as `(k - shift) / scale` per channel, with the channel's mean and
spread over the first update into the empty layer (the prompt; per batch row and KV head; `KVQuantizer.calibrate`).
Gemma's keys have a few channels with a large offset and spread; in a per-token group they set the step of every other
channel. Centering and equalizing the channels first gets most of what per-channel (KIVI-style) grouping gets while
keeping every operation per token (its effect on the end-to-end KL divergence: docs/quantization.md). It costs one
fused multiply-add pass over the keys at dequantization.

The attention kernels need keys/values in the model dtype, so `update` dequantizes the history into a **workspace**
shared by all compressed layers of one cache (one buffer for keys, one for values, the size of the largest layer),
which exists anyway while one layer's attention runs. It is reused by the next compressed layer: the tensors that
`update` returns are valid until the next compressed layer's `update` (the model consumes them before that; Gemma 4's
KV-shared layers read those of the last storing layer of their type, and no compressed layer updates after it in the
same forward). Reusing it instead of allocating per call avoids page-faulting a fresh buffer every step
(docs/quantization.md).

Optional rotation (`rotate=True`): a normalized Sylvester-Hadamard matrix over each group, applied before quantizing
and undone after dequantizing. It spreads a group's outlier channels over all its channels (the idea of llama.cpp's
rotated KV cache, there applied to queries and keys inside the attention; here undone in the cache, because the
cache does not see the queries). After the key calibration it lowers int4's KL divergence 1.6-8x
(docs/quantization.md); it costs a `[group x group]` product over the whole history per dequantizing step (in place,
in tiles: `KVQuantizer.dequantize_into`) and nothing on the codes, where the query is rotated instead. The cache's
default (`CacheOptions.full_layer_rotation`) turns it on for int4 only; the layer itself takes `rotate` as given.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from transformers.utils import is_torchdynamo_compiling

from .code_attention import CODE_ATTENTION_MODES, MAX_CODE_QUERY_LENGTH, CompressedHistory, CompressedKV
from .code_path import codes_preferred
from .full import FixedCapacityCounters
from .quantizer import DEFAULT_GROUP_SIZE, QUANTIZATION_MODES, KVQuantizer
from .storage import (
    GROWTH_FACTOR,
    StorageLayer,
    grown_capacity,
    mark_static,
    prepare_fixed_capacity_step,
    writable,
)

__all__ = ["DequantWorkspace", "QuantizedFullLayer", "StaticQuantizedFullLayer"]


class DequantWorkspace:
    """Model-dtype buffers that compressed layers dequantize their history into, shared by the layers of one cache.

    One flat buffer per (keys/values, dtype, device), grown by `GROWTH_FACTOR` when a layer needs more; a view of its
    prefix is returned. Static mode (`static=True`) marks the buffers as static addresses for compiled graphs and never
    regrows them after the first allocation for a given size.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def view(
        self, role: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, exact: bool = False
    ) -> torch.Tensor:
        """A `shape`-d view of the `role` buffer (`"keys"` / `"values"`), allocated or grown as needed."""
        numel = math.prod(shape)
        key = (role, dtype, device)
        buffer = self._buffers.get(key)
        if (
            buffer is not None
            and not is_torchdynamo_compiling()
            and buffer.is_inference()
            and not torch.is_inference_mode_enabled()
        ):
            # Allocated under `torch.inference_mode()` (a pipeline's prefill): not writable outside it. Checked in
            # eager steps only (dynamo cannot trace `is_inference`), like the layers' own `_make_writable`.
            buffer = None
        if buffer is None or buffer.numel() < numel:
            size = numel if exact or buffer is None else max(numel, math.ceil(buffer.numel() * GROWTH_FACTOR))
            buffer = torch.zeros(size, dtype=dtype, device=device)
            self._buffers[key] = buffer
            if exact:
                mark_static(buffer)
        return buffer[:numel].view(shape)

    def nbytes(self) -> int:
        return sum(buffer.numel() * buffer.element_size() for buffer in self._buffers.values())

    def clear(self) -> None:
        self._buffers.clear()


class QuantizedFullLayer(StorageLayer):
    """A full-attention layer storing keys and values compressed (int8 / int4 / fp8, per-token group scales).

    Growth and returned layout are those of `GrowableFullLayer`: time-ordered, the standard causal mask applies;
    one-token steps grow the storage by 1/64 (`grown_capacity`), multi-token steps to exactly the tokens held. `update` returns the
    dequantized history followed by the step's own tokens, exact, as a view of the shared `DequantWorkspace`.

    Args:
        mode (`str`): `"int8"`, `"int4"` or `"fp8"`.
        workspace (`DequantWorkspace`): shared dequantization buffers (one per cache).
        group_size (`int`, defaults to 64): channels per scale.
        rotate (`bool`, defaults to False): Hadamard rotation within groups.
        initial_capacity (`int`, defaults to 0): slots allocated at the first update (or the prompt length if larger).

    Example (head size 1 is too small to show grouping; see tests/core/test_quantized.py): `int8`, prefill `[1.0, -2.0]`
    -> codes `[64, -127]` with scale `2/127` per token (one group) -> update returns `[1.0, -2.0]` exact for this step,
    `[1.0 +- 0.008, -2.0]` dequantized at the next.
    """

    is_sliding = False
    attends_on_codes = True

    def __init__(
        self,
        mode: str,
        workspace: DequantWorkspace,
        group_size: int = DEFAULT_GROUP_SIZE,
        rotate: bool = False,
        initial_capacity: int = 0,
        key_calibration: bool = True,
    ) -> None:
        super().__init__()
        if mode not in QUANTIZATION_MODES:
            KVQuantizer(mode, 2)  # raises the error naming the valid modes
        self.mode, self.group_size, self.rotate = mode, group_size, rotate
        self.key_calibration = key_calibration
        self.workspace = workspace
        self.initial_capacity = int(initial_capacity)
        # Query rounding of attention on the codes: 1 = int8, 2 = int8 + int8 residual (`code_attention`).
        self.code_query_parts = 1
        # Longest step that attends on the codes (longer ones are prefill chunks: dequantized, as before).
        self.code_max_query_length = MAX_CODE_QUERY_LENGTH
        self._codes: dict[str, torch.Tensor] = {}
        self._scales: dict[str, torch.Tensor] = {}
        # role -> (shift, scale) `[batch, kv_heads, 1, head_dim]`: see `_calibrate` (keys only, when enabled).
        self._calibration: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    # --- allocation -----------------------------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self._allocate(key_states, value_states, max(self.initial_capacity, key_states.shape[-2]))

    def _allocate(self, key_states: torch.Tensor, value_states: torch.Tensor, slots: int) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.batch_size, self.num_heads = key_states.shape[:2]
        self.k_head_dim, self.v_head_dim = key_states.shape[-1], value_states.shape[-1]
        self.quantizers = {
            "keys": KVQuantizer(self.mode, self.k_head_dim, self.group_size, self.rotate),
            "values": KVQuantizer(self.mode, self.v_head_dim, self.group_size, self.rotate),
        }
        for role, quantizer in self.quantizers.items():
            self._codes[role] = torch.zeros(
                (self.batch_size, self.num_heads, slots, quantizer.packed_dim),
                dtype=quantizer.storage_dtype,
                device=self.device,
            )
            self._scales[role] = torch.zeros(
                (self.batch_size, self.num_heads, slots, quantizer.groups), dtype=self.dtype, device=self.device
            )
        self._calibration = {}
        if self.key_calibration:
            shape = (self.batch_size, self.num_heads, 1, self.k_head_dim)
            self._calibration["keys"] = (
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.ones(shape, dtype=self.dtype, device=self.device),
            )
        self.is_initialized = True
        self.note_write(0)

    @property
    def capacity(self) -> int:
        """Token slots currently allocated (0 before the first update)."""
        return self._codes["keys"].shape[-2] if self.is_initialized else 0

    def storage_tensors(self) -> list[torch.Tensor]:
        """Every tensor this layer holds: codes and scales of keys and values, then the key calibration (two
        `head_dim` vectors per row and head, whatever the length); `nbytes` counts them all, the cache counts the
        shared workspace."""
        if not self.is_initialized:
            return []
        return [*self._codes.values(), *self._scales.values(), *self._calibration_tensors()]

    def _calibration_tensors(self) -> list[torch.Tensor]:
        return [tensor for pair in self._calibration.values() for tensor in pair]

    def _map_storage(self, function: Callable[[torch.Tensor], torch.Tensor]) -> None:
        for store in (self._codes, self._scales):
            for role in store:
                store[role] = function(store[role])
        for role, (shift, scale) in self._calibration.items():
            self._calibration[role] = (function(shift), function(scale))

    def _calibrate(self, key_states: torch.Tensor) -> None:
        """Set the key calibration from the tokens of the first update into an empty layer (a prompt, usually).

        Keys are stored as `(k - shift) / scale` per channel before the per-token grouping. Gemma's keys have a few
        channels with a large offset and spread: in a per-token group they set the step for every other channel.
        Centering and equalizing the channels first keeps every cache operation per token (append, crop, beams stay
        lossless on the codes) and lowers the next-token KL divergence (docs/quantization.md). The
        calibration stays fixed until the layer is empty again (crop to 0, reset); values are stored without it (it
        did not lower their error). Eager only: a compiled graph keeps the calibration of its eager prefill.
        """
        if "keys" not in self._calibration:
            return
        for target, computed in zip(self._calibration["keys"], KVQuantizer.calibrate(key_states)):
            target.copy_(computed)

    def _grow(self, needed: int, query_length: int, limit: int | None = None) -> None:
        if needed <= self.capacity:
            return
        capacity = grown_capacity(self.capacity, needed, query_length, limit)
        length = self.cumulative_length

        def grown(tensor: torch.Tensor) -> torch.Tensor:
            new = tensor.new_zeros(tensor.shape[:2] + (capacity,) + tensor.shape[3:])
            new[:, :, :length].copy_(tensor[:, :, :length])
            return new

        for store in (self._codes, self._scales):  # per-token tensors only (not the calibration)
            for role in store:
                store[role] = grown(store[role])

    def _scratch(self, shape: torch.Size, exact: bool = False) -> torch.Tensor | None:
        """The int4 unpacking buffer, from the shared workspace (None for the other modes)."""
        if self.mode != "int4":
            return None
        return self.workspace.view("int4-scratch", tuple(shape), torch.int8, self.device, exact=exact)

    # --- update ---------------------------------------------------------------------------------------------------
    def _write(self, key_states: torch.Tensor, value_states: torch.Tensor, start: int) -> None:
        end = start + key_states.shape[-2]
        for role, states in (("keys", key_states), ("values", value_states)):
            codes, scales = self.quantizers[role].quantize(states, self._calibration.get(role))
            self._codes[role][:, :, start:end].copy_(codes)
            self._scales[role][:, :, start:end].copy_(scales)

    def _attention_input(self, role: str, length: int, states: torch.Tensor) -> torch.Tensor:
        """Dequantized `[0, length)` followed by this step's `states`, exact, in the workspace."""
        total = length + states.shape[-2]
        head_dim = states.shape[-1]
        out = self.workspace.view(role, (self.batch_size, self.num_heads, total, head_dim), self.dtype, self.device)
        if length:
            codes = self._codes[role][:, :, :length]
            self.quantizers[role].dequantize_into(
                codes,
                self._scales[role][:, :, :length],
                out[:, :, :length],
                self._scratch(codes.shape),
                self._calibration.get(role),
            )
        out[:, :, length:].copy_(states)
        return out

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        *args: Any,
        return_codes: bool = False,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens compressed; return `[batch, kv_heads, length, head_dim]` keys/values in model dtype
        (history dequantized, this step's tokens exact), valid until the next compressed layer's update.

        With `return_codes=True`, a step of at most `MAX_CODE_QUERY_LENGTH` tokens over a non-empty int8 / int4
        history returns `CompressedKV` handles instead (`hybrid_cache.code_attention`): the same keys and values,
        read from the codes by the registered attention function; nothing is dequantized. Other steps (prefill
        chunks, the first update) return dequantized tensors as without it.
        """
        self._prepare(key_states, value_states)
        start = self.cumulative_length
        self._grow(start + key_states.shape[-2], key_states.shape[-2])
        self.note_write(start)
        if start == 0:
            self._calibrate(key_states)
        if return_codes and self.uses_codes(start, key_states.shape[-2]):
            history = self.compressed_history(start, key_states, value_states)
            self._write(key_states, value_states, start)
            self.cumulative_length = start + key_states.shape[-2]
            return CompressedKV(history, "keys"), CompressedKV(history, "values")
        keys = self._attention_input("keys", start, key_states)
        values = self._attention_input("values", start, value_states)
        self._write(key_states, value_states, start)
        self.cumulative_length = start + key_states.shape[-2]
        return keys, values

    # --- attention on the codes ------------------------------------------------------------------------------------
    def stored_codes(self, role: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The codes and group scales `role` ("keys" / "values") is stored in (whole buffers, past the length too)."""
        return self._codes[role], self._scales[role]

    def empty_like(self) -> QuantizedFullLayer:
        """An empty growing layer with this one's codec settings (and a workspace of its own)."""
        return QuantizedFullLayer(
            self.mode, DequantWorkspace(), self.group_size, self.rotate, key_calibration=self.key_calibration
        )

    def uses_codes(self, history_length: int, query_length: int) -> bool:
        """Whether a step of `query_length` tokens after `history_length` stored ones attends on the codes: where it
        can, and where that is not slower than dequantizing (`code_path.codes_preferred`)."""
        return (
            self.mode in CODE_ATTENTION_MODES
            and history_length > 0
            and query_length <= self.code_max_query_length
            and codes_preferred(self)
        )

    def compressed_history(
        self, length: int, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> CompressedHistory:
        """Views of the codes, scales and calibration of the first `length` tokens, with this step's exact states."""
        shift, scale = self._calibration.get("keys", (None, None))
        return CompressedHistory(
            mode=self.mode,
            key_codes=self._codes["keys"][:, :, :length],
            key_scales=self._scales["keys"][:, :, :length],
            value_codes=self._codes["values"][:, :, :length],
            value_scales=self._scales["values"][:, :, :length],
            key_shift=shift,
            key_scale=scale,
            key_rotation=self.quantizers["keys"].rotation_matrix(key_states),
            value_rotation=self.quantizers["values"].rotation_matrix(value_states),
            current_keys=key_states,
            current_values=value_states,
            query_parts=self.code_query_parts,
        )

    # --- protocol -------------------------------------------------------------------------------------------------
    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cumulative_length + query_length, 0

    def get_max_length(self) -> int:
        return -1

    # --- state (see `StorageLayer.meta_state`): the codes, scales and key calibration of the first `length` tokens --
    state_kind = "quantized_full_attention"

    def state_settings(self) -> dict[str, Any]:
        return {
            "full_layer_quantization": self.mode,
            "full_layer_group_size": self.group_size,
            "full_layer_rotation": self.rotate,
            "full_layer_key_calibration": self.key_calibration,
        }

    def state(self) -> dict[str, torch.Tensor]:
        """`key_codes` / `value_codes` `[batch, kv_heads, length, packed_dim]`, `key_scales` / `value_scales`
        `[batch, kv_heads, length, groups]` (model dtype) and, with key calibration, `key_shift` / `key_scale`
        `[batch, kv_heads, 1, k_head_dim]`: everything `update` reads, nothing dequantized."""
        length = int(self.cumulative_length)
        named = {}
        for role, prefix in (("keys", "key"), ("values", "value")):
            named[f"{prefix}_codes"] = self._codes[role][:, :, :length]
            named[f"{prefix}_scales"] = self._scales[role][:, :, :length]
        if "keys" in self._calibration:
            named["key_shift"], named["key_scale"] = self._calibration["keys"]
        return named

    def state_layout(self, meta: Mapping[str, Any]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        rows = (meta["batch_size"], meta["num_heads"])
        layout: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for prefix, head_dim in (("key", meta["k_head_dim"]), ("value", meta["v_head_dim"])):
            quantizer = KVQuantizer(self.mode, head_dim, self.group_size, self.rotate)
            layout[f"{prefix}_codes"] = ((*rows, meta["slots"], quantizer.packed_dim), quantizer.storage_dtype)
            layout[f"{prefix}_scales"] = ((*rows, meta["slots"], quantizer.groups), meta["dtype"])
        if self.key_calibration:
            layout["key_shift"] = layout["key_scale"] = ((*rows, 1, meta["k_head_dim"]), meta["dtype"])
        return layout

    # Its state is its codes, scales and calibration by name (`state_layout`), not `keys` / `values`: every caller
    # passes `**state()` as the base class documents, so the narrower base signature never applies here.
    def load_state(self, meta: Mapping[str, Any], **tensors: torch.Tensor) -> None:  # type: ignore[override]
        """Hold exactly the state `meta` from the tensors of `state()` (same names), reallocating through
        `lazy_initialization` unless allocated for it already (in place: static addresses stay)."""
        device = tensors["key_codes"].device
        self._allocate_for_state(meta, device)
        length = meta["length"]
        with writable(self._codes["keys"]):
            self.reset()
            for role, prefix in (("keys", "key"), ("values", "value")):
                for store, name in ((self._codes, "codes"), (self._scales, "scales")):
                    store[role][:, :, :length].copy_(tensors[f"{prefix}_{name}"])
                    store[role][:, :, length:].zero_()
            if "keys" in self._calibration:
                for target, name in zip(self._calibration["keys"], ("key_shift", "key_scale")):
                    target.copy_(tensors[name])
            self.cumulative_length = length


class StaticQuantizedFullLayer(FixedCapacityCounters, QuantizedFullLayer):
    """`QuantizedFullLayer` with a fixed capacity, static addresses and a tensor counter, for `torch.compile`.

    Like `StaticFullLayer`, it returns `max_cache_len` slots (the ones past the length are masked by causality); the
    whole capacity is dequantized every step, so that every compiled step has the same shapes.

    Args:
        max_cache_len (`int`): total tokens (prompt + generated) the layer can hold; exceeding it raises.
        mode, workspace, group_size, rotate: as in `QuantizedFullLayer`.
    """

    is_compileable = True
    attends_on_codes = False  # compiled steps keep the dequantizing path (fixed shapes)

    def __init__(
        self,
        max_cache_len: int,
        mode: str,
        workspace: DequantWorkspace,
        group_size: int = DEFAULT_GROUP_SIZE,
        rotate: bool = False,
        key_calibration: bool = True,
    ) -> None:
        self.init_counters(max_cache_len)
        super().__init__(mode, workspace, group_size, rotate, key_calibration=key_calibration)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.allocate_fixed(key_states, value_states)
        for role, states in (("keys", key_states), ("values", value_states)):
            shape = (self.batch_size, self.num_heads, self.max_cache_len, states.shape[-1])
            self.workspace.view(role, shape, self.dtype, self.device, exact=True)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        query_length = key_states.shape[-2]
        if not is_torchdynamo_compiling():  # shape checks read the counter: eager only
            end = prepare_fixed_capacity_step(self, key_states, value_states)
            if end == query_length:  # an empty layer: calibrate in place (static addresses)
                self._calibrate(key_states)
        positions = self.length_tensor + torch.arange(query_length, device=self.device)
        self.note_write(self.length_tensor)
        returned = []
        for role, states in (("keys", key_states), ("values", value_states)):
            quantizer = self.quantizers[role]
            shape = (self.batch_size, self.num_heads, self.max_cache_len, states.shape[-1])
            out = self.workspace.view(role, shape, self.dtype, self.device, exact=True)
            calibration = self._calibration.get(role)
            quantizer.dequantize_into(
                self._codes[role],
                self._scales[role],
                out,
                self._scratch(self._codes[role].shape, exact=True),
                calibration,
            )
            out.index_copy_(2, positions, states)  # this step's tokens exact, as in the growing layer
            codes, scales = quantizer.quantize(states, calibration)
            # torch has no CPU index_copy_ for float8: copy the same bytes through uint8 views.
            self._codes[role].view(torch.uint8).index_copy_(2, positions, codes.view(torch.uint8))
            self._scales[role].index_copy_(2, positions, scales)
            returned.append(out)
        self.length_tensor.add_(query_length)
        return returned[0], returned[1]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.max_cache_len, 0

    def accepts_state(self, meta: Mapping[str, Any]) -> bool:
        return super().accepts_state(meta) and meta["capacity"] == self.max_cache_len

    def get_max_length(self) -> int:
        return self.max_cache_len

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._reorder_in_place(beam_idx)
