"""`HybridRingCache`: the cache container. It reads the model config once and gives each layer the storage its
attention needs; everything else is forwarding to the layers (see `layers.py`) and the mask hook (`mask_hook.py`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import Cache
from transformers.configuration_utils import PreTrainedConfig
from transformers.utils import is_torchdynamo_compiling

from .code_attention import CODE_ATTENTION, CODE_ATTENTION_MODES
from .compat import DummyLayer, check_rollback_supported, kv_sharing_modes, rollback_release_note
from .distributed import check_stage_layers, parallel_sizes, stage_layers
from .layers import GrowableFullLayer, RingSlidingLayer, RollbackError, StaticFullLayer, StaticRingSlidingLayer
from .mask_hook import (
    CacheOffset,
    ConversationMismatchError,
    DenseMaskRequest,
    HeldFromOffset,
    RingLayout,
    check_ring_attention_supported,
    install_mask_hook,
    is_mask_hook_installed,
)
from .quantized import QUANTIZATION_MODES, DequantWorkspace, QuantizedFullLayer, StaticQuantizedFullLayer
from .snapshot import CacheCheckpoint, load_cache, restore_checkpoint, save_cache, take_checkpoint
from .streaming import SinkWindowFullLayer

__all__ = ["HybridRingCache", "MemoryReport"]

SLIDING, FULL, SHARED = "sliding_attention", "full_attention", "shared"
# Storage whose one-token steps return keys out of time order once wrapped, described to the mask by a `RingLayout`.
_RING_LAYERS = (RingSlidingLayer, SinkWindowFullLayer)
# Layers another pipeline stage runs (`stage_layers`): a `DummyLayer` here, like KV-shared layers.
OTHER_STAGE = "other_stage"
# Layer types whose cache behaves as a sliding window (transformers maps chunked attention to the same cache class,
# but its mask is not a window: we store those layers fully, which is always exact).
_SLIDING_TYPES = ("sliding_attention",)
_FULL_TYPES = ("full_attention", "chunked_attention")


@dataclass
class MemoryReport:
    """KV bytes held by a `HybridRingCache`, per layer type, against a full cache of every layer.

    Attributes:
        tokens: tokens seen so far (cache length).
        total_bytes: bytes of every tensor the cache keeps alive: key/value storage, plus `extra_bytes`.
        full_cache_bytes: bytes a full (non-sliding) cache of every storing layer would hold for `tokens` tokens.
        kv_bytes: bytes of key/value storage actually allocated (every layer).
        extra_bytes: everything else the cache keeps alive: the window kept to undo the last speculative step (while
            past recording is on, see `HybridRingCache.deactivate_past_recording`), the fixed mode's counters, and
            `workspace_bytes`.
        bytes_by_type: allocated key/value bytes per layer type (`sliding_attention`, `full_attention`, `shared`).
        layers_by_type: number of layers of each type.
        slots_by_type: allocated token slots per layer of each type (capacity).
        per_layer: `(layer_type, bytes)` for every layer.
        workspace_bytes: model-dtype buffers that compressed full layers dequantize their history into (shared by
            those layers, one layer's keys and values; part of `extra_bytes` and `total_bytes`; 0 without
            compression).
    """

    tokens: int
    total_bytes: int
    full_cache_bytes: int
    kv_bytes: int = 0
    extra_bytes: int = 0
    bytes_by_type: dict[str, int] = field(default_factory=dict)
    layers_by_type: dict[str, int] = field(default_factory=dict)
    slots_by_type: dict[str, list[int]] = field(default_factory=dict)
    per_layer: list[tuple[str, int]] = field(default_factory=list)
    workspace_bytes: int = 0

    @property
    def saving(self) -> float:
        """Fraction of the full cache's bytes not held (0 when nothing is saved)."""
        return 1.0 - self.total_bytes / self.full_cache_bytes if self.full_cache_bytes else 0.0

    def __str__(self) -> str:
        lines = [
            f"KV cache after {self.tokens} tokens",
            f"  {'layer type':<18}{'layers':>7}{'slots/layer':>13}{'MiB':>11}",
        ]
        for layer_type, count in self.layers_by_type.items():
            slots = sorted(set(self.slots_by_type.get(layer_type, []))) or [0]
            slot_text = "/".join(str(s) for s in slots)
            lines.append(f"  {layer_type:<18}{count:>7}{slot_text:>13}{self.bytes_by_type[layer_type] / 2**20:>11.3f}")
        if self.workspace_bytes:
            lines.append(f"  {'dequant. workspace':<18}{'':>7}{'':>13}{self.workspace_bytes / 2**20:>11.3f}")
        if self.extra_bytes - self.workspace_bytes:
            other = self.extra_bytes - self.workspace_bytes
            lines.append(f"  {'rollback, counters':<18}{'':>7}{'':>13}{other / 2**20:>11.3f}")
        lines.append(f"  {'total':<18}{sum(self.layers_by_type.values()):>7}{'':>13}{self.total_bytes / 2**20:>11.3f}")
        lines.append(
            f"  full cache of every storing layer: {self.full_cache_bytes / 2**20:.3f} MiB "
            f"(held: {100 * (1 - self.saving):.1f}%, saved: {100 * self.saving:.1f}%)"
        )
        return "\n".join(lines)


