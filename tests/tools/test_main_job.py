"""The README's main job and Python snippet, run as a newcomer runs them, on the real Gemma 3 270M (slow; in CI).

The main job (``bash scripts/main_job.sh --no-setup``: the job without the set-up) must show the point with
clean output: a generation well past the 512-token window with the same tokens as DynamicCache, positive savings
against a full cache and DynamicCache's peak, the perplexity table with the ring equal to the no-cache forward, a
progress line for every long pass, and no warning, traceback, dependency noise or line glued by a carriage return.
Every Python command must go through ``$PYTHON``. The README snippet must print exactly what the README shows.
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOISE = re.compile(r"warn|traceback|error|deprecat|Generating .* split|Loading weights|it/s\]", re.I)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "HYBRID_CACHE_PYTHON_WHY")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", **extra)
    return env


pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("embedded_model_installed")]


def test_main_job_output(tmp_path):
    calls = tmp_path / "python_calls.log"
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/sh\necho "$*" >> {calls}\nexec {sys.executable} "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    run = subprocess.run(
        ["bash", "scripts/main_job.sh", "--no-setup"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
        env=_env(PYTHON=str(wrapper), OUT_DIR=str(tmp_path / "out")),
    )
    output = run.stdout + run.stderr
    assert run.returncode == 0, output
    noisy = [line for line in output.splitlines() if NOISE.search(line)]
    assert not noisy, noisy
    assert "\r" not in output  # progress must not glue lines in a log
    # Every Python command went through $PYTHON.
    logged = calls.read_text().splitlines()
    assert any("examples/generate_gemma3.py" in c for c in logged) and any(
        "hybrid_cache.tools.cli.perplexity" in c for c in logged
    )
    assert not re.search(r"^\s*python3? ", (ROOT / "scripts" / "main_job.sh").read_text(), re.M)

    # 1. generation past the window: same tokens, positive savings.
    assert re.search(r"prompt: 1024 tokens .* \(2\.0x the window\), then 128 greedy tokens", output)
    assert "--- DynamicCache" in output and "the same tokens." in output
    savings = [float(x) for x in re.findall(r"sav(?:es|ed):? (-?[\d.]+)%", output)]
    assert len(savings) >= 3 and all(s > 0 for s in savings), savings
    assert re.search(r"saves [\d.]+% of a full cache at the end and [\d.]+% of DynamicCache's peak", output)
    for progress in (
        "HybridRingCache: generating: 128 tok in",
        "DynamicCache: generating: 128 tok in",
        "   ring: 2048 tok in",
        "dynamic: 2048 tok in",
        "   none (one forward of 2048 tokens): 18 layers in",
    ):
        assert progress in output, progress

    # 2. perplexity: ring equals the no-cache forward.
    ppl = dict(re.findall(r"^(ring|dynamic|none)\s+([\d.]+)\s+2048", output, re.M))
    assert set(ppl) == {"ring", "dynamic", "none"}, output
    assert abs(float(ppl["ring"]) - float(ppl["none"])) / float(ppl["none"]) < 1e-4
    assert (tmp_path / "out" / "perplexity.json").is_file() and (tmp_path / "out" / "kv_memory.png").is_file()


def _readme_snippet() -> tuple[str, str]:
    """The README's Python snippet and the output block that follows it ("It prints:")."""
    text = (ROOT / "README.md").read_text()
    match = re.search(r"```python\n(.*?)```\s*\n(?:[^\n]*\n)*?It prints:\s*\n+```text\n(.*?)```", text, re.S)
    assert match, "README.md must have a ```python snippet followed by 'It prints:' and a ```text block"
    return match.group(1), match.group(2)


def test_readme_snippet_prints_what_the_readme_shows(tmp_path):
    code, expected = _readme_snippet()
    script = tmp_path / "snippet.py"
    script.write_text(code)
    run = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=900,
        env=_env(PYTHONPATH=str(ROOT)),
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.strip() == expected.strip()
    assert not [line for line in run.stderr.splitlines() if NOISE.search(line)], run.stderr
