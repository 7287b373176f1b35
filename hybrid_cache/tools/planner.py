"""KV-cache memory planner: the bytes each cache holds, per layer type and in total, for `HybridRingCache`,
transformers' `DynamicCache` and `StaticCache`, and a full cache of every layer, per process under tensor / pipeline
parallelism, and the longest context that fits a memory budget.

    hybrid-cache-plan gemma-3-27b --context 131072 --tp 2 --budget 16GiB
    hybrid-cache-plan path/to/config.json --context 32768 --batch 8 --dtype float16 --fixed

(``python -m hybrid_cache.tools.cli.planner`` is the same command; its code is `hybrid_cache.tools.cli.planner`.)

The numbers are what the caches report, not a formula of their own:

- `HybridRingCache`: the cache is built from the config (with the same arguments) and each layer answers
  `planned_nbytes(...)`, which uses the growth rule its `update` uses (`hybrid_cache.storage.grown_capacity`); tested
  equal to `memory_report().kv_bytes` after `generate` (the report's `total_bytes` adds the fixed mode's 8-byte
  counters and, right after a speculative step, the window kept to undo it).
- `DynamicCache` / `StaticCache`: built from the config; their layer classes decide the slots (tested equal to
  `hybrid_cache.tools.compare.kv_bytes_held`, which counts the storages they keep alive).
- full cache: every layer that stores K/V keeps every token (`memory_report().full_cache_bytes`).

Scenario: a prompt of `prompt_length` tokens in one step, then one-token steps up to `context_length` tokens (the cache
length `generate` leaves: prompt + new tokens - 1). KV heads per process are the config's divided by `tp_size`; with
`pp_size > 1` each pipeline stage holds the layers transformers gives it (`hybrid_cache.distributed`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, DynamicCache, StaticCache
from transformers.cache_utils import DynamicSlidingWindowLayer, StaticLayer
from transformers.configuration_utils import PreTrainedConfig

from hybrid_cache.cache import OTHER_STAGE, HybridRingCache
from hybrid_cache.compat import DummyLayer
from hybrid_cache.distributed import pipeline_layer_range
from hybrid_cache.specs import text_config

from .compare import layer_kv_geometry

__all__ = [
    "CACHE_LABELS",
    "PRESETS",
    "CachePlan",
    "KVPlan",
    "Preset",
    "load_config",
    "max_context_length",
    "plan_kv_memory",
]

# Plan keys and how they are printed.
CACHE_LABELS = {"ring": "HybridRingCache", "dynamic": "DynamicCache", "static": "StaticCache", "full": "full cache"}


# --- presets -------------------------------------------------------------------------------------------------------
_GEMMA3_SOURCE = (
    "huggingface/transformers src/transformers/models/gemma3/convert_gemma3_weights.py "
    "(commit c1a83acdb3fd77f2e897215d94a5ceaf05c885f1), `_VARIANTS[{variant!r}]`"
)
_GEMMA4_SOURCE = (
    "huggingface/transformers src/transformers/models/gemma4/convert_gemma4_weights.py "
    "(commit 0f3f0632a38798af2adf264adc752130ecc5fa66), `_VARIANTS[{variant!r}]`; values it leaves out are "
    "Gemma4TextConfig's defaults (transformers 5.24: head_dim 256, global_head_dim 512, sliding_window 512, "
    "max_position_embeddings 131072)"
)
_LLAMA4_SOURCE = (
    "huggingface/transformers src/transformers/models/llama4/configuration_llama4.py "
    "(commit b17cfe48c5a9631dcf9f57f3865a055903800f81), `Llama4TextConfig`'s defaults, documented there as "
    "meta-llama/Llama-4-Scout-17B-16E; {note}"
)
_GEMMA4_LAYERS = ["sliding_attention"] * 5 + ["full_attention"]
_GEMMA4_E2B_LAYERS = ["sliding_attention"] * 4 + ["full_attention"]


@dataclass(frozen=True)
class Preset:
    """A public model's attention geometry (the config fields that shape its KV cache), with where it comes from.

    Args:
        name: preset name (`gemma-3-27b`, ...).
        model_type: transformers config type (`gemma3_text`, `gemma4_text`).
        values: config fields, as published; fields that do not shape the KV cache (MLP sizes, vocabulary, experts)
            are left out.
        source: where the values were taken from.
    """

    name: str
    model_type: str
    values: dict[str, Any]
    source: str

    def config(self) -> PreTrainedConfig:
        return AutoConfig.for_model(self.model_type, **self.values)


def _gemma3(name: str, variant: str, **values: Any) -> Preset:
    # Gemma 3 layer types are the config's default: 5 sliding : 1 full (`sliding_window_pattern` 6).
    return Preset(name, "gemma3_text", values, _GEMMA3_SOURCE.format(variant=variant))


def _gemma4(name: str, variant: str, **values: Any) -> Preset:
    return Preset(name, "gemma4_text", values, _GEMMA4_SOURCE.format(variant=variant))


def _llama4(name: str, note: str, **values: Any) -> Preset:
    # 36 chunked_attention layers of 8192 and 12 full (NoPE) ones: the config's `no_rope_layer_interval` 4.
    geometry = dict(
        hidden_size=5120,
        num_hidden_layers=48,
        num_attention_heads=40,
        num_key_value_heads=8,
        head_dim=128,
        attention_chunk_size=8192,
        no_rope_layer_interval=4,
    )
    return Preset(name, "llama4_text", {**geometry, **values}, _LLAMA4_SOURCE.format(note=note))


PRESETS: dict[str, Preset] = {
    preset.name: preset
    for preset in [
        _gemma3(
            "gemma-3-270m",
            "gemma3_270m",
            hidden_size=640,
            num_hidden_layers=18,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=256,
            sliding_window=512,
            max_position_embeddings=32768,
        ),
        _gemma3(
            "gemma-3-1b",
            "gemma3_1b",
            hidden_size=1152,
            num_hidden_layers=26,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=256,
            sliding_window=512,
            max_position_embeddings=32768,
        ),
        _gemma3(
            "gemma-3-4b",
            "gemma3_4b",
            hidden_size=2560,
            num_hidden_layers=34,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=256,
            sliding_window=1024,
        ),
        _gemma3(
            "gemma-3-12b",
            "gemma3_12b",
            hidden_size=3840,
            num_hidden_layers=48,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=256,
            sliding_window=1024,
        ),
        _gemma3(
            "gemma-3-27b",
            "gemma3_27b",
            hidden_size=5376,
            num_hidden_layers=62,
            num_attention_heads=32,
            num_key_value_heads=16,
            head_dim=128,
            sliding_window=1024,
        ),
        _gemma4(
            "gemma-4-e2b",
            "gemma-4-e2b",
            hidden_size=1536,
            hidden_size_per_layer_input=256,
            num_hidden_layers=35,
            layer_types=_GEMMA4_E2B_LAYERS * 7,
            num_attention_heads=8,
            num_key_value_heads=1,
            num_global_key_value_heads=None,
            attention_k_eq_v=False,
            num_kv_shared_layers=20,
        ),
        _gemma4(
            "gemma-4-e4b",
            "gemma-4-e4b",
            hidden_size=2560,
            hidden_size_per_layer_input=256,
            num_hidden_layers=42,
            layer_types=_GEMMA4_LAYERS * 7,
            num_attention_heads=8,
            num_key_value_heads=2,
            num_global_key_value_heads=None,
            global_head_dim=512,
            attention_k_eq_v=False,
            num_kv_shared_layers=18,
        ),
        _gemma4(
            "gemma-4-26b-a4b",
            "gemma-4-26b-a4b",
            hidden_size=2816,
            hidden_size_per_layer_input=0,
            num_hidden_layers=30,
            layer_types=_GEMMA4_LAYERS * 5,
            num_attention_heads=16,
            num_key_value_heads=8,
            num_global_key_value_heads=2,
            attention_k_eq_v=True,
            num_kv_shared_layers=0,
            sliding_window=1024,
            max_position_embeddings=262_144,
        ),
        _gemma4(
            "gemma-4-31b",
            "gemma-4-31b",
            hidden_size=5376,
            hidden_size_per_layer_input=0,
            num_hidden_layers=60,
            layer_types=_GEMMA4_LAYERS * 10,
            num_attention_heads=32,
            num_key_value_heads=16,
            num_global_key_value_heads=4,
            attention_k_eq_v=True,
            num_kv_shared_layers=0,
            sliding_window=1024,
            max_position_embeddings=262_144,
        ),
        _llama4("llama-4-scout", "the text model's attention geometry"),
        _llama4(
            "llama-4-maverick",
            "Maverick (17B-128E) is taken to share that attention geometry (its published config differs in experts "
            "and MoE interleaving, which hold no KV); not re-read here",
        ),
    ]
}


def load_config(name_or_path: str | Path) -> PreTrainedConfig:
    """A preset name (`PRESETS`), a model directory, or a `config.json` file (read locally, nothing downloaded).

    Raises:
        ValueError: no such preset or path, a directory without a config.json, or a file that is not a model's
            config.json (not UTF-8, not JSON, not an object, no known ``model_type``): one line naming the file.
    """
    if str(name_or_path) in PRESETS:
        return PRESETS[str(name_or_path)].config()
    path = Path(name_or_path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model directory {str(path)!r} has no config.json; expected a directory with one")
        _read_config_file(path / "config.json")
        return AutoConfig.from_pretrained(path, local_files_only=True)
    if path.is_file():
        values = _read_config_file(path)
        return AutoConfig.for_model(values.pop("model_type"), **values)
    raise ValueError(
        f"{name_or_path!r} is neither a preset ({', '.join(PRESETS)}) nor a config.json file or model directory."
    )


def _read_config_file(path: Path) -> dict[str, Any]:
    """The values of a model's config.json, or a ValueError in one line naming `path` and what was expected."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    expected = "expected a model's config.json (a JSON object with its model_type)"
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        byte = exc.object[exc.start : exc.start + 1].hex()
        raise ValueError(
            f"{str(path)!r} is not UTF-8 text (byte 0x{byte} at offset {exc.start}); {expected}"
        ) from None
    except OSError as exc:
        raise ValueError(f"cannot read {str(path)!r}: {exc.strerror or exc}") from None
    if not text.strip():
        raise ValueError(f"{str(path)!r} is empty; {expected}")
    try:
        values = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"{str(path)!r} is not JSON ({exc.msg} at line {exc.lineno} column {exc.colno}); {expected}"
        ) from None
    if not isinstance(values, dict):
        raise ValueError(f"{str(path)!r} holds a JSON {type(values).__name__}, not an object; {expected}")
    model_type = values.get("model_type")
    if model_type not in CONFIG_MAPPING:
        what = (
            "no model_type" if model_type is None else f"model_type {model_type!r}, which transformers does not know"
        )
        raise ValueError(f"{str(path)!r} has {what}; {expected}")
    return values


