"""No half-done states, nothing unreported: the cache as users actually drive it (traps 10-12).

Failed calls followed by reuse, `torch.inference_mode()` then `no_grad`, pickled caches in a fresh process, past
recording left on by `generate`, configs that disagree with the model, prepared masks, mask functions registered
later, attention maps, and gradients through the cache. Every scenario ends with the no-cache oracle.
"""

from __future__ import annotations

import copy
import gc
import pickle
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch
from builders import MODEL_BUILDERS, VOCAB, chunked_logits, no_cache_logits, tiny_gemma3
from transformers import DynamicCache
from transformers.configuration_utils import PreTrainedConfig
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from hybrid_cache import (
    HybridRingCache,
    RollbackError,
    UnsupportedAttentionError,
    WindowMismatchError,
    attention_in_time_order,
    install_mask_hook,
)
from hybrid_cache.compat import cache_kwargs

TOLERANCE = 1e-4
TESTS = Path(__file__).parent


def tokens(length: int, batch: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def assert_close(got: torch.Tensor, expected: torch.Tensor, label: str = "") -> None:
    difference = (got - expected).abs().max().item()
    assert difference <= TOLERANCE, f"{label}: max |logit difference| = {difference:.3g}"


def snapshot(cache: HybridRingCache) -> list:
    """Everything that defines the cache's state, to check that a refused call changed nothing."""
    state = []
    for layer in cache.layers:
        if isinstance(getattr(layer, "keys", None), torch.Tensor):
            state.append(
                (layer.get_seq_length(), getattr(layer, "_oldest", None), layer.keys.clone(), layer.values.clone())
            )
    return state


def assert_unchanged(before: list, cache: HybridRingCache) -> None:
    after = snapshot(cache)
    assert len(before) == len(after)
    for (length, oldest, keys, values), (length2, oldest2, keys2, values2) in zip(before, after):
        assert (length, oldest) == (length2, oldest2) and torch.equal(keys, keys2) and torch.equal(values, values2)


def reachable_tensor_bytes(root) -> int:
    """Bytes of every distinct tensor storage reachable from `root` (the config excluded): what it keeps alive."""
    seen, storages, stack = set(), {}, [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (PreTrainedConfig, type, types.ModuleType, types.FunctionType)):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storages[obj.untyped_storage().data_ptr()] = obj.untyped_storage().nbytes()
            continue
        stack.extend(gc.get_referents(obj))
    return sum(storages.values())


# --- crop is all-or-nothing ------------------------------------------------------------------------------------------
def qwen2_full_first():
    """A Qwen2-style model whose first layer is full attention (`max_window_layers=1`), the others sliding."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_sliding_window=True,
        sliding_window=4,
        max_window_layers=1,
        attn_implementation="sdpa",
    )
    return Qwen2ForCausalLM(config).eval()


def test_refused_crop_changes_nothing():
    """A full layer before the sliding ones: a crop the rings cannot serve raises `RollbackError` before any layer
    is cut, and the caller who catches it continues with exact logits."""
    model = qwen2_full_first()
    ids = tokens(16)
    cache = HybridRingCache(model.config)
    assert cache.layer_kinds[0] == "full_attention"
    chunked_logits(model, cache, ids[:, :12], [9, 1, 1, 1])
    before = snapshot(cache)
    with pytest.raises(RollbackError, match="rollback_margin"):
        cache.crop(-3)
    assert_unchanged(before, cache)
    got = chunked_logits(model, cache, ids[:, 12:], [1, 1, 2])
    assert_close(got, no_cache_logits(model, ids)[:, 12:], "after a refused crop")


# --- inference mode, then no_grad ------------------------------------------------------------------------------------
@pytest.mark.parametrize("fixed", [False, True], ids=["growing", "fixed"])
def test_inference_mode_cache_reused_under_no_grad(model_name, fixed):
    """A cache filled under `torch.inference_mode()` (as pipelines do) continues under `no_grad` (as `generate`
    does), and again after `reset()`: exact both times."""
    model = MODEL_BUILDERS[model_name](window=4)
    ids = tokens(20)
    cache = HybridRingCache(model.config, max_cache_len=32 if fixed else None)
    with torch.inference_mode():
        first = chunked_logits(model, cache, ids[:, :10], [7, 1, 1, 1])
    with torch.no_grad():
        rest = chunked_logits(model, cache, ids[:, 10:], [1, 3, 1, 5])
    expected = no_cache_logits(model, ids)
    assert_close(torch.cat([first, rest], 1), expected, "inference_mode then no_grad")
    cache.reset()
    with torch.inference_mode():
        chunked_logits(model, cache, ids[:, :5], [5])
    cache.reset()
    assert_close(chunked_logits(model, cache, ids, [9, 1, 1, 9]), expected, "after reset")


def test_generate_after_inference_mode_prefill(model_name):
    model = MODEL_BUILDERS[model_name](window=4)
    ids = tokens(12)
    cache = HybridRingCache(model.config)
    with torch.inference_mode():
        model(input_ids=ids[:, :-1], **cache_kwargs(cache))
    kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False)
    out = model.generate(**kwargs, **cache_kwargs(cache))
    with torch.no_grad():
        assert torch.equal(out, model.generate(**kwargs, **cache_kwargs(DynamicCache(config=model.config))))


# --- pickled / torch.save'd caches in a fresh process ----------------------------------------------------------------
CHILD = """
import sys, torch, pickle
sys.path.insert(0, {tests!r})
from builders import MODEL_BUILDERS, VOCAB, chunked_logits, no_cache_logits
import hybrid_cache.mask_hook as mask_hook
assert not mask_hook.is_mask_hook_installed("sdpa"), "a fresh process starts without the hook"
model = MODEL_BUILDERS[{name!r}](window=4)
ids = torch.randint(3, VOCAB, (2, 20), generator=torch.Generator().manual_seed(0))
mask = torch.ones_like(ids)
mask[1, :2] = 0
cache = torch.load({path!r}, weights_only=False) if {use_torch!r} else pickle.load(open({path!r}, "rb"))
got = chunked_logits(model, cache, ids, [1, 1, 1, 1, 3, 1, 1, 1, 1, 1, 1, 1], mask, start={start})
expected = no_cache_logits(model, ids, mask)[:, {start}:]
difference = (got - expected)[mask[:, {start}:].bool()].abs().max().item()
assert difference <= 1e-4, difference
print("OK", difference)
"""


@pytest.mark.parametrize("use_torch", [True, False], ids=["torch.save", "pickle"])
def test_saved_cache_in_fresh_process(model_name, use_torch, tmp_path):
    """Saved before the wrap, loaded in a new process (no hook installed there): the dense decode-mask path and the
    wrapped steps that follow are exact."""
    model = MODEL_BUILDERS[model_name](window=4)
    cache = HybridRingCache(model.config)
    ids, mask = tokens(20, batch=2), torch.ones(2, 20, dtype=torch.long)
    mask[1, :2] = 0
    ids[1, :2] = 0
    chunked_logits(model, cache, ids[:, :6], [3, 1, 1, 1], mask[:, :6])  # the child starts from here
    path = tmp_path / "cache.bin"
    if use_torch:
        torch.save(cache, path)
    else:
        path.write_bytes(pickle.dumps(cache))
    child = CHILD.format(tests=str(TESTS), name=model_name, path=str(path), use_torch=use_torch, start=6)
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(child)], capture_output=True, text=True, timeout=300, cwd=TESTS.parent
    )
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]


# --- past recording does not outlive generate ------------------------------------------------------------------------
def test_prompt_lookup_leaves_nothing_behind(model_name):
    """After a prompt-lookup generation (which turns past recording on and never off), a long next turn must not
    keep undo copies alive, and `memory_report()` counts every tensor the cache keeps alive."""
    model = MODEL_BUILDERS[model_name](window=4)
    prompt = torch.cat([tokens(5, seed=1)] * 3, 1)  # repetitive: prompt lookup finds candidates
    cache = HybridRingCache(model.config)
    kwargs = dict(do_sample=False, max_new_tokens=12, min_new_tokens=12, pad_token_id=0)
    with torch.no_grad():
        out = model.generate(
            input_ids=prompt,
            attention_mask=torch.ones_like(prompt),
            **cache_kwargs(cache),
            prompt_lookup_num_tokens=3,
            **kwargs,
        )
        assert reachable_tensor_bytes(cache) == cache.memory_report().total_bytes
        assert cache.memory_report().extra_bytes == 0, "an undo copy survived generate"
        # A long plain forward right after: whatever it keeps is counted, and released by the next step.
        turn = torch.cat([out, tokens(40, seed=2)], 1)
        model(input_ids=turn[:, out.shape[1] :], **cache_kwargs(cache))
        assert reachable_tensor_bytes(cache) == cache.memory_report().total_bytes
        model(input_ids=tokens(1, seed=3), **cache_kwargs(cache))
        report = cache.memory_report()
        assert report.extra_bytes == 0 and reachable_tensor_bytes(cache) == report.total_bytes
        # A new generate call on the same cache starts without recording: its prefill keeps nothing.
        turn = torch.cat([turn, tokens(1, seed=3), tokens(30, seed=4)], 1)
        model.generate(input_ids=turn, attention_mask=torch.ones_like(turn), **cache_kwargs(cache), **kwargs)
        assert cache.memory_report().extra_bytes == 0
        assert reachable_tensor_bytes(cache) == cache.memory_report().total_bytes


def test_speculation_still_exact_after_recording_rules(model_name):
    """The recording rules (a crop releases the kept window, an un-cropped step ends recording) keep assisted
    decoding exact: tokens equal DynamicCache's."""
    model = MODEL_BUILDERS[model_name](window=4)
    prompt = torch.cat([tokens(6, seed=1)] * 3, 1)
    kwargs = dict(
        input_ids=prompt,
        attention_mask=torch.ones_like(prompt),
        do_sample=False,
        max_new_tokens=20,
        min_new_tokens=20,
        pad_token_id=0,
        prompt_lookup_num_tokens=5,
    )
    with torch.no_grad():
        ring = model.generate(**kwargs, **cache_kwargs(HybridRingCache(model.config)))
        assert torch.equal(ring, model.generate(**kwargs, **cache_kwargs(DynamicCache(config=model.config))))


# --- a config whose window disagrees with the model's ------------------------------------------------------------------
def test_cache_window_smaller_than_model_raises(model_name):
    """A cache built from a config with a smaller window than the model's mask: a clear error at the first step
    that would need an overwritten key (never wrong logits), and the cache is unchanged."""
    model = MODEL_BUILDERS[model_name](window=6)
    small = copy.deepcopy(model.config)
    small.sliding_window = 4
    cache = HybridRingCache(small)
    chunked_logits(model, cache, tokens(20)[:, :8], [8])
    before = snapshot(cache)
    with pytest.raises(WindowMismatchError, match="sliding_window=6"):
        chunked_logits(model, cache, tokens(20)[:, 8:9], [1])
    assert_unchanged(before, cache)


def test_cache_window_larger_than_model_is_exact(model_name):
    """A larger window than the model's only keeps more slots: still exact."""
    model = MODEL_BUILDERS[model_name](window=4)
    large = copy.deepcopy(model.config)
    large.sliding_window = 6
    cache = HybridRingCache(large)
    ids = tokens(20)
    assert_close(chunked_logits(model, cache, ids, [7] + [1] * 13), no_cache_logits(model, ids), "larger window")


@pytest.mark.parametrize("fixed", [False, True], ids=["growing", "fixed"])
def test_all_sliding_model_full_mask_request_is_harmless(fixed):
    """A Gemma 3 with only sliding layers still builds a full-attention mask, which transformers sizes against layer
    0 (a ring) for want of a full layer: unused, it must not trip the window check; results stay exact."""
    model = tiny_gemma3(window=4, layers=2)
    assert set(model.config.layer_types) == {"sliding_attention"}
    ids = tokens(16, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    cache = HybridRingCache(model.config, max_cache_len=32 if fixed else None)
    got = chunked_logits(model, cache, ids, [6, 1, 1, 1, 3, 1, 1, 1, 1], mask)
    expected = no_cache_logits(model, ids, mask)
    assert_close(got[mask.bool()], expected[mask.bool()], "all sliding")


# --- prepared 4D masks are refused after the wrap, even after an exact crop -------------------------------------------
def test_prepared_4d_mask_refused_after_crop():
    model = tiny_gemma3(window=3)
    cache = HybridRingCache(model.config)
    ids = tokens(9)
    chunked_logits(model, cache, ids[:, :7], [6, 1])  # the last step was a wrapped one-token step
    cache.crop(-1)  # exact: back to before that step
    before = snapshot(cache)
    mask_4d = torch.ones(1, 1, 1, 7, dtype=torch.bool)
    with pytest.raises(RuntimeError, match="4D attention mask"), torch.no_grad():
        model(input_ids=ids[:, 6:7], attention_mask=mask_4d, **cache_kwargs(cache))
    assert_unchanged(before, cache)
    assert_close(chunked_logits(model, cache, ids[:, 6:], [1, 1, 1]), no_cache_logits(model, ids)[:, 6:], "resume")


# --- mask functions registered by the user after the cache was made ---------------------------------------------------
def test_mask_function_registered_after_the_cache(model_name):
    """transformers documents `AttentionMaskInterface.register` for custom masks. Registered after the cache was
    made: used before the wrap (time-ordered keys, dense decode masks) and after it (the hook re-wraps it); exact."""
    model = MODEL_BUILDERS[model_name](window=4)
    cache = HybridRingCache(model.config)
    calls = []

    def my_sdpa_mask(*args, **kwargs):
        calls.append(kwargs.get("q_length"))
        return sdpa_mask(*args, **kwargs)

    ids = tokens(14, batch=2)
    previous = AttentionMaskInterface._global_mapping["sdpa"]
    AttentionMaskInterface.register("sdpa", my_sdpa_mask)
    try:
        got = chunked_logits(model, cache, ids, [3, 1, 1, 5, 1, 1, 1, 1])
    finally:
        AttentionMaskInterface.register("sdpa", previous)
        install_mask_hook()
    assert 1 in calls and 3 in calls, "the user's mask function was not used"
    assert_close(got, no_cache_logits(model, ids), "user mask function")


def test_custom_attention_name_registered_later():
    """A new attention implementation with its own mask function: exact while the ring is in time order, then the
    documented `UnsupportedAttentionError` (its mask cannot express ring order), with the cache unchanged."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    model = tiny_gemma3(window=4)
    cache = HybridRingCache(model.config)
    AttentionInterface.register("my_kernel", sdpa_attention_forward)
    AttentionMaskInterface.register("my_kernel", sdpa_mask)
    model.set_attn_implementation("my_kernel")
    ids = tokens(8)
    try:
        got = chunked_logits(model, cache, ids[:, :4], [3, 1])
        model.set_attn_implementation("sdpa")
        assert_close(got, no_cache_logits(model, ids)[:, :4], "before the wrap")
        model.set_attn_implementation("my_kernel")
        before = snapshot(cache)
        with pytest.raises(UnsupportedAttentionError, match="my_kernel"):
            chunked_logits(model, cache, ids[:, 4:6], [1, 1])
        assert_unchanged(before, cache)
    finally:
        model.set_attn_implementation("sdpa")


# --- attention maps in time order ------------------------------------------------------------------------------------
def test_attention_maps_in_time_order(model_name):
    """`output_attentions=True` after the wrap: sliding layers attend over the ring in slot order;
    `attention_in_time_order(weights, cache.key_positions(i))` equals the no-cache forward's weights row."""
    model = MODEL_BUILDERS[model_name](window=4, attn="eager")
    ids = tokens(15)
    cache = HybridRingCache(model.config)
    chunked_logits(model, cache, ids[:, :14], [9] + [1] * 5)
    with torch.no_grad():
        step = model(input_ids=ids[:, 14:], **cache_kwargs(cache), output_attentions=True)
        full = model(input_ids=ids, use_cache=False, output_attentions=True)
    checked = 0
    for layer_idx, weights in enumerate(step.attentions):
        store = layer_idx if cache.layer_kinds[layer_idx] != "shared" else _store_layer(model, cache, layer_idx)
        positions = cache.key_positions(store)
        if cache.layer_kinds[store] == "sliding_attention":
            assert positions.tolist() != sorted(positions.tolist()), "the ring should be out of time order here"
        timed = attention_in_time_order(weights, positions, length=15)
        difference = (timed[:, :, 0] - full.attentions[layer_idx][:, :, 14]).abs().max().item()
        assert difference < 1e-5, f"layer {layer_idx}: {difference:.3g}"
        checked += 1
    assert checked == len(cache.layers)
    with pytest.raises(ValueError, match="key_positions"):
        attention_in_time_order(step.attentions[0], torch.arange(3))


def _store_layer(model, cache, layer_idx: int) -> int:
    """The storing layer whose keys a KV-shared Gemma 4 layer reuses: the last non-shared layer of its type."""
    layer_type = model.config.layer_types[layer_idx]
    return max(
        i for i, kind in enumerate(cache.layer_kinds) if kind != "shared" and model.config.layer_types[i] == layer_type
    )


# --- gradients through the cache -------------------------------------------------------------------------------------
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_gradients_through_the_cache(model_name, attn):
    """Chunked training (a loss over chunks fed through one cache, keys not detached): the gradients equal
    DynamicCache's and the no-cache forward's, through several wraps; `backward()` never trips over in-place
    writes."""
    model = MODEL_BUILDERS[model_name](window=4, attn=attn)
    ids = tokens(18, batch=2)
    schedule = [5, 3, 1, 1, 6, 1, 1]

    def gradients(cache) -> dict[str, torch.Tensor]:
        model.zero_grad()
        if cache is None:
            logits = model(input_ids=ids, use_cache=False).logits
        else:
            logits, position = [], 0
            for size in schedule:
                logits.append(model(input_ids=ids[:, position : position + size], **cache_kwargs(cache)).logits)
                position += size
            logits = torch.cat(logits, 1)
        (logits.square().mean()).backward()
        return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    expected = gradients(None)
    for cache in (HybridRingCache(model.config), DynamicCache(config=model.config)):
        got = gradients(cache)
        assert got.keys() == expected.keys()
        worst = max((got[name] - expected[name]).abs().max().item() for name in expected)
        assert worst < 1e-5, f"{type(cache).__name__}: gradient differs by {worst:.3g}"


def test_fixed_capacity_refuses_gradients_clearly():
    model = tiny_gemma3(window=4)
    cache = HybridRingCache(model.config, max_cache_len=16)
    with pytest.raises(RuntimeError, match="cannot record gradients"):
        model(input_ids=tokens(5), **cache_kwargs(cache))
