"""Every error hybrid_cache raises on misuse: one base class, `HybridCacheError`, and each error also keeps the
built-in base that code written before it may catch (`ValueError`, `RuntimeError`)."""

from __future__ import annotations

__all__ = [
    "BandedMaskError",
    "CacheCapacityError",
    "CodeAttentionError",
    "CodeKernelError",
    "ConversationMismatchError",
    "HybridCacheError",
    "IncompleteStepError",
    "PreparedMaskError",
    "ProgramFormatError",
    "RollbackError",
    "UnsupportedAttentionError",
    "UnsupportedReleaseError",
    "WindowMismatchError",
]


class HybridCacheError(Exception):
    """Base class of hybrid_cache's errors: `except HybridCacheError` catches every one of them."""


class CacheCapacityError(HybridCacheError, RuntimeError):
    """Raised when a fixed-capacity layer is asked to hold more tokens than it was allocated for."""


class RollbackError(HybridCacheError, RuntimeError):
    """Raised when `crop` would need tokens a ring buffer has already overwritten."""


class UnsupportedAttentionError(HybridCacheError, RuntimeError):
    """Raised when a ring-buffer layout would be served by an attention path that cannot mask it correctly."""


class WindowMismatchError(HybridCacheError, ValueError):
    """Raised when the model's mask would attend to keys that the cache's sliding-window ring no longer holds."""


class ConversationMismatchError(HybridCacheError, ValueError):
    """Raised when a step's inputs cannot continue what the cache holds: a cache holds one conversation, and the
    attention mask (or the inputs `generate` sliced from it) does not cover the cached tokens followed by new ones."""


class PreparedMaskError(HybridCacheError, RuntimeError):
    """A prepared attention mask (4D, or a dict of them, built outside this step's mask creation) does not fit the keys
    the cache returns for this step: another width, or a wrapped ring's slot layout no mask was built for."""


class BandedMaskError(HybridCacheError, RuntimeError):
    """A long step's banded mask description (`hybrid_cache.banded.BandedMask`) reached code other than
    hybrid_cache's attention, or does not fit the step it is used for; or a banded-prefill setting is invalid."""


class CodeAttentionError(HybridCacheError, RuntimeError):
    """A compressed layer's `CompressedKV` handle reached code that is not hybrid_cache's code-domain attention."""


class CodeKernelError(HybridCacheError, RuntimeError):
    """The native code-attention kernel was required (`HYBRID_CACHE_CODE_KERNEL=on`) where it cannot run, or the
    setting is not one of auto / on / off; the message says why and how to fall back."""


class UnsupportedReleaseError(HybridCacheError, RuntimeError):
    """A feature the installed transformers release cannot run exactly; the message names the release that can."""


class IncompleteStepError(HybridCacheError, RuntimeError):
    """A forward failed after some layers stored its step, and the step cannot be taken back exactly (`steps.py`);
    the cache refuses every use until `reset`, `restore` or `load_into` replaces its state."""


class ProgramFormatError(HybridCacheError, ValueError):
    """A file given to `hybrid_cache.export.load_program` is not a hybrid_cache program, is damaged, or was exported
    in a program format this version does not run; the message names the file and the fix."""
