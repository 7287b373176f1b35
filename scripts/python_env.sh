# shellcheck shell=bash
# Sourced by scripts/setup.sh, scripts/test.sh and scripts/main_job.sh: chooses the one Python
# interpreter all of them use, and exports it as PYTHON (so every later step, and every script they call, uses it):
#
#   1. PYTHON, if set (a command or a path). If it cannot install packages (an "externally managed" system Python,
#      PEP 668, or one without pip), the project virtual environment (3.) is made from it instead.
#   2. else the active virtual environment (VIRTUAL_ENV) or conda environment (CONDA_PREFIX): its python.
#   3. else the project virtual environment .venv at the repository root (HYBRID_CACHE_VENV to put it elsewhere):
#      reused if it exists, else made with `python3 -m venv` (or python3.13 ... python3.10 when python3 is older
#      than 3.10). A system Python is never installed into unless PYTHON names it.
#
# hc_resolve_python [--no-create]: sets and exports PYTHON (an absolute path) and HYBRID_CACHE_PYTHON_WHY (why that
# one). With --no-create (scripts that only run things), a missing project venv falls back to python3.

hc_repo_root() { (cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd); }

hc_say() { printf '%s\n' "$*"; }

hc_die() {
    printf 'error: %s\n' "$*" >&2
    exit 1
}

# Python >= 3.10? (exit status)
hc_python_ok() { "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)' >/dev/null 2>&1; }

# Why an interpreter cannot take packages: "externally-managed" (PEP 668), "no-pip", or "" when it can.
hc_install_blocker() { "$1" "$(hc_repo_root)/scripts/check_install.py" --blocker; }

# The interpreter to make the project venv with: $1 if given, else the first python3.x >= 3.10 on PATH.
hc_base_python() {
    local candidate
    if [ -n "${1:-}" ]; then
        hc_python_ok "$1" || hc_die "$1 is not Python >= 3.10 ($("$1" --version 2>&1)): set PYTHON to a newer one"
        printf '%s\n' "$1"
        return
    fi
    for candidate in python3 python3.13 python3.12 python3.11 python3.10; do
        if command -v "$candidate" >/dev/null 2>&1 && hc_python_ok "$candidate"; then
            command -v "$candidate"
            return
        fi
    done
    hc_die "no Python >= 3.10 found (python3 is $(python3 --version 2>&1 || echo missing)): install one, or set PYTHON"
}

# Make (or reuse) the project venv from base interpreter $1; print its python.
hc_project_venv() {
    local venv="${HYBRID_CACHE_VENV:-$(hc_repo_root)/.venv}" base
    if [ -x "$venv/bin/python" ] && hc_python_ok "$venv/bin/python"; then
        printf '%s\n' "$venv/bin/python"
        return
    fi
    base="$(hc_base_python "${1:-}")"
    hc_say "[setup] creating the project virtual environment $venv with $base ($("$base" --version 2>&1))" >&2
    if ! "$base" -m venv "$venv" >&2; then
        rm -rf "$venv"
        hc_die "could not create a virtual environment with $base. On Debian/Ubuntu install the venv module first" \
               "(sudo apt install python3-venv, or python3.X-venv for your version), then re-run; or set PYTHON to an" \
               "interpreter that can install packages."
    fi
    printf '%s\n' "$venv/bin/python"
}

hc_resolve_python() {
    local create=1 chosen blocker
    [ "${1:-}" = "--no-create" ] && create=0
    if [ -n "${PYTHON:-}" ]; then
        chosen="$(command -v "$PYTHON" 2>/dev/null)" || hc_die "PYTHON=$PYTHON is not an executable"
        case "$chosen" in /*) ;; *) chosen="$PWD/$chosen" ;; esac
        hc_python_ok "$chosen" || hc_die "PYTHON=$PYTHON is not Python >= 3.10 ($("$chosen" --version 2>&1))"
        blocker="$(hc_install_blocker "$chosen")"
        if [ -z "$blocker" ] || [ "$create" = 0 ]; then
            PYTHON="$chosen"
            : "${HYBRID_CACHE_PYTHON_WHY:=chosen by PYTHON}"
        else
            PYTHON="$(hc_project_venv "$chosen")"
            HYBRID_CACHE_PYTHON_WHY="the project virtual environment, made from PYTHON=$chosen, which is $blocker"
        fi
    elif [ -n "${VIRTUAL_ENV:-}" ] && [ -x "$VIRTUAL_ENV/bin/python" ]; then
        PYTHON="$VIRTUAL_ENV/bin/python"
        HYBRID_CACHE_PYTHON_WHY="the active virtual environment"
    elif [ -n "${CONDA_PREFIX:-}" ] && [ -x "$CONDA_PREFIX/bin/python" ]; then
        PYTHON="$CONDA_PREFIX/bin/python"
        HYBRID_CACHE_PYTHON_WHY="the active conda environment"
    elif [ "$create" = 1 ] || [ -x "${HYBRID_CACHE_VENV:-$(hc_repo_root)/.venv}/bin/python" ]; then
        PYTHON="$(hc_project_venv)"
        HYBRID_CACHE_PYTHON_WHY="the project virtual environment, as no environment was active"
    else
        PYTHON="$(command -v python3)" || hc_die "python3 not found: run bash scripts/setup.sh first"
        HYBRID_CACHE_PYTHON_WHY="python3: no environment is active and there is no project virtual environment"
    fi
    export PYTHON HYBRID_CACHE_PYTHON_WHY
}
