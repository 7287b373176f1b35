"""Attention on the compressed full layers' codes (`hybrid_cache.code_attention`).

1. The kernel equals the straightforward computation (dequantize the history, attend with the query rounded as the
   kernel rounds it) over random geometries: GQA ratios, head and group sizes, int8 / int4, key calibration and
   rotation on / off, boolean / additive / no masks, soft-capping, batch > 1, one and a few query tokens. The
   reference's dequantization is itself tied to today's path (the layer's dequantized keys and values + SDPA).
2. Tiny Gemma 3 / Gemma 4 models: `generate` (greedy, beams, assisted, prompt lookup) through attention on the codes
   gives the tokens of today's dequantize-then-SDPA path; with the two-part query its logits too.
3. The switch: follows the model's attention implementation, reversible, other caches untouched; misuse raises.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
from builders import (
    VOCAB,
    chunked_logits,
    decode_step_mask,
    generate_case_params,
    get_model,
    prompt,
    reference_cache_kwargs,
    repetitive_prompt,
    tiny_gemma3,
    tiny_gemma4,
)
from transformers import DynamicCache

import hybrid_cache.code_attention as code_attention
from hybrid_cache import HybridRingCache, use_code_attention
from hybrid_cache.code_attention import CODE_ATTENTION, CompressedKV, code_domain_attention, reference_attention
from hybrid_cache.compat import cache_kwargs
from hybrid_cache.errors import CodeAttentionError
from hybrid_cache.quantized import DequantWorkspace, QuantizedFullLayer

pytestmark = pytest.mark.usefixtures("one_thread")


# --- 1. the kernel ----------------------------------------------------------------------------------------------------
def random_case(seed: int) -> dict:
    rng = random.Random(seed)
    head_dim = rng.choice([8, 16, 32, 64, 128])
    return {
        "mode": rng.choice(["int8", "int4"]),
        "batch": rng.randint(1, 3),
        "kv_heads": rng.choice([1, 2]),
        "rep": rng.choice([1, 2, 4]),
        "head_dim": head_dim,
        "group": rng.choice([g for g in (8, 16, 32, 64) if g <= head_dim]),
        "history": rng.randint(1, 300),
        "query": rng.choice([1, 1, 2, 3, 5]),
        "rotate": rng.random() < 0.3,
        "calibration": rng.random() < 0.7,
        "mask": rng.choice(["bool", "float", "none"]),
        "softcap": rng.choice([None, None, 20.0]),
        "dtype": rng.choice([torch.float32, torch.bfloat16]),
    }


def build_step(case: dict, seed: int):
    """A layer holding `history` random tokens (keys with offset and outlier channels, like Gemma's), the step's
    handles, a copy of the layer that dequantizes, its dequantized keys / values, the query and the mask."""
    generator = torch.Generator().manual_seed(seed)
    b, h, d, dtype = case["batch"], case["kv_heads"], case["head_dim"], case["dtype"]

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(dtype)

    channel_scale = 1 + 5 * torch.rand(d, generator=generator)
    layer = QuantizedFullLayer(
        case["mode"], DequantWorkspace(), case["group"], case["rotate"], key_calibration=case["calibration"]
    )
    keys = (torch.randn(b, h, case["history"], d, generator=generator) * channel_scale + 2).to(dtype)
    layer.update(keys, randn(b, h, case["history"], d))
    dequantizing = copy.deepcopy(layer)
    new_keys, new_values = randn(b, h, case["query"], d), randn(b, h, case["query"], d)
    handle_keys, handle_values = layer.update(new_keys, new_values, return_codes=True)
    dense_keys, dense_values = dequantizing.update(new_keys, new_values)
    query = randn(b, h * case["rep"], case["query"], d)
    mask, allowed = decode_step_mask(b, case["history"], case["query"], case["mask"], dtype, padding=3)
    return handle_keys, handle_values, dense_keys, dense_values, query, mask, allowed


@pytest.mark.parametrize("seed", range(40))
def test_kernel_equals_the_dequantized_reference_with_the_same_query_rounding(seed):
    case = random_case(seed)
    handle_keys, _, _, _, query, mask, _ = build_step(case, seed)
    history = handle_keys.history
    for parts in (1, 2):
        actual = code_domain_attention(query, history, mask, scaling=0.25, softcap=case["softcap"], query_parts=parts)
        expected = reference_attention(query, history, mask, scaling=0.25, softcap=case["softcap"], query_parts=parts)
        assert actual.shape == (case["batch"], case["query"], query.shape[1], case["head_dim"])
        assert actual.dtype == query.dtype
        tolerance = 1e-5 if case["dtype"] == torch.float32 else 2e-2  # bf16: the output's own rounding
        torch.testing.assert_close(actual.float(), expected.float(), rtol=0, atol=tolerance * expected.abs().max())


@pytest.mark.parametrize("seed", range(12))
def test_kernel_tiles_cover_the_history_whatever_its_length(seed, monkeypatch):
    """Tiles of a few tokens (the real ones are thousands): histories of many tiles and a partial last tile give the
    same result as one tile, for the scores (int4 unpacked per batch row and tile) and the values."""
    case = random_case(seed) | {"history": random.Random(seed).randint(20, 300)}
    handle_keys, _, _, _, query, mask, _ = build_step(case, seed)
    history = handle_keys.history
    whole = code_domain_attention(query, history, mask, softcap=case["softcap"], query_parts=2)
    monkeypatch.setattr(code_attention, "KEY_TILE", random.Random(seed).randint(3, 17))
    monkeypatch.setattr(code_attention, "VALUE_TILE", random.Random(seed + 1).randint(3, 17))
    tiled = code_domain_attention(query, history, mask, softcap=case["softcap"], query_parts=2)
    expected = reference_attention(query, history, mask, softcap=case["softcap"], query_parts=2)
    tolerance = 1e-5 if case["dtype"] == torch.float32 else 2e-2
    torch.testing.assert_close(tiled.float(), whole.float(), rtol=0, atol=tolerance * expected.abs().max())
    torch.testing.assert_close(tiled.float(), expected.float(), rtol=0, atol=tolerance * expected.abs().max())


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_extreme_codes_do_not_overflow_the_integer_products(mode):
    """The largest products the kernel can form: a 512-channel group of codes at the end of their range (int4 -8,
    carried as -128 after unpacking; int8 -127) against a query at +-127 in both parts of a two-part query."""
    d, length = 512, 40
    layer = QuantizedFullLayer(mode, DequantWorkspace(), group_size=512, key_calibration=False)
    keys = -torch.ones(1, 1, length, d)
    keys[..., 1::2, :] = 1.0  # alternate -1 / +1 tokens: both ends of the code range
    layer.update(keys, keys.clone())
    query_keys = torch.ones(1, 1, 1, d)
    handle_keys, _ = layer.update(query_keys, query_keys.clone(), return_codes=True)
    query = torch.full((1, 1, 1, d), 3.0)
    query[..., ::2] += 1.0 / 512  # a residual part that is not zero
    for parts in (1, 2):
        actual = code_domain_attention(query, handle_keys.history, None, query_parts=parts)
        expected = reference_attention(query, handle_keys.history, None, query_parts=parts)
        torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5)


def test_float16_values_with_small_scales_keep_their_precision():
    """float16 values of magnitude 1e-3 have group scales near float16's smallest normal number: taking the int4
    unpacking's factor 16 out of them must not round them to subnormals (it is done in float32)."""
    case = {
        "mode": "int4",
        "batch": 1,
        "kv_heads": 1,
        "rep": 2,
        "head_dim": 32,
        "group": 32,
        "history": 50,
        "query": 1,
        "rotate": False,
        "calibration": True,
        "mask": "none",
        "softcap": None,
        "dtype": torch.float16,
    }
    handle_keys, _, _, _, query, mask, _ = build_step(case, 3)
    history = handle_keys.history
    history.value_scales.mul_(1e-3)  # as if the values had been 1000 times smaller
    history.current_values.mul_(1e-3)
    actual = code_domain_attention(query, history, mask).float()
    expected = reference_attention(query, history, mask).float()
    torch.testing.assert_close(actual, expected, rtol=2e-3, atol=0)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_gemma4_full_layer_geometry(mode):
    """Gemma 4's full layers: one KV head of 512 channels (keys = values before the norms), 8 query heads."""
    case = {
        "mode": mode,
        "batch": 2,
        "kv_heads": 1,
        "rep": 8,
        "head_dim": 512,
        "group": 64,
        "history": 257,
        "query": 2,
        "rotate": False,
        "calibration": True,
        "mask": "bool",
        "softcap": None,
        "dtype": torch.float32,
    }
    handle_keys, _, dense_keys, dense_values, query, mask, allowed = build_step(case, 11)
    expected = torch.nn.functional.scaled_dot_product_attention(
        query, dense_keys.expand(-1, 8, -1, -1), dense_values.expand(-1, 8, -1, -1), attn_mask=allowed
    ).transpose(1, 2)
    two_parts = code_domain_attention(query, handle_keys.history, mask, query_parts=2)
    assert (two_parts - expected).abs().max() < 2e-3 * expected.abs().max()
    one_part = code_domain_attention(query, handle_keys.history, mask)
    torch.testing.assert_close(one_part, reference_attention(query, handle_keys.history, mask), rtol=0, atol=1e-5)


@pytest.mark.parametrize("seed", range(12))
def test_reference_dequantizes_like_todays_path(seed):
    """With an exact query, the oracle is today's path: the layer's dequantized keys / values and SDPA."""
    case = random_case(seed) | {"dtype": torch.float32, "softcap": None}
    handle_keys, _, dense_keys, dense_values, query, mask, allowed = build_step(case, seed)
    rep = case["rep"]
    expected = torch.nn.functional.scaled_dot_product_attention(
        query,
        dense_keys.repeat_interleave(rep, 1),
        dense_values.repeat_interleave(rep, 1),
        attn_mask=allowed,
        scale=0.25,
    ).transpose(1, 2)
    exact_query = reference_attention(query, handle_keys.history, mask, scaling=0.25, query_parts=None)
    torch.testing.assert_close(exact_query, expected, rtol=0, atol=1e-5)
    # The two-part query stays within a few 1e-4 of it, and the int8 query is measurably further away (so the
    # rounding is really modelled, not a no-op).
    two_parts = code_domain_attention(query, handle_keys.history, mask, scaling=0.25, query_parts=2)
    assert (two_parts - expected).abs().max() < 2e-3 * expected.abs().max()


def test_query_rounding_is_visible_and_two_parts_shrink_it():
    case = {
        "mode": "int8",
        "batch": 2,
        "kv_heads": 1,
        "rep": 4,
        "head_dim": 64,
        "group": 64,
        "history": 200,
        "query": 1,
        "rotate": False,
        "calibration": True,
        "mask": "bool",
        "softcap": None,
        "dtype": torch.float32,
    }
    handle_keys, _, _, _, query, mask, _ = build_step(case, 0)
    exact = reference_attention(query, handle_keys.history, mask, query_parts=None)
    one = (code_domain_attention(query, handle_keys.history, mask, query_parts=1) - exact).abs().max()
    two = (code_domain_attention(query, handle_keys.history, mask, query_parts=2) - exact).abs().max()
    assert two < one / 10 and one > 1e-6


def test_fully_masked_rows_give_zeros_and_bad_masks_are_refused():
    case = random_case(3) | {"mask": "bool", "query": 1}
    handle_keys, _, _, _, query, mask, _ = build_step(case, 3)
    nothing = torch.zeros_like(mask)
    assert torch.equal(
        code_domain_attention(query, handle_keys.history, nothing),
        torch.zeros_like(code_domain_attention(query, handle_keys.history, mask)),
    )
    with pytest.raises(ValueError, match="mask must cover the layer's history"):
        code_domain_attention(query, handle_keys.history, mask[..., 1:])
    with pytest.raises(ValueError, match="query_parts"):
        code_domain_attention(query, handle_keys.history, mask, query_parts=3)


def test_handles_refuse_every_other_use():
    case = random_case(5)
    handle_keys, handle_values, *_ = build_step(case, 5)
    assert isinstance(handle_keys, CompressedKV) and handle_keys.shape[-2] == case["history"] + case["query"]
    assert "CompressedKV(keys" in repr(handle_keys)
    for misuse in (
        lambda: handle_keys + 1,
        lambda: handle_keys.float(),
        lambda: handle_keys[:, :, :2],
        lambda: torch.nn.functional.scaled_dot_product_attention(handle_keys, handle_keys, handle_values),
    ):
        with pytest.raises(CodeAttentionError, match="hybrid_cache_sdpa"):
            misuse()


def test_prefill_chunks_and_empty_layers_keep_dequantized_tensors():
    layer = QuantizedFullLayer("int8", DequantWorkspace(), 8)
    keys, values = layer.update(torch.randn(1, 1, 5, 16), torch.randn(1, 1, 5, 16), return_codes=True)
    assert type(keys) is torch.Tensor  # the first update: nothing stored yet
    long = code_attention.MAX_CODE_QUERY_LENGTH + 1
    keys, _ = layer.update(torch.randn(1, 1, long, 16), torch.randn(1, 1, long, 16), return_codes=True)
    assert type(keys) is torch.Tensor and keys.shape[-2] == 5 + long
    keys, _ = layer.update(torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16), return_codes=True)
    assert isinstance(keys, CompressedKV)
    fp8 = QuantizedFullLayer("fp8", DequantWorkspace(), 8)
    fp8.update(torch.randn(1, 1, 5, 16), torch.randn(1, 1, 5, 16))
    keys, _ = fp8.update(torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16), return_codes=True)
    assert type(keys) is torch.Tensor


