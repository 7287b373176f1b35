"""The codec of the compressed full layers: `KVQuantizer` turns `[..., head_dim]` tensors into int8 / int4 / fp8 codes
with per-token group scales and back (the format, and what it takes from llama.cpp, mlx-lm and torch, is described in
`hybrid_cache.quantized`, whose layers store the codes)."""

from __future__ import annotations

import itertools
import math

import torch
from transformers.utils import is_torchdynamo_compiling

__all__ = ["CALIBRATION_FLOOR", "DEFAULT_GROUP_SIZE", "QUANTIZATION_MODES", "KVQuantizer", "hadamard_matrix"]

QUANTIZATION_MODES = ("int8", "int4", "fp8")
DEFAULT_GROUP_SIZE = 64
_FP8_DTYPE = torch.float8_e4m3fn
_FP8_MAX = float(torch.finfo(_FP8_DTYPE).max)
# A channel's calibration scale is its spread over the calibration tokens, but at least this fraction of the mean
# spread of the head's channels: a channel that barely moved while calibrating must not be blown up later.
CALIBRATION_FLOOR = 0.2
# Tokens per tile of the dequantizing path's in-place rotation (`KVQuantizer._rotate_in_place`).
ROTATION_TILE = 4096


def hadamard_matrix(size: int) -> torch.Tensor:
    """Normalized Sylvester-Hadamard matrix `[size, size]` (orthogonal and symmetric: it is its own inverse)."""
    matrix = torch.ones(1, 1)
    while matrix.shape[0] < size:
        matrix = torch.cat([torch.cat([matrix, matrix], 1), torch.cat([matrix, -matrix], 1)], 0)
    return matrix / math.sqrt(size)


