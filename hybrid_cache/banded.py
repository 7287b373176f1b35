"""Banded prefill: attention of a long query block by block on the keys each block can see, with no q x k mask.

A sliding layer's query at position `p` sees the keys `p - W + 1 .. p`, yet transformers' SDPA path builds a boolean
`[batch, 1, q, k]` mask per layer type (`masking_utils.sdpa_mask`: 256 MiB at 16K tokens, 1 GiB at 32K) and torch's
CPU kernel runs every key block of it. Under hybrid_cache's attention function (`hybrid_cache_sdpa`,
`code_attention.py`) a long step goes another way:

- **The mask function** registered for `hybrid_cache_sdpa` (`banded_sdpa_mask`) has `sdpa_mask`'s signature. For a
  step of fewer than `min_query_length` query tokens (decode, short chunks) it *is* `sdpa_mask` (same call, same
  result). For a longer step whose mask it can bound (below) it returns a `BandedMask`: the call's arguments (sizes,
  offsets, the model's `mask_function` with its overlays, the 2D padding mask), no tensor of `q x k`.
- **The bound.** Which keys a query may see is read from the mask function's structure, where it is built from
  transformers' own pieces (recognized by their code objects, so another release's different code is simply not
  recognized): `causal_mask_function` (keys up to the query), `sliding_window_overlay(W)` (keys after `p - W`),
  `sliding_window_bidirectional_overlay`, `blockwise_overlay(ids)` (the span of the query's image block: Gemma 3 / 4
  bidirectional image blocks), combined by `and_masks` (intersection) and `or_masks` (union); anything else bounds
  nothing. The bound is a superset of the visible keys, per query: each block attends on the hull of its rows' bounds
  and the mask *inside* that range is the model's own function evaluated by `sdpa_mask` on that sub-rectangle, so
  the result is the dense computation's, row by row. A mask without an upper bound (no causal part: bidirectional
  encoders, packed sequences, a function it does not know) keeps transformers' dense mask: exact, today's cost.
- **The attention** (`banded_attention`, called by `hybrid_cache_sdpa` for a `BandedMask`): query blocks of at most
  `block_size` rows (cut where the absolute query position crosses a multiple of it, every cut on a multiple of
  `ROW_GRANULARITY`), each `torch.nn.functional.scaled_dot_product_attention` on its key range with its block mask.
  The key range is the hull of the rows' bounds widened outward to multiples of `key_alignment` in absolute key
  positions; where that reaches before the step's first key (a ring or sliding cache holding `W - 1` keys), masked
  zero columns stand for the keys not held. A sliding layer's block of `b` rows computes about `W - 1 + b` keys per
  row (so rounded) instead of all of them; a full layer's block the keys up to its last row; a plain causal full
  layer over the whole prompt (no padding, no overlay) is transformers' own causal SDPA call without a mask. Rows
  with no visible key return zeros, as SDPA does for a fully masked row.

Contracts: exact: each row's softmax runs over the dense mask's visible keys. With the default settings on torch's
CPU kernel it is also the same float computation: the kernel sums a row's keys in groups of 512 counted from its
first key, and the aligned key ranges give every row the groups that SDPA over the dense mask of the whole prompt
(keys from position 0) gives it, fully masked groups adding exact zeros; so the output is that one's bit for bit, in
one forward or in steps (tests/core/test_banded.py), fp32 and bf16. Other settings, other devices and SDPA on a
step's own keys (a sliding cache's keys start at `p - W + 1`, not on a group boundary) agree up to float summation
order. Memory is linear in the query length (the largest temporaries are `[batch, heads, block, range]`). Nothing
but `banded_attention` reads a `BandedMask` (any torch function on it raises `BandedMaskError` naming the fix;
Gemma 4's row selection `mask[:, :, rows, :]` before its KV-shared layers is supported).
`banded_prefill(min_query_length=None)` or `HYBRID_CACHE_BANDED=off` turns it off.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F
from transformers import masking_utils
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import (
    and_masks,
    causal_mask_function,
    or_masks,
    prepare_padding_mask,
    sdpa_mask,
    sliding_window_bidirectional_overlay,
    sliding_window_overlay,
)
from transformers.utils import is_torchdynamo_compiling

from .errors import BandedMaskError

__all__ = [
    "BLOCK_SIZE",
    "KEY_ALIGNMENT",
    "MIN_QUERY_LENGTH",
    "ROW_GRANULARITY",
    "BandedMask",
    "BandedMaskError",
    "banded_attention",
    "banded_prefill",
    "banded_sdpa_mask",
    "banded_settings",
    "key_bounds",
]

#: Query tokens from which a step's masks are described instead of built: below it (decode, verification steps,
#: short chunks) the dense mask is small and the banded path has nothing to gain (docs/design.md#the-banded-prefill).
MIN_QUERY_LENGTH = 512
#: Key ranges start and end on multiples of this many absolute key positions (the last one: at the step's last key).
#: torch's CPU flash attention sums a query row's keys in groups of 512 counted from the first key it is given, fp32
#: and bf16 alike; a range aligned so is a union of the groups of the dense computation over the whole prompt.
KEY_ALIGNMENT = 512
#: Query rows per block, cut where the absolute query position crosses a multiple of it, so that a block's key range
#: ends on an aligned boundary. With `KEY_ALIGNMENT` = `BLOCK_SIZE` = `W` = 512 a sliding layer's block computes 1024
#: keys per row, as one prefill chunk of 512 tokens does, against every key before it for the dense mask.
BLOCK_SIZE = 512
#: Block cuts fall on multiples of this many query positions, as the kernel's own row blocks do (32, 64 or 256 rows
#: from the first): rows of a block starting elsewhere can round otherwise.
ROW_GRANULARITY = 32
_ENV = "HYBRID_CACHE_BANDED"
_NEG, _POS = -(2**62), 2**62  # "no bound" below / above, in key positions


@dataclass
class _Settings:
    min_query_length: int | None
    block_size: int
    key_alignment: int


def _initial_settings() -> _Settings:
    setting = os.environ.get(_ENV, "auto").strip().lower() or "auto"
    if setting not in ("auto", "off"):
        raise BandedMaskError(f"{_ENV}={setting!r} is not a setting; use auto (the default) or off.")
    return _Settings(None if setting == "off" else MIN_QUERY_LENGTH, BLOCK_SIZE, KEY_ALIGNMENT)


_settings = _initial_settings()


def banded_settings() -> tuple[int | None, int, int]:
    """`(min_query_length, block_size, key_alignment)` in effect (`min_query_length` None: banded prefill off)."""
    return _settings.min_query_length, _settings.block_size, _settings.key_alignment


@contextlib.contextmanager
def banded_prefill(
    min_query_length: int | None = MIN_QUERY_LENGTH, block_size: int = BLOCK_SIZE, key_alignment: int = KEY_ALIGNMENT
) -> Iterator[None]:
    """Within the block, steps of at least `min_query_length` query tokens attend block by block (`block_size`
    rows, key ranges aligned to `key_alignment` absolute positions); `min_query_length=None`: never (transformers'
    dense masks). Process-wide; the previous settings come back on exit. `HYBRID_CACHE_BANDED=off` sets the default
    to never. Other block sizes and alignments than the defaults stay exact up to float summation order, not bit for
    bit (tests use them to send tiny models through the banded path).

    Raises:
        BandedMaskError: a setting that is not a positive int (`min_query_length` may be None).
    """
    values = {"min_query_length": min_query_length, "block_size": block_size, "key_alignment": key_alignment}
    for name, value in values.items():
        if (value is not None or name != "min_query_length") and (
            not isinstance(value, int) or isinstance(value, bool) or value < 1
        ):
            raise BandedMaskError(f"banded_prefill: {name} must be a positive int, got {value!r}.")
    previous = replace(_settings)
    vars(_settings).update(values)
    try:
        yield
    finally:
        vars(_settings).update(vars(previous))


# --- the bound: which keys a query may see, read from the mask function's structure -----------------------------------
def _code(function: Callable) -> Any:
    return getattr(function, "__code__", None)


_AND, _OR = _code(and_masks(causal_mask_function)), _code(or_masks(causal_mask_function))
_WINDOW = _code(sliding_window_overlay(1))
_BIDIRECTIONAL_WINDOW = _code(sliding_window_bidirectional_overlay(1))
# `blockwise_overlay` (Gemma 3 / 4's image blocks) is not in transformers 5.5, whose models build the image
# mask with a function of their own: not recognized here (unbounded), so those steps keep the dense mask.
_blockwise_overlay = getattr(masking_utils, "blockwise_overlay", None)
_BLOCKS = _code(_blockwise_overlay(torch.zeros((1, 1), dtype=torch.long))) if _blockwise_overlay else object()


def _cells(function: Callable) -> dict[str, Any]:
    code, closure = _code(function), getattr(function, "__closure__", None) or ()
    return dict(zip(code.co_freevars, (cell.cell_contents for cell in closure)))


def _block_spans(ids: torch.Tensor, queries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The first and last position of each query's block in `ids` `[batch, n]` (`blockwise_overlay`: a query of
    block `g >= 0` sees the keys of block `g`), `(+inf, -inf)` for a query outside any block; None if unreadable."""
    if ids.ndim != 2 or queries.numel() == 0 or int(queries.max()) >= ids.shape[1] or int(queries.min()) < 0:
        return None
    batch, length = ids.shape
    groups = torch.where(ids < 0, -1, ids.long()) + 1  # 0: no block
    if int(groups.max()) > length:
        return None
    positions = torch.arange(length, device=ids.device).expand(batch, length)
    first = torch.full((batch, length + 1), _POS, dtype=torch.long, device=ids.device)
    last = torch.full((batch, length + 1), _NEG, dtype=torch.long, device=ids.device)
    first.scatter_reduce_(1, groups, positions, "amin")
    last.scatter_reduce_(1, groups, positions, "amax")
    first[:, 0], last[:, 0] = _POS, _NEG
    query_groups = groups[:, queries]
    return first.gather(1, query_groups), last.gather(1, query_groups)


