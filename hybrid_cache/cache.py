"""`HybridRingCache`: the cache container. It builds one storage per decoder layer from the layer specifications
(`specs.py`) and the options (`options.py`), through the table `LAYER_STORAGE`; everything else is forwarding to the
layers (`ring.py`, `full.py`, `quantized.py`, `streaming.py`), the mask hook (`mask_hook.py`) and the snapshot format
(`snapshot.py`).
"""

from __future__ import annotations

import copy
import functools
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import Any, TypeVar

import torch
from transformers.cache_utils import Cache
from transformers.configuration_utils import PreTrainedConfig
from transformers.utils import is_torchdynamo_compiling

from .checkpoints import CacheCheckpoint, restore_checkpoint, take_checkpoint
from .code_attention import CODE_ATTENTION
from .compat import (
    CacheLayerMixin,
    DummyLayer,
    check_rollback_supported,
    initialize_layers_early,
    notify_generate_start,
    rollback_release_note,
)
from .distributed import check_parallel_config, stage_layers
from .full import GrowableFullLayer, StaticFullLayer
from .mask_hook import (
    RingLayout,
    annotate_offset,
    check_ring_attention_supported,
    install_mask_hook,
    is_mask_hook_installed,
)
from .memory import MemoryReport, memory_report
from .options import CacheOptions
from .quantized import DequantWorkspace, QuantizedFullLayer, StaticQuantizedFullLayer
from .ring import RingSlidingLayer, StaticRingSlidingLayer
from .snapshot import load_cache, save_cache
from .specs import FULL, OTHER_STAGE, LayerSpec, kv_heads_per_rank, layer_specs
from .steps import StepAdmission
from .storage import StorageLayer
from .streaming import SinkWindowFullLayer

__all__ = ["LAYER_STORAGE", "HybridRingCache", "MemoryReport"]


def _can(layer: Any, capability: str) -> bool:
    """A layer's capability (`StorageLayer`'s class attributes; `False` for storage that does not declare it)."""
    return getattr(layer, capability, False)


_T = TypeVar("_T")


def _given(value: _T | None) -> _T:
    """An option (or a sliding spec's window) the storage's factory needs: `CacheOptions.storage` selects a storage
    only when its option is set, so a factory in `LAYER_STORAGE` never reads `None` here."""
    assert value is not None
    return value


#: The storage of a layer, by `CacheOptions.storage(kind)` (like transformers' `STATIC_LAYER_TYPE_MAPPING`): a
#: factory of the layer spec, the options and the dequantization workspace the compressed layers share.
LAYER_STORAGE: dict[str, Callable[[LayerSpec, CacheOptions, DequantWorkspace], CacheLayerMixin]] = {
    "ring": lambda spec, options, _: RingSlidingLayer(_given(spec.window), rollback_margin=options.rollback_margin),
    "static_ring": lambda spec, options, _: StaticRingSlidingLayer(
        _given(spec.window), rollback_margin=options.rollback_margin
    ),
    "growable": lambda spec, options, _: GrowableFullLayer(options.initial_capacity),
    "static": lambda spec, options, _: StaticFullLayer(_given(options.max_cache_len)),
    "quantized": lambda spec, options, workspace: QuantizedFullLayer(
        _given(options.full_layer_quantization),
        workspace,
        options.full_layer_group_size,
        _given(options.full_layer_rotation),
        options.initial_capacity,
        key_calibration=options.full_layer_key_calibration,
    ),
    "static_quantized": lambda spec, options, workspace: StaticQuantizedFullLayer(
        _given(options.max_cache_len),
        _given(options.full_layer_quantization),
        workspace,
        options.full_layer_group_size,
        _given(options.full_layer_rotation),
        key_calibration=options.full_layer_key_calibration,
    ),
    "sink_window": lambda spec, options, _: SinkWindowFullLayer(
        options.sink_tokens, _given(options.full_layer_window), options.rollback_margin
    ),
}


def build_layer(spec: LayerSpec, options: CacheOptions, workspace: DequantWorkspace) -> CacheLayerMixin | DummyLayer:
    """The storage of one layer: from `LAYER_STORAGE`, or a `DummyLayer` for layers that store nothing here."""
    if not spec.stores:
        return DummyLayer()
    return LAYER_STORAGE[options.storage(spec.kind)](spec, options, workspace)


def _settled(method: Callable) -> Callable:
    """`method`, called after a step a failed forward left half-written is undone (`steps.StepJournal.settle`)."""

    @functools.wraps(method)
    def settled(self: HybridRingCache, *args: Any, **kwargs: Any) -> Any:
        self._steps.journal.settle(self.layers)
        return method(self, *args, **kwargs)

    return settled


