"""One reading of a model config: what every decoder layer's cache must hold (`LayerSpec`, `layer_specs`).

Only this module reads `layer_types`, `sliding_window`, the per-layer configs of heterogeneous configs (Gemma 4's
global layers declare their own `head_dim` / `num_key_value_heads`) and KV sharing (through
`compat.kv_sharing_modes`, which knows the releases). The container, the snapshot format and the tools build on the
specifications instead of reading the config themselves.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .compat import kv_sharing_modes
from .frozen import Frozen

__all__ = [
    "CHUNKED",
    "FULL",
    "OTHER_STAGE",
    "SHARED",
    "SLIDING",
    "LayerSpec",
    "check_stage_layers",
    "declared_structure",
    "declared_window",
    "has_sliding_layers",
    "kv_heads_per_rank",
    "layer_specs",
    "text_config",
]

#: Kinds of layer (`LayerSpec.kind`): the config's own layer types for storing layers, and two that store nothing.
SLIDING, FULL, CHUNKED = "sliding_attention", "full_attention", "chunked_attention"
SHARED = "shared"  # KV-shared (`kv_sharing_modes == "reuse"`), or a layer without attention (`moe` / `mlp`)
OTHER_STAGE = "other_stage"  # run by another pipeline stage (`stage_layers`)


@dataclass(unsafe_hash=True)
class LayerSpec(Frozen):
    """What one decoder layer's cache must hold, read from the config.

    Attributes:
        index: the decoder layer.
        kind: `SLIDING`, `FULL`, `CHUNKED`, `SHARED` or `OTHER_STAGE`.
        layer_type: the config's `layer_types` entry (`None` when the config declares none).
        window: the sliding window `W` of a `SLIDING` layer (a query sees `W` keys including itself), the chunk `C`
            (`attention_chunk_size`) of a `CHUNKED` one (a query sees the keys of its own chunk), else `None`.
        query_heads: attention heads, as declared (`None` when not declared).
        declared_kv_heads / declared_head_dim: KV heads and head size as the config declares them for this layer
            (per-layer configs first), `None` when it does not.
        shares_from: for a KV-shared layer, the layer whose keys and values it reuses, when the config names it
            (`kv_sharing_modes == "store"`), else `None`.
        hidden_size: the model width (head size of configs that declare none: `hidden_size // query_heads`).
    """

    index: int
    kind: str
    layer_type: str | None = None
    window: int | None = None
    query_heads: int | None = None
    declared_kv_heads: int | None = None
    declared_head_dim: int | None = None
    shares_from: int | None = None
    hidden_size: int | None = None

    @property
    def stores(self) -> bool:
        """Whether this layer holds keys and values of its own."""
        return self.kind in (SLIDING, FULL, CHUNKED)

    @property
    def kv_heads(self) -> int | None:
        """KV heads of the layer (the query heads when the config declares no KV heads)."""
        return self.declared_kv_heads or self.query_heads

    @property
    def head_dim(self) -> int | None:
        """Head size of the layer (`hidden_size // query_heads` when the config declares none)."""
        if self.declared_head_dim or not (self.hidden_size and self.query_heads):
            return self.declared_head_dim
        return self.hidden_size // self.query_heads


def text_config(config: Any) -> Any:
    """The decoder's text config of a composite or text config (anything else as given)."""
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


# Gemma 4 before transformers folded it into `per_layer_config` (5.5 to 5.14): full-attention layers take these
# attributes instead, as those releases' `Gemma4TextAttention` does (the KV heads only with `attention_k_eq_v`).
_FLAT_FULL_LAYER_ATTRIBUTES = {"head_dim": "global_head_dim", "num_key_value_heads": "num_global_key_value_heads"}


def _per_layer(config: Any, name: str) -> list[Any]:
    """`name` for every layer, from the per-layer configs of heterogeneous configs (Gemma 4), where reading the
    global attribute raises, or from Gemma 4's flat `global_*` attributes on releases without per-layer configs;
    `None` where a layer does not declare it."""
    per_layer = getattr(config, "per_layer_config", None)
    if per_layer is not None:
        return [getattr(layer_config, name, None) or None for layer_config in per_layer]
    values = [getattr(config, name, None) or None] * config.num_hidden_layers
    flat_name = _FLAT_FULL_LAYER_ATTRIBUTES.get(name)
    flat_value = getattr(config, flat_name, None) if flat_name is not None else None
    if flat_value and (name == "head_dim" or getattr(config, "attention_k_eq_v", False)):
        layer_types = _declared_layer_types(config) or []
        values = [flat_value if kind == FULL else value for kind, value in zip(layer_types, values)] or values
    return values


def _declared_layer_types(config: Any) -> list[str] | None:
    layer_types = getattr(config, "layer_types", None)
    return list(layer_types) if layer_types is not None else None


