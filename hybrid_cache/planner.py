"""Alias at the old path of `hybrid_cache.tools.planner` (the KV-memory planner) and of its command line
`hybrid_cache.tools.cli.planner` (`main`, `build_parser`): ``python -m hybrid_cache.planner`` runs that command
line. New code imports the tools paths."""

import sys

from .tools.cli.planner import build_parser, main  # noqa: F401
from .tools.planner import *  # noqa: F403

if __name__ == "__main__":
    sys.exit(main())
