"""Compressed full-attention layers (`full_layer_quantization`): the codec's error bounds, exact storage contents,
and every cache operation `generate` uses.

Oracles:
- the codec against formulas written out here (llama.cpp q8_0 / q4_0 rules, torch's float8 cast) and per-element
  error bounds (half a quantization step);
- the layers against exactly representable values (integers with a group maximum of 127 for int8, of -8 for int4),
  for which the compressed cache must return its inputs exactly (token ids as values, as in test_layers.py);
- the model-level plumbing (workspace sharing, chunked prefill, crop, beams, Gemma 4's KV-shared layers, compile)
  against a *fake-quantized* reference: exact growing storage that hands back `dequantize(quantize(history))`. The
  compressed cache must give the same logits (fp32, 1e-5) and the same tokens in every generate mode.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from builders import (
    MODEL_BUILDERS,
    VOCAB,
    chunked_logits,
    generate_case_params,
    get_model,
    no_cache_logits,
    prompt,
    random_schedule,
    repetitive_prompt,
    seeded_chunk_sizes,
)
from transformers import DynamicCache

from hybrid_cache import HybridRingCache
from hybrid_cache import quantizer as quantizer_module
from hybrid_cache.compat import cache_kwargs
from hybrid_cache.full import GrowableFullLayer
from hybrid_cache.quantized import DequantWorkspace, QuantizedFullLayer, StaticQuantizedFullLayer
from hybrid_cache.quantizer import KVQuantizer, hadamard_matrix
from hybrid_cache.ring import RingSlidingLayer
from hybrid_cache.tools.compare import kv_bytes_held

MODES = ("int8", "int4", "fp8")
WINDOW = 6


pytestmark = pytest.mark.usefixtures("one_thread")


# --- 1. the codec ----------------------------------------------------------------------------------------------------
def random_kv(seed: int, shape=(2, 3, 7, 64), dtype=torch.float32) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=generator) * torch.rand(shape[:-1] + (1,), generator=generator) * 20
    x[..., 3] *= 8  # an outlier channel, as Gemma's keys have
    return x.to(dtype)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("group", [8, 32, 64])
def test_int8_matches_q8_0_formula_and_half_step_bound(seed, group):
    x = random_kv(seed)
    quantizer = KVQuantizer("int8", 64, group_size=group)
    codes, scales = quantizer.quantize(x)
    grouped = x.unflatten(-1, (64 // group, group))
    expected_scales = grouped.abs().amax(-1) / 127
    torch.testing.assert_close(scales, expected_scales, rtol=0, atol=0)
    expected_codes = torch.round(grouped / expected_scales[..., None]).to(torch.int8).flatten(-2)
    assert torch.equal(codes, expected_codes)
    error = (quantizer.roundtrip(x) - x).abs().unflatten(-1, (64 // group, group))
    assert (error <= expected_scales[..., None] / 2 * (1 + 1e-5)).all()
    assert quantizer.bytes_per_token(4) == 64 + 64 // group * 4


@pytest.mark.parametrize("seed", range(4))
def test_int4_matches_q4_0_formula_extreme_exact_and_half_step_bound(seed):
    x = random_kv(seed)
    quantizer = KVQuantizer("int4", 64, group_size=32)
    codes, scales = quantizer.quantize(x)
    assert codes.dtype == torch.int8 and codes.shape[-1] == 32  # two channels per byte
    grouped = x.unflatten(-1, (2, 32))
    extreme = grouped.gather(-1, grouped.abs().argmax(-1, keepdim=True)).squeeze(-1)
    torch.testing.assert_close(scales, extreme / -8, rtol=0, atol=0)
    restored = quantizer.roundtrip(x).unflatten(-1, (2, 32))
    error = (restored - grouped).abs()
    step = scales.abs()[..., None]
    # Half a step, except where q4_0 saturates: the side opposite the extreme has 7 levels, not 8, so values
    # beyond 7.5 steps clamp to 7 (at most one step off, as in llama.cpp).
    saturated = (grouped / scales[..., None]) > 7.5
    assert (error <= torch.where(saturated, step, step / 2) * (1 + 1e-5)).all()
    # The value of largest magnitude maps to -8 exactly: it comes back unchanged.
    restored_extreme = restored.gather(-1, grouped.abs().argmax(-1, keepdim=True)).squeeze(-1)
    torch.testing.assert_close(restored_extreme, extreme, rtol=1e-6, atol=0)


@pytest.mark.parametrize("seed", range(4))
def test_fp8_is_torch_float8_cast_with_group_scale(seed):
    x = random_kv(seed)
    quantizer = KVQuantizer("fp8", 64, group_size=64)
    codes, scales = quantizer.quantize(x)
    assert codes.dtype == torch.float8_e4m3fn
    expected_scales = x.abs().amax(-1) / 448
    torch.testing.assert_close(scales.squeeze(-1), expected_scales, rtol=0, atol=0)
    restored = quantizer.roundtrip(x)
    expected = (x / expected_scales[..., None]).to(torch.float8_e4m3fn).float() * expected_scales[..., None]
    torch.testing.assert_close(restored, expected, rtol=1e-6, atol=0)
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for values in its normal range, absolute below it.
    bound = torch.maximum(x.abs() * 2**-4, expected_scales[..., None] * 2**-10)
    assert ((restored - x).abs() <= bound * (1 + 1e-5)).all()


@pytest.mark.parametrize("mode", MODES)
def test_rotation_is_orthogonal_and_keeps_the_error_bound(mode):
    hadamard = hadamard_matrix(16)
    torch.testing.assert_close(hadamard @ hadamard, torch.eye(16), rtol=0, atol=1e-6)
    x = random_kv(1)
    plain = KVQuantizer(mode, 64, group_size=16)
    rotated = KVQuantizer(mode, 64, group_size=16, rotate=True)
    for quantizer in (plain, rotated):
        # Orthogonal: the error norm per group is that of the rotated coordinates, each within half a step.
        error = (quantizer.roundtrip(x) - x).unflatten(-1, (4, 16)).norm(dim=-1)
        _, scales = quantizer.quantize(x)
        step = scales.abs() * (1 if mode != "fp8" else 448 * 2**-4)
        assert (error <= step * math.sqrt(16) / 2 * (1 + 1e-4) + 1e-6).all()
    if mode == "int4":  # the point of the rotation: the outlier channel no longer sets every group's step
        assert (rotated.roundtrip(x) - x).norm() < (plain.roundtrip(x) - x).norm()


@pytest.mark.parametrize("seed", range(4))
def test_tiled_rotation_of_a_dequantized_history_equals_the_whole_product(seed, monkeypatch):
    """The dequantizing path rotates in tiles of `ROTATION_TILE` tokens, in place, inside a workspace slice (rows
    not contiguous with each other): every token equals the one-product rotation, across tile ends."""
    rng = random.Random(seed)
    monkeypatch.setattr(quantizer_module, "ROTATION_TILE", rng.randint(1, 9))
    batch, heads, length, group = rng.randint(1, 3), rng.randint(1, 2), rng.randint(1, 30), rng.choice([4, 8, 16])
    quantizer = KVQuantizer(rng.choice(["int8", "int4"]), 2 * group, group_size=group, rotate=True)
    codes, scales = quantizer.quantize(random_kv(seed, (batch, heads, length, 2 * group)))
    workspace = torch.full((batch, heads, length + 5, 2 * group), float("nan"))
    out = workspace[:, :, :length]
    quantizer.dequantize_into(codes, scales, out)
    unrotated = KVQuantizer(quantizer.mode, 2 * group, group_size=group)
    expected = torch.empty_like(out)
    unrotated.dequantize_into(codes, scales, expected)
    expected = (expected.unflatten(-1, (2, group)) @ hadamard_matrix(group)).flatten(-2)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    assert workspace[:, :, length:].isnan().all()  # nothing written past the slice


@pytest.mark.parametrize(
    ("options", "rotated"),
    [
        ({"full_layer_quantization": "int4"}, True),  # the default: int4 rotates (its perplexity goal needs it)
        ({"full_layer_quantization": "int8"}, False),
        ({"full_layer_quantization": "fp8"}, False),
        ({"full_layer_quantization": "int4", "full_layer_rotation": False}, False),
        ({"full_layer_quantization": "int8", "full_layer_rotation": True}, True),
        ({"full_layer_quantization": "int4", "full_layer_group_size": 24}, False),  # not a power of two
        ({"full_layer_quantization": "int4", "full_layer_group_size": 8, "max_cache_len": 16}, True),
        ({}, False),
    ],
)
def test_rotation_default_is_resolved_once_for_int4_only(options, rotated):
    cache = HybridRingCache(get_model("gemma3").config, **options)
    assert cache.options.full_layer_rotation is rotated
    compressed = [layer for layer in cache.layers if isinstance(layer, QuantizedFullLayer)]
    assert all(layer.rotate is rotated for layer in compressed)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zeros_stay_zero_and_scales_use_the_model_dtype(mode, dtype):
    x = random_kv(2, dtype=dtype)
    x[0, 0, 0] = 0
    quantizer = KVQuantizer(mode, 64)
    codes, scales = quantizer.quantize(x)
    assert scales.dtype == dtype
    restored = quantizer.roundtrip(x)
    assert restored.dtype == dtype and torch.isfinite(restored).all()
    assert torch.equal(restored[0, 0, 0], torch.zeros(64, dtype=dtype))


def test_group_size_that_does_not_divide_the_head_uses_the_gcd():
    assert KVQuantizer("int8", 80, group_size=64).group_size == 16
    assert KVQuantizer("int8", 8, group_size=64).group_size == 8


# --- 2. exact layer contents (values representable exactly) ---------------------------------------------------------
def representable(values: list[list[int]], mode: str) -> torch.Tensor:
    """`[1, 1, tokens, 4]` tensor whose rows are `values` (token ids), each completed so the group extreme is exact:
    channel 3 holds 127 (int8) or -8 (int4); the id sits in channel 0 (int8) or channels 0 and 2 (int4 nibbles).
    """
    rows = []
    for token in values:
        token = token[0]
        if mode == "int8":
            rows.append([token, -token, 0, 127])
        else:
            rows.append([token % 8, -(token % 8), token % 7 - 3, -8])
    return torch.tensor(rows, dtype=torch.float32)[None, None]


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_layer_returns_exact_contents_through_prefill_decode_crop_and_beams(mode):
    """prefill [1,2,3]; decode 4, 5 -> [1..5]; crop(-2) -> [1,2,3]; decode 9 -> [1,2,3,9]; reorder beams.
    (Uncalibrated: the representable values are those of the plain codec; calibration is tested below.)"""
    layer = QuantizedFullLayer(mode, DequantWorkspace(), group_size=4, key_calibration=False)

    def step(ids):
        data = representable([[i] for i in ids], mode).expand(2, 1, -1, -1).clone()
        data[1] *= -1 if mode == "int8" else 1  # the second sequence differs (beam reorder below)
        keys, values = layer.update(data, data + 0)
        return keys, data

    keys, _ = step([1, 2, 3])
    for token in (4, 5):
        keys, _ = step([token])
    expected = representable([[i] for i in range(1, 6)], mode)
    assert keys[0:1].tolist() == expected.tolist()
    layer.crop(-2)
    assert layer.get_seq_length() == 3
    keys, _ = step([9])
    assert keys[0:1].tolist() == representable([[1], [2], [3], [9]], mode).tolist()
    before = keys.clone()
    layer.reorder_cache(torch.tensor([1, 0]))
    keys, _ = step([7])
    assert keys[:, :, :4].tolist() == before.flip(0).tolist()
    layer.batch_repeat_interleave(2)
    assert layer.batch_size == 4 and layer.nbytes() > 0
    layer.batch_select_indices(torch.tensor([0, 3]))
    assert layer.batch_size == 2


@pytest.mark.parametrize("mode", MODES)
def test_step_tokens_are_returned_exact_history_dequantized(mode):
    layer = QuantizedFullLayer(mode, DequantWorkspace(), group_size=8)
    first, second = random_kv(3, (1, 2, 5, 16)), random_kv(4, (1, 2, 1, 16))
    keys, values = layer.update(first, first * 2)
    assert torch.equal(keys, first) and torch.equal(values, first * 2)
    keys, values = layer.update(second, second)
    quantizer = KVQuantizer(mode, 16, group_size=8)
    assert torch.equal(keys[:, :, :5], quantizer.roundtrip(first, KVQuantizer.calibrate(first)))
    assert torch.equal(keys[:, :, 5:], second)
    assert torch.equal(values[:, :, :5], quantizer.roundtrip(first * 2))  # values: no calibration


def gemma_like_keys(seed: int, shape=(2, 1, 64, 64)) -> torch.Tensor:
    """Keys with what makes Gemma's hard to quantize per token: channels with a large constant offset and a few
    with a large spread (the real model: |k| up to 100 against a median channel RMS of 1-2)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=generator)
    x[..., :4] = x[..., :4] * 3 + 40
    x[..., 10:12] *= 25
    return x