#: The config field that sizes each windowed layer type: the sliding window, the attention chunk.
_WINDOW_FIELDS = {SLIDING: ("sliding_window", "window"), CHUNKED: ("attention_chunk_size", "chunk")}


def _declared_window_of(layer_config: Any, index: int, layer_type: str) -> int:
    """The window (sliding) or chunk (chunked) of layer `index`, or a `ValueError` naming the missing field."""
    field, what = _WINDOW_FIELDS[layer_type]
    value = getattr(layer_config, field, None)
    if value is None:
        raise ValueError(
            f"Layer {index} is {layer_type!r} but the config has no `{field}`. Set `config.{field}` to the model's "
            f"{what}, or declare the layer 'full_attention'."
        )
    return int(value)


def _refuse_recurrent_loops(config: Any) -> None:
    """A model that runs its recurrent layers several times (`n_recurrent_loops > 1`, e.g. `dory`) writes one cache
    layer per loop beyond the `num_hidden_layers` the config declares (it appends copies of the cache's layers to
    `cache.layers` inside its forward); in `dory`'s `recurrent_kv_cache_mode="last_loop"` it appends read-only views
    that take transformers' own layer classes only, whatever the loop count. A cache built from the declared layers
    can hold neither."""
    loops = getattr(config, "n_recurrent_loops", None)
    last_loop = getattr(config, "recurrent_kv_cache_mode", None) == "last_loop"
    if isinstance(loops, int) and (loops > 1 or last_loop):
        model_type = getattr(config, "model_type", type(config).__name__)
        how = "appends read-only views of" if last_loop else "writes per-loop copies of"
        raise ValueError(
            f"{model_type!r} runs its recurrent layers {loops} time(s) (n_recurrent_loops={loops}, "
            f"recurrent_kv_cache_mode={getattr(config, 'recurrent_kv_cache_mode', None)!r}) and {how} its cache "
            f"layers beyond the {config.num_hidden_layers} layers its config declares; HybridRingCache holds exactly "
            f"the declared layers. Use `DynamicCache(config=...)` for this model."
        )


def layer_specs(config: Any, stage_layers: Iterable[int] | None = None) -> list[LayerSpec]:
    """The specification of every decoder layer of `config` (composite or text config).

    Args:
        config: the model's config.
        stage_layers: under pipeline parallelism, the layers this process runs (checked by `check_stage_layers`);
            the others get kind `OTHER_STAGE`.

    Raises:
        ValueError: the config's layers cannot be stored by `HybridRingCache` (the message names the layer and fix),
            or the model writes cache layers the config does not declare (recurrent loops, `n_recurrent_loops > 1`).
    """
    config = text_config(config)
    _refuse_recurrent_loops(config)
    num_layers = config.num_hidden_layers
    layer_types = _declared_layer_types(config)
    if layer_types is not None and len(layer_types) != num_layers:
        raise ValueError(
            f"config.layer_types has {len(layer_types)} entries but num_hidden_layers={num_layers}; fix the config."
        )
    held = None if stage_layers is None else set(check_stage_layers(config, stage_layers))
    global_window = getattr(config, "sliding_window", None)
    types = layer_types or [SLIDING if global_window is not None else FULL] * num_layers
    sharing = kv_sharing_modes(config) or [None] * num_layers
    per_layer_configs = getattr(config, "per_layer_config", None)
    producers = {types[i]: i for i, mode in enumerate(sharing) if mode == "store"}
    columns = zip(_per_layer(config, "num_attention_heads"), _per_layer(config, "num_key_value_heads"))
    head_dims = _per_layer(config, "head_dim")
    specs = []
    for index, (layer_type, mode, (query_heads, kv_heads)) in enumerate(zip(types, sharing, columns)):
        window, shares_from = None, None
        if mode == "reuse" or layer_type in ("moe", "mlp"):
            kind, shares_from = SHARED, producers.get(layer_type) if mode == "reuse" else None
        elif layer_type in _WINDOW_FIELDS:
            kind = layer_type
            layer_config = per_layer_configs[index] if per_layer_configs is not None else config
            window = _declared_window_of(layer_config, index, layer_type)
        elif layer_type == FULL:
            kind = layer_type
        else:
            raise ValueError(
                f"Layer {index} has layer type {layer_type!r}, which HybridRingCache does not know how to store "
                f"(supported: sliding_attention, full_attention, chunked_attention, KV-shared layers). Use "
                f"`DynamicCache(config=...)` for this model."
            )
        if held is not None and index not in held:
            kind = OTHER_STAGE
        spec = LayerSpec(
            index=index,
            kind=kind,
            layer_type=layer_types[index] if layer_types is not None else None,
            window=window,
            query_heads=query_heads,
            declared_kv_heads=kv_heads,
            declared_head_dim=head_dims[index],
            shares_from=shares_from,
            hidden_size=getattr(config, "hidden_size", None),
        )
        specs.append(spec)
    return specs