# --- 2. the models --------------------------------------------------------------------------------------------------
WINDOW = 6
BUILDERS = {"gemma3": tiny_gemma3, "gemma4": tiny_gemma4}


def code_attention_model(name: str):
    return get_model(name, window=WINDOW, attn=CODE_ATTENTION)


def caches(model, mode: str, parts: int) -> tuple[HybridRingCache, HybridRingCache]:
    """(attention on the codes with `parts`, today's dequantizing path) for the same storage."""
    codes = HybridRingCache(model.config, full_layer_quantization=mode)
    for layer in codes.layers:
        if isinstance(layer, QuantizedFullLayer):
            layer.code_query_parts = parts
    return codes, HybridRingCache(model.config, full_layer_quantization=mode, full_layer_code_attention=False)


GENERATE_CASES = {
    "greedy": (lambda: prompt(2, pad=9), {"do_sample": False}),
    "beams3": (prompt, {"num_beams": 3, "do_sample": False}),
    "beams3_return2": (prompt, {"num_beams": 3, "num_return_sequences": 2, "do_sample": False}),
    "prompt_lookup": (repetitive_prompt, {"do_sample": False, "prompt_lookup_num_tokens": 4}),
    "assisted": (prompt, {"do_sample": False, "assistant": True}),
}


@torch.no_grad()
def run_generate(model, inputs, cache, new_tokens=20, **kwargs):
    if kwargs.pop("assistant", False):
        kwargs["assistant_model"] = tiny_gemma3(window=WINDOW, layers=2, seed=7)
    torch.manual_seed(7)
    out = model.generate(
        **inputs,
        **cache_kwargs(cache),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        pad_token_id=0,
        return_dict_in_generate=True,
        output_logits=True,
        **kwargs,
    )
    return out.sequences, torch.stack(out.logits, 1)