def test_calibration_formula():
    x = gemma_like_keys(0)
    shift, scale = KVQuantizer.calibrate(x)
    assert shift.shape == scale.shape == (2, 1, 1, 64)
    torch.testing.assert_close(shift, x.mean(dim=-2, keepdim=True))
    spread = x.std(dim=-2, unbiased=False, keepdim=True)
    floor = spread.mean(dim=-1, keepdim=True) * 0.2
    torch.testing.assert_close(scale, torch.maximum(spread, floor))
    # A one-token sample has no spread: scale 1 (the codes are those of x - shift), never a division by zero.
    shift, scale = KVQuantizer.calibrate(x[:, :, :1])
    assert torch.equal(scale, torch.ones_like(scale)) and torch.equal(shift, x[:, :, :1])
    codes, scales = KVQuantizer("int8", 64, 16).quantize(x[:, :, :1], (shift, scale))
    assert torch.equal(codes, torch.zeros_like(codes))


@pytest.mark.parametrize("mode", MODES)
def test_calibration_lowers_the_error_on_offset_and_outlier_channels(mode):
    """Calibrated on the first 16 tokens, measured on all 64: the error must drop several-fold where the per-token
    codec is weak. Integer codes: on the ordinary channels (one scale per 64 channels is set by the outliers
    otherwise). fp8 (relative precision per element): on the offset channels (40 +- 3 is coded at the precision of
    40 otherwise)."""
    x = gemma_like_keys(1)
    quantizer = KVQuantizer(mode, 64)
    calibration = KVQuantizer.calibrate(x[:, :, :16])
    channels = slice(0, 4) if mode == "fp8" else slice(12, None)
    plain = (quantizer.roundtrip(x) - x)[..., channels].norm()
    calibrated = (quantizer.roundtrip(x, calibration) - x)[..., channels].norm()
    assert calibrated < plain / 3
    assert (quantizer.roundtrip(x, calibration) - x).norm() < (quantizer.roundtrip(x) - x).norm() / 1.9


