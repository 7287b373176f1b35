"""torch.export through transformers' exporter (`transformers.exporters`): the exporter walks every attribute of the
cache and assigns it back (`cast_leaf_tensors`), flattens it into a pytree and rebuilds it; the exported prefill and
decode steps of tiny Gemma 3 / Gemma 4 models give the eager logits, and the cache continues exactly after them."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from builders import VOCAB, no_cache_logits, tiny_gemma3, tiny_gemma4

from hybrid_cache import HybridRingCache, cache_kwargs
from hybrid_cache.options import CacheOptions

exporter_dynamo = pytest.importorskip("transformers.exporters.exporter_dynamo", reason="no exporters before 5.14")
from transformers.exporters.configs import DynamoConfig  # noqa: E402
from transformers.exporters.utils import cast_leaf_tensors  # noqa: E402

TOLERANCE = 1e-4

# transformers' exporter runner reads a torch treespec attribute torch 2.13 deprecates (not ours to fix).
pytestmark = pytest.mark.filterwarnings("ignore:`treespec.children_specs` is deprecated:FutureWarning")


def _runnable(program):
    """What the exporter returned, as a callable: an `ExportedProgram` before transformers 5.24 (run its `module()`),
    a runner that takes the model's keywords from 5.24."""
    run = program.module() if isinstance(program, torch.export.ExportedProgram) else program

    def step(**inputs):
        with torch.no_grad():  # an inference step: a cache of graph tensors cannot be exported (deep-copied) again
            return run(**inputs)

    return step


def _returned_cache(output) -> HybridRingCache:
    """The cache a step returned (`cache` from transformers 5.24, `past_key_values` before)."""
    cache = output.get("cache", output.get("past_key_values"))
    assert isinstance(cache, HybridRingCache)
    return cache


def test_the_exporters_attribute_walk_passes_and_changes_nothing():
    """`cast_leaf_tensors` assigns every attribute back (FrozenInstanceError before); values stay fixed."""
    model = tiny_gemma3(window=4)
    ids = torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
    cache = HybridRingCache(model.config, full_layer_quantization="int8")
    with torch.no_grad():
        model(input_ids=ids[:, :9], **cache_kwargs(cache), use_cache=True)
        cast_leaf_tensors({"cache": cache}, torch.float32, torch.device("cpu"))
        reference = HybridRingCache(model.config, full_layer_quantization="int8")
        model(input_ids=ids[:, :9], **cache_kwargs(reference), use_cache=True)
        got = model(input_ids=ids[:, 9:], **cache_kwargs(cache), use_cache=True).logits
        expected = model(input_ids=ids[:, 9:], **cache_kwargs(reference), use_cache=True).logits
    assert torch.equal(got, expected)
    with pytest.raises(dataclasses.FrozenInstanceError, match="max_cache_len"):
        cache.options.max_cache_len = 5
    with pytest.raises(dataclasses.FrozenInstanceError):
        cache.specs[0].window = 3
    again = dataclasses.replace(cache.options)
    assert again == cache.options and hash(again) == hash(cache.options) != hash(CacheOptions())


@pytest.mark.parametrize("build", [tiny_gemma3, tiny_gemma4], ids=["gemma3", "gemma4"])
def test_exported_prefill_and_decode_steps_match_eager(build):
    """prefill 6 tokens (ring of 4: wrapped), then a one-token step. An exported program takes the Python state of
    the cache it was traced with as part of its input spec (counters, as with transformers' own caches), so the decode
    step is exported from the cache the exported prefill returned, and run on it: the no-cache forward's logits at
    both steps, and the returned cache continues eagerly."""
    model = build(window=4)
    ids = torch.randint(3, VOCAB, (1, 8), generator=torch.Generator().manual_seed(1))
    expected = no_cache_logits(model, ids)
    exporter = exporter_dynamo.DynamoExporter()

    def step(cache, chunk):
        return {"input_ids": chunk, **cache_kwargs(cache)}

    prefill = _runnable(exporter.export(model, step(HybridRingCache(model.config), ids[:, :6]), config=DynamoConfig()))
    output = prefill(**step(HybridRingCache(model.config), ids[:, :6]))
    assert (output.logits - expected[:, :6]).abs().max() < TOLERANCE
    cache = _returned_cache(output)
    assert cache.get_seq_length() == 6

    decode = _runnable(exporter.export(model, step(cache, ids[:, 6:7]), config=DynamoConfig()))
    output = decode(**step(cache, ids[:, 6:7]))
    assert (output.logits - expected[:, 6:7]).abs().max() < TOLERANCE
    cache = _returned_cache(output)
    with torch.no_grad():
        logits = model(**step(cache, ids[:, 7:8]), use_cache=True).logits
    assert (logits - expected[:, 7:8]).abs().max() < TOLERANCE