def _layer_plan(text_config: PreTrainedConfig) -> list[tuple[str, int | None]]:
    """`(storage kind, sliding window)` for every decoder layer, read from the config."""
    num_layers = text_config.num_hidden_layers
    layer_types = getattr(text_config, "layer_types", None)
    if layer_types is None:
        window = getattr(text_config, "sliding_window", None)
        layer_types = [SLIDING if window is not None else FULL] * num_layers
    if len(layer_types) != num_layers:
        raise ValueError(
            f"config.layer_types has {len(layer_types)} entries but num_hidden_layers={num_layers}; fix the config."
        )
    sharing = kv_sharing_modes(text_config) or [None] * num_layers
    per_layer_configs = getattr(text_config, "per_layer_config", None)
    plan = []
    for index, (layer_type, mode) in enumerate(zip(layer_types, sharing)):
        if mode == "reuse" or layer_type in ("moe", "mlp"):
            plan.append((SHARED, None))
        elif layer_type in _SLIDING_TYPES:
            layer_config = per_layer_configs[index] if per_layer_configs is not None else text_config
            window = getattr(layer_config, "sliding_window", None)
            if window is None:
                raise ValueError(
                    f"Layer {index} is 'sliding_attention' but the config has no `sliding_window`. Set "
                    f"`config.sliding_window` to the model's window, or declare the layer 'full_attention'."
                )
            plan.append((SLIDING, int(window)))
        elif layer_type in _FULL_TYPES:
            plan.append((FULL, None))
        else:
            raise ValueError(
                f"Layer {index} has layer type {layer_type!r}, which HybridRingCache does not know how to store "
                f"(supported: sliding_attention, full_attention, chunked_attention, KV-shared layers). Use "
                f"`DynamicCache(config=...)` for this model."
            )
    return plan


