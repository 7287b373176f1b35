"""Side by side: hybrid_cache's KV quantizer against transformers' own quantized cache layers, on real K/V.

Captures the keys/values of the full-attention layers of the embedded Gemma 3 270M over the first `--tokens` tokens
of the default text (fp32, exact DynamicCache), then prints the relative RMS round-trip error of each quantizer per
layer, and the seconds it took:

- hybrid_cache `KVQuantizer` (int8 / int4 / fp8, groups of 64, with and without rotation);
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

from hybrid_cache.quantized import KVQuantizer  # noqa: E402


def capture(tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    from transformers import DynamicCache

    from hybrid_cache.models import load_model
    from hybrid_cache.text import load_text

    model, tokenizer = load_model()
    text, _ = load_text()
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :tokens]
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model.model(input_ids=ids, cache=cache, use_cache=True)
    full = [i for i, kind in enumerate(model.config.layer_types) if kind == "full_attention"]
    return [(cache.layers[i].keys.clone(), cache.layers[i].values.clone()) for i in full]


def transformers_quantizers() -> dict[str, object]:
    from transformers.cache_utils import Fp8QuantizedLayer, HQQQuantizedLayer, QuantoQuantizedLayer

    makers: dict[str, object] = {"transformers Fp8QuantizedLayer (per tensor)": lambda: Fp8QuantizedLayer()}
    if importlib.util.find_spec("hqq") is not None:
        for bits in (8, 4):
            makers[f"transformers HQQQuantizedLayer int{bits} g64 per token"] = (
                lambda bits=bits: HQQQuantizedLayer(nbits=bits, axis_key=1, axis_value=1, q_group_size=64)
            )
    if importlib.util.find_spec("optimum") is not None and importlib.util.find_spec("optimum.quanto") is not None:
        makers["transformers QuantoQuantizedLayer int4 g64 per channel"] = (
            lambda: QuantoQuantizedLayer(nbits=4, axis_key=-1, axis_value=-1, q_group_size=64)
        )
    return makers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    args = parser.parse_args()
    kv = capture(args.tokens)

    def relative(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.float() - b).norm() / b.norm())

    rows = []
    for name, make in transformers_quantizers().items():
        errors, seconds = [], 0.0
        for keys, values in kv:
            layer = make()
            layer.lazy_initialization(keys[:, :, :1], values[:, :, :1])
            for tensor in (keys, values):
                began = time.perf_counter()
                if hasattr(layer, "axis_key"):
                    restored = layer._dequantize(layer._quantize(tensor.contiguous(), axis=layer.axis_key))
                else:
                    restored = layer._dequantize(layer._quantize(tensor))
                seconds += time.perf_counter() - began
                errors.append(relative(restored, tensor))
        rows.append((name, errors, seconds))
    for mode in ("int8", "int4", "fp8"):
        for rotate in (False, True):
            errors, seconds = [], 0.0
            for keys, values in kv:
                for tensor in (keys, values):
                    quantizer = KVQuantizer(mode, tensor.shape[-1], 64, rotate=rotate)
                    began = time.perf_counter()
                    restored = quantizer.roundtrip(tensor)
                    seconds += time.perf_counter() - began
                    errors.append(relative(restored, tensor))
            rows.append((f"hybrid_cache KVQuantizer {mode} g64" + (" + rotation" if rotate else ""), errors, seconds))
    print(f"| quantizer | rel. RMS error, keys per full layer | values per full layer | round trip s |")
    print("| --- | --- | --- | --- |")
    for name, errors, seconds in rows:
        keys = " / ".join(f"{e:.4f}" for e in errors[0::2])
        values = " / ".join(f"{e:.4f}" for e in errors[1::2])
        print(f"| {name} | {keys} | {values} | {seconds:.2f} |")


if __name__ == "__main__":
    main()