class KVQuantizer:
    """Quantizes `[..., head_dim]` tensors token by token, and dequantizes them into a preallocated tensor.

    Args:
        mode (`str`): `"int8"`, `"int4"` or `"fp8"`.
        head_dim (`int`): size of the last dimension.
        group_size (`int`, defaults to 64): channels sharing one scale; reduced to `gcd(head_dim, group_size)` when
            it does not divide `head_dim` (tiny test models have heads of 8 or 16).
        rotate (`bool`, defaults to False): Hadamard rotation within each group (see the module docstring); needs a
            power-of-two group.

    Example:

    ```python
    >>> quantizer = KVQuantizer("int8", head_dim=256)
    >>> data, scales = quantizer.quantize(keys)          # [b, h, t, 256] int8, [b, h, t, 4] keys.dtype
    >>> out = torch.empty_like(keys); quantizer.dequantize_into(data, scales, out)
    ```
    """

    def __init__(self, mode: str, head_dim: int, group_size: int = DEFAULT_GROUP_SIZE, rotate: bool = False) -> None:
        if mode not in QUANTIZATION_MODES:
            raise ValueError(
                f"Unknown full-layer quantization {mode!r}; choose one of {QUANTIZATION_MODES} (or None for exact "
                f"storage in the model dtype)."
            )
        if mode == "int4" and head_dim % 2:
            raise ValueError(f"int4 packs two channels per byte and needs an even head size, got {head_dim}.")
        if group_size < 1:
            raise ValueError(f"`group_size` must be >= 1, got {group_size}.")
        self.mode = mode
        self.head_dim = head_dim
        self.group_size = math.gcd(head_dim, group_size)
        if rotate and self.group_size & (self.group_size - 1):
            raise ValueError(
                f"The Hadamard rotation needs a power-of-two group, got {self.group_size} (head size {head_dim}); "
                f"pass another `full_layer_group_size` or rotate=False."
            )
        self.rotate = rotate
        self._rotation: torch.Tensor | None = None
        self.groups = head_dim // self.group_size

    # --- layout ---------------------------------------------------------------------------------------------------
    @property
    def storage_dtype(self) -> torch.dtype:
        return {"int8": torch.int8, "int4": torch.int8, "fp8": _FP8_DTYPE}[self.mode]

    @property
    def packed_dim(self) -> int:
        """Elements of `storage_dtype` per token and head."""
        return self.head_dim // 2 if self.mode == "int4" else self.head_dim

    def bytes_per_token(self, scale_element_size: int) -> int:
        """Stored bytes per token and head: the codes plus one scale per group."""
        return (
            self.packed_dim * torch.empty((), dtype=self.storage_dtype).element_size()
            + self.groups * scale_element_size
        )

    def rotation_matrix(self, reference: torch.Tensor) -> torch.Tensor | None:
        """The `[group, group]` Hadamard matrix on `reference`'s device (None without rotation)."""
        return self._rotation_for(reference) if self.rotate else None

    def _rotation_for(self, reference: torch.Tensor) -> torch.Tensor:
        if self._rotation is None or self._rotation.device != reference.device:
            self._rotation = hadamard_matrix(self.group_size).to(reference.device)
        return self._rotation

    # --- quantize -------------------------------------------------------------------------------------------------
    @staticmethod
    @torch.no_grad()
    def calibrate(sample: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-channel `(shift, scale)` of `sample` (`[batch, heads, tokens, head_dim]`) over its tokens, per row and
        head: the mean, and the RMS deviation from it floored at `CALIBRATION_FLOOR` x the head's mean deviation
        (1 where a head did not vary at all, e.g. a one-token sample). Both `[batch, heads, 1, head_dim]`, in
        `sample.dtype` (the rounded values are the ones both directions use)."""
        values = sample.float()
        shift = values.mean(dim=-2, keepdim=True)
        spread = (values - shift).square().mean(dim=-2, keepdim=True).sqrt()
        scale = torch.maximum(spread, spread.mean(dim=-1, keepdim=True) * CALIBRATION_FLOOR)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        return shift.to(sample.dtype), scale.to(sample.dtype)

    @torch.no_grad()
    def quantize(
        self, tensor: torch.Tensor, calibration: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`[..., head_dim]` -> codes `[..., packed_dim]` (`storage_dtype`), scales `[..., groups]` (`tensor.dtype`).

        Computed in float32; the scale is rounded to the model dtype *before* dividing, so that dequantization with the
        stored scale reproduces the rounding grid exactly. With `calibration` (`calibrate`'s `(shift, scale)`), the
        codes are those of `(tensor - shift) / scale`.
        """
        values = tensor.float()
        if calibration is not None:
            shift, scale = calibration
            values = (values - shift.float()) / scale.float()
        grouped = values.unflatten(-1, (self.groups, self.group_size))
        if self.rotate:
            grouped = grouped @ self._rotation_for(grouped)
        if self.mode == "int4":
            # q4_0: the signed value of largest magnitude maps to -8, so it is represented exactly.
            index = grouped.abs().argmax(dim=-1, keepdim=True)
            scales = (grouped.gather(-1, index) / -8.0).to(tensor.dtype)
        else:
            limit = 127.0 if self.mode == "int8" else _FP8_MAX
            scales = (grouped.abs().amax(dim=-1, keepdim=True) / limit).to(tensor.dtype)
        divisor = scales.float()
        divisor = torch.where(divisor == 0, torch.ones_like(divisor), divisor)  # an all-zero group stays zero
        scaled = grouped / divisor
        if self.mode == "fp8":
            codes = scaled.clamp(-_FP8_MAX, _FP8_MAX).to(_FP8_DTYPE).flatten(-2)
        elif self.mode == "int8":
            codes = scaled.round().clamp(-127, 127).to(torch.int8).flatten(-2)
        else:
            nibbles = scaled.round().clamp(-8, 7).to(torch.int8).flatten(-2)
            half = self.head_dim // 2
            # Two's-complement nibbles: channel j in the low half-byte, channel j + half in the high one.
            codes = (nibbles[..., :half] & 0x0F) | (nibbles[..., half:] << 4)
        return codes, scales.squeeze(-1)

    # --- dequantize -----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def dequantize_into(
        self,
        codes: torch.Tensor,
        scales: torch.Tensor,
        out: torch.Tensor,
        scratch: torch.Tensor | None = None,
        calibration: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """Write the model-dtype values of `codes` / `scales` into `out` (`[..., head_dim]`), in place.

        A cast and an in-place multiply per tensor: torch's mixed int8 x bf16 multiply has no vectorized CPU kernel
        (docs/quantization.md), and in-place writes allocate nothing. int4 needs
        an int8 buffer of `codes`' shape for the unpacked nibbles: pass `scratch` to reuse one (a fresh buffer per
        call costs page faults). `calibration`: the `(shift, scale)` the codes were quantized with.
        """
        if self.mode == "int4":
            half = self.head_dim // 2
            scratch = torch.empty_like(codes) if scratch is None else scratch
            # Arithmetic shifts of int8 sign-extend the nibbles: no offset to subtract afterwards.
            torch.bitwise_right_shift(codes, 4, out=scratch)
            out[..., half:].copy_(scratch)
            torch.bitwise_left_shift(codes, 4, out=scratch)
            scratch.bitwise_right_shift_(4)
            out[..., :half].copy_(scratch)
        else:
            out.copy_(codes)
        grouped = out.unflatten(-1, (self.groups, self.group_size))
        grouped.mul_(scales.unsqueeze(-1).to(out.dtype))
        if self.rotate:
            self._rotate_in_place(grouped)
        if calibration is not None:
            shift, scale = calibration
            torch.addcmul(shift, out, scale, out=out)

    def _rotate_in_place(self, grouped: torch.Tensor) -> None:
        """`grouped` `[..., L, groups, group]` times the Hadamard matrix, in place, `ROTATION_TILE` tokens at a time:
        each tile's product lands in a small buffer and is copied back (a whole-history product allocates and
        page-faults a second history: about 2x slower, docs/quantization.md)."""
        rotation = self._rotation_for(grouped).to(grouped.dtype)
        length = grouped.shape[-3]
        if is_torchdynamo_compiling() or not length:  # a compiled graph fuses the whole product itself
            grouped.copy_(grouped @ rotation)
            return
        tile = min(ROTATION_TILE, length)
        buffer = torch.empty((tile * self.groups, self.group_size), dtype=grouped.dtype, device=grouped.device)
        for index in itertools.product(*(range(size) for size in grouped.shape[:-3])):
            row = grouped[index]  # [L, groups, group]: a view of `out`, contiguous per token
            for start in range(0, length, tile):
                part = row[start : start + tile].view(-1, self.group_size)
                product = buffer[: part.shape[0]]
                torch.matmul(part, rotation, out=product)
                part.copy_(product)

    def roundtrip(
        self, tensor: torch.Tensor, calibration: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """`dequantize(quantize(tensor))`: what the cache hands back for a stored token (tests, error bounds)."""
        codes, scales = self.quantize(tensor, calibration)
        out = torch.empty_like(tensor)
        self.dequantize_into(codes, scales, out, calibration=calibration)
        return out
