"""One process's share of a distributed model, without starting one (the torchrun runs are in test_distributed.py):
the layers a pipeline stage holds, the splits a cache refuses, and `early_initialization` with a rank's KV heads."""

from __future__ import annotations

import copy
import importlib.util
import inspect

import pytest
import torch
from builders import VOCAB, reference_cache_kwargs, tiny_gemma3, tiny_gemma4
from transformers import DynamicCache
from transformers.distributed import DistributedConfig

from hybrid_cache import HybridRingCache, restrict_to_stage, stage_layers
from hybrid_cache.compat import DummyLayer, cache_kwargs
from hybrid_cache.distributed import check_stage_layers, parallel_sizes, pipeline_layer_range
from hybrid_cache.errors import UnsupportedReleaseError

_DISTRIBUTED_SIZES = inspect.signature(DistributedConfig).parameters
needs_tp = pytest.mark.skipif(
    "tp_size" not in _DISTRIBUTED_SIZES, reason="this release's DistributedConfig has no tp_size"
)
needs_pp = pytest.mark.skipif(
    "pp_size" not in _DISTRIBUTED_SIZES
    or importlib.util.find_spec("transformers.distributed.pipeline_parallel") is None,
    reason="this transformers release has no pipeline parallelism (hybrid_cache refuses stages there: test below)",
)


def _distributed(model, **sizes):
    model.config.distributed_config = DistributedConfig(**sizes)
    return model.config


@needs_pp
def test_pipeline_config_without_stage_layers_is_refused():
    """Under PP every stage has a cache; built from the config alone it would hold (and wait for) every layer."""
    config = _distributed(tiny_gemma3(), pp_size=2)
    assert parallel_sizes(config) == (1, 2)
    with pytest.raises(ValueError, match=r"HybridRingCache\.for_model\(model\)"):
        HybridRingCache(config)


def test_stage_cache_holds_only_its_layers():
    """Gemma 3, stage 1 of 2 (layers 3-5): no storage for 0-2; the cache length and mask sizes come from layer 3."""
    model = tiny_gemma3(window=4, layers=6)
    cache = HybridRingCache(model.config, stage_layers=[3, 4, 5])
    assert cache.layer_kinds == ["other_stage"] * 3 + ["sliding_attention"] * 2 + ["full_attention"]
    assert all(isinstance(layer, DummyLayer) for layer in cache.layers[:3])
    keys = torch.randn(2, 2, 7, 8)
    for index in (3, 4, 5):
        cache.update(keys, keys, index)
    assert cache.get_seq_length() == 7
    if hasattr(cache, "get_query_offset"):  # the cache protocol's query offset (not in transformers 5.5)
        assert cache.get_query_offset(0) == 7
    kv_length, layout = cache.get_mask_sizes(1, 0)  # transformers asks about layer 0 when a stage has no full layer
    assert kv_length == 4 and layout.positions.tolist() == cache.layers[3]._slot_positions(8).tolist() == [4, 5, 6, 7]
    report = cache.memory_report()
    assert report.bytes_by_type["other_stage"] == 0 and report.layers_by_type["other_stage"] == 3
    with pytest.raises(RuntimeError, match="another pipeline stage runs it"):
        cache.update(keys, keys, 0)


def test_for_model_without_pipeline_parallelism_is_the_plain_cache():
    model = tiny_gemma4()
    assert stage_layers(model) is None
    assert HybridRingCache.for_model(model, rollback_margin=2).layer_kinds == HybridRingCache(model.config).layer_kinds


@pytest.mark.parametrize(
    "layers, message",
    [
        ([], "holds no decoder layer"),
        ([6, 7, 8], "outside the model's 8 layers"),
        ([-1, 0], "outside the model's 8 layers"),
        ([4, 5, 6, 7], "Layer 5 reuses the keys/values of layer 2"),  # layer 2 (full, "store") runs on stage 0
    ],
)
def test_splits_a_stage_cannot_serve(layers, message):
    config = tiny_gemma4(layers=8, shared=3).config  # layers 5-7 reuse the K/V of layers 2 (full) and 4 (sliding)
    with pytest.raises(ValueError, match=message):
        HybridRingCache(config, stage_layers=layers)


def test_kv_sharing_within_a_stage_is_served():
    config = tiny_gemma4(layers=8, shared=3).config
    assert check_stage_layers(config, [7, 2, 3, 4, 5, 6]) == [2, 3, 4, 5, 6, 7]
    assert HybridRingCache(config, stage_layers=range(2, 8)).layer_kinds[5:] == ["shared"] * 3


@pytest.mark.skipif(needs_pp.args[0] is False, reason="this release has pipeline parallelism (tested below)")
def test_stages_are_refused_where_transformers_has_no_pipeline_parallelism():
    with pytest.raises(UnsupportedReleaseError, match="upgrade transformers or use one stage"):
        pipeline_layer_range(0, 2, 8)


