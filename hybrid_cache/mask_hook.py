"""The mask hook: makes transformers' own mask creation right for a ring-buffer key layout.

transformers builds every attention mask the same way: the model calls `create_causal_mask` /
`create_sliding_window_causal_mask`, which ask the cache for `get_query_offset(layer_idx)` and
`get_mask_sizes(q_length, layer_idx) -> (kv_length, kv_offset)`, then call the function registered for
`config._attn_implementation` in `AttentionMaskInterface` with key positions `kv_offset + arange(kv_length)`.

Once a ring buffer has wrapped, its slots are not in time order, so no `(kv_length, kv_offset)` pair describes them.
`HybridRingCache` then returns a `RingLayout` in place of the integer `kv_offset`: an object that carries the absolute
position held by every returned key slot (`-1` for an empty slot). The hook wraps the `sdpa` and `eager` mask
functions: when `kv_offset` is a `RingLayout`, the model's own `mask_function` (sliding window, causal, and any
`or_mask_function` / `and_mask_function` overlay) and the 2D padding mask are evaluated at those real positions;
in every other case the call is passed through untouched, so every other cache class gets the exact masks it got
before. A `DenseMaskRequest` offset (time-ordered keys, one-token step on CPU with grouped-query attention) is served
by the original function with its integer offset and the `is_causal` skip disabled: the same mask transformers builds
whenever it does not skip, which routes SDPA to its fast packed-GQA path on CPU. Other registered mask functions (flash attention, flex attention) are wrapped with a guard that raises a
clear error if a `RingLayout` ever reaches them, instead of producing a wrong mask.

The hook is installed by `HybridRingCache` itself (idempotent, thread-safe); `install_mask_hook()` /
`uninstall_mask_hook()` are public for explicit control.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function

__all__ = [
    "SUPPORTED_ATTN_IMPLEMENTATIONS",
    "DenseMaskRequest",
    "RingLayout",
    "UnsupportedAttentionError",
    "install_mask_hook",
    "is_mask_hook_installed",
    "uninstall_mask_hook",
]

# Mask functions the hook knows how to serve for a ring layout. Both materialize a dense [batch, 1, q, kv] mask.
SUPPORTED_ATTN_IMPLEMENTATIONS = ("sdpa", "eager")

_HOOK_MARKER = "_hybrid_cache_hook_of"
_install_lock = threading.Lock()


class UnsupportedAttentionError(RuntimeError):
    """Raised when a ring-buffer layout would be served by an attention path that cannot mask it correctly."""


class RingLayout:
    """The key layout of a ring-buffer layer for one forward pass, passed where transformers expects `kv_offset`.

    Args:
        positions (`torch.LongTensor` of shape `[kv_length]`):
            Absolute token position held by each key slot returned by the layer's `update`, in slot order;
            `-1` marks an empty slot, which is always masked.

    Integer arithmetic on it raises on purpose: only the hook may interpret it, and any other consumer of
    `kv_offset` would otherwise silently build a time-ordered mask for keys that are not in time order.
    """

    __slots__ = ("positions",)

    def __init__(self, positions: torch.Tensor):
        self.positions = positions

    def __repr__(self) -> str:
        return f"RingLayout(positions={self.positions.tolist()})"

    def _refuse(self, *args, **kwargs):
        raise UnsupportedAttentionError(
            "A HybridRingCache key layout (`RingLayout` / `DenseMaskRequest`) reached code that treats `kv_offset` "
            "as an integer. This happens when the mask is built by a function other than hybrid_cache's hook (a locally "
            "overridden `AttentionMaskInterface` entry, or a model-specific mask path such as bidirectional image "
            "blocks). Use attn_implementation='sdpa' or 'eager' with the model's standard text masks, or use "
            "`DynamicCache` for this model."
        )

    __add__ = __radd__ = __sub__ = __rsub__ = __int__ = __index__ = __lt__ = __le__ = __gt__ = __ge__ = _refuse


class DenseMaskRequest:
    """A time-ordered `kv_offset` whose mask must be materialized (never replaced by SDPA's `is_causal` / no mask).

    Why: for a one-token step transformers skips the mask when nothing is padded, and its SDPA integration then runs
    grouped-query attention with `enable_gqa=True`; on CPU that kernel is several times slower than the packed path
    transformers takes when a mask is present (measured 240 ms vs 24 ms per full layer at 16384 tokens x batch 8,
    bf16; see docs/benchmarks.md). The mask itself is exactly transformers' own for `offset`.
    """

    __slots__ = ("offset",)

    def __init__(self, offset: int):
        self.offset = offset

    def __repr__(self) -> str:
        return f"DenseMaskRequest(offset={self.offset})"

    __add__ = __radd__ = __sub__ = __rsub__ = __int__ = __index__ = RingLayout._refuse


def _ring_mask_function(
    mask_function: Callable, positions: torch.Tensor, padding_mask: torch.Tensor | None
) -> Callable:
    """Evaluate `mask_function` (and the padding mask) at the real position of each key slot.

    `kv_idx` is the slot index (0..kv_length-1); `positions[kv_idx]` is the absolute token position it holds.
    Works both with broadcast index tensors and under `vmap` (transformers wraps that path in
    `TransformGetItemToIndex`, which makes `positions[kv_idx]` a valid gather for a 0-d index).
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


def _make_ring_aware(original: Callable) -> Callable:
    """Wrap a dense mask function (`sdpa_mask` / `eager_mask`) so it understands `RingLayout` offsets."""

    def ring_aware_mask(
        batch_size: int,
        q_length: int,
        kv_length: int,
        q_offset: int = 0,
        kv_offset: int | RingLayout = 0,
        mask_function: Callable = causal_mask_function,
        attention_mask: torch.Tensor | None = None,
        **kwargs,
    ):
        if isinstance(kv_offset, DenseMaskRequest):
            kwargs["allow_is_causal_skip"] = False
            kv_offset = kv_offset.offset
        if not isinstance(kv_offset, RingLayout):
            # Exact pass-through: every other cache (and ring layers still in time order) is untouched.
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

    def guarded_mask(*args, **kwargs):
        if isinstance(kwargs.get("kv_offset"), DenseMaskRequest):  # time-ordered: any backend can serve it
            kwargs["kv_offset"] = kwargs["kv_offset"].offset
        if isinstance(kwargs.get("kv_offset"), RingLayout):
            raise UnsupportedAttentionError(
                f"attn_implementation={name!r} cannot attend over HybridRingCache's ring buffers (its mask cannot "
                f"express keys that are not in time order). Load the model with attn_implementation='sdpa' or "
                f"'eager' (e.g. `model.set_attn_implementation('sdpa')`), or use `DynamicCache`."
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
    this call keeps working for every cache other than `HybridRingCache`.
    """
    with _install_lock:
        for name, function in list(AttentionMaskInterface._global_mapping.items()):
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
    """Raise a clear error if a ring layout would be masked by an implementation the hook cannot serve."""
    implementation = attn_implementation or "sdpa"
    if implementation not in SUPPORTED_ATTN_IMPLEMENTATIONS:
        raise UnsupportedAttentionError(
            f"HybridRingCache supports attn_implementation in {SUPPORTED_ATTN_IMPLEMENTATIONS}, but the model uses "
            f"{implementation!r}: its attention cannot be masked for keys stored in ring order. Load the model with "
            f"attn_implementation='sdpa' (or call `model.set_attn_implementation('sdpa')`), or use `DynamicCache`."
        )
    if not is_mask_hook_installed(implementation):
        # Someone registered a new function for this name after us: wrap it too, so the ring stays exact.
        install_mask_hook()
