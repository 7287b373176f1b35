"""Alias at the old path of `hybrid_cache.tools.perplexity` (streaming perplexity) and of its command line
`hybrid_cache.tools.cli.perplexity` (`main`, `build_parser`): ``python -m hybrid_cache.perplexity`` runs that
command line. New code imports the tools paths."""

import sys

from .tools.cli.perplexity import build_parser, main  # noqa: F401
from .tools.compare import full_cache_bytes_per_token  # noqa: F401  importable here before the move
from .tools.perplexity import *  # noqa: F403

if __name__ == "__main__":
    sys.exit(main())
