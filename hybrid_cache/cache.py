"""`HybridRingCache`: the cache container. It builds one storage per decoder layer from the layer specifications
(`specs.py`) and the options (`options.py`), through the table `LAYER_STORAGE`; everything else is forwarding to the
layers (`ring.py`, `full.py`, `quantized.py`, `streaming.py`), the mask hook (`mask_hook.py`) and the snapshot format
(`snapshot.py`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import Any

import torch
from transformers.cache_utils import Cache
from transformers.configuration_utils import PreTrainedConfig
from transformers.utils import is_torchdynamo_compiling

from .code_attention import CODE_ATTENTION
from .compat import CacheLayerMixin, DummyLayer, check_rollback_supported, rollback_release_note
from .distributed import check_parallel_config, stage_layers
from .full import GrowableFullLayer, StaticFullLayer
from .mask_hook import (
    IssuedLayouts,
    RingLayout,
    annotate_offset,
    check_ring_attention_supported,
    install_mask_hook,
    is_mask_hook_installed,
    refuse_empty_step,
)
from .memory import MemoryReport, memory_report
from .options import CacheOptions
from .quantized import DequantWorkspace, QuantizedFullLayer, StaticQuantizedFullLayer
from .ring import RingSlidingLayer, StaticRingSlidingLayer
from .snapshot import CacheCheckpoint, load_cache, restore_checkpoint, save_cache, take_checkpoint
from .specs import FULL, OTHER_STAGE, SHARED, SLIDING, LayerSpec, kv_heads_per_rank, layer_specs
from .streaming import SinkWindowFullLayer

__all__ = ["LAYER_STORAGE", "OTHER_STAGE", "SHARED", "SLIDING", "FULL", "HybridRingCache", "MemoryReport"]

# Storage whose one-token steps return keys out of time order once wrapped, described to the mask by a `RingLayout`.
_RING_LAYERS = (RingSlidingLayer, SinkWindowFullLayer)

#: The storage of a layer, by `CacheOptions.storage(kind)` (like transformers' `STATIC_LAYER_TYPE_MAPPING`): a
#: factory of the layer spec, the options and the dequantization workspace the compressed layers share.
LAYER_STORAGE: dict[str, Callable[[LayerSpec, CacheOptions, DequantWorkspace], CacheLayerMixin]] = {
    "ring": lambda spec, options, _: RingSlidingLayer(spec.window, rollback_margin=options.rollback_margin),
    "static_ring": lambda spec, options, _: StaticRingSlidingLayer(
        spec.window, rollback_margin=options.rollback_margin
    ),
    "growable": lambda spec, options, _: GrowableFullLayer(options.initial_capacity),
    "static": lambda spec, options, _: StaticFullLayer(options.max_cache_len),
    "quantized": lambda spec, options, workspace: QuantizedFullLayer(
        options.full_layer_quantization,
        workspace,
        options.full_layer_group_size,
        options.full_layer_rotation,
        options.initial_capacity,
        key_calibration=options.full_layer_key_calibration,
    ),
    "static_quantized": lambda spec, options, workspace: StaticQuantizedFullLayer(
        options.max_cache_len,
        options.full_layer_quantization,
        workspace,
        options.full_layer_group_size,
        options.full_layer_rotation,
        key_calibration=options.full_layer_key_calibration,
    ),
    "sink_window": lambda spec, options, _: SinkWindowFullLayer(
        options.sink_tokens, options.full_layer_window, options.rollback_margin
    ),
}


def build_layer(spec: LayerSpec, options: CacheOptions, workspace: DequantWorkspace) -> CacheLayerMixin:
    """The storage of one layer: from `LAYER_STORAGE`, or a `DummyLayer` for layers that store nothing here."""
    if not spec.stores:
        return DummyLayer()
    return LAYER_STORAGE[options.storage(spec.storage_kind)](spec, options, workspace)


class HybridRingCache(Cache):
    """An exact, memory-minimal cache for models mixing sliding-window and full attention (Gemma 3, Gemma 4, ...).

    Each layer gets the storage its attention needs (`specs.layer_specs`, `LAYER_STORAGE`): sliding layers a ring of
    `sliding_window` slots (+ `rollback_margin`) written in place at `position % capacity`; full layers an
    append-only buffer growing geometrically, or with `max_cache_len` a static buffer for `torch.compile`; KV-shared
    layers nothing. The ring's slot order after the wrap is described to the model's own mask creation by a hook
    (`hybrid_cache.mask_hook`), installed on construction. Results equal a no-cache forward pass.

    Args:
        config (`PreTrainedConfig`): the model's config (composite or text config).
        stage_layers (`Iterable[int]`, *optional*): under pipeline parallelism, the decoder layers this process runs;
            the others get no storage, and positions and mask sizes are answered from the layers held.
            `HybridRingCache.for_model(model)` reads them from the model. Required when `config` belongs to a model
            loaded with `DistributedConfig(pp_size > 1)`.
        max_cache_len, rollback_margin, initial_capacity, dense_decode_mask, full_layer_*: the storage options, checked
            together and documented in `hybrid_cache.options.CacheOptions` (`cache.options`). By default every layer
            is exact and grows as needed.

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
        full_layer_rotation: bool | None = None,
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
        self.options = CacheOptions(
            max_cache_len,
            rollback_margin,
            initial_capacity,
            dense_decode_mask,
            full_layer_quantization,
            full_layer_group_size,
            full_layer_rotation,
            full_layer_key_calibration,
            full_layer_window,
            full_layer_sink_tokens,
            full_layer_code_attention,
        )
        self.config = config.get_text_config(decoder=True)
        self.tp_size = check_parallel_config(config, stage_layers)
        self.specs = layer_specs(self.config, stage_layers)
        self.layer_kinds = [spec.storage_kind for spec in self.specs]
        self._workspace = DequantWorkspace()
        super().__init__(layers=[build_layer(spec, self.options, self._workspace) for spec in self.specs])
        self._layouts = IssuedLayouts()  # ring layouts announced to this step's masks (see `update`)
        self._first_ring = next((i for i, layer in enumerate(self.layers) if isinstance(layer, _RING_LAYERS)), None)
        install_mask_hook()

    # Options read as attributes (`dense_decode_mask` may be changed between steps).
    max_cache_len = property(lambda self: self.options.max_cache_len)
    dense_decode_mask = property(
        lambda self: self.options.dense_decode_mask,
        lambda self, value: setattr(self, "options", replace(self.options, dense_decode_mask=value)),
    )

    def __setstate__(self, state: dict) -> None:
        # Unpickling skips `__init__`: the mask hook must be in place in this process before the first wrapped step.
        self.__dict__.update(_upgrade_pickled_state(state))
        install_mask_hook()

    @classmethod
    def for_model(cls, model: Any, **kwargs: Any) -> HybridRingCache:
        """A cache for `model` as this process runs it (under pipeline parallelism: its stage's layers only)."""
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
        if isinstance(layer, DummyLayer):
            _refuse_update_of_empty_layer(self.specs[layer_idx])
        if not is_torchdynamo_compiling():  # the checks read Python counters; compiled steps were checked eagerly
            self._check_ring_mask_was_built(layer_idx, key_states.shape[-2])
        if type(layer) is QuantizedFullLayer:  # the growing compressed layer (not the compileable one)
            return layer.update(key_states, value_states, *args, return_codes=self.attends_on_codes(), **kwargs)
        return layer.update(key_states, value_states, *args, **kwargs)

    def attends_on_codes(self) -> bool:
        """Whether compressed full layers return their codes (`full_layer_code_attention`, default: the model's)."""
        if self.options.full_layer_code_attention is not None:
            return self.options.full_layer_code_attention
        return getattr(self.config, "_attn_implementation", None) == CODE_ATTENTION

    def _check_ring_mask_was_built(self, layer_idx: int, query_length: int) -> None:
        """Checked before any layer of a step is written (also at a full layer that comes before the first ring), so
        a refused step leaves the cache as it was (see `mask_hook.IssuedLayouts`)."""
        first_ring = self._first_ring
        if first_ring is None or layer_idx > first_ring and not isinstance(self.layers[layer_idx], _RING_LAYERS):
            return  # time-ordered layers after the first ring: the first ring already checked this step
        ring = self.layers[max(layer_idx, first_ring)]
        if isinstance(ring, _RING_LAYERS) and ring.needs_ring_layout(query_length):
            step = (ring.cumulative_length, query_length)
            self._layouts.check_served(step, getattr(self.config, "_attn_implementation", None))

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int | RingLayout]:
        layer_idx = self._storing_layer_index(layer_idx)
        if query_length == 0 and not is_torchdynamo_compiling():
            refuse_empty_step(self.get_seq_length())
        kv_length, kv_offset = super().get_mask_sizes(query_length, layer_idx)
        layer, attention = self.layers[layer_idx], getattr(self.config, "_attn_implementation", None)
        dense = query_length == 1 and _wants_dense_mask(self.options, self.specs[layer_idx], layer)
        if dense and not isinstance(kv_offset, RingLayout) and not is_mask_hook_installed(attention or "sdpa"):
            install_mask_hook()  # only a performance request, but it needs the hook to be honoured
        # Which mask this can be, for the hook's window check (see `HeldFromOffset.sliding_request`).
        sliding_request = not isinstance(layer, SinkWindowFullLayer) and (FULL in self.layer_kinds or None)
        columns = layer.get_seq_length() + query_length if not is_torchdynamo_compiling() else None
        kv_offset = annotate_offset(kv_offset, columns_needed=columns, sliding_request=sliding_request, dense=dense)
        if isinstance(kv_offset, RingLayout) and not is_torchdynamo_compiling():
            # Only a wrapped ring needs the hook: check now that it will be the one serving this mask.
            check_ring_attention_supported(attention)
            self._layouts.issue(layer_idx, (layer.cumulative_length, query_length), kv_offset)
        return kv_length, kv_offset

    def key_positions(self, layer_idx: int) -> torch.Tensor:
        """Absolute position of every key layer `layer_idx` returned in the last step, in the order the attention saw
        them (`-1`: empty slot): column `j` of its attention weights belongs to position `key_positions(layer_idx)[j]`
        (see `hybrid_cache.attention_in_time_order`). KV-shared layers: pass the index of the layer they reuse."""
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
            with rollback_release_note():
                layer.check_crop(tokens_to_remove)
        for layer in storing:
            layer.crop(tokens_to_remove)
        self._layouts.forget()

    def reset(self) -> None:
        super().reset()
        self._layouts.forget()

    def activate_past_recording(self) -> None:
        """Keep the window of each multi-token step until the next one, so that `crop` can undo it exactly (called by
        assisted / prompt-lookup decoding). Raises `UnsupportedReleaseError` where that is not exact (`compat`)."""
        check_rollback_supported()
        for layer in self.layers:
            if hasattr(layer, "activate_past_recording"):
                layer.activate_past_recording()

    def deactivate_past_recording(self) -> None:
        """Stop keeping the last multi-token step's window for rollbacks, and release it (the cache also does so when a
        recorded step is not rolled back before the next one, and when a new `generate` call starts)."""
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
        """`layer_idx`, or the first storing layer when it stores nothing (transformers asks for layer 0, which may be
        KV-shared or on another pipeline stage; its `Cache` base answers from the first storing layer, so do we)."""
        if layer_idx < len(self.layers) and isinstance(self.layers[layer_idx], DummyLayer):
            return next((i for i, layer in enumerate(self.layers) if not isinstance(layer, DummyLayer)), layer_idx)
        return layer_idx

    # --- protocol additions ---------------------------------------------------------------------------------------
    def early_initialization(
        self,
        batch_size: int,
        num_heads: int | list[int],
        head_dim: int | list[int],
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        """Allocate every storing layer ahead of time (`torch.export`, compiled prefill). `num_heads` / `head_dim`: one
        per layer, or an int: the KV heads per process (`specs.kv_heads_per_rank`), the head size where the config
        declares none."""
        if isinstance(num_heads, int):
            num_heads = kv_heads_per_rank(self.specs, num_heads, self.tp_size)
        if isinstance(head_dim, int):
            head_dim = [spec.declared_head_dim or head_dim for spec in self.specs]
        super().early_initialization(batch_size, num_heads, head_dim, dtype, device)

    @property
    def is_compileable(self) -> bool:
        # Compiled decode steps need static shapes and addresses: only with a fixed full-attention capacity.
        return self.max_cache_len is not None

    def memory_report(self) -> MemoryReport:
        """Bytes held per layer type and in total (every tensor the cache keeps alive), against a full cache of every
        storing layer for the same tokens."""
        tokens = int(self.get_seq_length())
        return memory_report(tokens, self.layer_kinds, self.layers, self._workspace.nbytes())

    # --- persistence and snapshots (the format lives in snapshot.py) -----------------------------------------------
    def save(self, path: str | os.PathLike, metadata: Mapping[str, str] | None = None) -> None:
        """Write the cache to one safetensors file (replaced atomically) that `load` continues from exactly, with your
        `metadata` (str to str, keys not starting with `"hybrid_cache."`) in its header (`snapshot.read_metadata`)."""
        save_cache(self, path, metadata)

    @classmethod
    def load(
        cls, path: str | os.PathLike, config: PreTrainedConfig, *, device: torch.device | str | None = None
    ) -> HybridRingCache:
        """Read a cache written by `save` for `config` (tensors on `device`, default CPU): it continues exactly as the
        saved cache would. Raises `ValueError` naming the field when `config` does not match the file, or naming the
        path when the file is truncated, corrupted or not a saved cache; `OSError` when it cannot be opened."""
        return load_cache(cls, path, config, device)

    def checkpoint(self) -> CacheCheckpoint:
        """An in-memory snapshot for `restore`: a copy of the rings and the full layers' lengths (not their history)."""
        return take_checkpoint(self)

    def restore(self, checkpoint: CacheCheckpoint) -> None:
        """Go back exactly to the state at `checkpoint()`, any number of times. Raises `ValueError`, changing nothing,
        for another batch size or when the full layers' tokens before it were rewritten since (`reset()`, new prompt)."""
        restore_checkpoint(self, checkpoint)
        self._layouts.forget()  # a mask built before the restore describes another layout


def _refuse_update_of_empty_layer(spec: LayerSpec) -> None:
    """`update()` reached a layer that stores nothing here: the cache does not fit the model as it runs."""
    if spec.kind == OTHER_STAGE:
        raise RuntimeError(
            f"update() for layer {spec.index}, which this cache does not hold (stage_layers: another pipeline "
            f"stage runs it). Build the cache with `HybridRingCache.for_model(model)` on each process."
        )
    raise RuntimeError(
        f"Layer {spec.index} is KV-shared (kv_sharing_modes='reuse') and stores nothing, but the model called "
        f"update() for it: the cache was built from a config that does not match the model."
    )


def _wants_dense_mask(options: CacheOptions, spec: LayerSpec, layer: CacheLayerMixin) -> bool:
    """Whether a one-token step's mask is materialized (`dense_decode_mask`; default: grouped-query layers on CPU)."""
    if options.max_cache_len is not None:
        return False  # fixed mode: transformers already materializes one-token masks for compileable caches
    if options.dense_decode_mask is not None:
        return options.dense_decode_mask
    device = getattr(layer, "device", None)
    grouped_query = spec.declared_kv_heads is not None and (spec.query_heads or 1) > spec.declared_kv_heads
    return device is not None and device.type == "cpu" and grouped_query


def _upgrade_pickled_state(state: dict) -> dict:
    """The state of a cache pickled by a release that kept its options as separate attributes (before
    `CacheOptions`): the options read back from those attributes and the layers, the specs from the config."""
    if "options" in state:
        return state
    layers = state.get("layers", [])

    def first(kind: type) -> Any:
        return next((layer for layer in layers if isinstance(layer, kind)), None)

    ring, bounded, compressed = first(RingSlidingLayer), first(SinkWindowFullLayer), first(QuantizedFullLayer)
    growing = next((layer for layer in layers if hasattr(layer, "initial_capacity")), None)
    state["options"] = CacheOptions(
        max_cache_len=state.pop("_max_cache_len", state.pop("max_cache_len", None)),
        rollback_margin=getattr(ring, "rollback_margin", 0),
        initial_capacity=getattr(growing, "initial_capacity", 0),
        dense_decode_mask=state.pop("dense_decode_mask", None),
        full_layer_quantization=state.pop("full_layer_quantization", None),
        full_layer_group_size=getattr(compressed, "group_size", 64),
        full_layer_rotation=getattr(compressed, "rotate", False),
        full_layer_key_calibration=getattr(compressed, "key_calibration", True),
        full_layer_window=getattr(bounded, "window", None),
        full_layer_sink_tokens=getattr(bounded, "sink_tokens", None),
        full_layer_code_attention=state.pop("full_layer_code_attention", None),
    )
    kinds = state.get("layer_kinds", [])
    state["specs"] = [
        replace(spec, kind=OTHER_STAGE) if kind == OTHER_STAGE else spec
        for spec, kind in zip(layer_specs(state["config"]), kinds)
    ]
    for name in ("_issued_layouts", "_issued_step", "_verified_step", "_grouped_query"):
        state.pop(name, None)
    state["_layouts"] = IssuedLayouts()
    return state
