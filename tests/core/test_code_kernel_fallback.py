"""Where the native kernel cannot run, a compressed layer's decode step takes the faster of attention on the codes
(torch ops) and dequantizing (`hybrid_cache.code_path.codes_preferred`, asked by `QuantizedFullLayer.uses_codes`).

1. Where the kernel runs for the layer's codes, the codes are used, with no measurement.
2. `HYBRID_CACHE_CODE_FALLBACK`: `codes` and `dequantize` decide without measuring; a bad value raises.
3. `auto` measures once per geometry (stubbed timings: the faster path wins), keeps the answer for the process and on
   disk beside the kernel's build, and measures again only when told to; the real measurement returns both timings.
4. Through a layer and a model: the dequantizing answer gives exactly the dequantizing path's result (and tokens);
   `HYBRID_CACHE_CODE_KERNEL=on` still raises where the kernel cannot run.
"""

from __future__ import annotations

import json

import pytest
import torch
from builders import prompt, tiny_gemma3

import hybrid_cache.code_kernel as code_kernel
from hybrid_cache import HybridRingCache, cache_kwargs
from hybrid_cache import code_path as ca
from hybrid_cache.code_attention import CODE_ATTENTION, CompressedKV
from hybrid_cache.code_path import FALLBACK_ENV
from hybrid_cache.errors import CodeAttentionError, CodeKernelError
from hybrid_cache.quantized import DequantWorkspace, QuantizedFullLayer


@pytest.fixture
def fallback(monkeypatch, tmp_path):
    """A clean choice for one test: kernel auto, no remembered measurement, a fresh cache directory."""
    monkeypatch.setenv(code_kernel.KERNEL_ENV, "auto")
    monkeypatch.setenv(code_kernel.ISA_ENV, "auto")
    monkeypatch.setenv("HYBRID_CACHE_KERNEL_DIR", str(tmp_path))
    monkeypatch.setattr(ca, "_fallback_choices", {})

    def set_fallback(value: str) -> None:
        monkeypatch.setenv(FALLBACK_ENV, value)

    set_fallback("auto")
    return set_fallback


@pytest.fixture
def timings(monkeypatch):
    """Stub the measurement: `timings["codes_ms"]` / `["dequantize_ms"]` are what it reports; `timings["calls"]`
    counts the measurements."""
    state = {"codes_ms": 1.0, "dequantize_ms": 2.0, "calls": 0}

    def measured(layer):
        state["calls"] += 1
        return {"codes_ms": state["codes_ms"], "dequantize_ms": state["dequantize_ms"]}

    monkeypatch.setattr(ca, "_time_both_paths", measured)
    return state


def layer_with_history(mode: str = "int8", head_dim: int = 32, group: int = 16, tokens: int = 20, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    layer = QuantizedFullLayer(mode, DequantWorkspace(), group, rotate=mode == "int4")
    layer.update(
        torch.randn(2, 2, tokens, head_dim, generator=generator),
        torch.randn(2, 2, tokens, head_dim, generator=generator),
    )
    return layer


# --- 1. the kernel runs: codes ---------------------------------------------------------------------------------------
@pytest.mark.skipif(not code_kernel.available_isas(), reason="the CPU has none of the kernel's instruction sets")
def test_where_the_kernel_runs_the_codes_are_used_without_measuring(fallback, timings):
    fallback("dequantize")  # not consulted: the kernel runs
    layer = layer_with_history("int4", head_dim=256, group=64)
    assert ca.codes_preferred(layer) and layer.uses_codes(20, 1)
    assert timings["calls"] == 0


# --- 2. the setting ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kernel", ["auto", "off"])
def test_codes_and_dequantize_decide_without_measuring(fallback, timings, kernel, monkeypatch):
    monkeypatch.setenv(code_kernel.KERNEL_ENV, kernel)
    layer = layer_with_history(head_dim=32)  # 32 channels: no kernel takes them
    fallback("codes")
    assert ca.codes_preferred(layer)
    fallback("dequantize")
    assert not ca.codes_preferred(layer) and not layer.uses_codes(20, 1)
    assert timings["calls"] == 0


def test_a_bad_fallback_setting_raises(fallback):
    fallback("fastest")
    with pytest.raises(CodeAttentionError, match="HYBRID_CACHE_CODE_FALLBACK='fastest' is not a setting"):
        ca.codes_preferred(layer_with_history())


# --- 3. auto: measured once --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "codes_ms, dequantize_ms, expected",
    [(1.0, 2.0, True), (1.6, 2.0, True), (3.0, 2.0, False), (2.0, 2.0, False), (1.9, 2.0, False)],
)
def test_auto_takes_the_faster_path(fallback, timings, codes_ms, dequantize_ms, expected):
    timings |= {"codes_ms": codes_ms, "dequantize_ms": dequantize_ms}
    layer = layer_with_history()
    assert ca.codes_preferred(layer) is expected and layer.uses_codes(20, 1) is expected
    assert timings["calls"] == 1  # once per process and geometry


