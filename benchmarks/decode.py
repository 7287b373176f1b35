"""Decode benchmark (thin wrapper): ``python benchmarks/decode.py [options]`` == ``python -m hybrid_cache.tools.cli.bench``."""

import sys

from hybrid_cache.tools.cli.bench import main

if __name__ == "__main__":
    sys.exit(main())