def test_calibration_is_per_row_moves_with_the_rows_and_is_redone_when_empty():
    layer = QuantizedFullLayer("int4", DequantWorkspace(), group_size=16)
    x = gemma_like_keys(2)
    x[1] = x[1] * 0.1 - 7  # the second row has other statistics
    layer.update(x, x)
    shift, scale = KVQuantizer.calibrate(x)
    assert torch.equal(layer._calibration["keys"][0], shift) and torch.equal(layer._calibration["keys"][1], scale)
    step = gemma_like_keys(3, (2, 1, 1, 64))
    before = layer.update(step, step)[0].clone()  # (returned tensors are workspace views, reused by the next update)
    layer.crop(-1)
    layer.reorder_cache(torch.tensor([1, 0]))
    after, _ = layer.update(step, step)
    assert torch.equal(after[:, :, :64], before[:, :, :64].flip(0))  # codes, scales and calibration moved together
    layer.batch_repeat_interleave(2)
    layer.batch_select_indices(torch.tensor([2, 1]))
    after_select, _ = layer.update(step, step)
    assert torch.equal(after_select[:, :, :64], before[:, :, :64])
    # Empty again (crop to 0, or reset): the next prompt calibrates afresh.
    for empty in (lambda: layer.crop(-layer.get_seq_length()), layer.reset):
        empty()
        fresh = gemma_like_keys(4) * 2 + 1
        layer.update(fresh, fresh)
        assert torch.equal(layer._calibration["keys"][0], KVQuantizer.calibrate(fresh)[0])