@pytest.fixture
def count_code_steps(monkeypatch):
    calls = []
    kernel = code_attention.code_domain_attention

    def counting(*args, **kwargs):
        calls.append(args[0].shape[2])
        return kernel(*args, **kwargs)

    monkeypatch.setattr(code_attention, "code_domain_attention", counting)
    return calls


@pytest.mark.parametrize("model_name", list(BUILDERS))
@pytest.mark.parametrize("case", generate_case_params(GENERATE_CASES))
@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("parts", [1, 2])
def test_generate_on_codes_equals_the_reference(model_name, mode, case, parts, count_code_steps, monkeypatch):
    """Same tokens (and logits) as the same cache whose attention on the codes is replaced by `reference_attention`
    (dequantize, attend in float64 with the same query rounding); with the two-part query also the same tokens as
    today's dequantize-then-SDPA path."""
    make_inputs, kwargs = GENERATE_CASES[case]
    if "assistant" in kwargs and model_name == "gemma4":
        pytest.skip("the tiny assistant is a Gemma 3 model; Gemma 4 is covered by prompt lookup")
    model, inputs = code_attention_model(model_name), make_inputs()
    on_codes, dequantizing = caches(model, mode, parts)
    tokens, logits = run_generate(model, inputs, on_codes, **kwargs)
    assert count_code_steps, "the compressed layers never attended on their codes"
    monkeypatch.setattr(code_attention, "code_domain_attention", reference_attention)
    expected_tokens, expected_logits = run_generate(model, inputs, caches(model, mode, parts)[0], **kwargs)
    assert torch.equal(tokens, expected_tokens)
    beams = "num_beams" in kwargs  # beam logits are per-beam scores, compared through the tokens
    if not beams:
        # float32 against float64: a query element within float32 noise of a rounding boundary rounds either way
        # (one int8 step of one element), hence the looser bound for the one-part query.
        torch.testing.assert_close(logits, expected_logits, rtol=0, atol=1e-5 if parts == 2 else 1e-3)
    if parts == 2:
        dequantized_tokens, dequantized_logits = run_generate(model, inputs, dequantizing, **kwargs)
        assert torch.equal(tokens, dequantized_tokens)
        if not beams:
            torch.testing.assert_close(logits, dequantized_logits, rtol=0, atol=1e-4)


