"""`LayerState`: the counters, geometry and storage settings of one storing layer, as `StorageLayer.meta_state`
exports them; in-memory checkpoints (`checkpoints.py`) and the file format (`snapshot.py`) carry it. Its fields are the
one definition of a layer's counters (`COUNTER_FIELDS`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Protocol

import torch

__all__ = ["COUNTER_FIELDS", "LayerState", "StateHolder"]


@dataclasses.dataclass(frozen=True)
class LayerState:
    """The counters, geometry and storage settings of one storing layer (`StorageLayer.meta_state`); its content is
    kept beside it (`StorageLayer.state`).

    `slots` is how many slots (from slot 0) hold content worth keeping: a ring in time order (`oldest == 0`,
    `length <= max_slots`) keeps `length`, a wrapped ring all its `max_slots` (in slot order, not time order); a full
    layer keeps `length`. `capacity` is the allocated slot count, restored so that growth continues as it would have.
    `settings` are the layer's `state_settings()` (empty for exact storage), as `(option, value)` pairs.
    """

    kind: str
    length: int
    oldest: int
    capacity: int
    slots: int
    batch_size: int
    num_heads: int
    k_head_dim: int
    v_head_dim: int
    dtype: torch.dtype
    settings: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> LayerState:
        """The state of a layer's `meta_state()`: its counters, and every other entry as a setting."""
        settings = tuple((name, value) for name, value in meta.items() if name not in COUNTER_FIELDS)
        return cls(**{name: meta[name] for name in COUNTER_FIELDS}, settings=settings)

    def to_json(self) -> dict[str, Any]:
        return {**self.meta(), "dtype": str(self.dtype)}

    def meta(self) -> dict[str, Any]:
        """The layer's `meta_state()` this state was read from (what `load_state` takes)."""
        return {**{name: getattr(self, name) for name in COUNTER_FIELDS}, **dict(self.settings)}


#: The counters and geometry every layer state has, in the order the format writes them: `LayerState`'s fields.
COUNTER_FIELDS = tuple(field.name for field in dataclasses.fields(LayerState) if field.name != "settings")


class StateHolder(Protocol):
    """What checkpoints (`checkpoints.py`) and the file format (`snapshot.py`) see of a cache: its layers, each layer's
    role, its options and config. `HybridRingCache` is one; naming it here instead keeps the container out of their
    imports (no circle, not even a type-only one)."""

    layers: list[Any]
    config: Any
    options: Any

    @property
    def layer_kinds(self) -> list[str]: ...

    def reset(self) -> None: ...
