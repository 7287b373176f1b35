"""`Frozen`: the base of the cache's value objects (`CacheOptions`, `LayerSpec`), whose fields are fixed at
construction.

`dataclass(frozen=True)` refuses every assignment, and transformers' exporters walk every attribute of every object a
model is given and assign it back (`exporters.utils.cast_leaf_tensors`: `setattr(obj, name, cast(value))`, the same
value for anything that is not a tensor). A `Frozen` dataclass accepts that assignment of a field's own value and
refuses any other, with `dataclasses.FrozenInstanceError` as a frozen dataclass would.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["Frozen"]


class Frozen:
    """Mixin for `@dataclass(unsafe_hash=True)` classes: fields are set once (by `__init__`; `__post_init__` may
    resolve one with `object.__setattr__`), then only ever assigned their own value again."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self.__dict__ and not _same(self.__dict__[name], value):
            raise dataclasses.FrozenInstanceError(
                f"cannot assign to field {name!r}: {type(self).__name__} is fixed at construction (build a new one, "
                f"e.g. with dataclasses.replace)"
            )
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        raise dataclasses.FrozenInstanceError(f"cannot delete field {name!r} of {type(self).__name__}")


def _same(old: Any, new: Any) -> bool:
    if old is new:
        return True
    try:
        return type(old) is type(new) and bool(old == new)
    except Exception:  # noqa: BLE001 - a comparison that cannot answer is a change
        return False
