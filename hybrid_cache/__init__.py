"""hybrid_cache: an exact, memory-minimal KV cache for transformers' hybrid local/global attention models.

The public API is `__all__`: the cache and what it reports, snapshots, attention maps, pipeline-stage helpers and the
errors. Storage classes, the quantizer and the mask hook's controls stay importable from their modules
(`hybrid_cache.layers`, `hybrid_cache.quantized`, `hybrid_cache.streaming`, `hybrid_cache.mask_hook`).
"""

from .attention_maps import attention_in_time_order
from .cache import HybridRingCache, MemoryReport
from .code_attention import use_code_attention
from .distributed import restrict_to_stage, stage_layers
from .errors import (
    CacheCapacityError,
    CodeAttentionError,
    ConversationMismatchError,
    HybridCacheError,
    RollbackError,
    UnsupportedAttentionError,
    WindowMismatchError,
)
from .snapshot import CacheCheckpoint, read_metadata

# Importable from the package for code written against earlier releases; documented in their modules.
from .code_attention import CODE_ATTENTION, register_code_attention  # noqa: F401, E402
from .layers import GrowableFullLayer, RingSlidingLayer, StaticFullLayer, StaticRingSlidingLayer  # noqa: F401, E402
from .mask_hook import RingLayout, install_mask_hook, is_mask_hook_installed, uninstall_mask_hook  # noqa: F401, E402
from .quantized import QUANTIZATION_MODES, KVQuantizer, QuantizedFullLayer, StaticQuantizedFullLayer  # noqa: F401, E402
from .streaming import SinkWindowFullLayer  # noqa: F401, E402

__all__ = [
    "CacheCapacityError",
    "CacheCheckpoint",
    "CodeAttentionError",
    "ConversationMismatchError",
    "HybridCacheError",
    "HybridRingCache",
    "MemoryReport",
    "RollbackError",
    "UnsupportedAttentionError",
    "WindowMismatchError",
    "attention_in_time_order",
    "read_metadata",
    "restrict_to_stage",
    "stage_layers",
    "use_code_attention",
]
__version__ = "0.1.0"