def key_bounds(mask_function: Callable, queries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inclusive bounds `(lo, hi)` `[batch | 1, q]` on the key positions `mask_function` may allow for each query
    position in `queries` `[q]`: every allowed key `k` of query `p` has `lo <= k <= hi` (a superset, never tighter
    than the function). Unrecognized functions are unbounded (`-2**62`, `2**62`); an empty bound has `lo > hi`."""
    code = _code(mask_function)
    queries = queries.long()
    row = queries.unsqueeze(0)
    if mask_function is causal_mask_function:
        return torch.full_like(row, _NEG), row
    if code is _WINDOW:
        return row - int(_cells(mask_function)["sliding_window"]) + 1, torch.full_like(row, _POS)
    if code is _BIDIRECTIONAL_WINDOW:
        window = int(_cells(mask_function)["sliding_window"])
        return row - window, row + window
    if code is _BLOCKS:
        spans = _block_spans(_cells(mask_function)["block_sequence_ids"], queries)
        if spans is not None:
            return spans
    if code is _AND or code is _OR:
        parts = [key_bounds(part, queries) for part in _cells(mask_function)["mask_functions"]]
        if not parts:
            return torch.full_like(row, _NEG), torch.full_like(row, _POS)
        lo, hi = parts[0]
        for part_lo, part_hi in parts[1:]:
            if code is _AND:
                lo, hi = torch.maximum(lo, part_lo), torch.minimum(hi, part_hi)
            else:  # the hull of the union; an empty part (lo > hi) must not widen it
                empty = part_lo > part_hi
                lo = torch.minimum(lo, torch.where(empty, _POS, part_lo))
                hi = torch.maximum(hi, torch.where(empty, _NEG, part_hi))
        return lo, hi
    return torch.full_like(row, _NEG), torch.full_like(row, _POS)


def _is_plain(mask_function: Callable) -> bool:
    """Whether `mask_function` is causal, possibly and-ed with sliding windows: a function of `q - k` alone."""
    if mask_function is causal_mask_function or _code(mask_function) is _WINDOW:
        return True
    return _code(mask_function) is _AND and all(_is_plain(part) for part in _cells(mask_function)["mask_functions"])


# --- the description ------------------------------------------------------------------------------------------------
_MISUSE = (
    "A banded mask description (hybrid_cache's attention `hybrid_cache_sdpa` describes a long step's mask instead of "
    "building a [batch, 1, q, k] tensor) reached {what}; only hybrid_cache_sdpa's attention reads it. Use "
    "attn_implementation='sdpa' for this model (`model.set_attn_implementation('sdpa')`), or build the dense masks "
    "with `with hybrid_cache.banded.banded_prefill(min_query_length=None):` (or HYBRID_CACHE_BANDED=off)."
)


@dataclass
class BandedMask:
    """What `sdpa_mask` would build for a long step, `[batch, 1, q_length, kv_length]`, as a description.

    Args:
        q_offset / kv_offset: absolute positions of query row 0 and key column 0 (keys are contiguous positions).
        mask_function: the model's mask function, overlays included, of absolute positions `(b, h, q, k)`.
        padding_mask: the 2D padding mask `[batch, >= kv_offset + kv_length]` (True: a real token), or None.
        request: the rest of the mask call's keyword arguments (`use_vmap`, `device`, ...), for `sdpa_mask`.
    The block masks are `sdpa_mask` on sub-rectangles of the same call, so every entry is the dense mask's.
    """

    batch_size: int
    q_length: int
    kv_length: int
    q_offset: int
    kv_offset: int
    mask_function: Callable
    padding_mask: torch.Tensor | None
    request: dict[str, Any]
    _bounds: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)
    _masks: dict[tuple, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.batch_size, 1, self.q_length, self.kv_length)

    @property
    def ndim(self) -> int:
        return 4

    def contiguous(self) -> BandedMask:
        """Itself: `generate` (5.18 to 5.24) calls `.contiguous()` on the masks it prepares for a compileable cache."""
        return self

    @property
    def dtype(self) -> torch.dtype:
        return torch.bool

    @property
    def device(self) -> torch.device:
        return torch.device(self.request.get("device", "cpu"))

    @property
    def plain(self) -> bool:
        """The mask is a function of `q - k` alone (causal / sliding, no padding, no overlay)."""
        return self.padding_mask is None and _is_plain(self.mask_function)

    def bounds(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`key_bounds` of every query row, in key columns (computed once, shared by the layers of this mask)."""
        if self._bounds is None:
            queries = torch.arange(self.q_length, device=self.device) + self.q_offset
            lo, hi = key_bounds(self.mask_function, queries)
            self._bounds = (lo - self.kv_offset, hi - self.kv_offset)
        return self._bounds

    @property
    def bounded(self) -> bool:
        """Every query row has a finite upper bound (the banded path gains; otherwise the dense mask is kept)."""
        return bool((self.bounds()[1] < _POS - self.kv_offset).all())

    def key_range(self, start: int, stop: int, alignment: int = 1) -> tuple[int, int, int]:
        """Key columns `[c0, c1)` holding every key query rows `[start, stop)` may see, widened to multiples of
        `alignment` in absolute key positions (the last column at most), and how many positions the aligned start
        lies before the first key (`pad`: columns of no key, masked). At least one column."""
        lo, hi = self.bounds()
        low = max(int(lo[:, start:stop].amin()), 0)
        high = min(int(hi[:, start:stop].amax()) + 1, self.kv_length)
        if high <= low:  # no row sees a key (padding): one fully masked column gives SDPA's zeros
            low = min(max(low, 0), self.kv_length - 1)
            high = low + 1
        first = (self.kv_offset + low) // alignment * alignment - self.kv_offset
        last = min(-(-(self.kv_offset + high) // alignment) * alignment - self.kv_offset, self.kv_length)
        return max(first, 0), last, max(-first, 0)

    def row_blocks(self, size: int, granularity: int = 1) -> list[tuple[int, int]]:
        """Query rows in blocks of at most `size`, cut where the absolute query position reaches a multiple of
        `size`, every cut on a multiple of `granularity <= size` positions (a cut between two such positions becomes
        a small block of the rows around it)."""
        cuts = {0, self.q_length}
        for cut in range((-self.q_offset) % size or size, self.q_length, size):
            position = self.q_offset + cut
            for rounded in (position // granularity * granularity, -(-position // granularity) * granularity):
                cuts.add(min(max(rounded - self.q_offset, 0), self.q_length))
        ordered = sorted(cuts)
        return list(zip(ordered, ordered[1:]))

    def block(self, start: int, stop: int, low: int, high: int) -> torch.Tensor:
        """The mask of query rows `[start, stop)` over key columns `[low, high)`, `[batch, 1, rows, columns]` bool:
        transformers' `sdpa_mask` evaluated on that sub-rectangle of this call."""
        mask = sdpa_mask(
            **self.request,
            batch_size=self.batch_size,
            q_length=stop - start,
            kv_length=high - low,
            q_offset=self.q_offset + start,
            kv_offset=self.kv_offset + low,
            mask_function=self.mask_function,
            attention_mask=self.padding_mask,
            allow_is_causal_skip=False,
            allow_is_bidirectional_skip=False,
        )
        assert mask is not None  # no skip allowed: sdpa_mask materializes
        return mask

    def additive_block(
        self, start: int, stop: int, low: int, high: int, dtype: torch.dtype, pad: int = 0
    ) -> torch.Tensor:
        """`block` as SDPA's additive form in `dtype` (0 / -inf: what SDPA converts a boolean mask to), after `pad`
        masked columns of no key. A plain mask depends on `q - k` alone, so its blocks are cached by their geometry
        (a sliding layer has two or three)."""
        shift = self.q_offset + start - self.kv_offset - low
        key = (shift, stop - start, high - low, pad, dtype) if self.plain else None
        if key is not None and key in self._masks:
            return self._masks[key]
        allowed = self.block(start, stop, low, high)
        additive = torch.full((*allowed.shape[:-1], pad + allowed.shape[-1]), -torch.inf, dtype=dtype)
        additive = additive.to(allowed.device)
        additive[..., pad:].masked_fill_(allowed, 0.0)
        if key is not None:
            self._masks[key] = additive
        return additive

    def dense(self) -> torch.Tensor:
        """The whole mask `[batch, 1, q_length, kv_length]` (what `sdpa_mask` returns without skipping)."""
        return self.block(0, self.q_length, 0, self.kv_length)

    def __getitem__(self, index: Any) -> BandedMask:
        """`mask[:, :, rows, :]` with a slice of rows (Gemma 4 keeps the last rows before its KV-shared layers)."""
        full = slice(None)
        if (
            isinstance(index, tuple)
            and len(index) == 4
            and index[0] == full
            and index[1] == full
            and index[3] == full
            and isinstance(index[2], slice)
            and index[2].step in (None, 1)
        ):
            start, stop, _ = index[2].indices(self.q_length)
            stop = max(stop, start)
            rows = replace(self, q_length=stop - start, q_offset=self.q_offset + start, _bounds=None, _masks={})
            if self._bounds is not None:
                rows._bounds = (self._bounds[0][:, start:stop], self._bounds[1][:, start:stop])
            return rows
        raise BandedMaskError(_MISUSE.format(what=f"an indexing `mask[{index!r}]` other than a slice of query rows"))

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise BandedMaskError(_MISUSE.format(what=f"the torch function `{getattr(func, '__name__', func)}`"))


def _integer(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool):
        return int(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
        return int(value)  # StaticCache's tensor offset (eager: compiled calls keep the dense mask)
    return None


def banded_sdpa_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Callable = causal_mask_function,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor | BandedMask | None:
    """The mask function of `hybrid_cache_sdpa`: `sdpa_mask` itself for a step shorter than `min_query_length`
    (and while compiling, and for masks it cannot bound); a `BandedMask` for a longer one."""

    def dense() -> torch.Tensor | None:
        return sdpa_mask(
            batch_size=batch_size,
            q_length=q_length,
            kv_length=kv_length,
            q_offset=q_offset,
            kv_offset=kv_offset,
            mask_function=mask_function,
            attention_mask=attention_mask,
            **kwargs,
        )

    threshold = _settings.min_query_length
    if threshold is None or q_length < threshold or is_torchdynamo_compiling():
        return dense()
    query_start, key_start = _integer(q_offset), _integer(kv_offset)
    if query_start is None or key_start is None or (attention_mask is not None and attention_mask.ndim != 2):
        return dense()
    padding = prepare_padding_mask(attention_mask, kv_length, key_start)
    if padding is not None:
        padding = padding.to(device=kwargs.get("device", padding.device), dtype=torch.bool)
        if bool(padding[:, key_start : key_start + kv_length].all()):
            padding = None  # nothing padded: the plain (mask-free, cached) paths apply
    request = {key: value for key, value in kwargs.items() if key not in ("local_size", "allow_is_causal_skip")}
    request.pop("allow_is_bidirectional_skip", None)
    mask = BandedMask(batch_size, q_length, kv_length, query_start, key_start, mask_function, padding, request)
    return mask if mask.bounded else dense()


# --- the attention --------------------------------------------------------------------------------------------------
def _grouped(states: torch.Tensor, heads: int, low: int, high: int, pad: int) -> torch.Tensor:
    """Key (or value) columns `[low, high)` of `[b, Hkv, k, D]` after `pad` zero columns, for `heads` query heads as
    transformers' `repeat_kv` gives them to SDPA (one KV head as an expanded view: the same values, no copy)."""
    states = states[:, :, low:high]
    if pad:
        states = torch.cat([states.new_zeros((*states.shape[:2], pad, states.shape[-1])), states], dim=2)
    if states.shape[1] == heads:
        return states
    if states.shape[1] == 1:
        return states.expand(-1, heads, -1, -1)
    groups = heads // states.shape[1]
    return states[:, :, None].expand(states.shape[0], states.shape[1], groups, *states.shape[2:]).flatten(1, 2)


def banded_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: BandedMask,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention of `query` `[b, Hq, q, D]` over `key` / `value` `[b, Hkv, k, D]` under the described mask, block by
    block: `[b, q, Hq, Dv]` (the layout transformers' attention functions return), no attention weights.

    The keyword arguments are those of transformers' `sdpa_attention_forward`; soft-capping and position biases are
    refused as SDPA refuses them (`is_causal` is implied by the description)."""
    mask = attention_mask
    if kwargs.get("softcap") is not None:
        raise ValueError("`hybrid_cache_sdpa` (SDPA) does not support `softcap`; use attn_implementation='eager'.")
    if kwargs.get("position_bias") is not None:
        raise ValueError("The banded prefill does not take a `position_bias`; use attn_implementation='sdpa'.")
    batch, heads, length, _ = query.shape
    if length != mask.q_length or key.shape[2] != mask.kv_length or query.shape[0] not in (mask.batch_size, 1):
        raise BandedMaskError(
            f"The banded mask describes {mask.batch_size} x {mask.q_length} queries over {mask.kv_length} keys, but "
            f"attention got query {tuple(query.shape)} and keys {tuple(key.shape)}: the mask was built for another "
            f"step. Build the masks from this step's inputs and cache (or pass a 2D attention mask)."
        )
    if mask.plain and mask.q_length == mask.kv_length and mask.q_offset == mask.kv_offset:
        lo, hi = mask.bounds()
        if bool((hi[0] == torch.arange(length, device=hi.device)).all()) and int(lo.max()) <= 0:
            # A causal full layer over the whole prompt: transformers' own call, causal, no mask.
            return sdpa_attention_forward(module, query, key, value, None, dropout=dropout, scaling=scaling, **kwargs)
    out = query.new_empty((batch, length, heads, value.shape[-1]))
    size = _settings.block_size
    for start, stop in mask.row_blocks(size, min(ROW_GRANULARITY, size)):
        low, high, pad = mask.key_range(start, stop, _settings.key_alignment)
        rows = F.scaled_dot_product_attention(
            query[:, :, start:stop],
            _grouped(key, heads, low, high, pad),
            _grouped(value, heads, low, high, pad),
            attn_mask=mask.additive_block(start, stop, low, high, query.dtype, pad),
            dropout_p=dropout,
            scale=scaling,
        )
        out[:, start:stop] = rows.transpose(1, 2)
    return out, None
