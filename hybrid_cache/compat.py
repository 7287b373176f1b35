"""Every difference between the transformers releases hybrid_cache supports, in one place.

The rest of the package is written against the newest cache protocol and imports from here whatever changed across
the supported range (`SUPPORTED_RANGE`): no other module compares versions. Each name documents the release where
transformers changed and what this module does on either side of it.

| what                                   | changed in | here                                                      |
|----------------------------------------|------------|-----------------------------------------------------------|
| `cache=` keyword of `generate`/forward | 5.24       | `CACHE_KEYWORD`, `cache_kwargs`, `cache_from_kwargs`       |
| per-layer `early_initialization` lists | by 5.14    | `initialize_layers_early` (its loop, for every release)    |
| chunked prefill on a cache holding tokens | 5.23    | `chunked_prefill_release_note` (the refusal says why)      |
| `cache_utils.DummyLayer`               | 5.23       | `DummyLayer` (the same no-storage layer before 5.23)       |
| config `kv_sharing_modes` (Gemma 4)    | 5.23       | `kv_sharing_modes` (from `num_kv_shared_layers` before)    |
| `Cache.max_cache_len` assignable       | 5.20       | `HybridRingCache` keeps its own value (no change needed)   |
| `get_max_length` / `get_max_cache_shape` | 5.13     | `CacheLayerMixin` answers both                             |
| `generate` turns on past recording     | 5.14       | `PAST_RECORDING_SINCE`: crops past the margin raise        |
| assisted / prompt-lookup after the wrap| 5.18       | `ROLLBACK_SINCE`, `check_rollback_supported`               |
| `DynamicCache` sliding crop past window| 5.15       | `DYNAMIC_SLIDING_CROP_SINCE` (tests' reference only)       |
| Gemma 4 KV sharing without a cache     | 5.5.2      | `no_cache_forward_is_exact` (tests' oracle only)           |
| `generate` marks a cache passed in     | by 5.17    | `notify_generate_start` (the private `_is_user_defined`)   |
| attention passes positions to `update` | 5.24       | `STEP_POSITIONS_SINCE`: before, a reused cache's first    |
|                                        |            | assisted multi-token step is refused (cannot be checked)  |
| `activate_past_recording(recurrent_states_to_keep=)` | 5.25 | accepted; attention layers keep no recurrent state |

And one defect of every supported release, refused here: assisted / prompt-lookup decoding on a cache that already
holds the conversation feeds it all again (refused by `steps.check_assisted_start`, with `step_positions_note`).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import transformers
from packaging.version import Version
from transformers import cache_utils

from .errors import ConversationMismatchError, RollbackError, UnsupportedReleaseError

__all__ = [
    "CACHE_KEYWORD",
    "CACHE_KEYWORD_SINCE",
    "CHUNKED_PREFILL_CONTINUES_SINCE",
    "OLDEST_SUPPORTED",
    "DYNAMIC_SLIDING_CROP_SINCE",
    "PAST_RECORDING_SINCE",
    "ROLLBACK_SINCE",
    "STEP_POSITIONS_SINCE",
    "TRANSFORMERS_VERSION",
    "CacheLayerMixin",
    "DummyLayer",
    "UnsupportedReleaseError",
    "cache_from_kwargs",
    "cache_kwargs",
    "check_rollback_supported",
    "chunked_prefill_release_note",
    "initialize_layers_early",
    "kv_sharing_modes",
    "no_cache_forward_is_exact",
    "notify_generate_start",
    "rollback_release_note",
    "rollback_supported",
    "step_positions_note",
]

TRANSFORMERS_VERSION = Version(Version(transformers.__version__).base_version)
OLDEST_SUPPORTED = Version("5.5")  # Gemma 4's first release; also declared in pyproject.toml
CACHE_KEYWORD_SINCE = Version("5.24")
ROLLBACK_SINCE = Version("5.18")
PAST_RECORDING_SINCE = Version("5.14")
_NO_CACHE_KV_SHARING_SINCE = Version("5.5.2")
DYNAMIC_SLIDING_CROP_SINCE = Version("5.15")
CHUNKED_PREFILL_CONTINUES_SINCE = Version("5.23")
STEP_POSITIONS_SINCE = Version("5.24")
_DUMMY_LAYER_SINCE = Version("5.23")


if TRANSFORMERS_VERSION < OLDEST_SUPPORTED:
    raise ImportError(
        f"hybrid_cache supports transformers >= {OLDEST_SUPPORTED} (Gemma 4's first release), but "
        f"{transformers.__version__} is installed: its attention-mask protocol passes `cache_position` where "
        f"hybrid_cache needs `(query_length, layer_idx)` (see docs/limits.md). Install transformers>={OLDEST_SUPPORTED}."
    )

# --- the cache keyword ------------------------------------------------------------------------------------------------
#: The keyword under which the installed release's `generate` and model forwards read a cache. 5.24 renamed
#: `past_key_values` to `cache` (the old name still works there, deprecated); before 5.24 a `cache=` keyword is
#: swallowed by the model's `**kwargs` and the forward silently runs without any cache.
CACHE_KEYWORD = "cache" if TRANSFORMERS_VERSION >= CACHE_KEYWORD_SINCE else "past_key_values"
_CACHE_NAMES = ("cache", "past_key_values")


def cache_kwargs(cache: Any) -> dict[str, Any]:
    """`{CACHE_KEYWORD: cache}`: pass a cache to `model(...)` / `model.generate(...)` the way the installed release
    reads it, e.g. `model.generate(**inputs, **cache_kwargs(cache))`."""
    return {CACHE_KEYWORD: cache}


def cache_from_kwargs(kwargs: Mapping[str, Any]) -> Any:
    """The cache a caller passed under either name (`cache` or `past_key_values`), or None.

    Raises:
        ValueError: both names were passed, or `cache=` on a release before 5.24, whose models would ignore it.
    """
    given = {name: kwargs[name] for name in _CACHE_NAMES if kwargs.get(name) is not None}
    if len(given) > 1:
        raise ValueError("Both `cache=` and `past_key_values=` were passed: pass the cache once, as `cache=`.")
    if "cache" in given and CACHE_KEYWORD != "cache":
        raise ValueError(
            f"`cache=` is read by transformers >= {CACHE_KEYWORD_SINCE}; the installed {transformers.__version__} "
            f"ignores it (the forward would run without any cache). Pass `past_key_values=cache`, or "
            f"`**hybrid_cache.cache_kwargs(cache)`."
        )
    return next(iter(given.values()), None)


# --- cache layers -----------------------------------------------------------------------------------------------------
class CacheLayerMixin(cache_utils.CacheLayerMixin):
    """transformers' `CacheLayerMixin` answering both names of the capacity query: `get_max_length` (5.13 and later)
    and `get_max_cache_shape` (abstract before 5.13). Subclasses implement `get_max_length`."""

    def get_max_cache_shape(self) -> int:
        return self.get_max_length()


if TRANSFORMERS_VERSION >= _DUMMY_LAYER_SINCE:
    DummyLayer = cache_utils.DummyLayer
else:

    class DummyLayer:  # type: ignore[no-redef]
        """The storage-less layer of a KV-shared (or other-stage) decoder layer, as `cache_utils.DummyLayer` (5.23)."""

        is_compileable = True
        is_croppable = True
        supports_early_init = False
        is_sliding = False

        def __init__(self, **kwargs: Any) -> None:
            self.is_initialized = True
            self.keys = None
            self.values = None

        def update(
            self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
        ) -> tuple[None, None]:
            if key_states is None and value_states is None:
                return None, None
            raise NotImplementedError("A DummyLayer stores no cache: it cannot be updated.")

        def offload(self) -> None: ...
        def prefetch(self) -> None: ...
        def reset(self) -> None: ...
        def crop(self, tokens_to_remove: int) -> None: ...
        def reorder_cache(self, beam_idx: torch.LongTensor) -> None: ...
        def batch_repeat_interleave(self, repeats: int) -> None: ...
        def batch_select_indices(self, indices: torch.Tensor) -> None: ...

        def get_seq_length(self) -> int:
            return 0

        def get_max_length(self) -> int:
            return -1

        def get_max_cache_shape(self) -> int:
            return -1


# --- config ------------------------------------------------------------------------------------------------------------
def kv_sharing_modes(text_config: Any) -> list[str | None] | None:
    """Per-layer KV-sharing mode (`"reuse"`: the layer stores nothing and attends over an earlier layer's keys).

    From 5.23 configs declare `kv_sharing_modes`; before, Gemma 4 declares `num_kv_shared_layers`: the last that many
    layers reuse (when at least one layer stores) the keys and values of the last earlier layer of their type, which
    is how its modeling code of those releases decides; that layer is marked `"store"`, as newer configs mark it."""
    modes = getattr(text_config, "kv_sharing_modes", None)
    if modes is not None:
        return list(modes)
    shared = getattr(text_config, "num_kv_shared_layers", 0) or 0
    layers = text_config.num_hidden_layers
    first_shared = layers - shared
    if shared <= 0 or first_shared <= 0:
        return None
    modes = [("reuse" if index >= first_shared else None) for index in range(layers)]
    layer_types = getattr(text_config, "layer_types", None) or []
    for layer_type in set(layer_types[first_shared:]):
        stored = [index for index in range(first_shared) if layer_types[index] == layer_type]
        if stored:
            modes[stored[-1]] = "store"
    return modes


def no_cache_forward_is_exact(config: Any) -> bool:
    """Whether transformers' own forward *without* a cache (`use_cache=False`) computes the model on the installed
    release. Not so on 5.5.0 and 5.5.1 for Gemma 4 with KV-shared layers: without a cache those layers compute keys
    and values of their own instead of reusing the earlier layer's (fixed in 5.5.2); with any cache (DynamicCache or
    HybridRingCache, hence in every `generate` that caches) they reuse them. The tests' no-cache oracle uses a one-shot
    DynamicCache forward there instead."""
    if TRANSFORMERS_VERSION >= _NO_CACHE_KV_SHARING_SINCE:
        return True
    text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return not (getattr(text_config, "model_type", "").startswith("gemma4") and kv_sharing_modes(text_config))


# --- rollback (assisted and prompt-lookup decoding) ----------------------------------------------------------------
def rollback_supported() -> bool:
    """Whether `generate`'s assisted / prompt-lookup decoding runs exactly with a wrapped ring on the installed
    release: from 5.18. Before 5.14 `generate` never turns on past recording, so a ring can undo rejected draft tokens
    only within its `rollback_margin` (larger rollbacks raise `RollbackError`, naming 5.18); 5.14 to 5.17 turn it on,
    but their verification steps after the wrap are not exact with a ring (measured: the step's mask is not built
    from the ring's layout), so `activate_past_recording` refuses there."""
    return TRANSFORMERS_VERSION >= ROLLBACK_SINCE


@contextlib.contextmanager
def rollback_release_note() -> Iterator[None]:
    """Add to a `RollbackError` raised inside what the installed release lacks for exact rollbacks (nothing from
    5.18)."""
    try:
        yield
    except RollbackError as error:
        if rollback_supported():
            raise
        raise RollbackError(
            f"{error} (transformers {transformers.__version__}'s assisted / prompt-lookup decoding does not record the "
            f"window it would need: with HybridRingCache it is exact from transformers {ROLLBACK_SINCE}, or here with "
            f"`rollback_margin` >= the number of draft tokens per step.)"
        ) from error


def check_rollback_supported(what: str = "assisted / prompt-lookup decoding") -> None:
    """Raise `UnsupportedReleaseError` naming the release that supports `what` when the installed one does not."""
    if not rollback_supported():
        raise UnsupportedReleaseError(
            f"{what} with HybridRingCache needs transformers >= {ROLLBACK_SINCE}; the installed "
            f"{transformers.__version__} cannot run it exactly once the sliding-window ring has wrapped. Upgrade "
            f"transformers, or use DynamicCache for this generation."
        )


#: The attribute transformers' `generate` sets on a cache passed in, once per call before its first forward
#: (`GenerationMixin._prepare_cache_for_generation`; set by 5.17, not yet in 5.14, where past recording, the only
#: state a new call resets, is refused anyway): the only sign a new call started.
GENERATE_START_ATTRIBUTE = "_is_user_defined"


def notify_generate_start(cls: type) -> type:
    """Class decorator: `generate` calls `instance.on_generate_start()` each time it starts a call with an instance of
    `cls` passed in (through its assignment of `GENERATE_START_ATTRIBUTE`, which reads back as assigned)."""

    def assigned(self: Any) -> bool:
        return self.__dict__.get("_generate_start_value", False)

    def assign(self: Any, value: bool) -> None:
        _refuse_chunked_prefill_on_held_tokens(self, sys._getframe(1).f_locals.get("generation_config"))
        self.__dict__["_generate_start_value"] = value
        self.on_generate_start()

    setattr(cls, GENERATE_START_ATTRIBUTE, property(assigned, assign))
    return cls


def _refuse_chunked_prefill_on_held_tokens(cache: Any, generation_config: Any) -> None:
    """Before 5.23, `generate(prefill_chunk_size=...)` feeds a cache that holds tokens the conversation again from its
    first token; from 5.17 it also drops an all-ones attention mask first, so no mask shows the mismatch (on earlier
    releases the short mask is refused, `chunked_prefill_release_note`). Refused as the call starts, before any
    write. `generation_config`: the local of the `generate` frame that marks the cache (None: not from `generate`)."""
    if TRANSFORMERS_VERSION >= CHUNKED_PREFILL_CONTINUES_SINCE:
        return
    held = cache.get_seq_length()
    if held and getattr(generation_config, "prefill_chunk_size", None):
        raise ConversationMismatchError(
            f"generate(prefill_chunk_size=...) on a cache that already holds {held} tokens: transformers "
            f"{transformers.__version__} feeds such a cache the whole conversation again, from its first token (every "
            f"cache, DynamicCache included, then holds the earlier turns twice and continues wrong); from "
            f"{CHUNKED_PREFILL_CONTINUES_SINCE} it continues it. Nothing was written. Upgrade transformers, or leave "
            f"`prefill_chunk_size` out of the later turns."
        )


# --- assisted decoding on a reused cache ----------------------------------------------------------------------------
def step_positions_note() -> str:
    """Empty where the attention passes each step's positions to `Cache.update` (from 5.24), which is how the first
    assisted step on held tokens is told apart from one that feeds them again (`steps.check_assisted_start`); before,
    the words that say why such a multi-token step cannot be checked."""
    if TRANSFORMERS_VERSION >= STEP_POSITIONS_SINCE:
        return ""
    return (
        f"transformers {transformers.__version__} does not pass the step's positions to the cache (from "
        f"{STEP_POSITIONS_SINCE} it does),"
    )


# --- chunked prefill on a cache that holds a conversation -----------------------------------------------------------
def chunked_prefill_release_note() -> str:
    """What a refused short attention mask adds on releases whose chunked prefill (`generate(prefill_chunk_size=...)`)
    feeds a cache that already holds tokens the whole conversation again, from its first token, with the mask cut to
    each chunk (fixed in 5.23; `DynamicCache` then silently attends over the repeated tokens twice)."""
    if TRANSFORMERS_VERSION >= CHUNKED_PREFILL_CONTINUES_SINCE:
        return ""
    return (
        f" (If this came from `generate(prefill_chunk_size=...)` on a cache that already holds tokens: transformers "
        f"{transformers.__version__} feeds such a cache the whole conversation again, from its first token; from "
        f"{CHUNKED_PREFILL_CONTINUES_SINCE} it continues it. Upgrade transformers, or leave `prefill_chunk_size` out "
        f"of the later turns.)"
    )


# --- early initialization -------------------------------------------------------------------------------------------
def initialize_layers_early(
    layers: Sequence[Any],
    batch_size: int,
    num_heads: Sequence[int | None],
    head_dim: Sequence[int],
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """Allocate each layer that can be allocated ahead of time with its own `num_heads[i]` / `head_dim[i]`: the loop of
    transformers' `Cache.early_initialization` from 5.23, which 5.5-5.22 lack (they take one int for every layer)."""
    if len(num_heads) != len(layers) or len(head_dim) != len(layers):
        raise ValueError(
            f"early_initialization takes one num_heads and one head_dim per layer ({len(layers)} layers), or an int; "
            f"got lists of {len(num_heads)} and {len(head_dim)}."
        )
    for layer, heads, size in zip(layers, num_heads, head_dim):
        if heads is None or not getattr(layer, "supports_early_init", True) or layer.is_initialized:
            continue  # None: a layer that stores nothing (KV-shared)
        empty = torch.zeros((batch_size, heads, 0, size), dtype=dtype, device=device)
        layer.lazy_initialization(empty, empty)
