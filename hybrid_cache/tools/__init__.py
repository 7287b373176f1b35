"""The tools around the cache: not needed to use `HybridRingCache`, and importing nothing at package import.

Library modules (each importable on its own; they use the core only through its public names):

- `models` / `text`: the embedded Gemma 3 270M and the default evaluation text, offline;
- `compare`: the caches the ring is compared against and how their bytes are counted;
- `perplexity` / `quality`: streaming perplexity, and KL / top-1 agreement against an exact cache;
- `planner`: the KV bytes of every cache for a config, per process, and the longest context a budget allows;
- `prefix`: prefix caches built, saved and answered from, and their time to first token;
- `bench`: the benchmark harness;
- `lm_eval_ring`: lm-evaluation-harness' model type `hf-ring`;
- `progress`: progress lines of long passes.

Their command lines (argument parsing, printing, exit statuses) are in `hybrid_cache.tools.cli`. Dependencies beyond
the core's are in the `tools` extra of `pyproject.toml` (lm-eval and evaluate in `eval`); see docs/design.md.
"""

import os

#: The folder of the `evaluate` metric module "ring_perplexity": `evaluate.load(hybrid_cache.tools.RING_PERPLEXITY_METRIC)`
#: (a local folder: works offline).
RING_PERPLEXITY_METRIC = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "metrics", "ring_perplexity"
)
