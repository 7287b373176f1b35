"""The mask hook: makes transformers' own mask creation right for a ring-buffer key layout.

transformers builds every attention mask the same way: the model calls `create_causal_mask` /
`create_sliding_window_causal_mask`, which ask the cache for `get_query_offset(layer_idx)` and
`get_mask_sizes(q_length, layer_idx) -> (kv_length, kv_offset)`, then call the function registered for
`config._attn_implementation` in `AttentionMaskInterface` with key positions `kv_offset + arange(kv_length)`.

Once a ring buffer has wrapped, the ring's slots are not in time order, so no `(kv_length, kv_offset)` pair describes
the keys of a one-token decode step (the one step that returns the ring itself). `HybridRingCache` then returns a
`RingLayout` in place of the integer `kv_offset`: an object that carries the absolute position held by every returned
key slot (`-1` for an empty slot). The hook wraps the `sdpa`, `eager` and `flex_attention` mask functions: when
`kv_offset` is a `RingLayout`, the model's own `mask_function` (sliding window, causal, and any `or_mask_function` /
`and_mask_function` overlay such as Gemma's bidirectional image blocks) and the 2D padding mask are evaluated at
those real positions; in every other case the call is passed through untouched, so every other cache class gets the
exact masks it got before.

Model code may do one piece of arithmetic on `kv_offset` itself: `kv_length + kv_offset`, the length up to which it
pads per-position tensors (Gemma 3 / Gemma 4 image-block ids, `maybe_pad_block_sequence_ids`). A `RingLayout` answers
it with the cache length after the step (one past the newest position), which is what those tensors are indexed by;
any other arithmetic raises, because a time-ordered reading of ring slots would be silently wrong.

A `DenseMaskRequest` offset (time-ordered keys, one-token step on CPU with grouped-query attention) is an `int` equal
to the offset, served by the original function with the `is_causal` skip disabled: the same mask transformers builds
whenever it does not skip, which routes SDPA to its fast packed-GQA path on CPU. Being an `int`, it stays correct in
any code that reads it, the hook or not.

Other registered mask functions (flash attention, custom kernels) are wrapped with a guard that raises a clear error
if a `RingLayout` ever reaches them, instead of producing a wrong mask.

The hook is installed by `HybridRingCache` itself (on construction and on unpickling; idempotent, thread-safe);
`install_mask_hook()` / `uninstall_mask_hook()` are public for explicit control.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch
from transformers.masking_utils import (
    AttentionMaskInterface,
    causal_mask_function,
    sdpa_mask,
)
from transformers.utils import is_torchdynamo_compiling

from .code_attention import CODE_ATTENTION
from .errors import ConversationMismatchError, PreparedMaskError, UnsupportedAttentionError, WindowMismatchError
from .specs import declared_window
from .steps import check_mask_covers, refuse_unheld_key

__all__ = [
    "PROGRAM_ATTENTION",
    "SUPPORTED_ATTN_IMPLEMENTATIONS",
    "CacheOffset",
    "ConversationMismatchError",
    "DenseMaskRequest",
    "HeldFromOffset",
    "PreparedMaskError",
    "RingLayout",
    "UnsupportedAttentionError",
    "WindowMismatchError",
    "annotate_offset",
    "check_ring_attention_supported",
    "install_mask_hook",
    "is_mask_hook_installed",
    "uninstall_mask_hook",
]

# Mask functions the hook knows how to serve for a ring layout: each evaluates a mask function at arbitrary key
# positions (sdpa/eager materialize a dense [batch, 1, q, kv] mask, flex_attention a BlockMask from the same function).
# CODE_ATTENTION is hybrid_cache's own attention function (SDPA, or attention on compressed codes), with SDPA's mask.
#: The attention of an ExecuTorch runner program (`hybrid_cache.export.runner`, registered only by an export): its mask
#: function is sdpa's, its attention ExecuTorch's fused kernel. Last in the list: not one a user picks.
PROGRAM_ATTENTION = "hybrid_cache_program"
SUPPORTED_ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flex_attention", CODE_ATTENTION, PROGRAM_ATTENTION)

_HOOK_MARKER = "_hybrid_cache_hook_of"
_install_lock = threading.Lock()


class RingLayout:
    """The key layout of a wrapped ring's one-token step, passed where transformers expects `kv_offset`.

    Args:
        positions (`torch.LongTensor` of shape `[kv_length]`):
            Absolute token position held by each key slot returned by the layer's `update`, in slot order;
            `-1` marks an empty slot, which is always masked.
        end (`int`, *optional*):
            The cache length after the step: one past the newest position. Defaults to `positions.max() + 1`.

    `kv_length + layout` (the one arithmetic transformers' model code does on `kv_offset`, to pad per-position ids)
    gives `end`; any other arithmetic raises, since only the hook may read slot positions.
    `served` is set by the hook once a mask was built from this layout: the cache refuses to run a wrapped step whose
    layout was never served (a prepared 4D mask, or a mask path that bypassed the hook).
    """

    __slots__ = ("positions", "end", "served", "sliding_request", "columns_needed")

    def __init__(self, positions: torch.Tensor, end: int | torch.Tensor | None = None):
        self.positions = positions
        self.end = int(positions.max()) + 1 if end is None else end
        self.served = False
        self.sliding_request: bool | None = None  # see `HeldFromOffset.sliding_request`
        self.columns_needed: int | None = None  # see `CacheOffset.columns_needed`

    def __repr__(self) -> str:
        return f"RingLayout(positions={self.positions.tolist()}, end={self.end})"

    def __add__(self, other):
        if isinstance(other, int) and not isinstance(other, bool):
            # `kv_length + kv_offset`: the padded length of per-position tensors, i.e. `end` when kv_length is ours.
            return other - self.positions.shape[0] + self.end
        return self._refuse()

    __radd__ = __add__

    def _refuse(self, *args, **kwargs):
        raise UnsupportedAttentionError(
            "A HybridRingCache ring layout (`RingLayout`) reached code that treats `kv_offset` as an integer position. "
            "Ring slots are not in time order after the wrap, so only hybrid_cache's mask hook may read them. This "
            "happens when the mask is built by a function other than the hook (an `AttentionMaskInterface` entry "
            "registered on a local instance, or a model-specific mask path). Use attn_implementation='sdpa', 'eager' "
            "or 'flex_attention' with transformers' mask functions, or use `DynamicCache` for this model."
        )

    __sub__ = __rsub__ = __int__ = __index__ = __lt__ = __le__ = __gt__ = __ge__ = __mul__ = __rmul__ = _refuse


class CacheOffset(int):
    """An integer `kv_offset` given by `HybridRingCache` to the mask creation, with what the hook checks before
    passing the plain integer on. An `int`, so code that does not know it stays correct.

    `columns_needed` (set by the cache): the tokens held before the step plus the step's own. A 2D attention mask must
    cover them all; a shorter one means the inputs do not continue the cached conversation (a new, shorter prompt
    given to a cache that holds another one), and `ConversationMismatchError` is raised before anything is written.
    """

    columns_needed: int | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({int(self)})"


class DenseMaskRequest(CacheOffset):
    """A time-ordered integer `kv_offset` whose mask should be materialized (never replaced by SDPA's `is_causal`).

    Why: for a one-token step transformers skips the mask when nothing is padded, and its SDPA integration then runs
    grouped-query attention with `enable_gqa=True`; on CPU that kernel is several times slower than the packed path
    transformers takes when a mask is present (docs/benchmarks.md). The value is the plain offset, so every reader (the hook or not) gets the right
    positions; only the hook honours the request to materialize.
    """

    @property
    def offset(self) -> int:
        return int(self)

    def __repr__(self) -> str:
        return f"DenseMaskRequest(offset={int(self)})"


class HeldFromOffset(CacheOffset):
    """The integer `kv_offset` of a ring's time-ordered multi-token step whose older positions are no longer held.

    A ring's multi-token step (a prefill chunk or a new prompt after the wrap, a verification step) returns the held
    positions `[offset, length)` in time order followed by the new tokens, so the offset is a plain integer and every
    reader gets the right positions. Keys before `offset` were overwritten: the hook checks that the model's window
    does not reach them (`WindowMismatchError` otherwise) before passing the integer on. An `int`, so code that does
    not know the marker stays correct.
    """

    # Set by the cache: True when this request can only be for a sliding-window mask (the cache holds a full-attention
    # layer, so transformers sizes full masks against that one), False for a full-attention request (bounded full
    # layers: approximate by design, never checked), None when the cache cannot tell (no full layer held).
    sliding_request: bool | None = None


def _ring_mask_function(
    mask_function: Callable, positions: torch.Tensor, padding_mask: torch.Tensor | None
) -> Callable:
    """Evaluate `mask_function` (and the padding mask) at the real position of each key slot.

    `kv_idx` is the slot index (0..kv_length-1); `positions[kv_idx]` is the absolute token position it holds.
    Works with broadcast index tensors, under `vmap` (transformers wraps that path in `TransformGetItemToIndex`,
    which makes `positions[kv_idx]` a valid gather for a 0-d index) and as a flex-attention `mask_mod`.
    """
    valid = positions >= 0
    safe_positions = positions.clamp(min=0)
    if padding_mask is not None:
        # Positions past the end of the 2D mask count as padding, as in transformers' `prepare_padding_mask`.
        mask_length = padding_mask.shape[-1]
        valid = valid & (positions < mask_length)
        safe_positions = safe_positions.clamp(max=mask_length - 1)

    def inner_mask(batch_idx, head_idx, q_idx, kv_idx):
        kv_position = safe_positions[kv_idx]
        allowed = valid[kv_idx] & mask_function(batch_idx, head_idx, q_idx, kv_position)
        if padding_mask is not None:
            allowed = allowed & padding_mask[batch_idx, kv_position]
        return allowed

    return inner_mask


def _check_window(
    oldest_held: int,
    held_text: str,
    sliding_request: bool | None,
    batch_size: int,
    q_length: int,
    q_offset: int,
    mask_function: Callable,
    padding_mask: torch.Tensor | None,
    request: dict,
) -> None:
    """Refuse a sliding mask that lets a real query see a key older than the ring's oldest held position.

    The ring holds only its newest positions (from `oldest_held` on). If the model's window lets a real query (not a
    padding token) see position `oldest_held - 1`, the no-cache forward would attend to a key the ring has
    overwritten: the cache was built for a smaller window than the model's (e.g. from another config).

    Which mask is being built decides what is checked (`sliding_request`, set by the cache):

    - `True`: a sliding-window mask (the cache holds a full-attention layer, so transformers sizes full masks against
      that one): always checked.
    - `False`: a full-attention mask served by a bounded full layer (approximate by design): never checked.
    - `None`: the cache holds no full-attention layer (all-sliding models, pipeline stages without one), so
      transformers also sizes full-attention masks against a ring; those are built but no layer consumes them. A
      request that carries `local_size` (transformers' `create_sliding_window_causal_mask`) is a sliding one; without
      it, a mask that also sees position 0 is taken for a full-attention one and not checked.

    What is evaluated is the model's own `mask_function`, overlays included (an overlay reaching further back than
    the ring, e.g. a bidirectional block longer than the window, must be refused too), with transformers' own
    `sdpa_mask` on single key columns. `request`: the mask call's other keyword arguments (`device`, `use_vmap`,
    `local_size`, `config`).
    """
    if oldest_held <= 0 or sliding_request is False:
        return
    missing = oldest_held - 1
    device, local_size = request.get("device", "cpu"), request.get("local_size")

    def visible(position: int, padding: torch.Tensor | None) -> torch.Tensor:  # [batch, q]
        mask = sdpa_mask(
            batch_size=batch_size,
            q_length=q_length,
            kv_length=1,
            q_offset=q_offset,
            kv_offset=position,
            mask_function=mask_function,
            attention_mask=padding,
            allow_is_causal_skip=False,
            use_vmap=request.get("use_vmap", False),
            device=device,
        )
        assert mask is not None  # no skip allowed (causal, bidirectional): sdpa_mask materializes the mask
        return mask[:, 0, :, 0]

    violation = visible(missing, padding_mask)
    if padding_mask is not None:  # padding queries see nothing that a real token reads: ignore them
        query_positions = torch.arange(q_length, device=device) + q_offset
        inside = query_positions < padding_mask.shape[-1]
        violation = violation & (padding_mask[:, query_positions.clamp(max=padding_mask.shape[-1] - 1)] | ~inside)
    if sliding_request is None and local_size is None and bool(violation.any()):
        violation = violation & ~visible(0, None)  # full-attention masks are not a ring's
    if bool(violation.any()):
        model_window = local_size if local_size is not None else declared_window(request.get("config"))
        refuse_unheld_key(missing, held_text, model_window)


def _check_held_from(
    kv_offset: HeldFromOffset,
    batch_size: int,
    q_length: int,
    q_offset: int,
    mask_function: Callable,
    attention_mask: torch.Tensor | None,
    kwargs: dict[str, Any],
) -> None:
    """`_check_window` for a time-ordered multi-token step of a ring that returns no position before `kv_offset`
    (skipped while compiling: eager steps were checked)."""
    if is_torchdynamo_compiling():
        return
    device = kwargs.get("device", "cpu")
    padding_mask = None if attention_mask is None else attention_mask.to(device=device, dtype=torch.bool)
    _check_window(
        int(kv_offset),
        f"positions {int(kv_offset)} and later",
        kv_offset.sliding_request,
        batch_size,
        q_length,
        q_offset,
        mask_function,
        padding_mask,
        kwargs,
    )


def _check_mask_covers_cache(kv_offset: CacheOffset | RingLayout, attention_mask: torch.Tensor | None) -> None:
    """Refuse a 2D attention mask shorter than the cached tokens plus the step's own (see `CacheOffset`)."""
    needed = kv_offset.columns_needed
    if needed is None or attention_mask is None or attention_mask.ndim != 2 or is_torchdynamo_compiling():
        return
    check_mask_covers(attention_mask.shape[-1], needed)


