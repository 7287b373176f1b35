"""hybrid_cache: an exact, memory-minimal KV cache for transformers' hybrid local/global attention models.

The public API is `__all__`: the cache and what it reports, the switch that gives every `generate()` call a ring
(`enable` / `disable`), the cache keyword of the installed transformers release, attention on compressed codes,
attention maps, pipeline-stage helpers and the errors users catch (every error derives from `HybridCacheError`).
Everything else has one import path, its module: storage classes (`hybrid_cache.ring`, `hybrid_cache.full`,
`hybrid_cache.quantized`, `hybrid_cache.streaming`), the options (`hybrid_cache.options`), the layer specifications
(`hybrid_cache.specs`), the mask hook's controls (`hybrid_cache.mask_hook`), the remaining errors
(`hybrid_cache.errors`); the tools are under `hybrid_cache.tools`.
"""

from .attention_maps import attention_in_time_order
from .cache import HybridRingCache, MemoryReport
from .checkpoints import CacheCheckpoint
from .code_attention import use_code_attention
from .compat import cache_kwargs
from .distributed import restrict_to_stage, stage_layers
from .errors import (
    CacheCapacityError,
    ConversationMismatchError,
    HybridCacheError,
    RollbackError,
    WindowMismatchError,
)
from .switch import disable, enable
from .version import __version__ as __version__

__all__ = [
    "CacheCapacityError",
    "CacheCheckpoint",
    "ConversationMismatchError",
    "HybridCacheError",
    "HybridRingCache",
    "MemoryReport",
    "RollbackError",
    "WindowMismatchError",
    "attention_in_time_order",
    "cache_kwargs",
    "disable",
    "enable",
    "restrict_to_stage",
    "stage_layers",
    "use_code_attention",
]
