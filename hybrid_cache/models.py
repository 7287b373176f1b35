"""Alias of `hybrid_cache.tools.models` (the embedded model's loading) at its old path: the same module object, so
``from hybrid_cache import models`` and ``import hybrid_cache.models`` keep working. New code imports the tools
path."""

import sys

from .tools import models

sys.modules[__name__] = models