@notify_generate_start
class HybridRingCache(Cache):
    """An exact, memory-minimal cache for models mixing sliding-window and full attention (Gemma 3, Gemma 4, ...).

    Each layer gets the storage its attention needs (`specs.layer_specs`, `LAYER_STORAGE`): sliding layers a ring of
    `sliding_window` slots (+ `rollback_margin`) written in place at `position % capacity`; full layers an
    append-only buffer growing geometrically, or with `max_cache_len` a static buffer for `torch.compile`; KV-shared
    layers nothing. The ring's slot order after the wrap is described to the model's own mask creation by a hook
    (`hybrid_cache.mask_hook`), installed on construction. Results equal a no-cache forward pass.

    Args:
        config (`PreTrainedConfig`): the model's config (composite or text config).
        stage_layers (`Iterable[int]`, *optional*): under pipeline parallelism, the decoder layers this process runs
            (`HybridRingCache.for_model(model)` reads them; required for `DistributedConfig(pp_size > 1)` models).
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
            max_cache_len=max_cache_len,
            rollback_margin=rollback_margin,
            initial_capacity=initial_capacity,
            dense_decode_mask=dense_decode_mask,
            full_layer_quantization=full_layer_quantization,
            full_layer_group_size=full_layer_group_size,
            full_layer_rotation=full_layer_rotation,
            full_layer_key_calibration=full_layer_key_calibration,
            full_layer_window=full_layer_window,
            full_layer_sink_tokens=full_layer_sink_tokens,
            full_layer_code_attention=full_layer_code_attention,
        )
        self.config = config.get_text_config(decoder=True)
        self.tp_size = check_parallel_config(config, stage_layers)
        self.specs = layer_specs(self.config, stage_layers)  # each layer's role: the one place it is held
        self._workspace = DequantWorkspace()
        super().__init__(layers=[build_layer(spec, self.options, self._workspace) for spec in self.specs])
        first_ring = next((i for i, layer in enumerate(self.layers) if _can(layer, "ring_ordered")), None)
        # The step in progress: its admission, journal and announced layouts (`steps.py`).
        self._steps = StepAdmission([i for i, spec in enumerate(self.specs) if spec.stores], first_ring)
        install_mask_hook()

    layers: list[Any]  # storage (LAYER_STORAGE) or DummyLayer, not transformers' union; capabilities: `_can`
    #: Read by `distributed.restrict_to_stage`, which refuses this cache: it holds its stage's layers itself.
    holds_its_stage = True
    # Options read as attributes (`dense_decode_mask` may be changed between steps).
    max_cache_len = property(lambda self: self.options.max_cache_len)
    layer_kinds = property(lambda self: [spec.kind for spec in self.specs], doc="Each layer's role (specs).")
    dense_decode_mask = property(
        lambda self: self.options.dense_decode_mask,
        lambda self, value: setattr(self, "options", replace(self.options, dense_decode_mask=value)),
    )

    def __deepcopy__(self, memo: dict) -> HybridRingCache:
        memo[id(self.config)] = self.config  # the model's config, shared: the copy follows its attention switches
        copied = memo[id(self)] = type(self).__new__(type(self))
        copied.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return copied

    def __setstate__(self, state: dict) -> None:
        # Unpickling skips `__init__`: the mask hook must be in place in this process before the first wrapped step.
        self.__dict__.update(state)
        install_mask_hook()

    @classmethod
    def for_model(cls, model: Any, **kwargs: Any) -> HybridRingCache:
        """A cache for `model` as this process runs it (under pipeline parallelism: its stage's layers only)."""
        return cls(model.config, stage_layers=stage_layers(model), **kwargs)

    # --- guarded entry points (under `torch.compile`, inside the graph or not: `_in_graph`) ---------------------
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        layer = _layer_to_update(self, layer_idx)
        if is_torchdynamo_compiling():
            if _in_graph(layer, key_states.shape[-2]):  # no Python bookkeeping in the graph: its checks are ops
                if not _can(layer, "tensor_steps"):  # an exported program's runner admits its steps itself
                    key_states, value_states = self._steps.admit_in_graph(
                        self.layers, layer_idx, key_states, value_states, self.max_cache_len
                    )
                return layer.update(key_states, value_states, *args, **kwargs)
            return _update_outside_graph(self, key_states, value_states, layer_idx, *args, **kwargs)
        return _admitted_update(self, key_states, value_states, layer_idx, *args, **kwargs)

    def attends_on_codes(self) -> bool:
        """Whether compressed full layers return their codes (`full_layer_code_attention`, default: the model's)."""
        if self.options.full_layer_code_attention is not None:
            return self.options.full_layer_code_attention
        return getattr(self.config, "_attn_implementation", None) == CODE_ATTENTION

    # A `RingLayout` behaves as the int transformers adds it to (`mask_hook.RingLayout`); the hook reads the rest.
    def get_mask_sizes(  # type: ignore[override]
        self, query_length: int, layer_idx: int
    ) -> tuple[int, int | RingLayout]:
        layer_idx = _storing_layer_index(self, layer_idx)
        if is_torchdynamo_compiling():
            if _in_graph(self.layers[layer_idx], query_length):
                kv_length, kv_offset = super().get_mask_sizes(query_length, layer_idx)
                return kv_length, _annotated_offset(self, layer_idx, query_length, kv_offset)
            return _mask_sizes_outside_graph(self, query_length, layer_idx)
        return _requested_mask_sizes(self, query_length, layer_idx)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens held, not counting a step a failed forward left half-written (undone at the next call)."""
        layer_idx = _storing_layer_index(self, layer_idx)
        if is_torchdynamo_compiling():
            if _in_graph(self.layers[layer_idx], 1):  # a tensor counter, read as a snapshot (`tensor_counter`)
                return super().get_seq_length(layer_idx)
            return _seq_length_outside_graph(self, layer_idx)
        return _held_length(self, layer_idx)

    def key_positions(self, layer_idx: int) -> torch.Tensor:
        """Absolute position of every key layer `layer_idx` returned in the last step, in the order the attention saw
        them (`-1`: empty slot): column `j` of its attention weights belongs to position `key_positions(layer_idx)[j]`
        (see `hybrid_cache.attention_in_time_order`). KV-shared layers: pass the index of the layer they reuse."""
        if not self.specs[layer_idx].stores:
            raise ValueError(f"Layer {layer_idx} stores nothing (KV-shared): pass the index of the layer it reuses.")
        return self.layers[layer_idx].key_positions()

    # --- state changes that must be all-or-nothing ------------------------------------------------------------------
    @_settled
    def crop(self, tokens_to_remove: int) -> None:
        """Roll back tokens in every layer (negative: how many; positive, legacy: the length to keep), exactly or not
        at all: every layer is checked first, so a refused crop raises `RollbackError` and changes nothing."""
        storing = [layer for layer, spec in zip(self.layers, self.specs) if spec.stores]
        for layer in storing:
            with rollback_release_note():
                layer.check_crop(tokens_to_remove)
        for layer in storing:
            layer.crop(tokens_to_remove)
        self._steps.layouts.forget()

    def reset(self) -> None:
        """Forget every token (allocations are kept) and the step in progress; past recording stays as it is."""
        super().reset()
        self._steps.forget()

    reorder_cache = _settled(Cache.reorder_cache)
    batch_repeat_interleave = _settled(Cache.batch_repeat_interleave)
    batch_select_indices = _settled(Cache.batch_select_indices)

    def activate_past_recording(self, recurrent_states_to_keep: int | None = None, **kwargs: Any) -> None:
        """Keep the window of each multi-token step until the next one, so that `crop` can undo it exactly (called by
        assisted / prompt-lookup decoding; `recurrent_states_to_keep`, passed from transformers 5.25, sizes the states
        of linear-attention layers: unused). Raises `UnsupportedReleaseError` where that is not exact (`compat`)."""
        check_rollback_supported()
        self._steps.assisted_start = int(self.get_seq_length())  # checked at the next step (`steps.py`)
        for layer in self.layers:
            if _can(layer, "records_steps"):
                layer.activate_past_recording()

    def deactivate_past_recording(self) -> None:
        """Stop keeping the last multi-token step's window and release it (as at the next step or `generate` call)."""
        self._steps.assisted_start = 0
        for layer in self.layers:
            if _can(layer, "records_steps"):
                layer.deactivate_past_recording()

    def on_generate_start(self) -> None:
        """Called as `generate` starts a call with this cache (`compat.notify_generate_start`): recording left on by
        an earlier assisted generation must not copy this prefill."""
        self.deactivate_past_recording()

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
        initialize_layers_early(self.layers, batch_size, num_heads, head_dim, dtype, torch.device(device))

    @property
    def is_compileable(self) -> bool:
        # Compiled decode steps need static shapes and addresses: only with a fixed full-attention capacity.
        return self.max_cache_len is not None

    @_settled
    def memory_report(self) -> MemoryReport:
        """Bytes held per layer type and in total (every tensor the cache keeps alive), against a full cache of every
        storing layer for the same tokens."""
        tokens = int(self.get_seq_length())
        return memory_report(tokens, self.layer_kinds, self.layers, self._workspace.nbytes())

    # --- persistence and snapshots (the format lives in snapshot.py) -----------------------------------------------
    @_settled
    def save(self, path: str | os.PathLike, metadata: Mapping[str, str] | None = None) -> None:
        """Write the cache to one safetensors file (replaced atomically) that `load` continues from exactly, with your
        `metadata` (str to str, keys not starting with `"hybrid_cache."`) in its header (`snapshot.read_metadata`)."""
        save_cache(self, path, metadata)

    @classmethod
    def load(
        cls, path: str | os.PathLike, config: PreTrainedConfig, *, device: torch.device | str | None = None
    ) -> HybridRingCache:
        """Read a cache written by `save` for `config` (tensors on `device`, default CPU), which continues exactly as
        the saved one would; `ValueError` (naming the field, or the path and damaged part) or `OSError` otherwise."""
        return load_cache(cls, path, config, device)

    @_settled
    def checkpoint(self) -> CacheCheckpoint:
        """An in-memory snapshot for `restore`: a copy of the rings and the full layers' lengths (not their history)."""
        return take_checkpoint(self)

    def restore(self, checkpoint: CacheCheckpoint) -> None:
        """Go back exactly to the state at `checkpoint()`, any number of times. Raises `ValueError`, changing nothing,
        for another batch size or when the full layers' tokens before it were rewritten since (`reset()`, new prompt)."""
        restore_checkpoint(self, checkpoint)
        self._steps.forget(lambda: int(self.get_seq_length()))  # masks and journal described another state


def _storing_layer_index(cache: HybridRingCache, layer_idx: int) -> int:
    """`layer_idx`, or the first storing layer when it stores nothing (transformers asks for layer 0, which may be
    KV-shared or on another pipeline stage; its `Cache` base answers from the first storing layer, so do we)."""
    if layer_idx < len(cache.specs) and not cache.specs[layer_idx].stores:
        return next((i for i, spec in enumerate(cache.specs) if spec.stores), layer_idx)
    return layer_idx


def _in_graph(layer: Any, query_length: int) -> bool:
    """Whether a step of `query_length` tokens of `layer` runs inside a graph being traced, or leaves it: the entry
    points then run eagerly (`torch.compiler.disable`, a graph break), with every check and the step's journal, as
    without compile. Which one is a function of the storage and the step alone, never of which frames Dynamo happens
    to trace, so a forward whose frames are partly compiled and partly eager (graph breaks, the recompile limit)
    still gets one layout per step. Inside the graph: an exported program's
    layers (`tensor_steps`: every step is tensor arithmetic of the program's counters) and the fixed mode's one-token
    steps (`is_compileable`: static buffers and tensor counters, one graph for every decode step). Every other step
    (the growing mode's; the fixed mode's prompts and chunks, whose layout and bookkeeping follow the counters'
    values) runs eagerly, outside the graph, with all its checks."""
    return _can(layer, "tensor_steps") or (query_length == 1 and _can(layer, "is_compileable"))


_OUTSIDE_GRAPH = (
    "HybridRingCache runs this step eagerly, outside the compiled graph: only one-token steps of a cache with a fixed "
    "capacity compile into it (the growing mode and multi-token steps keep their eager checks and layouts). For a "
    "fullgraph decode step, build the cache with HybridRingCache(config, max_cache_len=...)."
)


def _admitted_update(
    cache: HybridRingCache,
    key_states: torch.Tensor,
    value_states: torch.Tensor,
    layer_idx: int,
    *args: Any,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`update` with its eager checks and the step's journal (`steps.StepAdmission`)."""
    layer, steps = cache.layers[layer_idx], cache._steps
    later_layer = not steps.journal.starts_step(layer_idx)  # of a step that already wrote
    try:
        steps.admit(cache, layer_idx, key_states.shape[-2], kwargs, check_ring_attention_supported)
        previous = layer.step_bookkeeping() if steps.journal.journaling else None
        codes = {"return_codes": cache.attends_on_codes()} if _can(layer, "attends_on_codes") else {}
        keys, values = layer.update(key_states, value_states, *args, **codes, **kwargs)
    except BaseException:
        if later_layer:
            steps.journal.abandon(cache.layers)  # the step's earlier writes go back now
        raise
    if hasattr(keys, "history"):  # attention on the codes: a refusal there undoes the step
        keys.history.on_refusal = steps.journal.fail
    steps.journal.stored(layer_idx, previous)
    return keys, values


def _requested_mask_sizes(cache: HybridRingCache, query_length: int, layer_idx: int) -> tuple[int, Any]:
    """`get_mask_sizes` with the step's eager bookkeeping: masks are built before the step's first write."""
    cache._steps.masks_requested(cache.layers, query_length, cache.get_seq_length)
    kv_length, kv_offset = Cache.get_mask_sizes(cache, query_length, layer_idx)
    return kv_length, _annotated_offset(cache, layer_idx, query_length, kv_offset)


def _held_length(cache: HybridRingCache, layer_idx: int) -> int:
    """`get_seq_length` without a step a failed forward left half-written."""
    length = Cache.get_seq_length(cache, layer_idx)
    return length - cache._steps.journal.uncommitted(layer_idx, cache.layers)


# The same three, run eagerly when reached from a graph being traced (a graph break): see `HybridRingCache.update`.
_update_outside_graph = torch.compiler.disable(_admitted_update, reason=_OUTSIDE_GRAPH)
_mask_sizes_outside_graph = torch.compiler.disable(_requested_mask_sizes, reason=_OUTSIDE_GRAPH)
_seq_length_outside_graph = torch.compiler.disable(_held_length, reason=_OUTSIDE_GRAPH)


def _layer_to_update(cache: HybridRingCache, layer_idx: int) -> StorageLayer:
    """The layer `update()` writes, or raise when the cache does not hold it."""
    if layer_idx >= len(cache.specs) or len(cache.layers) != len(cache.specs):
        _refuse_undeclared_layers(cache, layer_idx)
    if not cache.specs[layer_idx].stores:
        _refuse_update_of_empty_layer(cache.specs[layer_idx])
    return cache.layers[layer_idx]


def _annotated_offset(
    cache: HybridRingCache, layer_idx: int, query_length: int, kv_offset: int | RingLayout
) -> int | RingLayout:
    """`kv_offset` with what the mask hook needs to know (dense decode mask, window check, columns); a ring layout is
    recorded as issued for this step."""
    layer, attention = cache.layers[layer_idx], getattr(cache.config, "_attn_implementation", None)
    dense = query_length == 1 and _wants_dense_mask(cache.options, cache.specs[layer_idx], layer)
    if dense and not isinstance(kv_offset, RingLayout) and not is_mask_hook_installed(attention or "sdpa"):
        install_mask_hook()  # only a performance request, but it needs the hook to be honoured
    # Which mask this can be, for the hook's window check (see `HeldFromOffset.sliding_request`).
    sliding_request = not _can(layer, "drops_tokens_by_design") and (FULL in cache.layer_kinds or None)
    columns = layer.get_seq_length() + query_length if not is_torchdynamo_compiling() else None
    kv_offset = annotate_offset(kv_offset, columns_needed=columns, sliding_request=sliding_request, dense=dense)
    if isinstance(kv_offset, RingLayout) and is_torchdynamo_compiling():
        cache._steps.layouts.served_in_graph(layer.cumulative_length, query_length)
    elif isinstance(kv_offset, RingLayout):
        # Only a wrapped ring needs the hook: check now that it will be the one serving this mask.
        check_ring_attention_supported(attention)
        cache._steps.layouts.issue(layer_idx, (layer.cumulative_length, query_length), kv_offset)
    return kv_offset


def _refuse_undeclared_layers(cache: HybridRingCache, layer_idx: int) -> None:
    """`update()` for a layer the config does not declare, or after the model changed `cache.layers` (a model that
    appends cache layers of its own, e.g. per-loop copies of recurrent layers): refused before this layer writes
    anything, with `cache.layers` put back as the cache built it."""
    declared = len(cache.specs)
    appended = len(cache.layers) - declared
    if appended > 0:
        del cache.layers[declared:]  # what the model appended; the cache's own layers stay as they are
    model_type = getattr(cache.config, "model_type", type(cache.config).__name__)
    changed = f"appended {appended} cache layer(s) to `cache.layers` and " if appended > 0 else ""
    if appended < 0:
        changed = f"removed {-appended} layer(s) from `cache.layers` and "
    raise IndexError(
        f"The {model_type!r} model {changed}called update() for layer {layer_idx}, but its config declares "
        f"{declared} layers (0..{declared - 1}), the layers HybridRingCache holds: the model writes cache layers "
        f"its config does not declare, or the cache was built from another model's config. Use "
        f"`DynamicCache(config=...)` for this model."
    )


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
