"""Steps are transactions (`hybrid_cache.steps`): a forward that raised after some layers stored its step is undone
at the next call, so the retry is exact; where it cannot be undone the cache says so and how to recover; the
cache's own refusals come before anything is written.

Failures are injected the way they happen to users: a layer's MLP raising (an out-of-memory), a
`KeyboardInterrupt`, an attention function refusing compressed codes. Every continuation is compared with a
no-cache forward of the same tokens.
"""

from __future__ import annotations

import contextlib
import random

import pytest
import torch
from builders import VOCAB, chunked_logits, no_cache_logits, tiny_gemma3, tiny_gemma4

from hybrid_cache import HybridRingCache, cache_kwargs
from hybrid_cache.code_attention import CODE_ATTENTION
from hybrid_cache.errors import CacheCapacityError, CodeAttentionError, HybridCacheError, IncompleteStepError

TOLERANCE = 1e-4


@contextlib.contextmanager
def failing(module: torch.nn.Module, error: BaseException):
    """`module.forward` raises `error` once, inside the block."""
    original = module.forward

    def fail(*args, **kwargs):
        module.forward = original
        raise error

    module.forward = fail
    try:
        yield
    finally:
        module.forward = original


def lengths(cache: HybridRingCache) -> list[int]:
    return [int(layer.get_seq_length()) for layer, spec in zip(cache.layers, cache.specs) if spec.stores]


def forward(model, cache, chunk: torch.Tensor) -> torch.Tensor:
    return model(input_ids=chunk, **cache_kwargs(cache), use_cache=True).logits


def decoder_layers(model) -> torch.nn.ModuleList:
    return model.model.layers


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("name", ["gemma3", "gemma4"])
def test_a_forward_that_failed_midway_is_undone_and_the_retry_is_exact(name, seed):
    """prompt of `prefix` tokens, then a step of 1 (or a few, before the ring wraps) tokens whose forward raises in
    layer k's MLP after layers 0..k stored it: the cache reports the old length, and the retry continues exactly."""
    rng = random.Random(seed)
    window = rng.choice([3, 4, 6])
    model = tiny_gemma3(window=window) if name == "gemma3" else tiny_gemma4(window=window)
    prefix = rng.choice([rng.randint(1, window - 1), rng.randint(window + 1, 3 * window)])
    step = 1 if prefix >= window else rng.randint(1, window - prefix)
    ids = torch.randint(3, VOCAB, (1, prefix + step + 2), generator=torch.Generator().manual_seed(seed))
    cache = HybridRingCache(model.config)
    with torch.no_grad():
        forward(model, cache, ids[:, :prefix])
        before = lengths(cache)
        layers = decoder_layers(model)
        last_storing = max(i for i, spec in enumerate(cache.specs) if spec.stores)
        failing_layer = rng.randrange(last_storing)  # the last storing layer has not stored the step
        error = rng.choice([RuntimeError("CUDA out of memory (simulated)"), KeyboardInterrupt()])
        with pytest.raises(type(error)), failing(layers[failing_layer].mlp, error):
            forward(model, cache, ids[:, prefix : prefix + step])
        assert cache.get_seq_length() == prefix
        got = chunked_logits(model, cache, ids, [step, 1, 1], start=prefix)
        assert lengths(cache) == [length + step + 2 for length in before]
        expected = no_cache_logits(model, ids)[:, prefix:]
    assert (got - expected).abs().max() < TOLERANCE


def test_every_entry_point_sees_the_undone_step():
    """After a failed forward, `crop`, `save`, `checkpoint`, `memory_report` and beam reordering act on the cache as
    it was before the step (the half-written step never leaks into them)."""
    model = tiny_gemma3(window=4)
    ids = torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
    reference = HybridRingCache(model.config, rollback_margin=1)
    with torch.no_grad():
        forward(model, reference, ids[:, :9])
        for use in ("crop", "checkpoint", "memory_report", "reorder"):
            # The undone step's write took one token of a wrapped ring's rollback reach: a margin keeps crop(-1).
            cache = HybridRingCache(model.config, rollback_margin=1)
            forward(model, cache, ids[:, :9])
            with pytest.raises(RuntimeError), failing(decoder_layers(model)[2].mlp, RuntimeError("boom")):
                forward(model, cache, ids[:, 9:10])
            if use == "crop":
                cache.crop(-1)
                forward(model, cache, ids[:, 8:9])
            elif use == "checkpoint":
                checkpoint = cache.checkpoint()
                assert checkpoint.length == 9
            elif use == "memory_report":
                assert cache.memory_report().tokens == 9
            else:
                cache.reorder_cache(torch.tensor([0]))
            assert lengths(cache) == lengths(reference), use
            got = forward(model, cache, ids[:, 9:12])
            expected = no_cache_logits(model, ids)[:, 9:12]
            assert (got - expected).abs().max() < TOLERANCE, use


