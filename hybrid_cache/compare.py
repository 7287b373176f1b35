"""Alias of `hybrid_cache.tools.compare` (the compared caches and their bytes) at its old path: the same module object,
so ``from hybrid_cache import compare`` and ``import hybrid_cache.compare`` keep working. New code imports the tools
path."""

import sys

from .tools import compare

sys.modules[__name__] = compare
