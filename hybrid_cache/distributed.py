"""`HybridRingCache` under transformers' tensor and pipeline parallelism (`DistributedConfig(tp_size=...,
pp_size=...)`, torch.distributed underneath): which decoder layers this process runs, the split transformers makes,
and the splits a cache can serve.

Tensor parallelism needs nothing from the cache: every rank runs every layer on its own share of the KV heads, and the
layers allocate what their first update brings (`kv_heads / tp_size` heads per rank).

Pipeline parallelism does: every stage runs the same `generate` loop with its own cache, but only the stage's own
layers call `update`, while transformers asks the cache for the cache length and the mask sizes of layer 0 / the first
sliding / the first full layer (`get_seq_length()`, `get_mask_sizes(q, layer_idx)`), layers another stage runs. A cache
that gives those layers a `DummyLayer` answers from the first layer it holds instead, which is exact: transformers'
`Cache` skips dummy layers for the mask sizes, and for the cache length up to 5.24; from 5.25 it asks layer 0 itself,
so the stand-in of an other-stage layer (`OtherStageLayer`) answers the length of the stage's first layer.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import SimpleNamespace
from typing import Any

from transformers.cache_utils import Cache

from .compat import TRANSFORMERS_VERSION, DummyLayer
from .errors import UnsupportedReleaseError
from .specs import check_stage_layers

__all__ = [
    "OtherStageLayer",
    "check_parallel_config",
    "check_stage_layers",
    "parallel_sizes",
    "pipeline_layer_range",
    "restrict_to_stage",
    "stage_layers",
]


class OtherStageLayer(DummyLayer):
    """The stand-in of a decoder layer another pipeline stage runs, in one of transformers' own caches: stores nothing
    (a `DummyLayer`, skipped as one wherever transformers skips them) and answers the cache length with that of
    `held`, the first layer this stage runs, which has seen the same tokens. transformers 5.25 asks layer 0 for the
    cache length and the query offset (`Cache.get_seq_length()` no longer skips dummy layers)."""

    def __init__(self, held: Any) -> None:
        super().__init__()
        self.held = held

    def get_seq_length(self) -> int:
        return int(self.held.get_seq_length())


def parallel_sizes(config: Any) -> tuple[int, int]:
    """`(tp_size, pp_size)` of the model a config belongs to: `from_pretrained(..., distributed_config=...)` stores its
    `DistributedConfig` on `model.config`; `(1, 1)` for a model loaded in one process."""
    distributed = getattr(config, "distributed_config", None)
    if isinstance(distributed, dict):
        return int(distributed.get("tp_size") or 1), int(distributed.get("pp_size") or 1)
    return int(getattr(distributed, "tp_size", None) or 1), int(getattr(distributed, "pp_size", None) or 1)


def check_parallel_config(config: Any, stage_layers: Iterable[int] | None) -> int:
    """The tensor-parallel degree of the model `config` belongs to; raises when it is pipeline parallel and the
    stage's layers are not given (a cache must know which layers this process runs)."""
    tp_size, pp_size = parallel_sizes(config)
    if stage_layers is None and pp_size > 1:
        raise ValueError(
            f"This config belongs to a model loaded with pipeline parallelism (pp_size={pp_size}): this process "
            f"runs only some of its layers. Build the cache with `HybridRingCache.for_model(model)` (or pass "
            f"`stage_layers=hybrid_cache.stage_layers(model)`)."
        )
    return tp_size


def pipeline_layer_range(stage: int, num_stages: int, num_layers: int) -> range:
    """The decoder layers transformers gives pipeline stage `stage` of `num_stages` (contiguous, in order; the
    remainder goes to the first stages by 5.24, to the last one in 5.18).

    Computed by transformers' own `PipelineStage.layer_range_for_rank`, so the split follows transformers if it
    changes (its code plans to balance stages by layer type).
    """
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage must be in [0, {num_stages}), got {stage}.")
    if num_stages == 1:
        return range(num_layers)  # one stage runs every layer, on every release
    try:
        from transformers.distributed.pipeline_parallel import PipelineStage
    except ImportError as error:
        raise UnsupportedReleaseError(
            f"Pipeline stages need transformers' pipeline parallelism (transformers.distributed.pipeline_parallel), "
            f"which transformers {TRANSFORMERS_VERSION} does not have; upgrade transformers or use one stage."
        ) from error

    # The method reads only `self.pp_size`; a real `PipelineStage` would need a process group, hence the stand-in.
    stand_in = SimpleNamespace(pp_size=num_stages)
    start, end = PipelineStage.layer_range_for_rank(stand_in, stage, num_layers)  # type: ignore[arg-type]
    return range(start, end)


def stage_layers(model: Any) -> list[int] | None:
    """Indices of the decoder layers this process runs; `None` when the model is not pipeline parallel.

    Read from the modules: transformers replaces the layers of other stages with `PipelineIdentityLayer`.

    Example:

    ```python
    >>> model = AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(pp_size=2))
    >>> stage_layers(model)  # on rank 1 of a 6-layer model
    [3, 4, 5]
    ```
    """
    if getattr(model, "_pp_stage", None) is None:
        return None
    from transformers.distributed.pipeline_parallel import PipelineIdentityLayer

    decoder = getattr(model, getattr(model, "base_model_prefix", ""), model)
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise ValueError(
            f"{type(model).__name__} is pipeline parallel but has no `{model.base_model_prefix}.layers` to read the "
            f"stage's layers from; pass `stage_layers=` explicitly."
        )
    return [index for index, layer in enumerate(layers) if not isinstance(layer, PipelineIdentityLayer)]


def restrict_to_stage(cache: Cache, layers: Iterable[int]) -> Cache:
    """Give every layer of `cache` that this stage does not run an `OtherStageLayer`, a `DummyLayer` that answers the
    cache length from the stage's first layer (in place; returns `cache`).

    For transformers' own caches under pipeline parallelism (`DynamicCache(config=...)`, `StaticCache(...)`): without
    it, a later stage sizes its masks from layers it never updates and its results differ from one process (see
    docs/distributed.md). `HybridRingCache` does this itself (`HybridRingCache.for_model(model)`).
    """
    if getattr(cache, "holds_its_stage", False):
        raise TypeError(
            f"restrict_to_stage is for transformers' own caches; a {type(cache).__name__} holds its stage's layers "
            f"itself: build it with `HybridRingCache.for_model(model)` (or `stage_layers=`) instead."
        )
    if not cache.layers:
        raise ValueError(
            "restrict_to_stage needs a cache built with its layers (`DynamicCache(config=model.config)`)."
        )
    held = set(check_stage_layers(SimpleNamespace(num_hidden_layers=len(cache.layers)), layers))
    first_held = cache.layers[min(held)]
    for index in range(len(cache.layers)):
        if index not in held:
            cache.layers[index] = OtherStageLayer(first_held)
    return cache