def test_calibration_can_be_turned_off():
    x = gemma_like_keys(5)
    cache = HybridRingCache(
        get_model("gemma3").config, full_layer_quantization="int8", full_layer_key_calibration=False
    )
    cache.update(x, x, 5)
    keys, _ = cache.update(x[:, :, :1], x[:, :, :1], 5)
    assert torch.equal(keys[:, :, :64], KVQuantizer("int8", 64).roundtrip(x))
    assert cache.layers[5]._calibration == {}


def test_workspace_is_shared_and_grows():
    workspace = DequantWorkspace()
    a = QuantizedFullLayer("int8", workspace, group_size=8)
    b = QuantizedFullLayer("int8", workspace, group_size=8)
    x = random_kv(5, (1, 1, 4, 8))
    keys_a, _ = a.update(x, x)
    keys_b, _ = b.update(x * 2, x * 2)
    assert keys_a.untyped_storage().data_ptr() == keys_b.untyped_storage().data_ptr()
    assert workspace.nbytes() == 2 * 4 * 8 * 4  # one layer's keys and values, not one per layer


# --- 3. the model: fake-quantized reference ---------------------------------------------------------------------------
class FakeQuantFullLayer(GrowableFullLayer):
    """Exact growing storage that returns `dequantize(quantize(history))` + this step's tokens: the oracle.

    Key calibration as specified: `KVQuantizer.calibrate` of the keys of the first update into the empty layer, per
    batch row, moving with the rows (beams, repeats, selections); values uncalibrated.
    """

    def __init__(self, mode: str, rotate: bool = False, key_calibration: bool = True):
        super().__init__()
        self.mode, self.rotate, self.key_calibration = mode, rotate, key_calibration
        self.calibration = None

    def update(self, key_states, value_states, *args, **kwargs):
        start = self.cumulative_length
        if start == 0 and self.key_calibration:
            self.calibration = KVQuantizer.calibrate(key_states)
        keys, values = super().update(key_states, value_states)
        out = []
        for stored, new, calibration in ((keys, key_states, self.calibration), (values, value_states, None)):
            quantizer = KVQuantizer(self.mode, new.shape[-1], rotate=self.rotate)
            out.append(torch.cat([quantizer.roundtrip(stored[:, :, :start], calibration), new], dim=-2))
        return out[0], out[1]

    def _move_calibration(self, function):
        if self.calibration is not None:
            self.calibration = tuple(function(tensor) for tensor in self.calibration)

    def reorder_cache(self, beam_idx):
        super().reorder_cache(beam_idx)
        self._move_calibration(lambda tensor: tensor.index_select(0, beam_idx))

    def batch_repeat_interleave(self, repeats):
        super().batch_repeat_interleave(repeats)
        self._move_calibration(lambda tensor: tensor.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices):
        super().batch_select_indices(indices)
        self._move_calibration(lambda tensor: tensor[indices, ...])