# --- plans ---------------------------------------------------------------------------------------------------------
@dataclass
class CachePlan:
    """KV bytes one cache holds in one process.

    Attributes:
        bytes_by_type: bytes per layer type (`sliding_attention`, `full_attention`, `shared`, `other_stage`).
        layers_by_type: number of layers of each type.
        slots_by_type: token slots per layer of each type (distinct values).
    """

    bytes_by_type: dict[str, int] = field(default_factory=dict)
    layers_by_type: dict[str, int] = field(default_factory=dict)
    slots_by_type: dict[str, list[int]] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_type.values())

    def add(self, layer_type: str, slots: int, nbytes: int) -> None:
        self.bytes_by_type[layer_type] = self.bytes_by_type.get(layer_type, 0) + nbytes
        self.layers_by_type[layer_type] = self.layers_by_type.get(layer_type, 0) + 1
        if slots not in self.slots_by_type.setdefault(layer_type, []):
            self.slots_by_type[layer_type].append(slots)


@dataclass
class KVPlan:
    """The plan for one configuration: every cache, for every pipeline stage (one stage without pipeline parallelism).

    Attributes:
        context_length: tokens held (prompt + new tokens - 1 after `generate`).
        prompt_length: tokens of the first (multi-token) step.
        batch_size, dtype, tp_size, pp_size, max_cache_len, rollback_margin, initial_capacity: the request.
        stages: per pipeline stage, `{"ring" | "dynamic" | "static" | "full": CachePlan}`; every tensor-parallel rank
            of a stage holds the same.
        stage_layers: the decoder layers of each stage.
    """

    context_length: int
    prompt_length: int
    batch_size: int
    dtype: torch.dtype
    tp_size: int
    pp_size: int
    max_cache_len: int | None
    rollback_margin: int
    initial_capacity: int
    stages: list[dict[str, CachePlan]]
    stage_layers: list[list[int]]

    def per_process(self, cache: str) -> int:
        """Largest bytes any one process holds for `cache` (the stage that needs most)."""
        return max(stage[cache].total_bytes for stage in self.stages)

    def to_dict(self) -> dict[str, Any]:
        return {
            "context_length": self.context_length,
            "prompt_length": self.prompt_length,
            "batch_size": self.batch_size,
            "dtype": str(self.dtype).removeprefix("torch."),
            "tp_size": self.tp_size,
            "pp_size": self.pp_size,
            "max_cache_len": self.max_cache_len,
            "rollback_margin": self.rollback_margin,
            "initial_capacity": self.initial_capacity,
            "stage_layers": self.stage_layers,
            "stages": [
                {
                    name: {
                        "total_bytes": plan.total_bytes,
                        "bytes_by_type": plan.bytes_by_type,
                        "layers_by_type": plan.layers_by_type,
                        "slots_by_type": plan.slots_by_type,
                    }
                    for name, plan in stage.items()
                }
                for stage in self.stages
            ],
        }


