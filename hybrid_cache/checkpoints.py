"""In-memory checkpoints of a `HybridRingCache` (`checkpoint` / `restore`), of the layers' states (`LayerState`,
`storage.py`) that checkpoints and the file format (`snapshot.py`) share.

A checkpoint copies the state of every layer that overwrites slots in place (the sliding rings, the bounded full
layers: about `window + margin` slots each) and remembers only the length of the time-ordered full layers (exact or
compressed): restoring cuts them back, which is exact as long as their tokens before the checkpoint were not rewritten
since. Every storage layer records the lowest position written since it was last asked (`note_write` / `write_floor`
in `storage.py`); the checkpoints of a cache collect those floors whenever a checkpoint is taken or restored, and
`restore` refuses, naming the fix, when the tokens it would keep have been overwritten.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

import torch

from .specs import FULL, OTHER_STAGE, SLIDING
from .state import LayerState, StateHolder
from .storage import NOTHING_WRITTEN

__all__ = ["CacheCheckpoint", "read_layer_state", "refuse_stateless_layers", "restore_checkpoint", "take_checkpoint"]


def read_layer_state(layer: Any) -> LayerState | None:
    """The state of one layer of a cache (its `meta_state()`), or `None` when it holds no tokens (KV-shared, never
    used, reset) or stores nothing."""
    meta = layer.meta_state() if getattr(layer, "state_kind", None) is not None else None
    return None if meta is None else LayerState.from_meta(meta)


def refuse_stateless_layers(cache: StateHolder, action: str) -> None:
    """Refuse, naming the fix, a cache whose layers do not export their state: pipeline-parallel stages
    (`stage_layers`), or a storage class without `state_kind`."""
    for index, (kind, layer) in enumerate(zip(cache.layer_kinds, cache.layers)):
        if kind == OTHER_STAGE:
            raise ValueError(
                f"Cannot {action} a pipeline-parallel stage's cache (layer {index} runs on another stage): the format "
                f"holds whole caches. Keep each stage's prefix in memory (`copy.deepcopy(cache)`) instead."
            )
        if kind in (SLIDING, FULL) and getattr(layer, "state_kind", None) is None:
            raise ValueError(
                f"Cannot {action} layer {index}: its storage, {type(layer).__name__}, does not export its state "
                f"(`state_kind` is None). Use `copy.deepcopy(cache)` to keep a copy in memory."
            )


# --- checkpoints ------------------------------------------------------------------------------------------------
# Live checkpoints of every cache, so that each one learns about the writes made while another was newer.
_CHECKPOINTS: weakref.WeakKeyDictionary[StateHolder, weakref.WeakSet[CacheCheckpoint]] = weakref.WeakKeyDictionary()


class CacheCheckpoint:
    """An in-memory snapshot of a `HybridRingCache`, made by `cache.checkpoint()`, used by `cache.restore()`.

    It holds a copy of the state of every layer that overwrites slots in place (the rings, at most
    `window + rollback_margin` slots per sliding layer, and bounded full layers) and, for the time-ordered
    full-attention layers (exact or compressed), their length only: it never keeps their history (or its storage)
    alive. `restore` can be called any number of times, after decoding, cropping or resetting, as long as the batch
    size is the same and the full layers' tokens before the checkpoint were not rewritten since.

    Attributes:
        length (`int`): tokens the cache held when the checkpoint was taken.
    """

    def __init__(
        self,
        cache: StateHolder,
        states: list[LayerState | None],
        contents: list[dict[str, torch.Tensor] | None],
    ) -> None:
        self._cache = weakref.ref(cache)
        self._states = states
        self._contents = contents
        # Lowest position written in each layer since this checkpoint (collected from the layers' write floors).
        self._floors = [NOTHING_WRITTEN] * len(states)
        self.length = max((s.length for s in states if s is not None), default=0)

    def nbytes(self) -> int:
        """Bytes of content this checkpoint holds (the copied states of the rings and bounded layers)."""
        return sum(t.numel() * t.element_size() for c in self._contents if c is not None for t in c.values())

    def __repr__(self) -> str:
        return f"CacheCheckpoint(length={self.length}, nbytes={self.nbytes()})"

    # A checkpoint never changes once taken, and its cache must know every copy of it (to tell it about later
    # writes): copies are the checkpoint itself, and it does not leave the process.
    def __copy__(self) -> CacheCheckpoint:
        return self

    def __deepcopy__(self, memo: dict) -> CacheCheckpoint:
        return self

    def __reduce__(self) -> Any:
        raise TypeError(
            "A CacheCheckpoint lives in memory next to its cache and cannot be pickled; save the cache itself with "
            "`cache.save(path)` and load it with `HybridRingCache.load(path, config)`."
        )


def _length_restored_layers(cache: StateHolder) -> Iterator[tuple[int, Any]]:
    """The layers a checkpoint restores by cutting back their length (time-ordered full layers)."""
    return (
        (i, layer)
        for i, layer in enumerate(cache.layers)
        if getattr(layer, "state_kind", None) is not None and layer.restores_by_length
    )


def _collect_write_floors(cache: StateHolder) -> None:
    """Hand the time-ordered layers' write floors to every live checkpoint of `cache`, then clear them."""
    live = _CHECKPOINTS.get(cache, ())
    for index, layer in _length_restored_layers(cache):
        floor = layer.take_write_floor()
        for checkpoint in live:
            checkpoint._floors[index] = min(checkpoint._floors[index], floor)


