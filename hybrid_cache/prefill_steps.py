"""Prefill in steps: on hybrid_cache's attention, `generate` puts a long prompt into the cache `PREFILL_STEP` tokens at
a time, each step attending on its band (`banded.py`), as mlx-lm (2048-token steps) and llama.cpp (ubatches of 512)
do by default.

Why steps on top of the banded attention: the attention of a whole prompt at once is already at window cost, but the
rest of the model is not. Its activations grow with the prompt (`[tokens, 2048]` per MLP projection of Gemma 3 270M:
64 MiB each at 8K tokens in fp32), are allocated fresh and first touched at every layer (page faults), and are read
through caches they no longer fit in; steps of 2048 tokens avoid that (docs/design.md#the-banded-prefill has the
measurements). Steps also bound the activations' memory to one step's, whatever the prompt. The result is
transformers' chunked prefill's, that of one forward up to float summation order.

`enable_prefill_steps(model)` wraps that one model instance's `generate` (an instance attribute shadowing the class
method, as `hybrid_cache.enable` does; nothing else is touched). A call gets `prefill_chunk_size=step` only where that
is transformers' own chunked prefill of the same result:

- the model runs `hybrid_cache_sdpa` at the call (a model switched back to `sdpa` runs unchanged);
- the call does not set `prefill_chunk_size` itself (`prefill_chunk_size=None` asks for one forward), nor does the
  `generation_config` it uses;
- it has a cache (`use_cache` is not False) that is not compileable (transformers compiles a chunked prefill into
  one) and, on releases before 5.23, holds nothing yet (those feed a held conversation again: compat.py);
- it brings no multimodal input (pixels, audio, pre-encoded features, token types marking images: an image block
  split across steps would attend otherwise than in one forward).

`use_code_attention(model)` enables it for its block; `hybrid_cache.tools.models.load_model` for the models it loads.
`disable_prefill_steps(model)` undoes it (the wrapper stays inert if another one was stacked on it meanwhile).
"""

from __future__ import annotations

from typing import Any

from .compat import CHUNKED_PREFILL_CONTINUES_SINCE, TRANSFORMERS_VERSION, cache_from_kwargs
from .generate_wrapper import GenerateWrapper, require_generate

__all__ = ["PREFILL_STEP", "SteppedGenerate", "disable_prefill_steps", "enable_prefill_steps", "prefill_steps_of"]

#: Tokens per prefill step (docs/design.md#the-banded-prefill; mlx-lm's default step too).
PREFILL_STEP = 2048
# What must not be split into steps: raw multimodal inputs and pre-encoded features (transformers' own list where it
# has one), and token types that mark image / audio tokens.
_MULTIMODAL = (
    "mm_encoder_outputs",
    "pixel_values",
    "pixel_values_videos",
    "image_position_ids",
    "input_features",
    "input_features_mask",
    "input_values",
)
_TOKEN_TYPES = ("token_type_ids", "mm_token_type_ids")


def _multimodal_keys() -> tuple[str, ...]:
    from transformers.generation import utils

    keys: tuple[str, ...] = getattr(utils, "MULTIMODAL_INPUTS_TO_DROP_OUTSIDE_PREFILL", ())  # not on every release
    return tuple(dict.fromkeys((*_MULTIMODAL, *keys)))


class SteppedGenerate(GenerateWrapper):
    """The `generate` that `enable_prefill_steps` puts on a model instance (the module docstring has the contract).

    Attributes:
        model: the model whose `generate` this is.
        attention (`str`): the attention implementation under which calls get steps (`hybrid_cache_sdpa`).
        step (`int`): tokens per prefill step.
        previous: what `model.__dict__["generate"]` held before (`None`: nothing, the class method served).
        active (`bool`): False once disabled (the wrapper then passes every call through).
        steps_given (`int`): calls that got `prefill_chunk_size=step`.
    """

    def __init__(self, model: Any, attention: str, step: int, previous: Any) -> None:
        super().__init__(model, previous)
        self.attention, self.step = attention, step
        self.active, self.steps_given = True, 0

    def wants_steps(self, kwargs: dict[str, Any]) -> bool:
        """Whether a call with `kwargs` gets `prefill_chunk_size=step` (see the module docstring)."""
        if not self.active or getattr(self.model.config, "_attn_implementation", None) != self.attention:
            return False
        if "prefill_chunk_size" in kwargs:
            return False
        config = kwargs.get("generation_config") or getattr(self.model, "generation_config", None)
        if config is None or not hasattr(config, "prefill_chunk_size") or config.prefill_chunk_size is not None:
            return False
        if kwargs.get("use_cache", getattr(config, "use_cache", True)) is False:
            return False
        if any(kwargs.get(key) is not None for key in _multimodal_keys()):
            return False
        if any(kwargs.get(key) is not None and bool(kwargs[key].any()) for key in _TOKEN_TYPES):
            return False
        cache = cache_from_kwargs(kwargs)
        if cache is not None:
            if getattr(cache, "is_compileable", False):
                return False
            if TRANSFORMERS_VERSION < CHUNKED_PREFILL_CONTINUES_SINCE and cache.get_seq_length():
                return False
        return True

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.wants_steps(kwargs):
            kwargs["prefill_chunk_size"] = self.step
            self.steps_given += 1
        return super().__call__(*args, **kwargs)

    def __repr__(self) -> str:
        state = "active" if self.active else "inactive"
        return f"<hybrid_cache SteppedGenerate of {type(self.model).__name__}, {self.step}-token steps, {state}>"


def _chain(model: Any) -> list[Any]:
    """`model.generate`'s instance wrappers, outermost first (each keeps what it wraps as `previous`)."""
    chain, current = [], model.__dict__.get("generate")
    while current is not None and current not in chain:
        chain.append(current)
        current = getattr(current, "previous", None)
    return chain


def prefill_steps_of(model: Any) -> SteppedGenerate | None:
    """The active prefill-step wrapper of `model.generate`, if `enable_prefill_steps` put one there."""
    return next((w for w in _chain(model) if isinstance(w, SteppedGenerate) and w.active), None)


def enable_prefill_steps(model: Any, attention: str, step: int = PREFILL_STEP) -> Any:
    """Give `model.generate` prefill steps of `step` tokens while the model runs the attention implementation
    `attention` (module docstring); calling it again sets the step. Returns `model`.

    Raises:
        TypeError: `model` has no `generate`.
        ValueError: `step` is not a positive int.
    """
    require_generate(model, "enable_prefill_steps")
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise ValueError(f"the prefill step must be a positive int, got {step!r}")
    current = prefill_steps_of(model)
    if current is not None:
        current.attention, current.step = attention, step
        return model
    model.generate = SteppedGenerate(model, attention, step, model.__dict__.get("generate"))
    return model


def disable_prefill_steps(model: Any) -> Any:
    """Undo `enable_prefill_steps` (no-op where it is off): the outermost wrapper is removed, one wrapped by another
    wrapper since (`hybrid_cache.enable`) stays in place but inert. Returns `model`."""
    chain = _chain(model)
    for wrapper in chain:
        if isinstance(wrapper, SteppedGenerate):
            wrapper.active = False
    if chain and isinstance(chain[0], SteppedGenerate):
        if chain[0].previous is None:
            del model.generate
        else:
            model.generate = chain[0].previous
    return model