class HybridRingCache(Cache):
    """An exact, memory-minimal cache for models mixing sliding-window and full attention (Gemma 3, Gemma 4, ...).

    Each layer gets the storage its attention needs, read from `config.get_text_config(decoder=True)`:

    - `sliding_attention` layers: a ring buffer of exactly `sliding_window` slots (+ `rollback_margin`), written in
      place at `position % capacity` (one-token steps copy one token: no `cat`, no `roll`).
    - `full_attention` layers: an append-only buffer growing geometrically (amortized O(1) per token), or, with
      `max_cache_len`, a preallocated static buffer for `torch.compile`.
    - KV-shared layers (`kv_sharing_modes == "reuse"`, Gemma 4): no storage at all.

    Ring slots are not in time order after the wrap; the cache describes their positions to the model's own mask
    creation through a documented hook (`hybrid_cache.mask_hook`), installed on construction. Results equal a
    no-cache forward pass (same model, same mask semantics).

    Args:
        config (`PreTrainedConfig`): the model's config (composite or text config).
        max_cache_len (`int`, *optional*): fixed capacity of the full-attention layers (prompt + new tokens). Makes
            the cache compileable; exceeding it raises `CacheCapacityError`. Default: storage that grows.
        rollback_margin (`int`, defaults to 0): extra ring slots so that `crop(-n)` is exact for
            `n <= rollback_margin + 1` after the wrap. Not needed for `generate`'s assisted / prompt-lookup decoding:
            with past recording on, the last multi-token step can always be undone exactly.
        initial_capacity (`int`, defaults to 0): minimum first allocation of the growing full-attention buffers
            (the default allocates the prompt length; growth is by 1/64, see `layers.GROWTH_FACTOR`).
        dense_decode_mask (`bool`, *optional*): materialize the mask of one-token steps instead of letting SDPA run
            without one. Default (`None`): on CPU for grouped-query layers, where transformers' mask-less path
            (`enable_gqa`) is several times slower than its masked, packed path; never on accelerators, whose
            mask-less kernels are the fast ones. Results are the same either way (same mask semantics).
        stage_layers (`Iterable[int]`, *optional*): under pipeline parallelism, the decoder layers this process runs;
            the others get no storage, and positions and mask sizes are answered from the layers held.
            `HybridRingCache.for_model(model)` reads them from the model. Required when `config` belongs to a model
            loaded with `DistributedConfig(pp_size > 1)`.
        full_layer_quantization (`str`, *optional*): store the full-attention layers compressed: `"int8"`, `"int4"`
            or `"fp8"` (per-token groups of `full_layer_group_size` channels, one scale each; see
            `hybrid_cache.quantized` and docs/quantization.md). Approximate. Sliding rings stay exact in the model
            dtype. Default `None`: exact storage.
        full_layer_group_size (`int`, defaults to 64): channels per quantization scale.
        full_layer_rotation (`bool`, defaults to False): Hadamard rotation within each group before quantizing
            (lower int4 error, slower decode).
        full_layer_key_calibration (`bool`, defaults to True): center and equalize the key channels before the
            per-token grouping, with a per-channel mean and spread taken from the first update of each full layer
            (the prompt). Lowers the compressed modes' error several-fold on Gemma (docs/quantization.md) for one
            extra pass over the keys per step; no effect without `full_layer_quantization`.
        full_layer_code_attention (`bool`, *optional*): whether decode steps (up to
            `code_attention.MAX_CODE_QUERY_LENGTH` tokens) of `"int8"` / `"int4"` full layers attend on the codes
            (`hybrid_cache.code_attention`: no dequantized history; needs the model's attention implementation to be
            `"hybrid_cache_sdpa"`, which is SDPA for every other call) instead of returning dequantized keys and
            values. Default (`None`): follow the model, i.e. on exactly while `config._attn_implementation ==
            "hybrid_cache_sdpa"` (switch with `model.set_attn_implementation(...)` or
            `hybrid_cache.use_code_attention(model)`). `True` with another attention function raises at its first
            decode step; `False` never. Not with `max_cache_len` (the compileable layers keep the dequantizing path).
        full_layer_window (`int`, *optional*): bound every full-attention layer to `full_layer_sink_tokens` +
            the last `full_layer_window` tokens (StreamingLLM-style, keys at their absolute positions; approximate;
            see `hybrid_cache.streaming`). The whole cache then has a fixed size. Default `None`: unbounded.
        full_layer_sink_tokens (`int`, defaults to 4 with `full_layer_window`): first tokens the bounded full
            layers keep forever.

    Example:

    ```python
    >>> from hybrid_cache import HybridRingCache
    >>> cache = HybridRingCache(model.config)
    >>> out = model.generate(**inputs, **cache_kwargs(cache), max_new_tokens=64)
    >>> print(cache.memory_report())
    ```
    """

    def __init__(
        self,
        config: PreTrainedConfig,
        max_cache_len: int | None = None,
        rollback_margin: int = 0,
        initial_capacity: int = 0,
        dense_decode_mask: bool | None = None,
        stage_layers: Iterable[int] | None = None,
        full_layer_quantization: str | None = None,
        full_layer_group_size: int = 64,
        full_layer_rotation: bool = False,
        full_layer_key_calibration: bool = True,
        full_layer_window: int | None = None,
        full_layer_sink_tokens: int | None = None,
        full_layer_code_attention: bool | None = None,
    ) -> None:
        if not isinstance(config, PreTrainedConfig):
            raise TypeError(
                f"HybridRingCache expects the model's config (a transformers PreTrainedConfig), got "
                f"{type(config).__name__}. Pass `model.config`."
            )
        _check_full_layer_options(
            full_layer_quantization, full_layer_rotation, full_layer_window, full_layer_sink_tokens, max_cache_len
        )
        _check_code_attention_option(full_layer_code_attention, full_layer_quantization, max_cache_len)
        self.config = config.get_text_config(decoder=True)
        self.full_layer_code_attention = full_layer_code_attention
        self.tp_size, pp_size = parallel_sizes(config)
        if stage_layers is None and pp_size > 1:
            raise ValueError(
                f"This config belongs to a model loaded with pipeline parallelism (pp_size={pp_size}): this process "
                f"runs only some of its layers. Build the cache with `HybridRingCache.for_model(model)` (or pass "
                f"`stage_layers=hybrid_cache.stage_layers(model)`)."
            )
        held = None if stage_layers is None else set(check_stage_layers(self.config, stage_layers))
        self.max_cache_len = max_cache_len
        self.full_layer_quantization = full_layer_quantization
        self._workspace = DequantWorkspace()
        self.dense_decode_mask = dense_decode_mask
        query_heads = self._per_layer_attribute("num_attention_heads", 1)
        kv_heads = self._per_layer_attribute("num_key_value_heads", None)
        self._grouped_query = [kv is not None and q > kv for q, kv in zip(query_heads, kv_heads)]
        self.layer_kinds: list[str] = []
        layers = []
        for index, (kind, window) in enumerate(_layer_plan(self.config)):
            if held is not None and index not in held:
                kind = OTHER_STAGE
            self.layer_kinds.append(kind)
            if kind == SLIDING:
                ring_class = RingSlidingLayer if max_cache_len is None else StaticRingSlidingLayer
                layers.append(ring_class(window, rollback_margin=rollback_margin))
            elif kind in (SHARED, OTHER_STAGE):
                layers.append(DummyLayer())
            elif full_layer_window is not None:
                sinks = 4 if full_layer_sink_tokens is None else full_layer_sink_tokens
                layers.append(SinkWindowFullLayer(sinks, full_layer_window, rollback_margin))
            elif full_layer_quantization is not None and max_cache_len is not None:
                layers.append(
                    StaticQuantizedFullLayer(
                        max_cache_len,
                        full_layer_quantization,
                        self._workspace,
                        full_layer_group_size,
                        full_layer_rotation,
                        key_calibration=full_layer_key_calibration,
                    )
                )
            elif full_layer_quantization is not None:
                layers.append(
                    QuantizedFullLayer(
                        full_layer_quantization,
                        self._workspace,
                        full_layer_group_size,
                        full_layer_rotation,
                        initial_capacity,
                        key_calibration=full_layer_key_calibration,
                    )
                )
            elif max_cache_len is not None:
                layers.append(StaticFullLayer(max_cache_len))
            else:
                layers.append(GrowableFullLayer(initial_capacity))
        super().__init__(layers=layers)
        # The ring layout announced to the mask of the current step; the hook marks it served (see `update`).
        self._issued_layouts: dict[int, RingLayout] = {}  # ring layouts announced for the step `_issued_step`
        self._issued_step: tuple[int, int] | None = None
        self._verified_step: tuple[int, int] | None = None  # the step whose served layout the first update checked
        # Layers whose one-token steps can return keys out of time order (sliding rings, bounded full layers).
        self._first_ring = next((i for i, layer in enumerate(layers) if isinstance(layer, _RING_LAYERS)), None)
        install_mask_hook()

    @property
    def max_cache_len(self) -> int | None:
        """The fixed full-attention capacity given to the constructor (`None`: storage that grows). Our own
        attribute: transformers' `Cache` had a read-only `max_cache_len` property up to 5.19."""
        return self.__dict__.get("_max_cache_len", self.__dict__.get("max_cache_len"))  # (pickles of older versions)

    @max_cache_len.setter
    def max_cache_len(self, value: int | None) -> None:
        self.__dict__["_max_cache_len"] = value

    def __setstate__(self, state: dict) -> None:
        # Unpickling (`pickle`, `torch.load`, `copy.deepcopy` in a new process) skips `__init__`: the mask hook must
        # be in place before the first step after the wrap, whichever process this is.
        self.__dict__.update(state)
        install_mask_hook()

    @classmethod
    def for_model(cls, model: Any, **kwargs: Any) -> HybridRingCache:
        """A cache for `model` as this process runs it: under pipeline parallelism, storage for its stage's layers
        only (read from the model, see `hybrid_cache.stage_layers`); otherwise the same as `cls(model.config)`."""
        return cls(model.config, stage_layers=stage_layers(model), **kwargs)

    # --- guarded entry points -------------------------------------------------------------------------------------
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_idx >= len(self.layers):
            raise IndexError(
                f"update() for layer {layer_idx}, but the config declares {len(self.layers)} layers. The cache was "
                f"built from another model's config."
            )
        layer = self.layers[layer_idx]
        if isinstance(layer, DummyLayer) and self.layer_kinds[layer_idx] == OTHER_STAGE:
            raise RuntimeError(
                f"update() for layer {layer_idx}, which this cache does not hold (stage_layers: another pipeline "
                f"stage runs it). Build the cache with `HybridRingCache.for_model(model)` on each process."
            )
        if isinstance(layer, DummyLayer):
            raise RuntimeError(
                f"Layer {layer_idx} is KV-shared (kv_sharing_modes='reuse') and stores nothing, but the model called "
                f"update() for it: the cache was built from a config that does not match the model."
            )
        if not is_torchdynamo_compiling():  # the checks read Python counters; compiled steps were checked eagerly
            self._check_ring_mask_was_built(layer_idx, key_states.shape[-2])
        if type(layer) is QuantizedFullLayer:  # the growing compressed layer (not the compileable one)
            return layer.update(key_states, value_states, *args, return_codes=self.attends_on_codes(), **kwargs)
        return layer.update(key_states, value_states, *args, **kwargs)

    def attends_on_codes(self) -> bool:
        """Whether this step's compressed full layers return their codes for attention on them (see
        `full_layer_code_attention`): the option, or by default whether the model uses `"hybrid_cache_sdpa"`."""
        if self.full_layer_code_attention is not None:
            return self.full_layer_code_attention
        return getattr(self.config, "_attn_implementation", None) == CODE_ATTENTION

    def _check_ring_mask_was_built(self, layer_idx: int, query_length: int) -> None:
        """A wrapped ring's one-token step is only exact if this step's mask was built by the hook from the layout
        `get_mask_sizes` announced. Checked before any layer of the step is written (also at a full layer that comes
        before the first ring), so a refused step leaves the cache as it was."""
        if (
            self._first_ring is None
            or layer_idx > self._first_ring
            and not isinstance(self.layers[layer_idx], _RING_LAYERS)
        ):
            return  # time-ordered layers after the first ring: the first ring already checked this step
        ring = self.layers[layer_idx] if layer_idx >= self._first_ring else self.layers[self._first_ring]
        if not isinstance(ring, _RING_LAYERS) or not ring.needs_ring_layout(query_length):
            return
        step = (ring.cumulative_length, query_length)
        if self._verified_step == step:
            return  # a later layer of the step whose layout the first one verified
        check_ring_attention_supported(getattr(self.config, "_attn_implementation", None))
        layouts, self._issued_layouts = self._issued_layouts, {}  # checked once; do not keep their tensors alive
        if not layouts or not all(layout.served for layout in layouts.values()) or self._issued_step != step:
            raise RuntimeError(
                "HybridRingCache's sliding-window ring has wrapped, but no attention mask was built for its slot "
                "layout in this forward pass (the model was given a prepared 4D attention mask, or its attention "
                "does not use transformers' mask functions). Pass a 2D attention mask (or none) so the model builds "
                "its masks itself, or use `DynamicCache` for this model."
            )
        self._verified_step = step

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int | RingLayout]:
        layer_idx = self._storing_layer_index(layer_idx)
        if query_length == 0 and not is_torchdynamo_compiling():
            raise ConversationMismatchError(
                f"A step with no new tokens reached HybridRingCache, which holds {self.get_seq_length()} tokens: "
                f"`generate` slices the new tokens off the prompt by the cached length, so a prompt no longer than "
                f"the cached tokens leaves nothing (or the wrong tokens) to run. A cache holds one conversation: to "
                f"continue it, pass the whole conversation (the cached tokens, then the new ones); to start another, "
                f"pass a new `HybridRingCache(model.config)` or call `cache.reset()` first."
            )
        kv_length, kv_offset = super().get_mask_sizes(query_length, layer_idx)
        if query_length == 1 and not isinstance(kv_offset, RingLayout) and self._wants_dense_mask(layer_idx):
            if not is_mask_hook_installed(getattr(self.config, "_attn_implementation", None) or "sdpa"):
                install_mask_hook()  # only a performance request, but it needs the hook to be honoured
            kv_offset = DenseMaskRequest(kv_offset)
        if not is_torchdynamo_compiling():
            if not isinstance(kv_offset, (RingLayout, CacheOffset)):
                kv_offset = CacheOffset(kv_offset)
            # The 2D mask must cover the held tokens and this step's (checked by the hook, see `CacheOffset`).
            kv_offset.columns_needed = self.layers[layer_idx].get_seq_length() + query_length
        if isinstance(kv_offset, (RingLayout, HeldFromOffset)):
            # Tell the hook's window check which mask this can be (see `HeldFromOffset.sliding_request`).
            kv_offset.sliding_request = (
                False
                if isinstance(self.layers[layer_idx], SinkWindowFullLayer)
                else (True if FULL in self.layer_kinds else None)
            )
        if isinstance(kv_offset, RingLayout) and not is_torchdynamo_compiling():
            # Only a wrapped ring needs the hook: check now that it will be the one serving this mask.
            check_ring_attention_supported(getattr(self.config, "_attn_implementation", None))
            step = (self.layers[layer_idx].cumulative_length, query_length)
            if step != self._issued_step:
                self._issued_layouts, self._issued_step = {}, step
            # The latest layout per layer asked: model code may size something from one request (Gemma's image-block
            # padding) and build the mask from the next.
            self._issued_layouts[layer_idx] = kv_offset
        return kv_length, kv_offset

    def key_positions(self, layer_idx: int) -> torch.Tensor:
        """Absolute token position of every key that layer `layer_idx` returned in the last step, in the order the
        attention saw them (`-1`: an empty slot, always masked).

        After the wrap a sliding layer's one-token step attends over the ring in slot order, so column `j` of its
        attention weights (`output_attentions=True`) belongs to position `key_positions(layer_idx)[j]`, not `j`. Use
        `hybrid_cache.attention_in_time_order(weights, cache.key_positions(layer_idx))` to get time-ordered maps.
        KV-shared layers attend over the keys of the last storing layer of their type: pass that layer's index.
        """
        layer = self.layers[layer_idx]
        if not hasattr(layer, "key_positions"):
            raise ValueError(
                f"Layer {layer_idx} is KV-shared and stores nothing; its attention uses the keys of the last storing "
                f"layer of the same type: call key_positions() with that layer's index."
            )
        return layer.key_positions()

    # --- state changes that must be all-or-nothing ------------------------------------------------------------------
    def crop(self, tokens_to_remove: int) -> None:
        """Roll back tokens in every layer (negative: how many; positive, legacy: the length to keep), exactly or not
        at all: every layer is checked first, so a refused crop raises `RollbackError` and changes nothing."""
        storing = [layer for layer in self.layers if not isinstance(layer, DummyLayer)]
        for layer in storing:
            try:
                layer.check_crop(tokens_to_remove)
            except RollbackError as error:
                if note := rollback_release_note():
                    raise RollbackError(f"{error}{note}") from error
                raise
        for layer in storing:
            layer.crop(tokens_to_remove)
        self._forget_step_layout()

    def reset(self) -> None:
        super().reset()
        self._forget_step_layout()

    def _forget_step_layout(self) -> None:
        # After a crop or reset the same (length, query length) step can come again: it must get a new layout.
        self._issued_layouts, self._issued_step, self._verified_step = {}, None, None

    def activate_past_recording(self) -> None:
        """Keep the window of each multi-token step until the next one, so that `crop` can undo it exactly (what
        `generate`'s assisted / prompt-lookup decoding calls, from transformers 5.14). Raises `UnsupportedReleaseError`
        on 5.14 to 5.17, whose speculative decoding is not exact with a wrapped ring (see `compat.rollback_supported`)."""
        check_rollback_supported()
        for layer in self.layers:
            if hasattr(layer, "activate_past_recording"):
                layer.activate_past_recording()

    def deactivate_past_recording(self) -> None:
        """Stop keeping the window of the last multi-token step for rollbacks, and release it.

        `generate`'s assisted and prompt-lookup decoding turn recording on and never off. The cache turns it off
        itself when a recorded step is not rolled back before the next one (speculation is over) and when a new
        `generate` call starts; call this to release the kept window right away (e.g. before a long prefill)."""
        for layer in self.layers:
            if isinstance(layer, _RING_LAYERS):
                layer.deactivate_past_recording()

    @property
    def _is_user_defined(self) -> bool:
        return getattr(self, "_user_defined_by_generate", False)

    @_is_user_defined.setter
    def _is_user_defined(self, value: bool) -> None:
        # transformers' `generate` sets this on a cache passed in, once per call, before its first forward: a new
        # generation starts, so recording left on by an earlier assisted generation must not copy this prefill.
        self._user_defined_by_generate = value
        self.deactivate_past_recording()

    def _storing_layer_index(self, layer_idx: int) -> int:
        """`layer_idx`, or the first layer holding storage when `layer_idx` holds none: transformers asks for layer 0
        when a cache has no layer of a mask's type, and under pipeline parallelism layer 0 may run on another stage
        (its `Cache` base answers from the first storing layer; so do we, for the mask request we record)."""
        if layer_idx < len(self.layers) and isinstance(self.layers[layer_idx], DummyLayer):
            return next((i for i, layer in enumerate(self.layers) if not isinstance(layer, DummyLayer)), layer_idx)
        return layer_idx

    def _wants_dense_mask(self, layer_idx: int) -> bool:
        if self.max_cache_len is not None or layer_idx >= len(self.layers):
            return False  # fixed mode: transformers already materializes one-token masks for compileable caches
        if self.dense_decode_mask is not None:
            return self.dense_decode_mask
        device = getattr(self.layers[layer_idx], "device", None)
        return device is not None and device.type == "cpu" and self._grouped_query[layer_idx]

    # --- protocol additions ---------------------------------------------------------------------------------------
    def early_initialization(
        self,
        batch_size: int,
        num_heads: int | list[int],
        head_dim: int | list[int],
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        """Allocate every storing layer ahead of time (for `torch.export` / compiled prefill).

        `num_heads` / `head_dim` may be per-layer lists (Gemma 4 has different head sizes per layer type). An int
        `num_heads` is the KV heads per process: used as given when every layer has the same count; when the config
        declares different counts per layer type (Gemma 4), each layer gets its config count divided by the tensor
        parallel degree (`model.config.distributed_config.tp_size`), and `num_heads` must be one of those. An int
        `head_dim` is replaced by the per-layer config values where the config declares them.
        """
        if isinstance(num_heads, int):
            num_heads = self._per_rank_kv_heads(num_heads)
        if isinstance(head_dim, int):
            head_dim = self._per_layer_attribute("head_dim", head_dim)
        super().early_initialization(batch_size, num_heads, head_dim, dtype, device)

    def _per_rank_kv_heads(self, num_heads: int) -> list[int]:
        """Per-layer KV heads of this process for `early_initialization(num_heads=int)` (see there)."""
        declared = self._per_layer_attribute("num_key_value_heads", num_heads)
        storing = {count for count, kind in zip(declared, self.layer_kinds) if kind in (SLIDING, FULL)}
        if len(storing) <= 1:
            return [num_heads] * len(declared)
        if any(count % self.tp_size for count in storing):
            raise ValueError(
                f"The config declares {sorted(storing)} KV heads per layer type, which tensor parallelism of degree "
                f"{self.tp_size} cannot split evenly. Pass `num_heads` as a list with one entry per layer."
            )
        per_rank = [count // self.tp_size for count in declared]
        if num_heads not in {count // self.tp_size for count in storing}:
            raise ValueError(
                f"early_initialization(num_heads={num_heads}): this model has {sorted(storing)} KV heads per layer "
                f"type ({self.tp_size} tensor-parallel rank(s): {sorted({c // self.tp_size for c in storing})} per "
                f"rank), so one int cannot describe it. Pass `num_heads` as a list with one entry per layer."
            )
        return per_rank

    def _per_layer_attribute(self, name: str, default: int | None) -> list[int | None]:
        """`name` for every layer, from the per-layer configs of heterogeneous configs (Gemma 4), where reading the
        global attribute raises; `default` where a layer does not declare it."""
        per_layer = getattr(self.config, "per_layer_config", None)
        if per_layer is None:
            return [getattr(self.config, name, None) or default] * self.config.num_hidden_layers
        return [getattr(layer_config, name, None) or default for layer_config in per_layer]

    @property
    def is_compileable(self) -> bool:
        # Compiled decode steps need static shapes and addresses: only with a fixed full-attention capacity.
        return self.max_cache_len is not None

    def memory_report(self) -> MemoryReport:
        """Bytes held per layer type and in total (every tensor the cache keeps alive), against a full cache of every
        storing layer for the same tokens."""
        tokens = int(self.get_seq_length())
        workspace = self._workspace.nbytes()
        report = MemoryReport(
            tokens=tokens, total_bytes=workspace, full_cache_bytes=0, extra_bytes=workspace, workspace_bytes=workspace
        )
        for kind, layer in zip(self.layer_kinds, self.layers):
            held = layer.nbytes() if hasattr(layer, "nbytes") else 0
            extra = layer.extra_nbytes() if hasattr(layer, "extra_nbytes") else 0
            report.per_layer.append((kind, held))
            report.kv_bytes += held
            report.extra_bytes += extra
            report.total_bytes += held + extra
            report.bytes_by_type[kind] = report.bytes_by_type.get(kind, 0) + held
            report.layers_by_type[kind] = report.layers_by_type.get(kind, 0) + 1
            report.slots_by_type.setdefault(kind, []).append(getattr(layer, "capacity", 0))
            if getattr(layer, "is_initialized", False) and hasattr(layer, "uncompressed_bytes_per_token"):
                report.full_cache_bytes += layer.uncompressed_bytes_per_token() * tokens
        return report

    # --- persistence and snapshots (the logic lives in snapshot.py) ------------------------------------------------
    def save(self, path: str | os.PathLike, metadata: Mapping[str, str] | None = None) -> None:
        """Write the cache to one safetensors file, from which `HybridRingCache.load` continues exactly.

        The file holds every layer's K/V content (rings in slot order with their counters, full layers' tokens),
        the constructor arguments, what identifies the model config, and `metadata` verbatim in the safetensors
        header (`safetensors.safe_open(path, "pt").metadata()`, or `hybrid_cache.read_metadata(path)`). It is
        written to a temporary file in the same directory and renamed over `path`: one file, no leftovers.

        Args:
            path (`str` or `os.PathLike`): the file to write (replaced if it exists).
            metadata (`dict[str, str]`, *optional*): your own header entries; keys may not start with
                `"hybrid_cache."`.
        """
        save_cache(self, path, metadata)

    @classmethod
    def load(
        cls, path: str | os.PathLike, config: PreTrainedConfig, *, device: torch.device | str | None = None
    ) -> HybridRingCache:
        """Read a cache written by `save`: it continues exactly as the saved cache would (same logits in fp32,
        bit-identical tensors in every dtype).

        Args:
            path (`str` or `os.PathLike`): a file written by `HybridRingCache.save`.
            config (`PreTrainedConfig`): the config of the model that saved it (checked against the file).
            device (`torch.device` or `str`, *optional*): where to put the tensors (default: CPU).

        Raises:
            ValueError: `config` does not match the file (the message names the field: `num_hidden_layers`,
                `layer_types`, `sliding_window`, `num_key_value_heads`, `head_dim`, ...), or the file is truncated,
                corrupted or not a saved cache (the message names the path).
            OSError: the file cannot be opened.
        """
        return load_cache(cls, path, config, device)

    def checkpoint(self) -> CacheCheckpoint:
        """An in-memory snapshot for `restore`: a copy of the rings (about `sliding layers x window` slots) and the
        full layers' lengths, never their history. Cheap enough for every branch point of a generation."""
        return take_checkpoint(self)

    def restore(self, checkpoint: CacheCheckpoint) -> None:
        """Go back exactly to the state at `checkpoint()`, even after the rings overwrote those slots: the rings get
        their saved slots back and the full layers are cut back to the checkpoint's length.

        Works any number of times, after decoding, `crop` or `reset`, while the batch size is the same. Raises
        `ValueError` (and changes nothing) for another batch size, or when the full layers' tokens before the
        checkpoint were rewritten since (e.g. `reset()` then a new prompt).
        """
        restore_checkpoint(self, checkpoint)
        self._forget_step_layout()  # a mask built before the restore describes another layout


def _check_code_attention_option(
    code_attention: bool | None, quantization: str | None, max_cache_len: int | None
) -> None:
    """Refuse `full_layer_code_attention=True` where no layer could attend on codes."""
    if not code_attention:
        return
    if quantization not in CODE_ATTENTION_MODES:
        raise ValueError(
            f"full_layer_code_attention=True attends on integer codes: it needs full_layer_quantization in "
            f"{CODE_ATTENTION_MODES}, got {quantization!r}. Drop the option or pick one of those modes."
        )
    if max_cache_len is not None:
        raise ValueError(
            "full_layer_code_attention=True has no compileable variant: the fixed-capacity layers (max_cache_len) "
            "keep the dequantizing path. Drop max_cache_len or the option."
        )


def _check_full_layer_options(
    quantization: str | None, rotation: bool, window: int | None, sink_tokens: int | None, max_cache_len: int | None
) -> None:
    """Refuse unknown or unsupported full-layer storage options before anything is built."""
    if quantization is not None and quantization not in QUANTIZATION_MODES:
        raise ValueError(
            f"Unknown full_layer_quantization {quantization!r}; choose one of {QUANTIZATION_MODES}, or None for exact "
            f"full-attention layers."
        )
    if rotation and quantization is None:
        raise ValueError("full_layer_rotation=True needs full_layer_quantization ('int8', 'int4' or 'fp8').")
    if sink_tokens is not None and window is None:
        raise ValueError(
            "full_layer_sink_tokens bounds the full-attention layers only together with full_layer_window (the recent "
            "tokens kept): pass both, e.g. full_layer_sink_tokens=4, full_layer_window=1024."
        )
    if window is not None and quantization is not None:
        raise ValueError(
            "Bounded full layers (full_layer_window) and full_layer_quantization cannot be combined yet: the bounded "
            "layers are already a fixed size. Use one of the two."
        )
    if window is not None and max_cache_len is not None:
        raise ValueError(
            "Bounded full layers (full_layer_window) have no compileable variant: drop max_cache_len (the bounded "
            "cache already has a fixed size) or drop full_layer_window to compile."
        )
