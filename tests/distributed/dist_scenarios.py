"""What the distributed tests run: the same `generate` calls, with the same caches, in every torchrun rank
(`dist_worker.py`) and in one process (the reference, `tests/core/test_distributed.py`).

A cache name means the same thing in both places: `HybridRingCache.for_model(model)` is the stage's cache under
pipeline parallelism and the plain cache in one process.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from builders import VOCAB, left_padded_batch  # tests/ is on the path: pytest's pythonpath, the worker's PYTHONPATH
from transformers import DynamicCache

from hybrid_cache import HybridRingCache
from hybrid_cache.compat import cache_kwargs
from hybrid_cache.distributed import parallel_sizes, pipeline_layer_range, restrict_to_stage, stage_layers

WINDOW = 4  # every scenario's prompt is longer than the window: the rings wrap
NEW_TOKENS = 8


def _ids(generator: torch.Generator, batch: int, length: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=generator)


def _left_padded(generator: torch.Generator, lengths: list[int]) -> dict[str, torch.Tensor]:
    """A left-padded batch (padding longer than the window in the last row: trap 5)."""
    width = max(lengths)
    rows = _ids(generator, len(lengths), width)
    return left_padded_batch([row[width - length :] for row, length in zip(rows, lengths)])


@dataclass(frozen=True)
class Scenario:
    """One `generate` call (or two, for `second_turn`) with fixed inputs and options."""

    name: str
    lengths: list[int]
    options: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    second_turn: int = 0  # > 0: a second generate call on the same cache with this many new user tokens


SCENARIOS = {
    scenario.name: scenario
    for scenario in [
        Scenario("greedy", [9]),
        Scenario("padded", [11, 8, 4]),
        Scenario("sampling", [9, 6], {"do_sample": True, "top_k": 20, "num_return_sequences": 2}, seed=1234),
        Scenario("beam", [10, 7], {"num_beams": 3, "num_return_sequences": 2}),
        Scenario("chunked_prefill", [11], {"prefill_chunk_size": 3}),
        Scenario("second_turn", [9, 5], second_turn=5),
    ]
}


def capacity(scenario: Scenario) -> int:
    return max(scenario.lengths) + 2 * NEW_TOKENS + scenario.second_turn


def _early_initialized(model: Any, scenario: Scenario) -> HybridRingCache:
    """Fixed capacity, allocated ahead of time with this process's KV heads (`num_heads` as one int)."""
    cache = HybridRingCache.for_model(model, max_cache_len=capacity(scenario))
    tp_size, _ = parallel_sizes(model.config)
    first = model.config.get_text_config(decoder=True).per_layer_config[0]
    cache.early_initialization(
        batch_size=len(scenario.lengths),
        num_heads=first.num_key_value_heads // tp_size,
        head_dim=first.head_dim,
        dtype=model.dtype,
        device=model.device,
    )
    return cache


def _told(model: Any) -> HybridRingCache:
    """The stage's layers given explicitly (transformers' split), instead of read from the model."""
    _, pp_size = parallel_sizes(model.config)
    if pp_size == 1:
        return HybridRingCache(model.config)
    stage = model._pp_stage.pp_rank
    layers = pipeline_layer_range(stage, pp_size, model.config.num_hidden_layers)
    return HybridRingCache(model.config, stage_layers=layers)


def _dynamic_for_stage(model: Any) -> DynamicCache:
    cache = DynamicCache(config=model.config)
    layers = stage_layers(model)
    return cache if layers is None else restrict_to_stage(cache, layers)


CACHES: dict[str, Callable[[Any, Scenario], Any]] = {
    "ring": lambda model, scenario: HybridRingCache.for_model(model),
    "ring_fixed": lambda model, scenario: HybridRingCache.for_model(model, max_cache_len=capacity(scenario)),
    "ring_early_init": _early_initialized,
    "ring_told": lambda model, scenario: _told(model),
    "dynamic": lambda model, scenario: DynamicCache(config=model.config),
    "dynamic_stage": lambda model, scenario: _dynamic_for_stage(model),
}


def storage_pointers(cache: Any) -> list[int]:
    """Addresses of every allocated key buffer (an early-initialized cache must keep them through `generate`)."""
    return [layer.keys.data_ptr() for layer in cache.layers if getattr(layer, "keys", None) is not None]


@torch.no_grad()
def run(model: Any, scenario_name: str, cache_name: str) -> dict[str, Any]:
    """Run a scenario; return its tokens, logits and what the cache held at the end."""
    scenario = SCENARIOS[scenario_name]
    generator = torch.Generator().manual_seed(len(scenario.lengths) * 100 + max(scenario.lengths))
    inputs = _left_padded(generator, scenario.lengths)
    cache = CACHES[cache_name](model, scenario)
    pointers = storage_pointers(cache)
    options = {"max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS, "do_sample": False, **scenario.options}
    torch.manual_seed(scenario.seed)
    out = model.generate(**inputs, **cache_kwargs(cache), output_logits=True, return_dict_in_generate=True, **options)
    sequences, logits = out.sequences, list(out.logits)
    if scenario.second_turn:
        user = _ids(generator, sequences.shape[0], scenario.second_turn)
        input_ids = torch.cat([sequences, user], dim=1)
        mask = torch.cat([inputs["attention_mask"], torch.ones_like(input_ids[:, inputs["input_ids"].shape[1] :])], 1)
        out = model.generate(
            input_ids=input_ids,
            attention_mask=mask,
            **cache_kwargs(cache),
            output_logits=True,
            return_dict_in_generate=True,
            **options,
        )
        sequences, logits = out.sequences, logits + list(out.logits)
    report = cache.memory_report() if isinstance(cache, HybridRingCache) else None
    return {
        "sequences": sequences,
        "logits": torch.stack(logits),
        "batch": inputs["input_ids"].shape[0],
        "cache_batch": next(
            (
                layer.keys.shape[0]
                for layer in cache.layers
                if getattr(layer, "keys", None) is not None and layer.keys.numel()
            ),
            None,
        ),
        "prompt": inputs["input_ids"].shape[1],
        "tokens": cache.get_seq_length(),
        "kv_bytes": None if report is None else report.kv_bytes,
        "bytes_by_type": None if report is None else dict(report.bytes_by_type),
        "kept_storage": bool(pointers) and pointers == storage_pointers(cache),
        "kv_heads": [getattr(layer, "num_heads", None) for layer in cache.layers],
    }


# What each parallel layout runs: (scenario, cache) pairs.
RUNS = {
    "tp": [
        ("greedy", "ring"),
        ("greedy", "ring_fixed"),
        ("padded", "ring"),
        ("padded", "ring_fixed"),
        ("padded", "ring_early_init"),
        ("padded", "dynamic"),
        ("sampling", "ring"),
        ("beam", "ring"),
        ("chunked_prefill", "ring"),
        ("second_turn", "ring"),
    ],
    "pp": [
        ("greedy", "ring"),
        ("greedy", "ring_told"),
        ("padded", "ring"),
        ("padded", "ring_fixed"),
        ("padded", "ring_told"),
        ("padded", "dynamic"),
        ("padded", "dynamic_stage"),
        ("sampling", "ring"),
        ("beam", "ring"),
        ("chunked_prefill", "ring"),
        ("second_turn", "ring"),
        ("second_turn", "dynamic_stage"),
    ],
}
RUNS["tp_pp"] = RUNS["pp"]