def test_auto_remembers_per_geometry_and_on_disk(fallback, timings, tmp_path):
    assert ca.codes_preferred(layer_with_history("int8", head_dim=32))
    ca.codes_preferred(layer_with_history("int4", head_dim=32))
    ca.codes_preferred(layer_with_history("int8", head_dim=48))
    assert timings["calls"] == 3  # three geometries
    stored = json.loads((tmp_path / "code_path.json").read_text())
    assert len(stored) == 3 and {entry["choice"] for entry in stored.values()} == {"codes"}
    assert {entry["geometry"]["mode"] for entry in stored.values()} == {"int8", "int4"}
    ca._fallback_choices.clear()  # a new process: read from disk, not measured again
    timings["codes_ms"] = 10.0
    assert ca.codes_preferred(layer_with_history("int8", head_dim=32))
    assert timings["calls"] == 3
    result = ca.measure_fallback(layer_with_history("int8", head_dim=32), force=True)
    assert result["choice"] == "dequantize" and timings["calls"] == 4
    assert not ca.codes_preferred(layer_with_history("int8", head_dim=32))


def test_an_unreadable_or_unwritable_cache_only_costs_a_measurement(fallback, timings, monkeypatch, tmp_path):
    (tmp_path / "code_path.json").write_text("not json")
    assert ca.codes_preferred(layer_with_history())
    monkeypatch.setenv("HYBRID_CACHE_KERNEL_DIR", str(tmp_path / "file"))
    (tmp_path / "file").write_text("")  # a file where the directory should be
    ca._fallback_choices.clear()
    assert ca.codes_preferred(layer_with_history())
    assert timings["calls"] == 2


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_the_real_measurement_times_both_paths(fallback, mode, monkeypatch):
    """No timing is asserted: only that both paths ran and the answer is one of the two."""
    monkeypatch.setattr(ca, "_FALLBACK_TOKENS", 256)
    layer = layer_with_history(mode, head_dim=32)
    result = ca.measure_fallback(layer)
    assert result["codes_ms"] > 0 and result["dequantize_ms"] > 0
    assert result["choice"] in ("codes", "dequantize") and result["geometry"]["key_head_dim"] == 32
    assert layer.cumulative_length == 20  # the measured layer is a copy: this one is untouched


# --- 4. through a layer and a model ------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_the_dequantizing_answer_returns_the_dequantizing_paths_tensors(fallback, mode):
    fallback("dequantize")
    layer = layer_with_history(mode, head_dim=32)
    twin = layer_with_history(mode, head_dim=32)
    step = torch.randn(2, 2, 1, 32), torch.randn(2, 2, 1, 32)
    keys, values = layer.update(*step, return_codes=True)
    expected = twin.update(*step)
    assert not isinstance(keys, CompressedKV)
    torch.testing.assert_close(keys, expected[0], rtol=0, atol=0)
    torch.testing.assert_close(values, expected[1], rtol=0, atol=0)
    fallback("codes")
    assert isinstance(layer.update(*step, return_codes=True)[0], CompressedKV)


def test_generate_with_the_dequantizing_answer_equals_the_dequantizing_cache(fallback):
    """A model on `hybrid_cache_sdpa` whose layers the kernel cannot take (heads of 16), told to dequantize: the
    tokens and logits of the cache that never attends on the codes."""
    fallback("dequantize")
    model = tiny_gemma3(window=4, attn=CODE_ATTENTION, seed=5)
    inputs = prompt(2, pad=3)
    outputs = []
    for code_attention in (None, False):
        cache = HybridRingCache(model.config, full_layer_quantization="int8", full_layer_code_attention=code_attention)
        torch.manual_seed(0)
        out = model.generate(
            **inputs,
            **cache_kwargs(cache),
            max_new_tokens=6,
            do_sample=False,
            pad_token_id=0,
            return_dict_in_generate=True,
            output_logits=True,
        )
        outputs.append((out.sequences, torch.stack(out.logits, 1)))
    torch.testing.assert_close(outputs[0][0], outputs[1][0], rtol=0, atol=0)
    torch.testing.assert_close(outputs[0][1], outputs[1][1], rtol=0, atol=0)


def test_on_still_raises_where_the_kernel_cannot_run(fallback, monkeypatch):
    monkeypatch.setenv(code_kernel.KERNEL_ENV, "on")
    with pytest.raises(CodeKernelError, match="HYBRID_CACHE_CODE_KERNEL=on"):
        layer_with_history(head_dim=32).uses_codes(20, 1)
