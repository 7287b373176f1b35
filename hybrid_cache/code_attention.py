"""Attention on the compressed full layers' int8 / int4 codes, for decode steps (no dequantized history).

`QuantizedFullLayer` stores every token's keys and values as int8 codes (or int4 nibbles) with one scale per group of
`group_size` channels, keys after a per-channel calibration `(k - shift) / scale`. Today's path dequantizes the whole
history into the model dtype every step and calls SDPA on it. For a decode step (a few query tokens) this module
computes the same attention on the codes instead:

- **Scores.** For a key stored as codes `c` with group scales `s_g` and calibration `(shift, scale)`,
  `q . k = q . shift + sum_g s_g * ((q * scale)_g . c_g)`: the calibration's scale folds into the query, its shift is
  one constant per query, and the per-token group scales factor out of each group's dot product. The calibrated
  query is quantized to int8 per (query, group) (llama.cpp's Q8 K.Q; `query_parts=2` adds a second int8 part for
  the residual, about 15 bits), and each group's dot products are exact int32 products of codes (`torch._int_mm`
  with a block-diagonal query matrix, one call per batch row, KV head and tile of `KEY_TILE` tokens, on the codes
  as stored: no copy of the int8 history; int4 bytes are unpacked per batch row and tile, in two whole-tile integer
  operations, into `16 * nibble`, whose factor 16 goes into the query's scale). Each tile's products are multiplied
  by their tokens' group scales and summed over groups with the query's group scales as weights. With the Hadamard
  rotation, the query is rotated instead of the keys (`H` is symmetric and orthogonal). The step's own keys are
  exact, as in the dequantizing path.
- **Softmax** in float32, with the model's mask (`[batch | 1, 1, q, kv]` boolean or additive), scaling and soft-cap.
- **Values.** `sum_t p_t * v_t` with `v_t = s_(t,g) * c_t`: tiles of `VALUE_TILE` tokens are cast to float32,
  multiplied by their group scales and multiplied by the probabilities, accumulating in float32. At no point is the
  whole history materialized in the model dtype (the largest temporary is one tile).

The arithmetic is exact up to: the query's int8 rounding (error measured in docs/quantization.md; `query_parts=2`
makes it negligible), float32 summation order, and the final cast to the model dtype. The codes themselves are read
as they are, so the result equals attention over the dequantized history with that rounded query
(`reference_attention`, the oracle of tests/core/test_code_attention.py).

How it plugs into transformers: the attention function `hybrid_cache_attention` is registered through
`AttentionInterface` under `CODE_ATTENTION` (`"hybrid_cache_sdpa"`; its mask function is SDPA's, except that a long
step's mask is described instead of built: `banded.py`, the banded prefill). For every other call whose keys are
ordinary tensors it *is* transformers' `sdpa_attention_forward` (same arguments, same result). A
compressed layer's decode step returns, instead of dequantized keys and values, a `CompressedKV`: a tensor-like
handle with the shape and dtype of the keys it stands for, no storage, and a reference to the codes. The registered
function recognises it and runs `code_domain_attention`; any other consumer (another attention function, any torch
operation) gets a `CodeAttentionError` naming the fix, never garbage. Which path a `HybridRingCache` takes is decided
per step by its `full_layer_code_attention` option (default: follow the model's attention implementation, so the
switch is `model.set_attn_implementation("hybrid_cache_sdpa")` and back, or `use_code_attention(model)`).

Which path runs where (docs/quantization.md has the measured table): the native kernel (`code_kernel`) where it can
run; elsewhere (no compiler, another CPU, a geometry the kernel does not take, another device) the torch operations
above are slower than dequantizing on some machines (3.4x the exact ring against 1.7x on an AVX2 CPU), so a layer
attends on its codes there only where that measured faster: `codes_preferred`, switched by
`HYBRID_CACHE_CODE_FALLBACK` (`auto`: measured once per machine and geometry, cached on disk; `codes`; `dequantize`).

Registration (on import of `hybrid_cache`) adds one name to transformers' global attention and mask registries; it
changes nothing for any model that does not select that name.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface

from . import code_kernel
from .banded import BandedMask, banded_attention, banded_sdpa_mask
from .errors import CodeAttentionError
from .prefill_steps import disable_prefill_steps, enable_prefill_steps, prefill_steps_of

__all__ = [
    "CODE_ATTENTION",
    "CODE_ATTENTION_MODES",
    "MAX_CODE_QUERY_LENGTH",
    "CodeAttentionError",
    "CompressedHistory",
    "CompressedKV",
    "code_domain_attention",
    "hybrid_cache_attention",
    "reference_attention",
    "register_code_attention",
    "use_code_attention",
]

CODE_ATTENTION = "hybrid_cache_sdpa"
# Storage modes whose codes are integers (fp8 codes are not: that mode keeps the dequantizing path).
CODE_ATTENTION_MODES = ("int8", "int4")
# Longest step (query tokens) that attends on the codes; longer steps (prefill chunks) keep the dequantizing path.
MAX_CODE_QUERY_LENGTH = 16
# Tokens of history cast to float32 at a time for the value product (a tile of batch x heads x VALUE_TILE x head_dim).
VALUE_TILE = 1024
# Tokens of key history per score tile (int4 codes are unpacked to int8 one batch row of one tile at a time).
KEY_TILE = 4096
# What the kernel's unpacked codes (`_scaled_codes`) are multiplied by, per mode: int4 nibbles come out as 16 x their
# value, and the factor is taken out of the query's scale (keys) or the group scales (values).
CODE_FACTOR = {"int8": 1, "int4": 16}
_QUERY_LEVELS = 127.0
_RESIDUAL_LEVELS = 254.0


@dataclass
class CompressedHistory:
    """The compressed history of one full layer for one step, and the step's own exact keys and values.

    Shapes (`b` batch, `h` KV heads, `L` history tokens, `q` step tokens, `G` groups):
    `key_codes` `[b, h, L, Dk]` int8 (int4: `[b, h, L, Dk / 2]`, channel `j` in the low nibble, `j + Dk / 2` in the
    high one), `key_scales` `[b, h, L, Gk]`, likewise for values; `key_shift` / `key_scale` `[b, h, 1, Dk]` (the
    calibration, or None); `key_rotation` / `value_rotation` `[group, group]` (the Hadamard matrix, or None);
    `current_keys` `[b, h, q, Dk]`, `current_values` `[b, h, q, Dv]` in the model dtype; `query_parts`: how
    `hybrid_cache_attention` rounds the query (`code_domain_attention`).
    """

    mode: str
    key_codes: torch.Tensor
    key_scales: torch.Tensor
    value_codes: torch.Tensor
    value_scales: torch.Tensor
    key_shift: torch.Tensor | None
    key_scale: torch.Tensor | None
    key_rotation: torch.Tensor | None
    value_rotation: torch.Tensor | None
    current_keys: torch.Tensor
    current_values: torch.Tensor
    query_parts: int = 1
    #: Called when attention on this history is refused or fails after the layer stored the step (the cache undoes
    #: the step at its next call: `steps.StepJournal.fail`).
    on_refusal: Callable[[], None] | None = None

    def refuse(self, error: BaseException) -> BaseException:
        """`error`, after telling the cache (`on_refusal`) that this step's attention did not run."""
        if self.on_refusal is not None:
            self.on_refusal()
        return error

    def __post_init__(self) -> None:
        if self.mode not in CODE_ATTENTION_MODES:
            raise ValueError(
                f"Attention on the codes supports {CODE_ATTENTION_MODES}, got {self.mode!r} (fp8 codes are not "
                f"integers); use full_layer_code_attention=False for this cache."
            )

    @property
    def history_length(self) -> int:
        return self.key_codes.shape[-2]

    @property
    def key_head_dim(self) -> int:
        return self.current_keys.shape[-1]

    @property
    def value_head_dim(self) -> int:
        return self.current_values.shape[-1]


