"""The recoveries the docs promise, after every failure: `reset()`, `restore()`, `key_positions()`, the undo of an
interrupted step on any cache, and `crop(-n)` of the last step whatever its length (`hybrid_cache.steps`,
`ring.SlotUndo`). Each continuation is compared with the no-cache forward of the same tokens (fp32, 1e-4).

Failures are injected as users meet them: a layer's MLP raising midway (an out-of-memory), the output layer or the
final norm raising after the last storing layer stored the step (an out-of-memory in the logits).
"""

from __future__ import annotations

import contextlib
import random

import pytest
import torch
from builders import VOCAB, no_cache_logits, tiny_gemma3, tiny_gemma4

from hybrid_cache import HybridRingCache, cache_kwargs
from hybrid_cache.compat import STEP_POSITIONS_SINCE, TRANSFORMERS_VERSION, rollback_supported

TOLERANCE = 1e-4
needs_rollback = pytest.mark.skipif(not rollback_supported(), reason="past recording is exact from transformers 5.18")


class Injected(RuntimeError):
    """The error a patched module raises once."""


@contextlib.contextmanager
def failing_once(module: torch.nn.Module):
    """`module.forward` raises `Injected` once inside the block (the block expects it)."""
    original = module.forward

    def fail(*args, **kwargs):
        module.forward = original
        raise Injected("injected failure")

    module.forward = fail
    try:
        with pytest.raises(Injected):
            yield
    finally:
        module.forward = original