def fake_quant_cache(model, mode: str, rotate: bool | None = None, key_calibration: bool = True) -> HybridRingCache:
    """The oracle of `HybridRingCache(full_layer_quantization=mode)`; `rotate=None` is the documented default: the
    Hadamard rotation for int4 only (the tiny models' groups are powers of two)."""
    rotate = mode == "int4" if rotate is None else rotate
    cache = HybridRingCache(model.config)
    for index, layer in enumerate(cache.layers):
        if isinstance(layer, GrowableFullLayer):
            cache.layers[index] = FakeQuantFullLayer(mode, rotate, key_calibration)
    return cache


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("mode", MODES)
def test_chunked_logits_equal_fake_quant_reference(model_name, mode, seed):
    model = get_model(model_name)
    ids = torch.randint(3, VOCAB, (2, 40), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[1, : 4 + seed] = 0  # left padding
    schedule = random_schedule(ids.shape[1], seeded_chunk_sizes(seed, one_token_share=0.5, high=3 * WINDOW))
    cache = HybridRingCache(model.config, full_layer_quantization=mode)
    actual = chunked_logits(model, cache, ids, schedule, mask)
    expected = chunked_logits(model, fake_quant_cache(model, mode), ids, schedule, mask)
    real = mask.bool()
    torch.testing.assert_close(actual[real], expected[real], rtol=0, atol=1e-5)
    # ...and the compression is real: not the exact ring's logits.
    exact = no_cache_logits(model, ids, mask)
    assert not torch.allclose(actual[real], exact[real], atol=1e-6)


def test_sliding_layers_stay_exact_in_the_model_dtype():
    """Gemma 3 tiny: layers 0-4 are sliding and run before the only full layer, so their rings must hold exactly
    what the exact cache's rings hold; the full layer holds int8 codes."""
    model = get_model("gemma3")
    ids = torch.randint(3, VOCAB, (1, 30), generator=torch.Generator().manual_seed(0))
    exact, compressed = HybridRingCache(model.config), HybridRingCache(model.config, full_layer_quantization="int8")
    chunked_logits(model, exact, ids, [11, 1, 1, 17])
    chunked_logits(model, compressed, ids, [11, 1, 1, 17])
    for kind, a, b in zip(compressed.layer_kinds, exact.layers, compressed.layers):
        if kind == "sliding_attention":
            assert isinstance(b, RingSlidingLayer) and b.dtype == torch.float32
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        else:
            assert isinstance(b, QuantizedFullLayer) and b.storage_tensors()[0].dtype == torch.int8


# --- 4. generate -----------------------------------------------------------------------------------------------------
GENERATE_CASES = {
    "greedy": (lambda: prompt(2, pad=9), {"do_sample": False}),
    "sampling": (lambda: prompt(2, pad=9), {"do_sample": True, "top_k": 20, "temperature": 0.8}),
    "beams3": (prompt, {"num_beams": 3, "do_sample": False}),
    "beams3_return2": (prompt, {"num_beams": 3, "num_return_sequences": 2, "do_sample": False}),
    "sample_return3": (prompt, {"do_sample": True, "top_k": 20, "num_return_sequences": 3}),
    "prompt_lookup": (repetitive_prompt, {"do_sample": False, "prompt_lookup_num_tokens": 4}),
    "assisted": (prompt, {"do_sample": False, "assistant": True}),
}


@torch.no_grad()
def run_generate(model, inputs, cache, new_tokens=20, seed=7, **kwargs):
    if kwargs.pop("assistant", False):
        kwargs["assistant_model"] = MODEL_BUILDERS["gemma3"](window=WINDOW, layers=2, seed=7)
    torch.manual_seed(seed)
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
    assert out.sequences.shape[-1] == inputs["input_ids"].shape[-1] + new_tokens
    return out.sequences, torch.stack(out.logits, 1)


@pytest.mark.parametrize("case", generate_case_params(GENERATE_CASES))
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_generate_modes_equal_fake_quant_reference(model_name, mode, case):
    make_inputs, kwargs = GENERATE_CASES[case]
    if "assistant" in kwargs and model_name == "gemma4":
        pytest.skip("the tiny assistant is a Gemma 3 model; Gemma 4 is covered by prompt lookup")
    model, inputs = get_model(model_name), make_inputs()
    cache = HybridRingCache(model.config, full_layer_quantization=mode)
    tokens, logits = run_generate(model, inputs, cache, **kwargs)
    expected_tokens, expected_logits = run_generate(model, inputs, fake_quant_cache(model, mode), **kwargs)
    assert torch.equal(tokens, expected_tokens)
    if "num_beams" not in kwargs:  # beam logits are per-beam scores, compared through the tokens
        torch.testing.assert_close(logits, expected_logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_multi_turn_and_fixed_capacity(model_name, mode):
    """A second `generate` call continues the same cache (multi-turn), and the fixed-capacity (compileable) layer
    gives the growing layer's tokens."""
    model = get_model(model_name)
    first = prompt(1, seed=3)
    growing = HybridRingCache(model.config, full_layer_quantization=mode)
    fixed = HybridRingCache(model.config, full_layer_quantization=mode, max_cache_len=96)
    assert fixed.is_compileable and not growing.is_compileable
    assert any(isinstance(layer, StaticQuantizedFullLayer) for layer in fixed.layers)
    reference = fake_quant_cache(model, mode)
    outputs = []
    for cache in (growing, fixed, reference):
        tokens, _ = run_generate(model, first, cache, new_tokens=12)
        follow_up = torch.cat([tokens, torch.randint(3, VOCAB, (1, 9), generator=torch.Generator().manual_seed(1))], 1)
        tokens, _ = run_generate(
            model, {"input_ids": follow_up, "attention_mask": torch.ones_like(follow_up)}, cache, new_tokens=12
        )
        outputs.append(tokens)
    assert torch.equal(outputs[0], outputs[2]) and torch.equal(outputs[1], outputs[2])


def test_compiled_decode_matches_eager():
    from builders import greedy_decode  # the exact cache's compile decoding loop, reused

    torch._dynamo.reset()
    model = get_model("gemma3")
    prompt_ids = torch.randint(3, VOCAB, (2, 2 * WINDOW + 1), generator=torch.Generator().manual_seed(0))
    eager = greedy_decode(
        model,
        HybridRingCache(model.config, full_layer_quantization="int8", max_cache_len=48),
        prompt_ids,
        model.forward,
        16,
    )
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("eager")
    compiled_forward = torch.compile(model.forward, backend=counter, fullgraph=True)
    cache = HybridRingCache(model.config, full_layer_quantization="int8", max_cache_len=48)
    compiled = greedy_decode(model, cache, prompt_ids, compiled_forward, 16)
    assert torch.equal(eager, compiled)
    assert counter.frame_count == 1


# --- 5. memory and errors ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("mode", "dtype", "limit"),
    [
        ("int8", torch.float32, 0.27),
        ("int4", torch.float32, 0.15),
        ("fp8", torch.float32, 0.27),
        ("int8", torch.bfloat16, 0.54),
        ("int4", torch.bfloat16, 0.30),
    ],
)
def test_memory_report_counts_codes_and_scales(mode, dtype, limit):
    """Head size 256 as on Gemma 3 270M: compressed full-layer bytes against the same layer in the model dtype."""
    cache = HybridRingCache(get_model("gemma3").config, full_layer_quantization=mode)
    keys = random_kv(0, (2, 2, 40, 256), dtype)
    cache.update(keys, keys, 5)  # the full layer
    layer = cache.layers[5]
    report = cache.memory_report()
    calibration_bytes = 2 * 2 * 2 * 256 * keys.element_size()  # key shift and scale per row, head and channel
    expected = 2 * 2 * 40 * (2 * layer.quantizers["keys"].bytes_per_token(keys.element_size())) + calibration_bytes
    assert layer.nbytes() == expected == report.bytes_by_type["full_attention"]
    assert report.kv_bytes == kv_bytes_held(cache)
    assert report.workspace_bytes == 2 * 2 * 2 * 40 * 256 * keys.element_size()
    # The workspace is kept alive by the cache: part of what it holds in total.
    assert report.total_bytes == report.kv_bytes + report.workspace_bytes == report.kv_bytes + report.extra_bytes
    assert (expected - calibration_bytes) / layer.uncompressed_bytes_per_token() / 40 <= limit
    assert "dequant. workspace" in str(report)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"full_layer_quantization": "int3"}, "Unknown full_layer_quantization 'int3'"),
        ({"full_layer_rotation": True}, "needs full_layer_quantization"),
        ({"full_layer_sink_tokens": 4}, "only together with full_layer_window"),
        ({"full_layer_window": 64, "full_layer_quantization": "int8"}, "cannot be combined"),
        ({"full_layer_window": 64, "max_cache_len": 128}, "no compileable variant"),
    ],
)
def test_clear_errors_for_unknown_modes_and_unsupported_combinations(kwargs, message):
    with pytest.raises(ValueError, match=message):
        HybridRingCache(get_model("gemma3").config, **kwargs)


