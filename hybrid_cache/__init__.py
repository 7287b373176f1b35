"""hybrid_cache: an exact, memory-minimal KV cache for transformers' hybrid local/global attention models."""

import os

from .attention_maps import attention_in_time_order
from .cache import HybridRingCache, MemoryReport
from .compat import CACHE_KEYWORD, UnsupportedReleaseError, cache_kwargs
from .distributed import restrict_to_stage, stage_layers
from .layers import (
    CacheCapacityError,
    GrowableFullLayer,
    RingSlidingLayer,
    RollbackError,
    StaticFullLayer,
    StaticRingSlidingLayer,
)
from .mask_hook import (
    RingLayout,
    UnsupportedAttentionError,
    WindowMismatchError,
    install_mask_hook,
    is_mask_hook_installed,
    uninstall_mask_hook,
)
from .quantized import QUANTIZATION_MODES, KVQuantizer, QuantizedFullLayer, StaticQuantizedFullLayer
from .snapshot import CacheCheckpoint, read_metadata
from .streaming import SinkWindowFullLayer
from .switch import disable, enable, is_enabled

__all__ = [
    "CACHE_KEYWORD",
    "CacheCapacityError",
    "CacheCheckpoint",
    "GrowableFullLayer",
    "HybridRingCache",
    "KVQuantizer",
    "MemoryReport",
    "QUANTIZATION_MODES",
    "RING_PERPLEXITY_METRIC",
    "QuantizedFullLayer",
    "RingLayout",
    "RingSlidingLayer",
    "RollbackError",
    "SinkWindowFullLayer",
    "StaticFullLayer",
    "StaticQuantizedFullLayer",
    "StaticRingSlidingLayer",
    "UnsupportedAttentionError",
    "UnsupportedReleaseError",
    "WindowMismatchError",
    "attention_in_time_order",
    "cache_kwargs",
    "disable",
    "enable",
    "is_enabled",
    "install_mask_hook",
    "is_mask_hook_installed",
    "restrict_to_stage",
    "stage_layers",
    "read_metadata",
    "uninstall_mask_hook",
]
__version__ = "0.1.0"
#: The folder of the `evaluate` metric module "ring_perplexity": `evaluate.load(hybrid_cache.RING_PERPLEXITY_METRIC)`.
RING_PERPLEXITY_METRIC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "metrics", "ring_perplexity")
