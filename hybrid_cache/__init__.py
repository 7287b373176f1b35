"""hybrid_cache: an exact, memory-minimal KV cache for transformers' hybrid local/global attention models.

The public API is `__all__`: the cache and what it reports, the switch that gives every `generate()` call a ring
(`enable` / `disable`), the cache keyword of the installed transformers release, attention on compressed codes,
attention maps, pipeline-stage helpers and the errors users catch (every error derives from `HybridCacheError`).
Storage classes, the options, the layer specifications, the quantizer, the mask hook's controls and the remaining
errors stay importable from the package and from their modules (`hybrid_cache.ring`, `hybrid_cache.full`,
`hybrid_cache.options`, `hybrid_cache.specs`, `hybrid_cache.quantized`, `hybrid_cache.streaming`,
`hybrid_cache.mask_hook`, `hybrid_cache.errors`, ...).
"""

import os

from .attention_maps import attention_in_time_order
from .cache import HybridRingCache, MemoryReport

# Importable from the package for code written against earlier releases; documented in their modules.
from .code_attention import CODE_ATTENTION, register_code_attention, use_code_attention  # noqa: F401, E402
from .compat import (
    CACHE_KEYWORD,  # noqa: F401, E402
    cache_kwargs,
)
from .distributed import restrict_to_stage, stage_layers
from .errors import (  # noqa: F401, E402
    CacheCapacityError,
    CodeAttentionError,
    CodeKernelError,
    ConversationMismatchError,
    HybridCacheError,
    RollbackError,
    UnsupportedAttentionError,
    UnsupportedReleaseError,
    WindowMismatchError,
)
from .full import GrowableFullLayer, StaticFullLayer  # noqa: F401, E402
from .mask_hook import RingLayout, install_mask_hook, is_mask_hook_installed, uninstall_mask_hook  # noqa: F401, E402
from .options import CacheOptions  # noqa: F401, E402
from .quantized import QUANTIZATION_MODES, KVQuantizer, QuantizedFullLayer, StaticQuantizedFullLayer  # noqa: F401, E402
from .ring import RingSlidingLayer, StaticRingSlidingLayer  # noqa: F401, E402
from .snapshot import (
    CacheCheckpoint,
    read_metadata,  # noqa: F401, E402
)
from .specs import LayerSpec, layer_specs  # noqa: F401, E402
from .streaming import SinkWindowFullLayer  # noqa: F401, E402
from .switch import (
    disable,
    enable,
    is_enabled,  # noqa: F401, E402
)

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
from .version import __version__  # noqa: E402, F401

#: The folder of the `evaluate` metric module "ring_perplexity": `evaluate.load(hybrid_cache.RING_PERPLEXITY_METRIC)`.
RING_PERPLEXITY_METRIC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "metrics", "ring_perplexity")