def has_sliding_layers(config: Any) -> bool:
    """Whether the model has any sliding-window attention layers (otherwise a ring cache saves nothing)."""
    config = text_config(config)
    layer_types = _declared_layer_types(config)
    if layer_types:
        return any("sliding" in layer_type for layer_type in layer_types)
    return getattr(config, "sliding_window", None) is not None


def declared_window(config: Any) -> int | None:
    """The `sliding_window` a config declares for the whole model (`None` when it declares none, or for `None`)."""
    return getattr(config, "sliding_window", None)


def declared_structure(config: Any) -> dict[str, Any]:
    """The layer structure as the config declares it, field by field (what a saved cache is checked against):
    `num_hidden_layers`, `layer_types`, `kv_sharing_modes` (as `compat.kv_sharing_modes` reads it on every release),
    `sliding_window` (per layer, `None` for non-sliding layers), `num_key_value_heads` and `head_dim` (per layer, as
    declared), `model_type`."""
    config = text_config(config)
    specs = layer_specs(config)
    return {
        "num_hidden_layers": config.num_hidden_layers,
        "layer_types": _declared_layer_types(config),
        "kv_sharing_modes": kv_sharing_modes(config),
        "sliding_window": [spec.window if spec.kind == SLIDING else None for spec in specs],
        "num_key_value_heads": [spec.declared_kv_heads for spec in specs],
        "head_dim": [spec.declared_head_dim for spec in specs],
        "model_type": getattr(config, "model_type", None),
    }


def check_stage_layers(text_config: Any, layers: Iterable[int]) -> list[int]:
    """Validate the layers a pipeline stage holds; return them sorted.

    Refuses what no cache of one stage can serve: no layer at all, unknown indices, and a KV-shared layer (Gemma 4
    `kv_sharing_modes == "reuse"`) whose producer layer runs on another stage (transformers hands shared K/V from
    layer to layer inside one forward of one process; they never cross stages).
    """
    num_layers = text_config.num_hidden_layers
    held = sorted(set(int(index) for index in layers))
    if not held:
        raise ValueError(
            f"This pipeline stage holds no decoder layer (the model has {num_layers}); use a pp_size of at most "
            f"{num_layers}."
        )
    if held[0] < 0 or held[-1] >= num_layers:
        raise ValueError(f"stage_layers={held} is outside the model's {num_layers} layers (0..{num_layers - 1}).")
    modes = kv_sharing_modes(text_config) or [None] * num_layers
    layer_types = getattr(text_config, "layer_types", None) or [None] * num_layers
    producers = {layer_types[index]: index for index, mode in enumerate(modes) if mode == "store"}
    for index in held:
        producer = producers.get(layer_types[index])
        if modes[index] == "reuse" and producer is not None and producer not in held:
            raise ValueError(
                f"Layer {index} reuses the keys/values of layer {producer} (KV sharing), but this pipeline stage "
                f"holds layers {held[0]}..{held[-1]} and layer {producer} runs on another stage: transformers passes "
                f"shared K/V only within one process. Use tensor parallelism for this model, or a pipeline split that "
                f"keeps layers {producer}..{num_layers - 1} on one stage."
            )
    return held


def kv_heads_per_rank(specs: list[LayerSpec], num_heads: int, tp_size: int) -> list[int]:
    """Per-layer KV heads of one process for `early_initialization(num_heads=int)`: `num_heads` for every layer when
    the storing layers declare one count; when they declare different counts per layer type (Gemma 4), each layer's
    count divided by the tensor-parallel degree `tp_size`, and `num_heads` must be one of those."""
    declared = [spec.declared_kv_heads or num_heads for spec in specs]
    storing = {count for count, spec in zip(declared, specs) if spec.stores}
    if len(storing) <= 1:
        return [num_heads] * len(declared)
    if any(count % tp_size for count in storing):
        raise ValueError(
            f"The config declares {sorted(storing)} KV heads per layer type, which tensor parallelism of degree "
            f"{tp_size} cannot split evenly. Pass `num_heads` as a list with one entry per layer."
        )
    per_rank = [count // tp_size for count in declared]
    if num_heads not in {count // tp_size for count in storing}:
        raise ValueError(
            f"early_initialization(num_heads={num_heads}): this model has {sorted(storing)} KV heads per layer "
            f"type ({tp_size} tensor-parallel rank(s): {sorted({c // tp_size for c in storing})} per "
            f"rank), so one int cannot describe it. Pass `num_heads` as a list with one entry per layer."
        )
    return per_rank