def _per_rank_geometry(config: PreTrainedConfig, tp_size: int) -> list[tuple[int, int] | None]:
    """`(kv_heads per process, head_dim)` per layer; `None` for KV-shared layers."""
    geometry = []
    for index, shape in enumerate(layer_kv_geometry(config)):
        if shape is not None and shape[0] % tp_size:
            raise ValueError(
                f"Layer {index} has {shape[0]} KV heads, which tensor parallelism cannot split over {tp_size} "
                f"ranks (transformers shards whole heads). Use a tp_size that divides every layer's KV heads."
            )
        geometry.append(None if shape is None else (shape[0] // tp_size, shape[1]))
    return geometry


def _transformers_slots(layer: Any, prompt_length: int, context_length: int) -> int:
    """Slots a transformers cache layer keeps alive (the storages `kv_bytes_held` counts) in the plan's scenario."""
    if isinstance(layer, DummyLayer):
        return 0
    if isinstance(layer, StaticLayer):  # StaticSlidingWindowLayer too: its `max_cache_len` is min(window, capacity)
        return layer.max_cache_len
    if isinstance(layer, DynamicSlidingWindowLayer):
        # Each step `cat`s the kept `window - 1` tokens with the new ones and keeps a view of that `cat`: the prompt's
        # whole storage after one step, `min(window, tokens)` slots after a one-token step.
        if context_length == prompt_length:
            return prompt_length
        return min(layer.sliding_window, context_length)
    if type(layer).__name__ == "DynamicLayer":
        return context_length
    raise ValueError(f"The planner does not know how {type(layer).__name__} stores K/V.")


def _stage_plan(
    config: PreTrainedConfig,
    layers: list[int] | None,
    geometry: list[tuple[int, int] | None],
    *,
    batch_size: int,
    dtype: torch.dtype,
    prompt_length: int,
    context_length: int,
    max_cache_len: int | None,
    rollback_margin: int,
    initial_capacity: int,
) -> dict[str, CachePlan]:
    ring = HybridRingCache(
        config,
        max_cache_len=max_cache_len,
        rollback_margin=rollback_margin,
        initial_capacity=initial_capacity,
        stage_layers=layers,
    )
    dynamic = DynamicCache(config=config)
    static = StaticCache(config=config, max_cache_len=max_cache_len or context_length)
    element_size = torch.empty((), dtype=dtype).element_size()
    plans = {name: CachePlan() for name in CACHE_LABELS}
    for index, kind in enumerate(ring.layer_kinds):
        shape = geometry[index] if kind != OTHER_STAGE else None
        if shape is None:  # KV-shared, or another stage's: nothing stored here by any cache
            for plan in plans.values():
                plan.add(kind, 0, 0)
            continue
        heads, head_dim = shape
        per_slot = batch_size * heads * 2 * head_dim * element_size
        ring_layer = ring.layers[index]
        plans["ring"].add(
            kind,
            ring_layer.capacity_after(prompt_length, context_length),
            ring_layer.planned_nbytes(batch_size, heads, head_dim, head_dim, dtype, prompt_length, context_length),
        )
        for name, cache in (("dynamic", dynamic), ("static", static)):
            slots = _transformers_slots(cache.layers[index], prompt_length, context_length)
            plans[name].add(kind, slots, slots * per_slot)
        plans["full"].add(kind, context_length, context_length * per_slot)
    return plans


def plan_kv_memory(
    config: PreTrainedConfig | str | Path,
    context_length: int,
    *,
    prompt_length: int | None = None,
    batch_size: int = 1,
    dtype: torch.dtype | str = torch.bfloat16,
    max_cache_len: int | None = None,
    rollback_margin: int = 0,
    initial_capacity: int = 0,
    tp_size: int = 1,
    pp_size: int = 1,
) -> KVPlan:
    """KV bytes of every cache, per layer type, per process.

    Args:
        config: a model config (composite or text), a preset name or a config path (see `load_config`).
        context_length: tokens the cache holds (prompt + new tokens - 1 after `generate`).
        prompt_length: tokens of the first step (default: `context_length`, the whole context as one prompt).
        batch_size: sequences (times beams).
        dtype: K/V dtype (`torch.bfloat16` or its name).
        max_cache_len: the ring's fixed-capacity mode (`HybridRingCache(max_cache_len=...)`, must hold the context)
            and `StaticCache`'s capacity (default: `context_length`).
        rollback_margin, initial_capacity: `HybridRingCache` arguments.
        tp_size: tensor-parallel degree (KV heads per process = config heads / tp_size).
        pp_size: pipeline stages (transformers' split of the decoder layers).

    Example:

    ```python
    >>> plan = plan_kv_memory("gemma-3-27b", 131072, tp_size=2)
    >>> plan.per_process("ring") / 2**30  # GiB per process
    ```
    """
    if not isinstance(config, PreTrainedConfig):
        config = load_config(config)
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    prompt_length = context_length if prompt_length is None else prompt_length
    if not 1 <= prompt_length <= context_length:
        raise ValueError(f"Need 1 <= prompt_length <= context_length, got {prompt_length} and {context_length}.")
    if max_cache_len is not None and max_cache_len < context_length:
        raise ValueError(f"max_cache_len={max_cache_len} cannot hold a context of {context_length} tokens.")
    if tp_size < 1 or pp_size < 1:
        raise ValueError(f"tp_size and pp_size must be >= 1, got {tp_size} and {pp_size}.")
    text = text_config(config)
    geometry = _per_rank_geometry(text, tp_size)
    num_layers = text.num_hidden_layers
    stage_layers = [list(pipeline_layer_range(stage, pp_size, num_layers)) for stage in range(pp_size)]
    options = dict(
        batch_size=batch_size,
        dtype=dtype,
        prompt_length=prompt_length,
        context_length=context_length,
        max_cache_len=max_cache_len,
        rollback_margin=rollback_margin,
        initial_capacity=initial_capacity,
    )
    stages = [_stage_plan(text, layers if pp_size > 1 else None, geometry, **options) for layers in stage_layers]
    return KVPlan(
        context_length=context_length,
        prompt_length=prompt_length,
        batch_size=batch_size,
        dtype=dtype,
        tp_size=tp_size,
        pp_size=pp_size,
        max_cache_len=max_cache_len,
        rollback_margin=rollback_margin,
        initial_capacity=initial_capacity,
        stages=stages,
        stage_layers=stage_layers,
    )


def max_context_length(
    config: PreTrainedConfig | str | Path,
    budget_bytes: int,
    cache: str = "ring",
    *,
    fixed: bool = False,
    new_tokens: int = 0,
    limit: int = 2**31,
    **options: Any,
) -> int | None:
    """Longest context (tokens) whose `cache` bytes fit `budget_bytes` in every process; `None` when even `limit`
    tokens fit (no layer grows with the context), 0 when not even one token fits.

    Args:
        cache: `ring`, `dynamic`, `static` or `full`.
        fixed: fixed capacity (`max_cache_len` = the context): the ring's compileable mode, and `StaticCache`.
        new_tokens: tokens generated after the prompt (the prompt is the rest of the context; default 0: the whole
            context as one prompt).
        options: the other arguments of `plan_kv_memory` (batch_size, dtype, tp_size, pp_size, ...).
    """
    if cache not in CACHE_LABELS:
        raise ValueError(f"cache must be one of {', '.join(CACHE_LABELS)}, got {cache!r}.")
    if not isinstance(config, PreTrainedConfig):
        config = load_config(config)

    def held(tokens: int) -> int:
        prompt = max(1, tokens - new_tokens)
        plan = plan_kv_memory(config, tokens, prompt_length=prompt, max_cache_len=tokens if fixed else None, **options)
        return plan.per_process(cache)

    if held(1) > budget_bytes:
        return 0
    if held(limit) <= budget_bytes:
        return None
    low, high = 1, limit  # held(low) fits, held(high) does not; held() never decreases with the context
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if held(middle) <= budget_bytes else (low, middle)
    return low