def test_a_multi_token_step_that_overwrote_the_ring_is_undone_from_its_record():
    """A 3-token step on a wrapped ring of 4 slots overwrote 2 tokens the retry needs: each ring kept the slots it
    overwrote (`ring.SlotUndo`), so the failed step is undone exactly and the retry continues as if it never ran."""
    model = tiny_gemma3(window=4)
    ids = torch.randint(3, VOCAB, (1, 13), generator=torch.Generator().manual_seed(1))
    cache = HybridRingCache(model.config)
    with torch.no_grad():
        forward(model, cache, ids[:, :8])
        with pytest.raises(RuntimeError), failing(decoder_layers(model)[3].mlp, RuntimeError("boom")):
            forward(model, cache, ids[:, 8:11])
        assert cache.get_seq_length() == 8
        got = forward(model, cache, ids[:, 8:13])
        expected = no_cache_logits(model, ids)[:, 8:13]
    assert (got - expected).abs().max() < TOLERANCE


def test_a_step_that_cannot_be_undone_says_how_to_recover():
    """The guard behind the records: where a layer that stored a failed step cannot take it back (here its record is
    discarded by hand, as no eager step does), the next call raises `IncompleteStepError` naming reset / restore /
    load, on every use, until one of them replaces the state; then the cache continues exactly."""
    model = tiny_gemma3(window=4)
    ids = torch.randint(3, VOCAB, (1, 13), generator=torch.Generator().manual_seed(1))
    cache = HybridRingCache(model.config)
    with torch.no_grad():
        forward(model, cache, ids[:, :8])
        checkpoint = cache.checkpoint()
        with pytest.raises(RuntimeError), failing(decoder_layers(model)[3].mlp, RuntimeError("boom")):
            forward(model, cache, ids[:, 8:11])
        cache.layers[0]._undo = None  # white-box: no record of the step in the first ring
        for _ in range(2):
            with pytest.raises(IncompleteStepError, match=r"cache\.reset\(\).*cache\.restore\(checkpoint\)"):
                forward(model, cache, ids[:, 8:11])
        with pytest.raises(IncompleteStepError):
            cache.save("/nonexistent/never-written.safetensors")
        cache.restore(checkpoint)
        got = forward(model, cache, ids[:, 8:13])
        expected = no_cache_logits(model, ids)[:, 8:13]
    assert (got - expected).abs().max() < TOLERANCE


def test_a_multi_token_step_is_undone_while_past_recording_keeps_its_window():
    """With past recording on (assisted / prompt-lookup decoding turns it on), the same failed 3-token step on a
    wrapped ring is undone exactly."""
    model = tiny_gemma3(window=4)
    ids = torch.randint(3, VOCAB, (1, 13), generator=torch.Generator().manual_seed(2))
    cache = HybridRingCache(model.config)
    with torch.no_grad():
        forward(model, cache, ids[:, :8])
        try:
            cache.activate_past_recording()
        except HybridCacheError:
            pytest.skip("this transformers release cannot roll back exactly (compat.ROLLBACK_SINCE)")
        # one token first: before transformers 5.24 a multi-token first step after activation on a held cache is
        # refused (steps.check_assisted_start)
        forward(model, cache, ids[:, 8:9])
        with pytest.raises(RuntimeError), failing(decoder_layers(model)[3].mlp, RuntimeError("boom")):
            forward(model, cache, ids[:, 9:12])
        got = forward(model, cache, ids[:, 9:13])
        expected = no_cache_logits(model, ids)[:, 9:13]
    assert (got - expected).abs().max() < TOLERANCE


