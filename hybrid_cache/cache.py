"""`HybridRingCache`: the cache container. It reads the model config once and gives each layer the storage its
attention needs; everything else is forwarding to the layers (see `layers.py`) and the mask hook (`mask_hook.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, DummyLayer
from transformers.configuration_utils import PreTrainedConfig
from transformers.utils import is_torchdynamo_compiling

from .layers import GrowableFullLayer, RingSlidingLayer, StaticFullLayer, StaticRingSlidingLayer
from .mask_hook import DenseMaskRequest, RingLayout, check_ring_attention_supported, install_mask_hook
from .quantized import QUANTIZATION_MODES, DequantWorkspace, QuantizedFullLayer, StaticQuantizedFullLayer
from .streaming import SinkWindowFullLayer

__all__ = ["HybridRingCache", "MemoryReport"]

SLIDING, FULL, SHARED = "sliding_attention", "full_attention", "shared"
# Layer types whose cache behaves as a sliding window (transformers maps chunked attention to the same cache class,
# but its mask is not a window: we store those layers fully, which is always exact).
_SLIDING_TYPES = ("sliding_attention",)
_FULL_TYPES = ("full_attention", "chunked_attention")


@dataclass
class MemoryReport:
    """KV bytes held by a `HybridRingCache`, per layer type, against a full cache of every layer.

    Attributes:
        tokens: tokens seen so far (cache length).
        total_bytes: bytes of key/value storage actually allocated (every layer).
        full_cache_bytes: bytes a full (non-sliding) cache of every storing layer would hold for `tokens` tokens.
        bytes_by_type: allocated bytes per layer type (`sliding_attention`, `full_attention`, `shared`).
        layers_by_type: number of layers of each type.
        slots_by_type: allocated token slots per layer of each type (capacity).
        per_layer: `(layer_type, bytes)` for every layer.
        workspace_bytes: model-dtype buffers that compressed full layers dequantize their history into (shared by
            those layers, one layer's keys and values; not part of `total_bytes`; 0 without compression).
    """

    tokens: int
    total_bytes: int
    full_cache_bytes: int
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
        lines = [f"KV cache after {self.tokens} tokens", f"  {'layer type':<18}{'layers':>7}{'slots/layer':>13}{'MiB':>11}"]
        for layer_type, count in self.layers_by_type.items():
            slots = sorted(set(self.slots_by_type.get(layer_type, []))) or [0]
            slot_text = "/".join(str(s) for s in slots)
            lines.append(f"  {layer_type:<18}{count:>7}{slot_text:>13}{self.bytes_by_type[layer_type] / 2**20:>11.3f}")
        lines.append(f"  {'total':<18}{sum(self.layers_by_type.values()):>7}{'':>13}{self.total_bytes / 2**20:>11.3f}")
        lines.append(
            f"  full cache of every storing layer: {self.full_cache_bytes / 2**20:.3f} MiB "
            f"(held: {100 * (1 - self.saving):.1f}%, saved: {100 * self.saving:.1f}%)"
        )
        if self.workspace_bytes:
            lines.append(f"  + dequantization workspace (shared, transient use): {self.workspace_bytes / 2**20:.3f} MiB")
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
    sharing = getattr(text_config, "kv_sharing_modes", None) or [None] * num_layers
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
            (the default allocates the prompt length; growth is by 1.25x).
        dense_decode_mask (`bool`, *optional*): materialize the mask of one-token steps instead of letting SDPA run
            without one. Default (`None`): on CPU for grouped-query layers, where transformers' mask-less path
            (`enable_gqa`) is several times slower than its masked, packed path; never on accelerators, whose
            mask-less kernels are the fast ones. Results are the same either way (same mask semantics).
        full_layer_quantization (`str`, *optional*): store the full-attention layers compressed: `"int8"`, `"int4"`
            or `"fp8"` (per-token groups of `full_layer_group_size` channels, one scale each; see
            `hybrid_cache.quantized` and docs/quantization.md). Approximate. Sliding rings stay exact in the model
            dtype. Default `None`: exact storage.
        full_layer_group_size (`int`, defaults to 64): channels per quantization scale.
        full_layer_rotation (`bool`, defaults to False): Hadamard rotation within each group before quantizing
            (lower int4 error, slower decode).
        full_layer_window (`int`, *optional*): bound every full-attention layer to `full_layer_sink_tokens` +
            the last `full_layer_window` tokens (StreamingLLM-style, keys at their absolute positions; approximate;
            see `hybrid_cache.streaming`). The whole cache then has a fixed size. Default `None`: unbounded.
        full_layer_sink_tokens (`int`, defaults to 4 with `full_layer_window`): first tokens the bounded full
            layers keep forever.

    Example:

    ```python
    >>> from hybrid_cache import HybridRingCache
    >>> cache = HybridRingCache(model.config)
    >>> out = model.generate(**inputs, cache=cache, max_new_tokens=64)
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
        full_layer_quantization: str | None = None,
        full_layer_group_size: int = 64,
        full_layer_rotation: bool = False,
        full_layer_window: int | None = None,
        full_layer_sink_tokens: int | None = None,
    ) -> None:
        if not isinstance(config, PreTrainedConfig):
            raise TypeError(
                f"HybridRingCache expects the model's config (a transformers PreTrainedConfig), got "
                f"{type(config).__name__}. Pass `model.config`."
            )
        _check_full_layer_options(
            full_layer_quantization, full_layer_rotation, full_layer_window, full_layer_sink_tokens, max_cache_len
        )
        self.config = config.get_text_config(decoder=True)
        self.max_cache_len = max_cache_len
        self.full_layer_quantization = full_layer_quantization
        self._workspace = DequantWorkspace()
        self.dense_decode_mask = dense_decode_mask
        query_heads = self._per_layer_attribute("num_attention_heads", 1)
        kv_heads = self._per_layer_attribute("num_key_value_heads", None)
        self._grouped_query = [kv is not None and q > kv for q, kv in zip(query_heads, kv_heads)]
        self.layer_kinds: list[str] = []
        layers = []
        for kind, window in _layer_plan(self.config):
            self.layer_kinds.append(kind)
            if kind == SLIDING:
                ring_class = RingSlidingLayer if max_cache_len is None else StaticRingSlidingLayer
                layers.append(ring_class(window, rollback_margin=rollback_margin))
            elif kind == SHARED:
                layers.append(DummyLayer())
            elif full_layer_window is not None:
                sinks = 4 if full_layer_sink_tokens is None else full_layer_sink_tokens
                layers.append(SinkWindowFullLayer(sinks, full_layer_window, rollback_margin))
            elif full_layer_quantization is not None and max_cache_len is not None:
                layers.append(StaticQuantizedFullLayer(
                    max_cache_len, full_layer_quantization, self._workspace, full_layer_group_size, full_layer_rotation
                ))
            elif full_layer_quantization is not None:
                layers.append(QuantizedFullLayer(
                    full_layer_quantization, self._workspace, full_layer_group_size, full_layer_rotation,
                    initial_capacity,
                ))
            elif max_cache_len is not None:
                layers.append(StaticFullLayer(max_cache_len))
            else:
                layers.append(GrowableFullLayer(initial_capacity))
        super().__init__(layers=layers)
        self._ring_mask_request: tuple[int, int] | None = None
        install_mask_hook()

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
            raise RuntimeError(
                f"Layer {layer_idx} is KV-shared (kv_sharing_modes='reuse') and stores nothing, but the model called "
                f"update() for it: the cache was built from a config that does not match the model."
            )
        if (
            not is_torchdynamo_compiling()  # the checks read Python counters; compiled steps were checked eagerly
            and isinstance(layer, (RingSlidingLayer, SinkWindowFullLayer))
            and layer.needs_ring_layout(key_states.shape[-2])
        ):
            self._check_ring_mask_was_built(layer, key_states.shape[-2])
        return layer.update(key_states, value_states, *args, **kwargs)

    def _check_ring_mask_was_built(self, layer: RingSlidingLayer | SinkWindowFullLayer, query_length: int) -> None:
        """A wrapped ring is only exact if this step's mask came from `get_mask_sizes` through the hook."""
        check_ring_attention_supported(getattr(self.config, "_attn_implementation", None))
        if self._ring_mask_request != (layer.cumulative_length, query_length):
            raise RuntimeError(
                "HybridRingCache's sliding-window ring has wrapped, but no attention mask was built for its slot "
                "layout in this forward pass (the model was given a prepared 4D attention mask, or its attention "
                "does not use transformers' mask functions). Pass a 2D attention mask (or none) so the model builds "
                "its masks itself, or use `DynamicCache` for this model."
            )

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int | RingLayout]:
        kv_length, kv_offset = super().get_mask_sizes(query_length, layer_idx)
        if query_length == 1 and not isinstance(kv_offset, RingLayout) and self._wants_dense_mask(layer_idx):
            return kv_length, DenseMaskRequest(kv_offset)
        if isinstance(kv_offset, RingLayout) and not is_torchdynamo_compiling():
            # Only a wrapped ring needs the hook: check now that it will be the one serving this mask.
            check_ring_attention_supported(getattr(self.config, "_attn_implementation", None))
            self._ring_mask_request = (self.layers[layer_idx].cumulative_length, query_length)
        return kv_length, kv_offset

    def _wants_dense_mask(self, layer_idx: int) -> bool:
        if self.max_cache_len is not None or layer_idx >= len(self.layers):
            return False  # fixed mode: transformers already materializes one-token masks for compileable caches
        if self.dense_decode_mask is not None:
            return self.dense_decode_mask
        device = getattr(self.layers[layer_idx], "device", None)
        return device is not None and device.type == "cpu" and self._grouped_query[layer_idx]

    # --- protocol additions ---------------------------------------------------------------------------------------
    def early_initialization(
        self, batch_size: int, num_heads: int | list[int], head_dim: int | list[int], dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        """Allocate every storing layer ahead of time (for `torch.export` / compiled prefill).

        `num_heads` / `head_dim` may be per-layer lists (Gemma 4 has different head sizes per layer type); when given
        as ints, per-layer values are taken from the config where it declares them.
        """
        if isinstance(num_heads, int):
            num_heads = self._per_layer_attribute("num_key_value_heads", num_heads)
        if isinstance(head_dim, int):
            head_dim = self._per_layer_attribute("head_dim", head_dim)
        super().early_initialization(batch_size, num_heads, head_dim, dtype, device)

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
        """Bytes held per layer type and in total, against a full cache of every storing layer for the same tokens."""
        tokens = int(self.get_seq_length())
        report = MemoryReport(tokens=tokens, total_bytes=0, full_cache_bytes=0, workspace_bytes=self._workspace.nbytes())
        for kind, layer in zip(self.layer_kinds, self.layers):
            held = layer.nbytes() if hasattr(layer, "nbytes") else 0
            report.per_layer.append((kind, held))
            report.total_bytes += held
            report.bytes_by_type[kind] = report.bytes_by_type.get(kind, 0) + held
            report.layers_by_type[kind] = report.layers_by_type.get(kind, 0) + 1
            report.slots_by_type.setdefault(kind, []).append(getattr(layer, "capacity", 0))
            if isinstance(layer, QuantizedFullLayer) and layer.is_initialized:
                report.full_cache_bytes += layer.uncompressed_bytes_per_token() * tokens
            elif getattr(layer, "is_initialized", False) and layer.keys is not None and hasattr(layer, "batch_size"):
                per_token = layer.batch_size * layer.num_heads * (layer.k_head_dim + layer.v_head_dim)
                report.full_cache_bytes += per_token * layer.keys.element_size() * tokens
        return report


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