@pytest.mark.parametrize("model_name", list(BUILDERS))
def test_chunked_steps_mix_both_paths(model_name):
    """Prefill chunks (dequantizing) and decode steps of 1-3 tokens (codes), with left padding."""
    model = code_attention_model(model_name)
    ids = torch.randint(3, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    schedule = [17, 1, 3, 1, 2, 15, 1]
    on_codes, dequantizing = caches(model, "int8", 2)
    actual = chunked_logits(model, on_codes, ids, schedule, mask)
    expected = chunked_logits(model, dequantizing, ids, schedule, mask)
    real = mask.bool()
    torch.testing.assert_close(actual[real], expected[real], rtol=0, atol=1e-4)


# --- 3. the switch ----------------------------------------------------------------------------------------------------
def test_switch_follows_the_model_and_is_reversible(count_code_steps):
    model = tiny_gemma3(window=WINDOW)  # sdpa
    inputs = prompt(1)
    cache = HybridRingCache(model.config, full_layer_quantization="int8")
    assert not cache.attends_on_codes()
    plain, _ = run_generate(model, inputs, cache)
    assert not count_code_steps
    with use_code_attention(model):
        assert model.config._attn_implementation == CODE_ATTENTION
        cache = HybridRingCache(model.config, full_layer_quantization="int8")
        assert cache.attends_on_codes()
        run_generate(model, inputs, cache)
        assert count_code_steps
    assert model.config._attn_implementation == "sdpa"
    again, _ = run_generate(model, inputs, HybridRingCache(model.config, full_layer_quantization="int8"))
    assert torch.equal(again, plain)


@pytest.mark.parametrize("model_name", list(BUILDERS))
def test_other_caches_are_untouched_by_the_attention_function(model_name):
    """Exact caches (and the model without cache) give bit-identical logits with "hybrid_cache_sdpa" and "sdpa"."""
    ids = torch.randint(3, VOCAB, (2, 24), generator=torch.Generator().manual_seed(2))
    with_ours = code_attention_model(model_name)
    with_sdpa = BUILDERS[model_name](window=WINDOW, attn="sdpa")
    for make in (lambda m: HybridRingCache(m.config), lambda m: DynamicCache(config=m.config), lambda m: None):
        schedule = [10, 1, 1, 12]
        outputs = []
        for model in (with_ours, with_sdpa):
            cache = make(model)
            if cache is None:
                outputs.append(model(input_ids=ids, **reference_cache_kwargs(model)).logits)
            else:
                outputs.append(chunked_logits(model, cache, ids, schedule))
        assert torch.equal(outputs[0], outputs[1])


def test_misuse_raises_clear_errors():
    model = tiny_gemma3(window=WINDOW)  # sdpa: cannot read the handles
    forced = HybridRingCache(model.config, full_layer_quantization="int8", full_layer_code_attention=True)
    with pytest.raises(CodeAttentionError, match="set_attn_implementation"):
        run_generate(model, prompt(1), forced)
    with pytest.raises(ValueError, match="needs full_layer_quantization"):
        HybridRingCache(model.config, full_layer_quantization="fp8", full_layer_code_attention=True)
    with pytest.raises(ValueError, match="needs full_layer_quantization"):
        HybridRingCache(model.config, full_layer_code_attention=True)
    with pytest.raises(ValueError, match="no compileable variant"):
        HybridRingCache(model.config, full_layer_quantization="int8", max_cache_len=64, full_layer_code_attention=True)
    handle_keys, handle_values, *_ = build_step(random_case(1), 1)
    query = torch.randn(handle_keys.shape[0], 2 * handle_keys.shape[1], 1, handle_keys.shape[-1])
    module = torch.nn.Module()
    with pytest.raises(CodeAttentionError, match="no dropout"):
        code_attention.hybrid_cache_attention(module, query, handle_keys, handle_values, None, dropout=0.1)
    with pytest.raises(CodeAttentionError, match="same step"):
        code_attention.hybrid_cache_attention(module, query, handle_keys, torch.zeros(1), None)
    with pytest.raises(CodeAttentionError, match="only the values"):
        code_attention.hybrid_cache_attention(module, query, torch.zeros(1), handle_values, None)


def test_fixed_capacity_and_fp8_caches_keep_dequantizing_under_the_code_attention_model(count_code_steps):
    model = code_attention_model("gemma3")
    for cache in (
        HybridRingCache(model.config, full_layer_quantization="int8", max_cache_len=64),
        HybridRingCache(model.config, full_layer_quantization="fp8"),
    ):
        run_generate(model, prompt(1), cache, new_tokens=5)
    assert not count_code_steps