def test_codec_refuses_odd_int4_heads_and_rotation_of_odd_groups():
    with pytest.raises(ValueError, match="even head size"):
        KVQuantizer("int4", 7)
    with pytest.raises(ValueError, match="power-of-two group"):
        KVQuantizer("int8", 24, group_size=24, rotate=True)


def test_shape_change_is_refused_and_leaves_the_layer_unchanged():
    layer = QuantizedFullLayer("int8", DequantWorkspace(), group_size=8)
    x = random_kv(0, (1, 1, 3, 8))
    layer.update(x, x)
    with pytest.raises(ValueError, match="batch size"):
        layer.update(random_kv(0, (2, 1, 1, 8)), random_kv(0, (2, 1, 1, 8)))
    assert layer.get_seq_length() == 3
    keys, _ = layer.update(x[:, :, :1], x[:, :, :1])
    assert keys.shape[-2] == 4


def test_dynamic_cache_untouched():
    """Sanity for the comparison tools: a DynamicCache holds no compressed layers and kv_bytes_held still counts it."""
    model = get_model("gemma3")
    cache = DynamicCache(config=model.config)
    chunked_logits(model, cache, torch.randint(3, VOCAB, (1, 10)), [10])
    assert kv_bytes_held(cache) > 0


@pytest.mark.parametrize("fixed", [False, True])
def test_inference_mode_prefill_then_no_grad_decode(fixed):
    """As pipelines fill caches: the codes, scales and key calibration allocated under `torch.inference_mode()` must
    be writable afterwards under `no_grad` (generate), with the same logits as staying in inference mode."""
    model = get_model("gemma3")
    ids = torch.randint(3, VOCAB, (1, 30), generator=torch.Generator().manual_seed(4))
    kwargs = {"full_layer_quantization": "int4", "max_cache_len": 40 if fixed else None}
    logits = []
    for switch in (False, True):
        cache = HybridRingCache(model.config, **kwargs)
        with torch.inference_mode():
            model(input_ids=ids[:, :20], **cache_kwargs(cache), use_cache=True)
        context = torch.no_grad() if switch else torch.inference_mode()
        with context:
            logits.append(chunked_logits(model, cache, ids, [1] * 10, start=20))
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=0)


@pytest.mark.parametrize("mode", MODES)
def test_beam_reorder_right_after_an_inference_mode_prefill(mode):
    """The fixed-capacity layer's in-place beam reorder is its first write after a prefill under
    `torch.inference_mode()`: it must make the storage writable first (as the exact fixed layers do), and move codes,
    scales and calibration together."""
    model = get_model("gemma3")
    ids = torch.randint(3, VOCAB, (2, 20), generator=torch.Generator().manual_seed(5))
    cache = HybridRingCache(model.config, full_layer_quantization=mode, max_cache_len=40)
    reference = HybridRingCache(model.config, full_layer_quantization=mode, max_cache_len=40)
    with torch.inference_mode():
        model(input_ids=ids, **cache_kwargs(cache), use_cache=True)
    with torch.no_grad():
        model(input_ids=ids.flip(0), **cache_kwargs(reference), use_cache=True)
        cache.reorder_cache(torch.tensor([1, 0]))
        step = torch.randint(3, VOCAB, (2, 1), generator=torch.Generator().manual_seed(6))
        logits = model(input_ids=step, **cache_kwargs(cache), use_cache=True).logits
        expected = model(input_ids=step, **cache_kwargs(reference), use_cache=True).logits
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)
