"""hybrid_cache: an exact, memory-minimal KV cache for transformers' hybrid local/global attention models."""

from .cache import HybridRingCache, MemoryReport
from .layers import (
    CacheCapacityError,
    GrowableFullLayer,
    RingSlidingLayer,
    RollbackError,
    StaticFullLayer,
    StaticRingSlidingLayer,
)
from .quantized import QUANTIZATION_MODES, KVQuantizer, QuantizedFullLayer, StaticQuantizedFullLayer
from .streaming import SinkWindowFullLayer
from .mask_hook import (
    RingLayout,
    UnsupportedAttentionError,
    install_mask_hook,
    is_mask_hook_installed,
    uninstall_mask_hook,
)

__all__ = [
    "CacheCapacityError",
    "GrowableFullLayer",
    "HybridRingCache",
    "KVQuantizer",
    "MemoryReport",
    "QUANTIZATION_MODES",
    "QuantizedFullLayer",
    "RingLayout",
    "RingSlidingLayer",
    "RollbackError",
    "SinkWindowFullLayer",
    "StaticFullLayer",
    "StaticQuantizedFullLayer",
    "StaticRingSlidingLayer",
    "UnsupportedAttentionError",
    "install_mask_hook",
    "is_mask_hook_installed",
    "uninstall_mask_hook",
]
__version__ = "0.1.0"