_MISUSE = (
    "A compressed full layer (HybridRingCache(full_layer_quantization='int8'|'int4')) returned its history as codes "
    "for attention on the codes, but {what}. Select hybrid_cache's attention function for the model "
    "(`model.set_attn_implementation('hybrid_cache_sdpa')` or `with hybrid_cache.use_code_attention(model):`), or "
    "build the cache with full_layer_code_attention=False to get dequantized keys and values."
)


class CompressedKV(torch.Tensor):
    """Stands for the keys (or values) `[batch, kv_heads, history + step tokens, head_dim]` of a compressed full
    layer's decode step: right shape, dtype and device, no storage. Only `hybrid_cache_attention` reads it (through
    `.history`); every torch operation on it raises `CodeAttentionError`."""

    history: CompressedHistory
    role: str  # "keys" or "values"

    @staticmethod
    def __new__(cls, history: CompressedHistory, role: str) -> CompressedKV:
        states = history.current_keys if role == "keys" else history.current_values
        shape = (*states.shape[:2], history.history_length + states.shape[2], states.shape[3])
        handle = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=states.dtype, device=states.device)
        handle.history = history
        handle.role = role
        return handle

    # torch declares `Tensor.__torch_dispatch__` as a plain C function (`_disabled_torch_dispatch_impl`); subclasses
    # override it with the classmethod its protocol calls (torch's subclass documentation), which mypy cannot match.
    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Iterable[type], args: tuple[Any, ...] = (), kwargs: dict[Any, Any] | None = None
    ) -> Any:
        error = CodeAttentionError(_MISUSE.format(what=f"`{func}` was called on it (another attention function?)"))
        for handle in (a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, CompressedKV)):
            handle.history.refuse(error)
        raise error

    # mypy reads torch's `Tensor.__repr__(self, *, tensor_contents=None)` with a keyword it cannot match (`*, Any =`),
    # even when repeated here; a handle has no contents to show, so it takes none.
    def __repr__(self) -> str:  # type: ignore[override]
        return f"CompressedKV({self.role}, shape={tuple(self.shape)}, dtype={self.dtype}, mode={self.history.mode})"


