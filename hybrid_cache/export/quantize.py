"""Weights of an exported program in fewer bits (`export_program(..., quantize="8da4w")`), with torchao.

`"8da4w"`: what XNNPACK runs fastest on a phone's CPU and what optimum-executorch's recipe for the same name does:
every linear layer 8-bit dynamic activations x 4-bit symmetric weights in groups of `LINEAR_GROUP` (XNNPACK's
blockwise int4 kernels; it keeps the scales in bf16), every embedding table 8-bit per row (ExecuTorch's
`quantized_decomposed::embedding_byte`, `executorch.kernels.quantized`). The output layer, tied to the embedding in
Gemma, is the largest matrix (vocabulary x hidden); its groups are `OUTPUT_GROUP` wide, which keeps its scales at a
quarter of the bytes at group 32 (the 270M's file: docs/export.md).

What is not done, and why: storing the tied embedding and output layer once. XNNPACK packs the output layer's weights
into its own blob, and the embedding's gather reads a program constant: one tensor cannot be both in ExecuTorch 1.5.1
without torchao's shared-embedding kernels, which its pip wheel does not ship.

The reference for a quantized program is the same quantized model run eagerly (`quantize_model` returns it), not the
fp32 model: 4-bit weights change the logits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["LINEAR_GROUP", "OUTPUT_GROUP", "QUANTIZATIONS", "quantize_model", "without_padding_idx"]

QUANTIZATIONS = ("8da4w",)
LINEAR_GROUP = 32
OUTPUT_GROUP = 128


def quantize_model(model: Any, quantization: str) -> Any:
    """Quantize `model`'s weights in place (`QUANTIZATIONS`; see the module docstring) and return it. A linear layer
    whose input width is not a multiple of its group keeps 8-bit per-channel weights."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantize={quantization!r}: the quantizations are {', '.join(QUANTIZATIONS)} (or None).")
    from torchao.quantization.granularity import PerAxis, PerGroup
    from torchao.quantization.quant_api import Int8DynamicActivationIntxWeightConfig, IntxWeightOnlyConfig, quantize_
    from torchao.utils import unwrap_tensor_subclass

    output = model.get_output_embeddings()
    groups = {}  # linear layer -> its group (0: per channel, 8-bit), chosen before any layer changes
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            group = OUTPUT_GROUP if module is output else LINEAR_GROUP
            groups[module] = group if module.weight.shape[1] % group == 0 else 0
    quantize_(
        model,
        IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerAxis(0)),
        lambda module, name: isinstance(module, torch.nn.Embedding),
    )
    for group in sorted(set(groups.values())):
        config = Int8DynamicActivationIntxWeightConfig(
            weight_dtype=torch.int4 if group else torch.int8,  # type: ignore[attr-defined]  # not in torch's stubs
            weight_granularity=PerGroup(group) if group else PerAxis(0),
            # XNNPACK keeps blockwise scales in bf16: the reference (this model, eager) rounds them the same way.
            weight_scale_dtype=torch.bfloat16 if group else None,
        )
        quantize_(model, config, lambda module, name, group=group: groups.get(module) == group)
    unwrap_tensor_subclass(model)
    return model


@contextlib.contextmanager
def without_padding_idx(model: Any) -> Iterator[None]:
    """Within the block, the model's embeddings have no `padding_idx` (it only zeroes a gradient; in the graph it
    keeps ExecuTorch's quantization fusion from turning a dequantized embedding into `embedding_byte`)."""
    embeddings = [module for module in model.modules() if isinstance(module, torch.nn.Embedding)]
    saved = [module.padding_idx for module in embeddings]
    for module in embeddings:
        module.padding_idx = None
    try:
        yield
    finally:
        for module, padding_idx in zip(embeddings, saved):
            module.padding_idx = padding_idx
