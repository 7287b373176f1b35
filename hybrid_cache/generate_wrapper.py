"""`GenerateWrapper`: what one model instance carries as its `generate` when this package changes how it is called.

An instance attribute shadowing the class method (no class, module or global is touched), wrapping what was there
before: an instance attribute someone else had set (`previous`), or the class method (`previous is None`). An object,
not a closure, so that `copy.deepcopy(model)` and a pickled model keep it. Its subclasses say what they change in a
call: `switch.RingGenerate` (a `HybridRingCache` for a call that brings none), `prefill_steps.SteppedGenerate`
(prefill steps on hybrid_cache's attention).
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["GenerateWrapper", "require_generate"]


class GenerateWrapper:
    """The base of a `generate` put on one model instance (see the module docstring).

    Attributes:
        model: the model whose `generate` this is.
        previous: what `model.__dict__["generate"]` held before (`None`: nothing, the class method served).
    """

    def __init__(self, model: Any, previous: Any) -> None:
        self.model, self.previous = model, previous
        functools.update_wrapper(self, type(model).generate)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call what is wrapped (subclasses change the call's keyword arguments first)."""
        return self._inner()(*args, **kwargs)

    def _inner(self) -> Any:
        """What this wrapper calls: the wrapped instance attribute, or the class method bound to the model."""
        if self.previous is not None:
            return self.previous
        return type(self.model).generate.__get__(self.model, type(self.model))


def require_generate(model: Any, caller: str) -> None:
    """Raise `TypeError` naming `caller` unless `model` is a transformers model with a `generate` method."""
    if not callable(getattr(model, "generate", None)) or not hasattr(type(model), "generate"):
        raise TypeError(f"{caller} expects a transformers model with a `generate` method, got {type(model).__name__}.")