_Offset = TypeVar("_Offset")


def _checked_offset(
    kv_offset: _Offset,
    batch_size: int | None,
    q_length: int | None,
    q_offset: int,
    mask_function: Callable,
    attention_mask: torch.Tensor | None,
    kwargs: dict[str, Any],
) -> _Offset | int:
    """The checks every offset from `HybridRingCache` gets before a mask is built (the 2D mask covers the cache, the
    model's window fits what a multi-token step returns); a `CacheOffset` comes back as the plain integer, anything
    else unchanged. The window check needs the call's sizes: skipped when they were passed positionally (None)."""
    if isinstance(kv_offset, (CacheOffset, RingLayout)):
        _check_mask_covers_cache(kv_offset, attention_mask)
    if isinstance(kv_offset, HeldFromOffset) and batch_size is not None and q_length is not None:
        _check_held_from(kv_offset, batch_size, q_length, q_offset, mask_function, attention_mask, kwargs)
    return int(kv_offset) if isinstance(kv_offset, CacheOffset) else kv_offset


def _make_ring_aware(original: Callable) -> Callable:
    """Wrap a mask function (`sdpa_mask` / `eager_mask` / `flex_attention_mask`) so it understands `RingLayout`."""

    def ring_aware_mask(
        batch_size: int,
        q_length: int,
        kv_length: int,
        q_offset: int = 0,
        kv_offset: int | RingLayout = 0,
        mask_function: Callable = causal_mask_function,
        attention_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> Any:
        if isinstance(kv_offset, DenseMaskRequest):
            kwargs["allow_is_causal_skip"] = False
        kv_offset = _checked_offset(kv_offset, batch_size, q_length, q_offset, mask_function, attention_mask, kwargs)
        if not isinstance(kv_offset, RingLayout):
            # Exact pass-through: every other cache (and ring layers in time order) is untouched.
            return original(
                batch_size=batch_size,
                q_length=q_length,
                kv_length=kv_length,
                q_offset=q_offset,
                kv_offset=kv_offset,
                mask_function=mask_function,
                attention_mask=attention_mask,
                **kwargs,
            )
        device = kwargs.get("device", "cpu")
        positions = kv_offset.positions.to(device)
        if positions.shape[0] != kv_length:
            raise RuntimeError(
                f"hybrid_cache internal error: ring layout has {positions.shape[0]} slots but the mask was asked for "
                f"kv_length={kv_length}. Please report this with the model config and call sequence."
            )
        padding_mask = None
        if attention_mask is not None:
            padding_mask = attention_mask.to(device=device, dtype=torch.bool)
        if not is_torchdynamo_compiling():
            held = kv_offset.positions[kv_offset.positions >= 0]
            if held.numel():
                _check_window(
                    int(held.min()),
                    f"positions {int(held.min())}..{int(held.max())} ({held.numel()} slots)",
                    kv_offset.sliding_request,
                    batch_size,
                    q_length,
                    q_offset,
                    mask_function,
                    padding_mask,
                    kwargs,
                )
            kv_offset.served = True
        # The ring's slots are not in time order, so `is_causal`-style skips never apply: always materialize.
        kwargs["allow_is_causal_skip"] = False
        kwargs["allow_is_bidirectional_skip"] = False
        kwargs.pop("local_size", None)
        return original(
            batch_size=batch_size,
            q_length=q_length,
            kv_length=kv_length,
            q_offset=q_offset,
            kv_offset=0,
            mask_function=_ring_mask_function(mask_function, positions, padding_mask),
            attention_mask=None,
            **kwargs,
        )

    setattr(ring_aware_mask, _HOOK_MARKER, original)
    ring_aware_mask.__doc__ = f"hybrid_cache ring-aware wrapper of `{getattr(original, '__name__', original)}`."
    return ring_aware_mask


def _make_guard(original: Callable, name: str) -> Callable:
    """Wrap a mask function that cannot serve a ring layout so it fails loudly instead of silently."""

    def guarded_mask(*args: Any, **kwargs: Any) -> Any:
        kv_offset = kwargs.get("kv_offset")
        if "kv_offset" in kwargs:
            kwargs["kv_offset"] = _checked_offset(
                kv_offset,
                kwargs.get("batch_size"),
                kwargs.get("q_length"),
                kwargs.get("q_offset", 0),
                kwargs.get("mask_function", causal_mask_function),
                kwargs.get("attention_mask"),
                kwargs,
            )
        if isinstance(kv_offset, RingLayout):
            raise UnsupportedAttentionError(
                f"attn_implementation={name!r} cannot attend over HybridRingCache's wrapped ring buffers (its mask "
                f"cannot express keys that are not in time order). Load the model with attn_implementation='sdpa', "
                f"'eager' or 'flex_attention' (e.g. `model.set_attn_implementation('sdpa')`), or use `DynamicCache`."
            )
        return original(*args, **kwargs)

    setattr(guarded_mask, _HOOK_MARKER, original)
    return guarded_mask


def is_mask_hook_installed(attn_implementation: str = "sdpa") -> bool:
    """Whether the globally registered mask function for `attn_implementation` is hybrid_cache's hook."""
    function = AttentionMaskInterface._global_mapping.get(attn_implementation)
    return function is not None and hasattr(function, _HOOK_MARKER)


def install_mask_hook() -> None:
    """Install the hook into `transformers.masking_utils.AttentionMaskInterface` (idempotent, thread-safe).

    Wraps whatever function is currently registered for each name, so a user's own registration made before
    this call keeps working for every cache other than `HybridRingCache`, and serves it too.
    """
    with _install_lock:
        for name, registered in list(AttentionMaskInterface._global_mapping.items()):
            # transformers' table is inferred as `dict[str, function]` (builtins.function, which mypy cannot call).
            function = cast(Callable[..., Any], registered)
            if hasattr(function, _HOOK_MARKER):
                continue
            if name in SUPPORTED_ATTN_IMPLEMENTATIONS:
                AttentionMaskInterface.register(name, _make_ring_aware(function))
            else:
                AttentionMaskInterface.register(name, _make_guard(function, name))


def uninstall_mask_hook() -> None:
    """Restore the mask functions that were registered before `install_mask_hook` (thread-safe)."""
    with _install_lock:
        for name, function in list(AttentionMaskInterface._global_mapping.items()):
            original = getattr(function, _HOOK_MARKER, None)
            if original is not None:
                AttentionMaskInterface.register(name, original)


def check_ring_attention_supported(attn_implementation: str | None) -> None:
    """Raise a clear error if a ring layout would be masked by an implementation the hook cannot serve; (re)install
    the hook if a function was registered for this name after us, so the ring stays exact."""
    implementation = attn_implementation or "sdpa"
    if implementation not in SUPPORTED_ATTN_IMPLEMENTATIONS:
        raise UnsupportedAttentionError(
            f"HybridRingCache supports attn_implementation in {SUPPORTED_ATTN_IMPLEMENTATIONS[:-1]} once its rings have "
            f"wrapped, but the model uses {implementation!r}: its attention cannot be masked for keys stored in ring "
            f"order. Load the model with attn_implementation='sdpa' (or call `model.set_attn_implementation('sdpa')`), "
            f"or use `DynamicCache`."
        )
    if not is_mask_hook_installed(implementation):
        install_mask_hook()


def annotate_offset(
    kv_offset: int | RingLayout, *, columns_needed: int | None, sliding_request: bool | None, dense: bool
) -> int | RingLayout:
    """What a `HybridRingCache` answers as `kv_offset` for transformers' mask creation: `kv_offset` itself, or, to be
    checked by the hook, a `CacheOffset` carrying `columns_needed` (a `DenseMaskRequest` when `dense`, for a
    one-token step whose mask should be materialized) and, for ring layouts and held windows, `sliding_request` (see
    `HeldFromOffset.sliding_request`). Compiled steps get the plain offset (no Python checks while tracing)."""
    if dense and not isinstance(kv_offset, RingLayout):
        kv_offset = DenseMaskRequest(kv_offset)
    if not is_torchdynamo_compiling():
        if not isinstance(kv_offset, (RingLayout, CacheOffset)):
            kv_offset = CacheOffset(kv_offset)
        kv_offset.columns_needed = columns_needed  # the 2D mask must cover the held tokens and the step's
    if isinstance(kv_offset, (RingLayout, HeldFromOffset)):
        kv_offset.sliding_request = sliding_request
    return kv_offset
