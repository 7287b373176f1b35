"""Alias at the old path of `hybrid_cache.tools.lm_eval_ring` (lm-eval's model type ``hf-ring``, registered on import)
and of its command line `hybrid_cache.tools.cli.lm_eval_ring`: ``python -m hybrid_cache.lm_eval_ring run --model
hf-ring ...`` runs lm_eval's command line. New code imports the tools paths."""

from .tools.cli.lm_eval_ring import main  # noqa: F401
from .tools.lm_eval_ring import *  # noqa: F403

if __name__ == "__main__":
    main()
