#!/usr/bin/env bash
# Set-up (scripts/setup.sh), then the main job with the same Python, offline (examples/main_job.sh): greedy generation
# well past the sliding window with HybridRingCache on the embedded Gemma 3 270M (same tokens as DynamicCache, K/V
# memory of both against a full cache), then perplexity ring vs DynamicCache vs no cache on a public-domain text.
set -euo pipefail
source "$(dirname "$0")/python_env.sh"
hc_resolve_python
cd "$(hc_repo_root)"
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec bash examples/main_job.sh "$@"