def take_checkpoint(cache: StateHolder) -> CacheCheckpoint:
    """See `HybridRingCache.checkpoint`."""
    refuse_stateless_layers(cache, "checkpoint")
    _collect_write_floors(cache)
    states: list[LayerState | None] = []
    contents: list[dict[str, torch.Tensor] | None] = []
    for layer in cache.layers:
        state = read_layer_state(layer)
        states.append(state)
        if state is not None and not layer.restores_by_length:
            contents.append({name: tensor.clone() for name, tensor in layer.state().items()})
        else:
            contents.append(None)
    checkpoint = CacheCheckpoint(cache, states, contents)
    _CHECKPOINTS.setdefault(cache, weakref.WeakSet()).add(checkpoint)
    return checkpoint


def _check_restorable(cache: StateHolder, checkpoint: CacheCheckpoint) -> None:
    """Raise, naming the fix, unless `checkpoint` can be restored exactly into `cache` (nothing is changed)."""
    for index, (layer, state) in enumerate(zip(cache.layers, checkpoint._states)):
        if state is None:
            continue
        contents = checkpoint._contents[index]
        device = None if contents is None else next(iter(contents.values())).device
        if not layer.same_state_layout(state.meta()) or (device is not None and layer.device != device):
            held = (
                f"batch_size={layer.batch_size}, kv_heads={layer.num_heads}, {layer.dtype} on {layer.device}"
                if layer.is_initialized
                else "nothing allocated"
            )
            raise ValueError(
                f"Cannot restore the checkpoint: layer {index} now holds {held}, but the checkpoint was taken with "
                f"batch_size={state.batch_size}, kv_heads={state.num_heads}, {state.dtype}. A checkpoint restores "
                f"into the same batch size, dtype and device: take it after `batch_repeat_interleave`, or keep a "
                f"`copy.deepcopy(cache)` instead."
            )
        if contents is None:
            floor = min(checkpoint._floors[index], int(layer.write_floor))
            if floor < state.length:
                raise ValueError(
                    f"Cannot restore the checkpoint exactly: full-attention layer {index} no longer holds its "
                    f"{state.length} tokens (positions from {floor} on were rewritten since: a crop or reset below "
                    f"the checkpoint followed by new tokens, a beam-search reorder, or a reallocation). A checkpoint "
                    f"keeps only the sliding-window rings; to go back further, keep `copy.deepcopy(cache)` or "
                    f"`cache.save(path)` instead."
                )


def restore_checkpoint(cache: StateHolder, checkpoint: CacheCheckpoint) -> None:
    """See `HybridRingCache.restore`."""
    if not isinstance(checkpoint, CacheCheckpoint):
        raise TypeError(
            f"restore() takes a CacheCheckpoint from `cache.checkpoint()`, got {type(checkpoint).__name__}."
        )
    if checkpoint._cache() is not cache:
        raise ValueError(
            "This checkpoint was taken from another cache. Restore it into the cache it came from; to branch a cache "
            "into an independent one, use `copy.deepcopy(cache)`."
        )
    _check_restorable(cache, checkpoint)
    _collect_write_floors(cache)
    for layer, state, contents in zip(cache.layers, checkpoint._states, checkpoint._contents):
        if getattr(layer, "state_kind", None) is None:
            continue
        if state is None:
            if layer.is_initialized:
                layer.clear()
        elif contents is not None:
            layer.load_state(state.meta(), **contents)
        else:
            layer.set_length(state.length)
