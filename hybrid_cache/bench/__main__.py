"""``python -m hybrid_cache.bench``: the benchmark's command line (`hybrid_cache.tools.cli.bench`)."""

import sys

from hybrid_cache.tools.cli.bench import main

sys.exit(main())