# --- the kernel -----------------------------------------------------------------------------------------------------
def _scaled_codes(codes: torch.Tensor, mode: str, out: torch.Tensor | None) -> torch.Tensor:
    """The codes as int8 `[..., D]`, `CODE_FACTOR[mode]` times their value: int8 codes as stored (no copy); int4
    nibbles unpacked into `out` in two whole-tensor operations as `16 * nibble` (the low nibble shifted into the
    high half of the byte, the high nibble masked in place, both exact in int8)."""
    if mode != "int4":
        return codes
    assert out is not None  # int4 callers pass the buffer the nibbles are unpacked into
    half = codes.shape[-1]
    torch.bitwise_left_shift(codes, 4, out=out[..., :half])
    torch.bitwise_and(codes, -16, out=out[..., half:])
    return out


def _quantize_query(grouped: torch.Tensor, parts: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """`[..., G, g]` float32 -> `parts` int8 tensors of the same shape and the scale `[..., G, 1]`, such that
    `grouped ~ scale * (codes[0] + codes[1] / 254)`."""
    scale = grouped.abs().amax(dim=-1, keepdim=True) / _QUERY_LEVELS
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    scaled = grouped / scale
    high = scaled.round()
    codes = [high]
    if parts == 2:
        codes.append(((scaled - high) * _RESIDUAL_LEVELS).round())
    return [code.to(torch.int8) for code in codes], scale


def _calibrated_query(query: torch.Tensor, history: CompressedHistory) -> tuple[torch.Tensor, torch.Tensor]:
    """`[b, h, m, Dk]` float32 -> the query in the codes' domain `[b, h, m, Gk, g]` (calibration scale folded in,
    rotated like the keys) and the shift's constant `[b, h, m]`."""
    constant = torch.zeros(query.shape[:-1], dtype=torch.float32, device=query.device)
    if history.key_shift is not None:
        assert history.key_scale is not None  # the calibration sets the shift and the scale together
        constant = (query * history.key_shift.float()).sum(-1)
        query = query * history.key_scale.float()
    groups = history.key_scales.shape[-1]
    grouped = query.unflatten(-1, (groups, query.shape[-1] // groups))
    if history.key_rotation is not None:
        grouped = grouped @ history.key_rotation.float()
    return grouped, constant


def _history_scores(
    grouped: torch.Tensor,
    history: CompressedHistory,
    parts: int,
    constant: torch.Tensor,
    scaling: float,
    out: torch.Tensor,
) -> None:
    """Write the scaled scores `scaling * (q . k + constant)` of the calibrated query `[b, h, m, G, g]` against the
    key codes into `out` `[b, h, m, L]` float32 (the history's columns of the step's score matrix); `constant`
    `[b, h, m]` is the calibration shift's term."""
    batch, heads, m, groups, group = grouped.shape
    length = history.history_length
    codes, query_scale = _quantize_query(grouped, parts)
    if code_kernel.kernel_usable(history.key_codes, history.key_scales, history.mode, grouped):
        weight = query_scale.squeeze(-1) * (scaling / CODE_FACTOR[history.mode])  # [b, h, m, G]
        code_kernel.history_scores(
            history.key_codes,
            history.key_scales,
            history.mode,
            torch.cat([code.flatten(-2) for code in codes], dim=2),  # [b, h, parts * m, D], parts outermost
            torch.cat([weight, weight / _RESIDUAL_LEVELS][:parts], dim=2),
            constant * scaling,
            out,
        )
        return
    # Block-diagonal query matrix [D, parts * G * m]: column (p, G', j) holds part p of query j's group G' in the
    # rows of that group and zeros elsewhere, so codes [L, D] @ it gives every group's dot product on its own.
    block = torch.zeros((batch, heads, groups, group, parts, groups, m), dtype=torch.int8, device=grouped.device)
    torch.diagonal(block, dim1=2, dim2=5).copy_(torch.stack(codes, dim=-1).permute(0, 1, 4, 5, 2, 3))
    block = block.view(batch, heads, groups * group, parts * groups * m)
    query_scale = query_scale.squeeze(-1) / CODE_FACTOR[history.mode]  # [b, h, m, G]
    if parts == 2:
        query_scale = query_scale / _RESIDUAL_LEVELS
    # The sum over groups weighted by the query's group scales, as one small matrix product per tile:
    # [tile, G * m] @ [G * m, m] with the query scales on the diagonal blocks.
    query_weights = torch.diag_embed(query_scale.transpose(-1, -2)).flatten(2, 3)  # [b, h, G * m, m]
    key_scales = history.key_scales.float().unsqueeze(-1)  # [b, h, L, G, 1]
    scores = torch.empty((batch, heads, length, m), dtype=torch.float32, device=grouped.device)
    tile = min(KEY_TILE, length)
    products = torch.empty((batch, heads, tile, parts * groups * m), dtype=torch.int32, device=grouped.device)
    weighted = torch.empty((batch, heads, tile, groups, m), dtype=torch.float32, device=grouped.device)
    unpacked = None
    if history.mode == "int4":
        unpacked = torch.empty((tile, groups * group), dtype=torch.int8, device=grouped.device)
    for start in range(0, length, tile):
        end = min(start + tile, length)
        size = end - start
        for row in range(batch):
            for head in range(heads):
                codes_tile = _scaled_codes(
                    history.key_codes[row, head, start:end],
                    history.mode,
                    None if unpacked is None else unpacked[:size],
                )
                torch._int_mm(codes_tile, block[row, head], out=products[row, head, :size])
        tile_products = products[:, :, :size]
        if parts == 2:
            # |one group's product| <= 512 * 127 * 128, times 254 stays below 2**31 for groups up to 512 channels.
            split = tile_products.view(batch, heads, size, 2, groups * m)
            tile_products = split[..., 0, :].mul(int(_RESIDUAL_LEVELS)).add_(split[..., 1, :])
        # Each (token, group) product times the token's group scale (float32), then the weighted sum over groups.
        tile_weighted = weighted[:, :, :size]
        torch.mul(tile_products.view(batch, heads, size, groups, m), key_scales[:, :, start:end], out=tile_weighted)
        torch.matmul(tile_weighted.view(batch, heads, size, groups * m), query_weights, out=scores[:, :, start:end])
    torch.mul(scores.transpose(-1, -2) + constant.unsqueeze(-1), scaling, out=out)


def _history_values(probabilities: torch.Tensor, history: CompressedHistory) -> torch.Tensor:
    """`sum_t p_t * v_t` over the history: `[b, h, m, L]` float32 probabilities -> `[b, h, m, Dv]` float32."""
    groups = history.value_scales.shape[-1]
    if code_kernel.kernel_usable(history.value_codes, history.value_scales, history.mode, probabilities):
        out = code_kernel.history_values(
            history.value_codes, history.value_scales, history.mode, probabilities, 1.0 / CODE_FACTOR[history.mode]
        )
    else:
        out = _history_values_with_torch(probabilities, history)
    if history.value_rotation is not None:
        grouped = out.unflatten(-1, (groups, out.shape[-1] // groups))
        out = (grouped @ history.value_rotation.float()).flatten(-2)
    return out


def _history_values_with_torch(probabilities: torch.Tensor, history: CompressedHistory) -> torch.Tensor:
    """`_history_values` before the rotation, with torch operations, one tile of `VALUE_TILE` tokens at a time."""
    batch, heads, m, length = probabilities.shape
    head_dim = history.value_head_dim
    groups = history.value_scales.shape[-1]
    out = torch.zeros((batch, heads, m, head_dim), dtype=torch.float32, device=probabilities.device)
    size = min(VALUE_TILE, length)
    buffer = torch.empty((batch, heads, size, head_dim), dtype=torch.float32, device=probabilities.device)
    unpacked = None
    if history.mode == "int4":
        unpacked = torch.empty((batch, heads, size, head_dim), dtype=torch.int8, device=probabilities.device)
    for start in range(0, length, VALUE_TILE):
        end = min(start + VALUE_TILE, length)
        codes = _scaled_codes(
            history.value_codes[:, :, start:end],
            history.mode,
            None if unpacked is None else unpacked[:, :, : end - start],
        )
        # In float32, so that dividing a float16 scale by the factor cannot leave float16's normal range.
        scales = history.value_scales[:, :, start:end].unsqueeze(-1).float() / CODE_FACTOR[history.mode]
        values = buffer[:, :, : end - start]
        values.copy_(codes)
        values.unflatten(-1, (groups, head_dim // groups)).mul_(scales)
        out.add_(torch.matmul(probabilities[..., start:end], values))
    return out


def _masked_scores(
    scores: torch.Tensor, attention_mask: torch.Tensor | None, rep: int, query_length: int
) -> torch.Tensor:
    """Apply the model's mask to `[b, h, m, K]` scores (rows `m = rep * q`, query index fastest)."""
    batch, heads, m, keys = scores.shape
    view = scores.view(batch, heads, rep, query_length, keys)
    if attention_mask is None:
        if query_length > 1:  # causal among the step's own tokens (bottom-right aligned), history fully visible
            rows = torch.arange(query_length, device=scores.device)
            columns = torch.arange(keys, device=scores.device) - (keys - query_length)
            view.masked_fill_(columns[None, :] > rows[:, None], float("-inf"))
        return scores
    if attention_mask.dim() != 4 or attention_mask.shape[-1] != keys or attention_mask.shape[-2] != query_length:
        raise ValueError(
            f"Attention on the codes expects a [batch, 1, {query_length}, {keys}] mask (or None), got "
            f"{tuple(attention_mask.shape)}: the mask must cover the layer's history and this step's tokens."
        )
    mask = attention_mask[:, :1].unsqueeze(1)  # [b | 1, 1, 1, q, K]
    if mask.dtype == torch.bool:
        # As an additive mask of the mask's own (small) size: a broadcast masked_fill_ over the scores is slower.
        if not bool(mask.all()):  # a decode step without padding masks nothing
            view.add_(torch.zeros(mask.shape, device=mask.device).masked_fill_(~mask, float("-inf")))
    else:
        view.add_(mask.float())
    return scores


def code_domain_attention(
    query: torch.Tensor,
    history: CompressedHistory,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    softcap: float | None = None,
    query_parts: int = 1,
) -> torch.Tensor:
    """Attention of `query` `[b, Hq, q, Dk]` over a compressed history and the step's exact tokens, on the codes.

    Returns `[b, q, Hq, Dv]` in `query.dtype` (the layout transformers' attention functions return). `Hq` must be a
    multiple of the KV heads (grouped-query attention); `scaling` defaults to `Dk ** -0.5`; `softcap` as in eager
    Gemma attention (`softcap * tanh(scores / softcap)` before the mask). `query_parts`: 1 (int8 query, the
    default) or 2 (int8 query plus an int8 residual, about 15 bits).
    """
    if query_parts not in (1, 2):
        raise ValueError(f"`query_parts` must be 1 or 2, got {query_parts}.")
    batch, query_heads, query_length, head_dim = query.shape
    kv_heads = history.key_codes.shape[1]
    if query_heads % kv_heads or head_dim != history.key_head_dim:
        raise ValueError(
            f"Query [{batch}, {query_heads}, {query_length}, {head_dim}] does not fit the compressed keys "
            f"({kv_heads} KV heads of {history.key_head_dim}): query heads must be a multiple of the KV heads."
        )
    rep = query_heads // kv_heads
    scaling = head_dim**-0.5 if scaling is None else scaling
    exact_query = query.float().reshape(batch, kv_heads, rep * query_length, head_dim)
    grouped, constant = _calibrated_query(exact_query, history)
    length = history.history_length
    scores = torch.empty((batch, kv_heads, rep * query_length, length + query_length), device=query.device)
    _history_scores(grouped, history, query_parts, constant, scaling, out=scores[..., :length])
    current = torch.matmul(exact_query, history.current_keys.float().transpose(-1, -2))
    torch.mul(current, scaling, out=scores[..., length:])
    if softcap is not None:
        scores = torch.tanh(scores / softcap).mul_(softcap)
    scores = _masked_scores(scores, attention_mask, rep, query_length)
    probabilities = torch.softmax(scores, dim=-1).nan_to_num_(0.0)  # a fully masked row attends to nothing
    out = _history_values(probabilities[..., :length], history)
    out.add_(torch.matmul(probabilities[..., length:], history.current_values.float()))
    out = out.view(batch, kv_heads, rep, query_length, -1).reshape(batch, query_heads, query_length, -1)
    return out.transpose(1, 2).contiguous().to(query.dtype)


# --- the oracle -----------------------------------------------------------------------------------------------------
def _unpack_int4(codes: torch.Tensor) -> torch.Tensor:
    """`[..., D / 2]` packed nibbles -> `[..., D]` int8 in [-8, 7] (low nibbles first, then high ones): the oracle's
    own unpacking, independent of the kernel's `_scaled_codes`."""
    half = codes.shape[-1]
    out = torch.empty((*codes.shape[:-1], 2 * half), dtype=torch.int8, device=codes.device)
    low, high = out[..., :half], out[..., half:]
    torch.bitwise_right_shift(codes, 4, out=high)  # arithmetic shifts of int8 sign-extend the nibbles
    torch.bitwise_left_shift(codes, 4, out=low)
    low.bitwise_right_shift_(4)
    return out


def _int_codes(codes: torch.Tensor, mode: str) -> torch.Tensor:
    return _unpack_int4(codes) if mode == "int4" else codes


def _dequantize(codes: torch.Tensor, scales: torch.Tensor, mode: str, rotation: torch.Tensor | None) -> torch.Tensor:
    values = _int_codes(codes, mode).double()
    groups = scales.shape[-1]
    grouped = values.unflatten(-1, (groups, values.shape[-1] // groups)) * scales.double().unsqueeze(-1)
    if rotation is not None:
        grouped = grouped @ rotation.double()
    return grouped.flatten(-2)


def reference_attention(
    query: torch.Tensor,
    history: CompressedHistory,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    softcap: float | None = None,
    query_parts: int = 1,
) -> torch.Tensor:
    """What `code_domain_attention` computes, the straightforward way in float64: dequantize the whole history
    (calibration and rotation undone), attend with the query whose calibrated, rotated form is rounded as the
    kernel rounds it (`query_parts`; `None` keeps the query exact), eager softmax. `[b, q, Hq, Dv]`, `query.dtype`."""
    batch, query_heads, query_length, head_dim = query.shape
    kv_heads = history.key_codes.shape[1]
    rep = query_heads // kv_heads
    scaling = head_dim**-0.5 if scaling is None else scaling
    exact = query.double().reshape(batch, kv_heads, rep * query_length, head_dim)
    keys = _dequantize(history.key_codes, history.key_scales, history.mode, history.key_rotation)
    rounded = exact
    if query_parts is not None:
        grouped, _ = _calibrated_query(exact.float(), history)
        codes, scale = _quantize_query(grouped, query_parts)
        approx = codes[0].double() + (codes[1].double() / _RESIDUAL_LEVELS if query_parts == 2 else 0.0)
        approx = approx * scale.double()
        if history.key_rotation is not None:
            approx = approx @ history.key_rotation.double()  # H is its own inverse
        rounded = approx.flatten(-2)
        if history.key_scale is not None:
            rounded = rounded / history.key_scale.double()
    if history.key_shift is not None:
        assert history.key_scale is not None  # the calibration sets the shift and the scale together
        # k = shift + scale * codes': the shift's term with the exact query, the rest with the rounded one.
        scores_history = (exact * history.key_shift.double()).sum(-1, keepdim=True) + rounded @ (
            keys * history.key_scale.double()
        ).transpose(-1, -2)
    else:
        scores_history = rounded @ keys.transpose(-1, -2)
    scores = torch.cat([scores_history, exact @ history.current_keys.double().transpose(-1, -2)], -1) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = _masked_scores(scores, attention_mask, rep, query_length)
    probabilities = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    values = torch.cat(
        [
            _dequantize(history.value_codes, history.value_scales, history.mode, history.value_rotation),
            history.current_values.double(),
        ],
        dim=-2,
    )
    out = (probabilities @ values).view(batch, kv_heads, rep, query_length, -1)
    return out.reshape(batch, query_heads, query_length, -1).transpose(1, 2).contiguous().to(query.dtype)


# --- transformers integration ---------------------------------------------------------------------------------------
def hybrid_cache_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The attention function registered as `CODE_ATTENTION`: `code_domain_attention` for a compressed layer's
    decode step (`key` / `value` are `CompressedKV`), `banded.banded_attention` for a long step whose mask is a
    `BandedMask` (`banded.banded_sdpa_mask`, this name's mask function), transformers' `sdpa_attention_forward` for
    every other call."""
    if not isinstance(key, CompressedKV):
        if isinstance(value, CompressedKV):
            raise value.history.refuse(CodeAttentionError(_MISUSE.format(what="only the values were a handle")))
        if isinstance(attention_mask, BandedMask):
            return banded_attention(
                module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
            )
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    try:
        return _attention_on_codes(query, key, value, attention_mask, dropout, scaling, **kwargs)
    except BaseException as error:
        key.history.refuse(error)
        raise


def _attention_on_codes(
    query: torch.Tensor,
    key: CompressedKV,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float,
    scaling: float | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    if not isinstance(value, CompressedKV) or value.history is not key.history:
        raise CodeAttentionError(_MISUSE.format(what="the values are not the handle of the same step as the keys"))
    if dropout:
        raise CodeAttentionError(
            f"Attention on the codes has no dropout (got {dropout}); it serves inference. Call `model.eval()`, or use "
            f"full_layer_code_attention=False while training."
        )
    if kwargs.get("output_attentions"):
        raise CodeAttentionError(
            "Attention on the codes does not return attention weights; use attn_implementation='eager' (with "
            "full_layer_code_attention=False) to get them."
        )
    history = key.history
    if isinstance(attention_mask, BandedMask):  # only where a test lowered the threshold below a decode step
        attention_mask = attention_mask.dense()
    output = code_domain_attention(
        query, history, attention_mask, scaling=scaling, softcap=kwargs.get("softcap"), query_parts=history.query_parts
    )
    return output, None


def register_code_attention() -> None:
    """Register `hybrid_cache_attention` (and its mask function, `banded.banded_sdpa_mask`: SDPA's mask, described
    instead of built for long steps) under `CODE_ATTENTION` in transformers' global `AttentionInterface` /
    `AttentionMaskInterface` (idempotent; done on import of `hybrid_cache`; the mask hook wraps what is registered)."""
    if AttentionInterface._global_mapping.get(CODE_ATTENTION) is not hybrid_cache_attention:
        AttentionInterface.register(CODE_ATTENTION, hybrid_cache_attention)
    if CODE_ATTENTION not in AttentionMaskInterface._global_mapping:
        AttentionMaskInterface.register(CODE_ATTENTION, banded_sdpa_mask)


@contextlib.contextmanager
def use_code_attention(model: Any) -> Iterator[Any]:
    """Within the block, `model` uses `CODE_ATTENTION`: a long step attends block by block on its band (`banded.py`),
    `generate` prefills a long prompt in steps of `prefill_steps.PREFILL_STEP` tokens (`prefill_steps.py`), and a
    `HybridRingCache` with compressed full layers attends on their codes. The previous attention implementation (and
    `generate`) come back on exit, also after an exception."""
    register_code_attention()
    previous = model.config._attn_implementation
    stepped = prefill_steps_of(model) is not None or not hasattr(type(model), "generate")
    model.set_attn_implementation(CODE_ATTENTION)
    if not stepped:
        enable_prefill_steps(model, CODE_ATTENTION)
    try:
        yield model
    finally:
        if not stepped:
            disable_prefill_steps(model)
        model.set_attn_implementation(previous)


register_code_attention()
