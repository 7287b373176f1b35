"""Every difference between the transformers releases hybrid_cache supports, in one place.

The rest of the package is written against the newest cache protocol and imports from here whatever changed across
the supported range (`SUPPORTED_RANGE`): no other module compares versions. Each name documents the release where
transformers changed and what this module does on either side of it.

| what                                   | changed in | here                                                      |
|----------------------------------------|------------|-----------------------------------------------------------|
| `cache=` keyword of `generate`/forward | 5.24       | `CACHE_KEYWORD`, `cache_kwargs`, `cache_from_kwargs`       |
| `cache_utils.DummyLayer`               | 5.23       | `DummyLayer` (the same no-storage layer before 5.23)       |
| config `kv_sharing_modes` (Gemma 4)    | 5.23       | `kv_sharing_modes` (from `num_kv_shared_layers` before)    |
| `Cache.max_cache_len` assignable       | 5.20       | `HybridRingCache` keeps its own value (no change needed)   |
| `get_max_length` / `get_max_cache_shape` | 5.13     | `CacheLayerMixin` answers both                             |
| `generate` turns on past recording     | 5.14       | `PAST_RECORDING_SINCE`: crops past the margin raise        |
| assisted / prompt-lookup after the wrap| 5.18       | `ROLLBACK_SINCE`, `check_rollback_supported`               |
| `DynamicCache` sliding crop past window| 5.15       | `DYNAMIC_SLIDING_CROP_SINCE` (tests' reference only)       |
| Gemma 4 KV sharing without a cache     | 5.5.2      | `no_cache_forward_is_exact` (tests' oracle only)           |
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import transformers
from packaging.version import Version
from transformers import cache_utils

from .errors import RollbackError, UnsupportedReleaseError

__all__ = [
    "CACHE_KEYWORD",
    "CACHE_KEYWORD_SINCE",
    "OLDEST_SUPPORTED",
    "DYNAMIC_SLIDING_CROP_SINCE",
    "PAST_RECORDING_SINCE",
    "ROLLBACK_SINCE",
    "TRANSFORMERS_VERSION",
    "CacheLayerMixin",
    "DummyLayer",
    "UnsupportedReleaseError",
    "cache_from_kwargs",
    "cache_kwargs",
    "check_rollback_supported",
    "kv_sharing_modes",
    "no_cache_forward_is_exact",
    "rollback_release_note",
    "rollback_supported",
]

TRANSFORMERS_VERSION = Version(Version(transformers.__version__).base_version)
OLDEST_SUPPORTED = Version("5.5")  # Gemma 4's first release; also declared in pyproject.toml
CACHE_KEYWORD_SINCE = Version("5.24")
ROLLBACK_SINCE = Version("5.18")
PAST_RECORDING_SINCE = Version("5.14")
_NO_CACHE_KV_SHARING_SINCE = Version("5.5.2")
DYNAMIC_SLIDING_CROP_SINCE = Version("5.15")
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

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
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
