"""Every command of docs/evaluation.md runs as written (slow: the embedded Gemma 3 270M, lm-eval and evaluate).

The ```python blocks run as they are, each in a fresh interpreter from the repository root (as the document says to
run them); the ```bash block's lm-eval command line runs with `--limit 1` added (one document of each task: the
command's arguments are what is checked, the full run is timed in the document). Installed with the `eval` extra.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "evaluation.md"


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", DOC.read_text(), re.S)


def _env() -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


def _run(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    run = subprocess.run(argv, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=1800, **kwargs)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run


def test_the_document_has_its_snippets():
    assert len(_blocks("python")) == 2 and len(_blocks("bash")) == 2


@pytest.mark.parametrize("index", [0, 1])
def test_python_snippet_runs_as_written(index):
    code = _blocks("python")[index]
    run = _run([sys.executable, "-c", code])
    assert "Traceback" not in run.stderr
    assert "kwarg is not of type `str`" not in run.stderr and "already-initialized model" not in run.stderr
    if "RING_PERPLEXITY_METRIC" in code:
        assert re.search(r"\{'perplexities': \[[\d.]+\], 'mean_perplexity': [\d.]+\}", run.stdout), run.stdout
    else:
        assert re.fullmatch(r"[\d.]+\s*", run.stdout), run.stdout


def test_lm_eval_command_runs_as_written():
    (block,) = [b for b in _blocks("bash") if "hybrid-cache-lm-eval" in b]
    words = shlex.split(block.replace("\\\n", " "))
    env_words = [w for w in words if re.fullmatch(r"[A-Z_]+=\S*", w)]
    assert set(env_words) <= {"HF_HUB_OFFLINE=1", "HF_DATASETS_OFFLINE=1"}
    command = words[len(env_words) :]
    assert command[0] == "hybrid-cache-lm-eval"
    # The console script's module (the console script itself imports the installed checkout, maybe another one).
    run = _run([sys.executable, "-m", "hybrid_cache.tools.cli.lm_eval_ring", *command[1:], "--limit", "1"])
    output = run.stdout + run.stderr
    assert "|ring_local_generate" in output and "|ring_local_perplexity" in output, output[-3000:]
    assert "kwarg is not of type `str`" not in output and "already-initialized model" not in output
