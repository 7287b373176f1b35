#!/usr/bin/env bash
# Set-up, then the main job, offline: a greedy generation with HybridRingCache on the embedded Gemma 3 270M (text and
# memory report), then a perplexity comparison ring vs DynamicCache vs no cache on the embedded public-domain text.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec bash examples/main_job.sh "$@"
