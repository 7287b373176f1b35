"""Alias at the old path of `hybrid_cache.tools.prefix` (prefix caches) and of its command line
`hybrid_cache.tools.cli.prefix` (`main`, `build_parser`): ``python -m hybrid_cache.prefix`` runs that command line.
New code imports the tools paths."""

import sys

from .tools.cli.prefix import build_parser, main  # noqa: F401
from .tools.prefix import *  # noqa: F403

if __name__ == "__main__":
    sys.exit(main())
