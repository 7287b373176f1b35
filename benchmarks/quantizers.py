"""Side by side: hybrid_cache's KV quantizer against transformers' own quantized cache layers, on real K/V.

Captures the queries, keys and values of the full-attention layers of the embedded Gemma 3 270M over the first
`--tokens` tokens of the default text (fp32, no cache), then prints per quantizer and full layer:

- the relative RMS round-trip error of keys and of values;
- what attention makes of it: the KL divergence of the attention probabilities (quantized keys against exact, mean
  over queries and heads, causal) and the relative error of the attention output (quantized keys and values);
- the seconds the round trips took.

Quantizers:

- hybrid_cache `KVQuantizer` (int8 / int4 / fp8, groups of 64), with and without the key calibration (per-channel
  shift and scale from the first `--calibration-tokens` tokens, as the cache takes them from its first update) and
  the rotation;
- transformers' `Fp8QuantizedLayer` (per-tensor scale; needs nothing extra);
- transformers' `HQQQuantizedLayer` (int8 / int4, groups of 64 per token) if `hqq` is installed, and
  `QuantoQuantizedLayer` (int4, groups of 64 along the token axis per channel, KIVI-style) if `optimum-quanto` is.

    HF_HUB_OFFLINE=1 python benchmarks/quantizers.py --tokens 2048
    # with the optional backends: pip install hqq optimum-quanto (into a separate virtual environment)

Round-trip seconds are wall time of quantize + dequantize of the captured tensors (quanto builds an extension on its
first call: run twice). This compares codecs only; docs/quantization.md explains why the cache does not reuse
transformers' layers (not croppable, whole-history re-quantization, per-tensor fp8 scale).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybrid_cache.quantizer import KVQuantizer  # noqa: E402


def capture(tokens: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]]:
    """`(queries, keys, values, scaling)` of every full-attention layer, as its attention function receives them."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from hybrid_cache.tools.models import load_model
    from hybrid_cache.tools.text import load_text

    model, tokenizer = load_model()
    text, _ = load_text()
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :tokens]
    full = {i for i, kind in enumerate(model.config.layer_types) if kind == "full_attention"}
    captured: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]] = {}
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def capturing_sdpa(module, query, key, value, attention_mask, **kwargs):
        if module.layer_idx in full:
            captured[module.layer_idx] = (query.clone(), key.clone(), value.clone(), module.scaling)
        return sdpa(module, query, key, value, attention_mask, **kwargs)

    ALL_ATTENTION_FUNCTIONS["sdpa"] = capturing_sdpa  # this script's process only
    try:
        with torch.inference_mode():
            model.model(input_ids=ids, use_cache=False)
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa
    return [captured[i] for i in sorted(captured)]


def causal_attention(query, key, value, scaling):
    """Probabilities and output of causal attention (grouped-query: key/value heads repeated)."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scores = (query @ key.transpose(-1, -2)) * scaling
    length = key.shape[-2]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    probabilities = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    return probabilities, probabilities @ value


def transformers_quantizers() -> dict[str, object]:
    from transformers.cache_utils import Fp8QuantizedLayer, HQQQuantizedLayer, QuantoQuantizedLayer

    makers: dict[str, object] = {"transformers Fp8QuantizedLayer (per tensor)": lambda: Fp8QuantizedLayer()}
    if importlib.util.find_spec("hqq") is not None:
        for bits in (8, 4):
            makers[f"transformers HQQQuantizedLayer int{bits} g64 per token"] = lambda bits=bits: HQQQuantizedLayer(
                nbits=bits, axis_key=1, axis_value=1, q_group_size=64
            )
    if importlib.util.find_spec("optimum") is not None and importlib.util.find_spec("optimum.quanto") is not None:
        makers["transformers QuantoQuantizedLayer int4 g64 per channel"] = lambda: QuantoQuantizedLayer(
            nbits=4, axis_key=-1, axis_value=-1, q_group_size=64
        )
    return makers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument(
        "--calibration-tokens",
        type=int,
        default=512,
        help="tokens the key calibration is taken from (the cache: its first update; default 512, "
        "the perplexity tool's chunk)",
    )
    args = parser.parse_args()
    captured = capture(args.tokens)
    exact = [causal_attention(q, k, v, scaling) for q, k, v, scaling in captured]

    def relative(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.float() - b).norm() / b.norm())

    rows = []

    def add_row(name, restore) -> None:
        """`restore(tensor, role) -> (restored, seconds)` for every full layer's keys and values."""
        key_errors, value_errors, kls, output_errors, seconds = [], [], [], [], 0.0
        for (query, keys, values, scaling), (probabilities, output) in zip(captured, exact):
            restored_keys, key_seconds = restore(keys, "keys")
            restored_values, value_seconds = restore(values, "values")
            seconds += key_seconds + value_seconds
            key_errors.append(relative(restored_keys, keys))
            value_errors.append(relative(restored_values, values))
            approximate, _ = causal_attention(query, restored_keys.float(), values, scaling)
            kl = probabilities * (probabilities.clamp_min(1e-30).log() - approximate.clamp_min(1e-30).log())
            kls.append(float(kl.sum(-1).mean()))
            _, approximate_output = causal_attention(query, restored_keys.float(), restored_values.float(), scaling)
            output_errors.append(relative(approximate_output, output))
        rows.append((name, key_errors, value_errors, kls, output_errors, seconds))

    def timed(function):
        began = time.perf_counter()
        result = function()
        return result, time.perf_counter() - began

    for name, make in transformers_quantizers().items():

        def restore(tensor, role, make=make):
            layer = make()
            layer.lazy_initialization(tensor[:, :, :1], tensor[:, :, :1])
            if hasattr(layer, "axis_key"):
                return timed(lambda: layer._dequantize(layer._quantize(tensor.contiguous(), axis=layer.axis_key)))
            return timed(lambda: layer._dequantize(layer._quantize(tensor)))

        add_row(name, restore)
    for mode in ("int8", "int4", "fp8"):
        for calibrate in (False, True):
            for rotate in (False, True):

                def restore(tensor, role, mode=mode, calibrate=calibrate, rotate=rotate):
                    quantizer = KVQuantizer(mode, tensor.shape[-1], 64, rotate=rotate)
                    if calibrate and role == "keys":  # as the cache: keys only
                        calibration = KVQuantizer.calibrate(tensor[:, :, : args.calibration_tokens])
                        return timed(lambda: quantizer.roundtrip(tensor, calibration))
                    return timed(lambda: quantizer.roundtrip(tensor))

                label = f"hybrid_cache KVQuantizer {mode} g64" + (" + key calibration" if calibrate else "")
                add_row(label + (" + rotation" if rotate else ""), restore)

    def joined(values, pattern):
        return " / ".join(pattern.format(value) for value in values)

    print(
        "| quantizer | rel. RMS error, keys per full layer | values | attention KL (keys) | attention output "
        "rel. error | round trip s |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for name, key_errors, value_errors, kls, output_errors, seconds in rows:
        print(
            f"| {name} | {joined(key_errors, '{:.4f}')} | {joined(value_errors, '{:.4f}')} | "
            f"{joined(kls, '{:.1e}')} | {joined(output_errors, '{:.3f}')} | {seconds:.2f} |"
        )


if __name__ == "__main__":
    main()
