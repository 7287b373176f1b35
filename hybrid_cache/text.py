"""Alias of `hybrid_cache.tools.text` (the evaluation texts) at its old path: the same module object, so ``from
hybrid_cache import text`` and ``import hybrid_cache.text`` keep working. New code imports the tools path."""

import sys

from .tools import text

sys.modules[__name__] = text