def forward(model, cache, ids: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """One step of `ids[:, start:end]` through `cache`, with the positions transformers' `generate` passes."""
    positions = torch.arange(start, end).unsqueeze(0)
    return model(input_ids=ids[:, start:end], position_ids=positions, **cache_kwargs(cache), use_cache=True).logits


def activate_past_recording(model, cache, ids: torch.Tensor, held: int) -> int:
    """`cache.activate_past_recording()` on `held` tokens; the number of tokens held after it. Before transformers 5.24
    the cache is not told a step's positions, so a multi-token first step after it is refused
    (`steps.check_assisted_start`): one token continues the conversation first there."""
    cache.activate_past_recording()
    if TRANSFORMERS_VERSION >= STEP_POSITIONS_SINCE:
        return held
    forward(model, cache, ids, held, held + 1)
    return held + 1


def assert_exact(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    difference = (got - expected).abs().max().item()
    assert difference < TOLERANCE, f"{what}: max |logit difference| {difference:.3g}"


def build(family: str, window: int):
    return tiny_gemma3(window=window) if family == "gemma3" else tiny_gemma4(window=window)


def last_storing_layer(cache: HybridRingCache) -> int:
    return max(i for i, spec in enumerate(cache.specs) if spec.stores)


def after_the_last_storing_layer(model) -> list[torch.nn.Module]:
    """Modules that run after the last storing layer stored a step: the final norm and the output layer."""
    return [model.model.norm, model.lm_head]


CASES = [(family, seed) for family in ("gemma3", "gemma4") for seed in range(4)]
IDS = [f"{family}-{seed}" for family, seed in CASES]


@needs_rollback
@pytest.mark.parametrize("failed_verification", ["none", "before-any-write", "in-a-layer"])
@pytest.mark.parametrize(("family", "seed"), CASES, ids=IDS)
def test_reset_after_past_recording_accepts_a_new_prompt(family, seed, failed_verification):
    """`activate_past_recording()` on a cache holding a conversation (optionally a verification step interrupted
    before any layer stored it, or in a layer), then `reset()`: a new prompt of any length is accepted (the pending
    assisted-start check belonged to the old conversation) and exact, and so is decoding after it."""
    rng = random.Random(seed)
    window = rng.choice([3, 4, 6])
    model = build(family, window)
    ids = torch.randint(3, VOCAB, (1, 40), generator=torch.Generator().manual_seed(seed))
    held, prompt = rng.randint(window + 1, 3 * window), rng.randint(2, 3 * window)
    cache = HybridRingCache(model.config)
    with torch.no_grad():
        forward(model, cache, ids, 0, held)
        held = activate_past_recording(model, cache, ids, held)
        if failed_verification != "none":
            layer = rng.randrange(last_storing_layer(cache))
            where = (
                model.model.embed_tokens
                if failed_verification == "before-any-write"
                else model.model.layers[layer].mlp
            )
            with failing_once(where):
                forward(model, cache, ids, held, held + 3)
        cache.reset()
        assert cache.get_seq_length() == 0
        new = ids[:, held:]  # another conversation
        got = torch.cat([forward(model, cache, new, 0, prompt), forward(model, cache, new, prompt, prompt + 1)], 1)
        expected = no_cache_logits(model, new[:, : prompt + 1])
    assert_exact(got, expected, "new prompt after reset")


@needs_rollback
@pytest.mark.parametrize("taken", ["before-recording", "after-recording"])
@pytest.mark.parametrize("failed_step", [False, True], ids=["", "after-a-failed-step"])
@pytest.mark.parametrize(("family", "seed"), CASES, ids=IDS)
def test_restore_keeps_past_recording(family, seed, taken, failed_step):
    """Past recording is a mode of the cache (as `deepcopy` keeps it): `restore(checkpoint)`, whenever the checkpoint
    was taken, leaves it on, so a verification step after the restore can be cropped back in part exactly."""
    rng = random.Random(seed)
    window = rng.choice([3, 4, 6])
    model = build(family, window)
    ids = torch.randint(3, VOCAB, (1, 40), generator=torch.Generator().manual_seed(seed))
    held = rng.randint(window + 1, 3 * window)
    draft = rng.randint(3, window + 2)
    keep = rng.randint(0, draft - 2)  # at least 2 rejected: more than a ring without a margin can undo alone
    cache = HybridRingCache(model.config)
    with torch.no_grad():
        forward(model, cache, ids, 0, held)
        checkpoint = cache.checkpoint() if taken == "before-recording" else None
        recorded = activate_past_recording(model, cache, ids, held)
        checkpoint = checkpoint or cache.checkpoint()
        if failed_step:
            with failing_once(model.model.layers[rng.randrange(last_storing_layer(cache))].mlp):
                forward(model, cache, ids, recorded, recorded + draft)
        cache.restore(checkpoint)
        held = cache.get_seq_length()  # `recorded`, or `held` for a checkpoint taken before recording
        forward(model, cache, ids, held, held + draft)  # the verification step
        cache.crop(-(draft - keep))  # keep the first `keep` draft tokens
        assert cache.get_seq_length() == held + keep
        got = forward(model, cache, ids, held + keep, held + keep + 2)
    expected = no_cache_logits(model, ids[:, : held + keep + 2])[:, held + keep :]
    assert_exact(got, expected, "after restore, verification and crop")


MODES = {
    "exact": {},
    "fixed": {"max_cache_len": 48},
    "int8": {"full_layer_quantization": "int8"},
    "int4": {"full_layer_quantization": "int4"},
    "fp8": {"full_layer_quantization": "fp8"},
    "sinks": {"full_layer_window": 4, "full_layer_sink_tokens": 2},
}


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("family", ["gemma3", "gemma4"])
def test_key_positions_answers_for_every_storing_layer(family, mode):
    """`key_positions(layer)` for every storing layer and storage (exact, fixed, compressed, bounded): one position per
    key column the attention saw (the weights of `output_attentions` with eager attention), each position at most
    once, full layers in time order; `attention_in_time_order` takes them."""
    from hybrid_cache import attention_in_time_order

    model = build(family, 4)
    model.set_attn_implementation("eager")
    ids = torch.randint(3, VOCAB, (1, 14), generator=torch.Generator().manual_seed(0))
    cache = HybridRingCache(model.config, **MODES[mode])
    with torch.no_grad():
        for start, end in ((0, 9), (9, 10), (10, 13), (13, 14)):
            out = model(input_ids=ids[:, start:end], **cache_kwargs(cache), use_cache=True, output_attentions=True)
            for index, spec in enumerate(cache.specs):
                if not spec.stores:
                    continue
                positions = cache.key_positions(index)
                weights = out.attentions[index]
                assert positions.shape == (weights.shape[-1],), (mode, index, start)
                held = positions[positions >= 0]
                assert held.unique().numel() == held.numel() and int(held.max()) < end
                if spec.kind == "full_attention" and mode in ("exact", "int8", "int4", "fp8"):
                    assert positions.tolist() == list(range(end)), (mode, index)
                attention_in_time_order(weights, positions)


@pytest.mark.parametrize("mode", ["exact", "fixed", "int8"])
@pytest.mark.parametrize(("family", "seed"), CASES, ids=IDS)
def test_an_interrupted_prompt_on_an_empty_cache_is_undone(family, seed, mode):
    """A prompt (shorter or longer than the window) interrupted in a layer of an empty cache is undone by emptying
    it: no `IncompleteStepError`, the same prompt retried without `reset` continues exactly, and `generate` on that
    cache gives `DynamicCache`'s tokens."""
    from transformers import DynamicCache

    rng = random.Random(seed)
    window = rng.choice([3, 4, 6])
    model = build(family, window)
    prompt = rng.choice([rng.randint(2, window), rng.randint(window + 1, 4 * window)])
    ids = torch.randint(3, VOCAB, (1, prompt + 6), generator=torch.Generator().manual_seed(seed))
    cache = HybridRingCache(model.config, **MODES[mode])
    with torch.no_grad():
        with failing_once(model.model.layers[rng.randrange(last_storing_layer(cache))].mlp):
            forward(model, cache, ids, 0, prompt)
        assert cache.get_seq_length() == 0
        if mode != "int8":  # compressed full layers: the no-cache forward is not their reference
            got = torch.cat([forward(model, cache, ids, 0, prompt), forward(model, cache, ids, prompt, prompt + 2)], 1)
            assert_exact(got, no_cache_logits(model, ids[:, : prompt + 2]), "retry of the interrupted prompt")
            cache.reset()
            with failing_once(model.model.layers[0].mlp):
                forward(model, cache, ids, 0, prompt)
        reference = (
            HybridRingCache(model.config, **MODES[mode]) if mode == "int8" else DynamicCache(config=model.config)
        )
        kwargs = {"max_new_tokens": 5, "do_sample": False, "attention_mask": torch.ones_like(ids[:, :prompt])}
        got = model.generate(ids[:, :prompt], **cache_kwargs(cache), **kwargs)
        expected = model.generate(ids[:, :prompt], **cache_kwargs(reference), **kwargs)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("module", ["norm", "lm_head"])
@pytest.mark.parametrize("mode", ["exact", "fixed", "int8", "sinks"])
@pytest.mark.parametrize(("family", "seed"), CASES, ids=IDS)
def test_crop_takes_back_a_step_that_failed_after_its_last_storing_layer(family, seed, mode, module):
    """A forward that raises after its last storing layer stored the step (the final norm, the output layer) leaves a
    complete step, as in every cache; `crop(-n)` takes it back exactly whatever its length: a prompt longer than the
    window on an empty cache, a multi-token step past the wrap, a decode step. The retry then matches a cache that
    never saw the failure (the no-cache forward for exact storage, the same storage otherwise)."""
    rng = random.Random(seed)
    window = rng.choice([3, 4, 6])
    model = build(family, window)
    failing_module = dict(zip(("norm", "lm_head"), after_the_last_storing_layer(model)))[module]
    ids = torch.randint(3, VOCAB, (1, 40), generator=torch.Generator().manual_seed(seed))
    cache = HybridRingCache(model.config, **MODES[mode])
    shadow = HybridRingCache(model.config, **MODES[mode])  # the same steps, never failed
    schedule = [rng.randint(window + 1, 3 * window)]
    schedule += [rng.choice([1, 2, window - 1, window + 1, 2 * window]) for _ in range(5)]
    start, outputs, shadows = 0, [], []
    with torch.no_grad():
        for count in schedule:
            if rng.random() < 0.6:
                with failing_once(failing_module):
                    forward(model, cache, ids, start, start + count)
                assert cache.get_seq_length() == start + count  # a complete step: kept, as by DynamicCache
                cache.crop(-count)
                assert cache.get_seq_length() == start
            outputs.append(forward(model, cache, ids, start, start + count))
            shadows.append(forward(model, shadow, ids, start, start + count))
            start += count
    got, expected = torch.cat(outputs, 1), torch.cat(shadows, 1)
    if mode in ("exact", "fixed"):
        expected = no_cache_logits(model, ids[:, :start])
    assert_exact(got, expected, f"schedule {schedule}")


@pytest.mark.parametrize("margin", [0, 1])
@pytest.mark.parametrize(("family", "seed"), CASES, ids=IDS)
def test_crop_of_the_last_step_whatever_its_length_then_any_continuation(family, seed, margin):
    """Property test: random steps; after each, `crop(-n)` of the whole of it always works, of a part of it within
    `margin + 1` tokens too; any other crop (a larger part, tokens before it) is exact or refused with
    `RollbackError`; the sequence continues exactly either way."""
    from hybrid_cache import RollbackError

    rng = random.Random(seed)
    window = rng.choice([3, 4, 6])
    model = build(family, window)
    ids = torch.randint(3, VOCAB, (1, 60), generator=torch.Generator().manual_seed(seed))
    expected = no_cache_logits(model, ids)
    cache = HybridRingCache(model.config, rollback_margin=margin)
    length = 0
    with torch.no_grad():
        while length < 45:
            count = rng.choice([1, 1, 2, window, window + 1, 2 * window + 1])
            forward(model, cache, ids, length, length + count)
            back = rng.choice([count, count, rng.randint(1, count), count + rng.randint(0, margin + 1)])
            back = min(back, length + count)
            # Guaranteed: the whole last step (its record), or a part of it within the margin.
            whole_or_margin = back == count or back <= min(count, margin + 1)
            try:
                cache.crop(-back)
            except RollbackError:
                assert not whole_or_margin, f"crop(-{back}) after a step of {count} at {length} refused"
                length += count
            else:
                length += count - back
            assert cache.get_seq_length() == length
            got = forward(model, cache, ids, length, length + 1)
            assert_exact(got, expected[:, length : length + 1], f"after crop(-{back}) of a step of {count}")
            length += 1


def test_memory_report_counts_the_last_steps_record():
    """The slots a step overwrote are kept alive until the next step (or a crop): `memory_report()` counts them, and a
    decode step keeps one slot per ring."""
    model = tiny_gemma3(window=4)
    ids = torch.randint(3, VOCAB, (1, 20), generator=torch.Generator().manual_seed(0))
    cache = HybridRingCache(model.config)
    with torch.no_grad():
        forward(model, cache, ids, 0, 9)
        forward(model, cache, ids, 9, 14)  # overwrites every slot of every ring
        after_chunk = cache.memory_report().extra_bytes
        forward(model, cache, ids, 14, 15)
        after_decode = cache.memory_report().extra_bytes
        cache.crop(-1)
        after_crop = cache.memory_report().extra_bytes
    rings = sum(1 for spec in cache.specs if spec.kind == "sliding_attention")
    layer = cache.layers[0]
    slot_bytes = layer.batch_size * layer.num_heads * (layer.k_head_dim + layer.v_head_dim) * 4
    assert after_chunk - after_crop == rings * 4 * slot_bytes
    assert after_decode - after_crop == rings * slot_bytes


@pytest.mark.parametrize("family", ["gemma3", "gemma4"])
def test_a_step_overwriting_more_than_undo_slots_keeps_no_record(family, monkeypatch):
    """A step past the wrap that overwrites more than `ring.UNDO_SLOTS` held slots (a prefill chunk of a real window;
    here the limit is lowered to 2 on a window of 4) keeps no copy of them: `crop` of it beyond the margin raises
    `RollbackError` naming the recoveries, a failure inside it leaves `IncompleteStepError` until `reset()`, which then
    continues exactly; a step within the limit is still undone exactly."""
    from hybrid_cache import RollbackError, ring
    from hybrid_cache.errors import IncompleteStepError

    monkeypatch.setattr(ring, "UNDO_SLOTS", 2)
    model = build(family, 4)
    ids = torch.randint(3, VOCAB, (1, 30), generator=torch.Generator().manual_seed(7))
    expected = no_cache_logits(model, ids)
    cache = HybridRingCache(model.config)
    with torch.no_grad():
        forward(model, cache, ids, 0, 9)
        forward(model, cache, ids, 9, 12)  # 3 slots overwritten per ring: no record
        assert all(not layer.undo_tensors() for layer in cache.layers if hasattr(layer, "undo_tensors"))
        with pytest.raises(RollbackError, match="at most 2 slots.*checkpoint"):
            cache.crop(-3)
        assert cache.get_seq_length() == 12
        forward(model, cache, ids, 12, 14)  # 2 slots: undone exactly
        cache.crop(-2)
        assert_exact(forward(model, cache, ids, 12, 13), expected[:, 12:13], "after crop(-2) within the limit")
        with failing_once(model.model.layers[1].mlp):
            forward(model, cache, ids, 13, 16)
        with pytest.raises(IncompleteStepError, match="reset"):
            forward(model, cache, ids, 13, 16)
        cache.reset()
        got = torch.cat([forward(model, cache, ids, 0, 13), forward(model, cache, ids, 13, 16)], 1)
    assert_exact(got, expected[:, :16], "after reset")