def test_a_failure_after_the_last_layer_stored_the_step_is_the_documented_limit():
    """The cache sees a step through its layers' updates: a forward that raised after the last storing layer (here
    in the output layer) leaves the step stored, as in DynamicCache; `crop(-1)` takes it back exactly."""
    model = tiny_gemma3(window=4)
    ids = torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(3))
    cache = HybridRingCache(model.config)
    with torch.no_grad():
        forward(model, cache, ids[:, :9])
        with pytest.raises(RuntimeError), failing(model.lm_head, RuntimeError("boom")):
            forward(model, cache, ids[:, 9:10])
        assert cache.get_seq_length() == 10
        cache.crop(-1)
        got = forward(model, cache, ids[:, 9:12])
        expected = no_cache_logits(model, ids)[:, 9:12]
    assert (got - expected).abs().max() < TOLERANCE


LAST_IS_FULL = ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]


def compressed_model(attn: str):
    return tiny_gemma3(window=4, layers=4, attn=attn, layer_types=LAST_IS_FULL, head_dim=64)


def test_code_attention_under_another_attention_is_refused_before_anything_is_written():
    """full_layer_code_attention=True while the model runs SDPA: refused when the step starts (the only full layer
    is the last one, so after the write nothing would notice); the fix the message names makes the retry exact."""
    model = compressed_model("sdpa")
    ids = torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(4))
    cache = HybridRingCache(model.config, full_layer_quantization="int8", full_layer_code_attention=True)
    reference = HybridRingCache(model.config, full_layer_quantization="int8", full_layer_code_attention=True)
    with torch.no_grad():
        model.set_attn_implementation(CODE_ATTENTION)
        forward(model, cache, ids[:, :9])
        forward(model, reference, ids[:, :9])
        expected = forward(model, reference, ids[:, 9:12])
        model.set_attn_implementation("sdpa")
        with pytest.raises(CodeAttentionError, match="set_attn_implementation"):
            forward(model, cache, ids[:, 9:10])
        assert lengths(cache) == [9] * 4
        model.set_attn_implementation(CODE_ATTENTION)
        got = forward(model, cache, ids[:, 9:12])
    assert (got - expected).abs().max() < TOLERANCE


def test_a_refusal_inside_attention_on_the_codes_undoes_the_step():
    """`output_attentions=True` reaches attention on the codes after the last (full) layer stored the token: the
    attention reports the refusal to the cache, which undoes the step at the next call; the retry without it is
    exact (the same logits as a cache that never failed)."""
    model = compressed_model(CODE_ATTENTION)
    ids = torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(5))
    cache = HybridRingCache(model.config, full_layer_quantization="int8")
    reference = HybridRingCache(model.config, full_layer_quantization="int8")
    with torch.no_grad():
        forward(model, cache, ids[:, :9])
        forward(model, reference, ids[:, :9])
        with pytest.raises(CodeAttentionError, match="attention weights"):
            model(input_ids=ids[:, 9:10], **cache_kwargs(cache), use_cache=True, output_attentions=True)
        assert cache.get_seq_length() == 9
        got = forward(model, cache, ids[:, 9:12])
        expected = forward(model, reference, ids[:, 9:12])
    assert (got - expected).abs().max() < TOLERANCE


@pytest.mark.parametrize("reload", [False, True], ids=["same-cache", "after-save-and-load"])
def test_a_step_beyond_max_cache_len_is_refused_before_the_rings_write(reload, tmp_path):
    """Found by the fuzzer's long mode: the full layer's capacity was checked when it stored, after the rings (layers
    0-4) had written a wrapped 7-token step, which a loaded cache (no window kept from the last step) could not undo.
    The capacity is checked when the step starts: refused, nothing written, and the cache continues exactly."""
    model = tiny_gemma3(window=3)
    ids = torch.randint(3, VOCAB, (1, 13), generator=torch.Generator().manual_seed(4))
    cache = HybridRingCache(model.config, max_cache_len=12)
    with torch.no_grad():
        forward(model, cache, ids[:, :1])
        if reload:
            cache.save(tmp_path / "cache.safetensors")
            cache = HybridRingCache.load(tmp_path / "cache.safetensors", model.config)
        forward(model, cache, ids[:, 1:8])
        before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
        with pytest.raises(CacheCapacityError, match="Nothing was written"):
            forward(model, cache, torch.randint(3, VOCAB, (1, 7)))
        assert cache.get_seq_length() == 8
        for (keys, values), layer in zip(before, cache.layers):
            assert torch.equal(keys, layer.keys) and torch.equal(values, layer.values)
        got = forward(model, cache, ids[:, 8:12])
    assert (got - no_cache_logits(model, ids[:, :12])[:, 8:12]).abs().max() < TOLERANCE
