"""hybrid_cache: an exact, memory-minimal KV cache for transformers' hybrid local/global attention models."""

from .attention_maps import attention_in_time_order
from .cache import HybridRingCache, MemoryReport
from .code_attention import CODE_ATTENTION, CodeAttentionError, register_code_attention, use_code_attention
from .distributed import restrict_to_stage, stage_layers
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
    WindowMismatchError,
    install_mask_hook,
    is_mask_hook_installed,
    uninstall_mask_hook,
)
from .snapshot import CacheCheckpoint, read_metadata

__all__ = [
    "CODE_ATTENTION",
    "CodeAttentionError",
    "CacheCapacityError",
    "CacheCheckpoint",
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
    "WindowMismatchError",
    "attention_in_time_order",
    "install_mask_hook",
    "is_mask_hook_installed",
    "restrict_to_stage",
    "stage_layers",
    "read_metadata",
    "register_code_attention",
    "uninstall_mask_hook",
    "use_code_attention",
]
__version__ = "0.1.0"
