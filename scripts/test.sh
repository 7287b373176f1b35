#!/usr/bin/env bash
# Set-up, then the whole test suite: layer tests, the no-cache oracle on tiny Gemma 3/4, generate parity, the mask
# hook, compile, and the real-model tests (marked slow; they run here too).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "${PYTHON:-python3}" -m pytest tests "$@"
