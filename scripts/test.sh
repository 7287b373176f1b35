#!/usr/bin/env bash
# Set-up (scripts/setup.sh), then the whole test suite with the same Python: layer tests, the no-cache oracle on tiny
# Gemma 3/4, generate parity, the mask hook, compile, the benchmark harness, and the real-model tests (marked slow;
# they run here too: the main job, the README snippet, the set-up scripts). Extra arguments go to pytest.
set -euo pipefail
source "$(dirname "$0")/python_env.sh"
hc_resolve_python
cd "$(hc_repo_root)"
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
echo "[test] $PYTHON -m pytest tests $*"
exec "$PYTHON" -m pytest tests "$@"
