"""``python -m hybrid_cache.bench``: see ``hybrid_cache.bench.cli``."""

import sys

from .cli import main

sys.exit(main())
