#!/usr/bin/env bash
# Set-up (scripts/setup.sh), then the whole test suite with the same Python: layer tests, the no-cache oracle on tiny
# Gemma 3/4, generate parity, the mask hook, compile, the benchmark harness, and the real-model tests (marked slow;
# they run here too: the main job, the README snippet, the set-up scripts), then the exported programs in the export
# venv (tests/export). Extra arguments go to both pytest runs.
set -euo pipefail
source "$(dirname "$0")/python_env.sh"
hc_resolve_python
cd "$(hc_repo_root)"
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
echo "[test] $PYTHON -m pytest tests --ignore=tests/export $*"
status=0
"$PYTHON" -m pytest tests --ignore=tests/export "$@" || status=$?
# The exported programs (tests/export): ExecuTorch and ONNX Runtime, in a venv of their own with the `export` extra
# (executorch brings torchao, whose import warns on a CPU machine: the other commands stay quiet without it). Made by
# the same set-up (torch's CPU build first), .venv-export in the repository unless HYBRID_CACHE_EXPORT_VENV says where.
export_venv="${HYBRID_CACHE_EXPORT_VENV:-$(hc_repo_root)/.venv-export}"
env -u PYTHON -u VIRTUAL_ENV -u CONDA_PREFIX HYBRID_CACHE_VENV="$export_venv" HYBRID_CACHE_EXTRAS=tools,real,test,export \
    bash scripts/setup.sh
echo "[test] $export_venv/bin/python -m pytest tests/export $*"
"$export_venv/bin/python" -m pytest tests/export "$@" || status=$?
exit "$status"
