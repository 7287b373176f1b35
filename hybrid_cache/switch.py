"""`enable(model)` / `disable(model)`: a `HybridRingCache` for every `model.generate()` call that brings no cache.

Most generation is started by code the user does not write: a `pipeline`, an evaluation harness (lm-evaluation-
harness's `HFLM`), a trainer's sampling loop. They all end in `model.generate(**inputs, **generate_kwargs)`.
`enable` wraps that one method of that one model instance (an instance attribute shadowing the class method; no class,
module or global is touched besides the documented mask hook that any `HybridRingCache` installs), so that each call

- that passes a cache of its own (`past_key_values=` or, from transformers 5.24, `cache=`) runs unchanged;
- that turns the cache off (`use_cache=False`) or asks transformers for a cache kind by name (`cache_implementation=`,
  in a `generation_config` passed in, or in the model's own `generation_config`, as some checkpoints ship one) runs
  unchanged: transformers builds the cache it names (a ring passed as well would make it raise "Passing both
  `cache_implementation` ... and `cache`"); `"hybrid"` names none (transformers unsets it), so it gets the ring;
- otherwise gets a fresh `HybridRingCache.for_model(model, **cache_options)`, passed under the keyword the installed
  release reads (`hybrid_cache.compat.CACHE_KEYWORD`).

`disable(model)` removes the wrapper and puts back exactly what was there before (the class method, or an instance
attribute someone else had set). The wrapper is an object, not a closure, so `copy.deepcopy(model)` gives a copy
whose `generate` builds caches for the copy, and a pickled model unpickles with the switch still on.

Example:

```python
>>> import hybrid_cache
>>> from transformers import pipeline
>>> hybrid_cache.enable(model)                      # every generate() without a cache now uses the ring
>>> pipe = pipeline("text-generation", model=model, tokenizer=tokenizer)
>>> pipe(long_prompt, max_new_tokens=64)
>>> hybrid_cache.disable(model)                     # back to transformers' default (DynamicCache)
```
"""

from __future__ import annotations

from typing import Any

from .cache import HybridRingCache
from .compat import CACHE_KEYWORD, cache_from_kwargs
from .generate_wrapper import GenerateWrapper, require_generate

__all__ = ["RingGenerate", "disable", "enable", "is_enabled"]

_MISSING = object()


class RingGenerate(GenerateWrapper):
    """The `generate` that `enable` puts on a model instance (see the module docstring for the contract).

    Attributes:
        model: the model whose `generate` this is.
        cache_options (`dict`): keyword arguments of every `HybridRingCache` built (besides the config).
        previous: what `model.__dict__["generate"]` held before `enable` (`None`: nothing, the class method served).
        caches_built (`int`): how many caches this wrapper has built (one per call that brought none).
    """

    def __init__(self, model: Any, cache_options: dict[str, Any], previous: Any) -> None:
        super().__init__(model, previous)
        self.cache_options = dict(cache_options)
        self.caches_built = 0

    def wants_ring(self, kwargs: dict[str, Any]) -> bool:
        """Whether a call with `kwargs` gets a fresh ring cache (no cache of its own, cache on, no named kind)."""
        if cache_from_kwargs(kwargs) is not None:
            return False
        if self.named_cache_implementation(kwargs) is not None:
            return False
        generation_config = kwargs.get("generation_config")
        if generation_config is not None and generation_config.use_cache is False:
            return False
        if kwargs.get("use_cache") is not None:
            return bool(kwargs["use_cache"])
        return getattr(self.model.generation_config, "use_cache", True) is not False

    def named_cache_implementation(self, kwargs: dict[str, Any]) -> str | None:
        """The `cache_implementation` transformers will build for a call with `kwargs`, resolved as its
        `_prepare_generation_config` does: the keyword (even `None`) over a `generation_config` passed in, over the
        model's own `generation_config` (a checkpoint may ship one, e.g. `"static"`); `"hybrid"` counts as none (the
        default transformers unsets, since it gives sliding-window models their dynamic sliding cache)."""
        if "cache_implementation" in kwargs:
            named = kwargs["cache_implementation"]
        else:
            named = getattr(kwargs.get("generation_config"), "cache_implementation", None)
            if named is None:
                named = getattr(self.model.generation_config, "cache_implementation", None)
        return None if named == "hybrid" else named

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.wants_ring(kwargs):
            for name in ("cache", "past_key_values"):
                kwargs.pop(name, None)  # explicit None: replaced by the ring
            kwargs[CACHE_KEYWORD] = HybridRingCache.for_model(self.model, **self.cache_options)
            self.caches_built += 1
        return super().__call__(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<hybrid_cache RingGenerate of {type(self.model).__name__}, cache options {self.cache_options}>"


def enable(model: Any, **cache_options: Any) -> Any:
    """Give every later `model.generate()` call that brings no cache of its own a fresh `HybridRingCache`.

    Args:
        model: a transformers model with `generate` (causal LM or a composite multimodal model such as
            `Gemma3ForConditionalGeneration`).
        **cache_options: keyword arguments of `HybridRingCache` (e.g. `rollback_margin`, `max_cache_len`,
            `full_layer_quantization`), checked now by building one cache.

    Returns:
        `model` (switched on in place). Calling `enable` again replaces the options.

    Raises:
        TypeError: `model` has no `generate`, or an option is not a `HybridRingCache` argument.
        ValueError: the model's config cannot be served by `HybridRingCache` (the message says why), or an option
            value is refused.
    """
    require_generate(model, "hybrid_cache.enable")
    HybridRingCache.for_model(model, **cache_options)  # refuse bad options and unsupported configs now
    current = model.__dict__.get("generate")
    previous = current.previous if isinstance(current, RingGenerate) else current
    model.generate = RingGenerate(model, cache_options, previous)
    return model


def disable(model: Any) -> Any:
    """Undo `enable`: `model.generate` is again exactly what it was before (no-op if the switch is off).

    Returns:
        `model`.
    """
    current = model.__dict__.get("generate", _MISSING)
    if isinstance(current, RingGenerate):
        if current.previous is None:
            del model.generate
        else:
            model.generate = current.previous
    return model


def is_enabled(model: Any) -> bool:
    """Whether `enable(model)` is in effect."""
    return isinstance(model.__dict__.get("generate"), RingGenerate)
