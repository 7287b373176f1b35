"""Alias of `hybrid_cache.tools.quality` (KL divergence and top-1 agreement against an exact cache) at its old path:
the same module object, so ``from hybrid_cache import quality`` and ``import hybrid_cache.quality`` keep working.
New code imports the tools path."""

import sys

from .tools import quality

sys.modules[__name__] = quality
