"""Alias of `hybrid_cache.tools.progress` (progress lines) at its old path: the same module object, so ``from
hybrid_cache import progress`` and ``import hybrid_cache.progress`` keep working. New code imports the tools path."""

import sys

from .tools import progress

sys.modules[__name__] = progress