@needs_pp
@pytest.mark.parametrize("stages, layers", [(2, 8), (3, 32), (4, 26), (3, 4)])
def test_pipeline_layer_range_is_transformers_split(stages, layers):
    """Every layer on exactly one stage, in order, none empty (where the remainder goes is transformers' choice: the
    first stages by 5.24, the last one in 5.18)."""
    ranges = [pipeline_layer_range(stage, stages, layers) for stage in range(stages)]
    assert [index for layer_range in ranges for index in layer_range] == list(range(layers))
    assert all(len(layer_range) >= layers // stages for layer_range in ranges)
    with pytest.raises(ValueError, match="stage must be"):
        pipeline_layer_range(2, 2, 8)


def test_restrict_to_stage_gives_transformers_caches_dummy_layers():
    model = tiny_gemma3(layers=6)
    cache = restrict_to_stage(DynamicCache(config=model.config), range(3, 6))
    assert [isinstance(layer, DummyLayer) for layer in cache.layers] == [True] * 3 + [False] * 3
    assert cache.is_sliding[:3] == [False] * 3  # so transformers looks for the first sliding / full layer past them
    keys = torch.randn(1, 1, 7, 8)
    for index in (3, 4, 5):
        cache.update(keys, keys, index)
    # transformers 5.25 asks layer 0 itself (no skipping of dummy layers): the stand-in answers the stage's length
    assert cache.get_seq_length() == cache.get_seq_length(3) == 7
    if hasattr(cache, "get_query_offset"):
        assert cache.get_query_offset(0) == 7
    copied = copy.deepcopy(cache)
    copied.update(keys[:, :, :1], keys[:, :, :1], 3)
    assert copied.get_seq_length() == 8 and cache.get_seq_length() == 7  # a copy answers from its own layers
    with pytest.raises(ValueError, match="built with its layers"):
        restrict_to_stage(DynamicCache(), [0])


def test_restrict_to_stage_refuses_a_ring_cache_which_holds_its_stage_itself():
    """Swapping dummy layers into a HybridRingCache would leave its layer specs (each layer's role) stale: refused,
    naming `for_model`, and the cache is unchanged."""
    model = tiny_gemma3(layers=6)
    cache = HybridRingCache(model.config)
    layers = list(cache.layers)
    with pytest.raises(TypeError, match="for_model"):
        restrict_to_stage(cache, range(3, 6))
    assert cache.layers == layers and cache.layer_kinds == [spec.kind for spec in cache.specs]


@needs_tp
def test_early_initialization_keeps_the_ranks_kv_heads():
    """TP=2 on Gemma 3 (2 KV heads): `num_heads=1` allocates 1 head per layer (it used to be replaced by the config's
    global 2); generate's first update then finds the layout it expects and keeps the buffers."""
    model = tiny_gemma3(layers=6)
    cache = HybridRingCache(_distributed(model, tp_size=2), max_cache_len=16)
    cache.early_initialization(batch_size=2, num_heads=1, head_dim=8, dtype=torch.float32, device="cpu")
    assert [layer.num_heads for layer in cache.layers] == [1] * 6
    keys = cache.layers[0].keys
    cache.update(torch.randn(2, 1, 5, 8), torch.randn(2, 1, 5, 8), 0)
    assert cache.layers[0].keys is keys


@needs_tp
def test_early_initialization_scales_per_type_heads_by_the_tp_degree():
    """Gemma 4 with 4 sliding / 2 full KV heads under TP=2: one int names a rank's count of one type; every layer
    gets its own type's count / 2. An int that is no rank's count, or heads TP cannot split, raise."""
    model = tiny_gemma4(query_heads=8, kv_heads=4, global_kv_heads=2)
    config = _distributed(model, tp_size=2)
    expected = [
        None if kind == "shared" else (2 if kind == "sliding_attention" else 1)
        for kind in HybridRingCache(config).layer_kinds
    ]
    for num_heads in (2, 1):
        cache = HybridRingCache(config)
        cache.early_initialization(batch_size=1, num_heads=num_heads, head_dim=8, dtype=torch.float32, device="cpu")
        assert [getattr(layer, "num_heads", None) for layer in cache.layers] == expected
    with pytest.raises(ValueError, match="one int cannot describe it"):
        HybridRingCache(config).early_initialization(1, 4, 8, torch.float32, "cpu")
    config.distributed_config = DistributedConfig(tp_size=4)
    with pytest.raises(ValueError, match="cannot split evenly"):
        HybridRingCache(config).early_initialization(1, 1, 8, torch.float32, "cpu")


def test_early_initialization_in_one_process_is_unchanged():
    """Without tensor parallelism Gemma 4's ints still mean the config's per-layer counts, and the run is exact."""
    model = tiny_gemma4()
    cache = HybridRingCache(model.config, max_cache_len=20)
    cache.early_initialization(batch_size=1, num_heads=2, head_dim=8, dtype=torch.float32, device="cpu")
    shapes = [(layer.num_heads, layer.k_head_dim) for layer in cache.layers if hasattr(layer, "num_heads")]
    assert shapes == [(2, 8), (2, 8), (1, 16), (2, 8), (2, 8)]
    input_ids = torch.randint(3, VOCAB, (1, 9))
    with torch.no_grad():
        got = model(input_ids=input_ids, **cache_kwargs(cache), use_cache=True).logits
        expected = model(input_ids=input_ids, **reference_cache_kwargs(model)).logits
    assert (got - expected).abs().max() < 1e-4
