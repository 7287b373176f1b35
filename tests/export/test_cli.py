"""The console script `hybrid-cache-export` as a user calls it: a local checkpoint (tiny Gemma 3 with a tokenizer)
exported to `.onnx` and `.pte` with a progress line per stage, then `--run` / `--run-only` generating from the file:
the text equals eager greedy `generate` with `DynamicCache`; every user mistake is one line on stderr, exit code 2.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from builders import SAMPLE, tiny_model, tiny_tokenizer
from transformers import DynamicCache

from hybrid_cache import cache_kwargs

pytest.importorskip("onnxruntime", reason="the export extra is not installed")
pytest.importorskip("executorch", reason="the export extra is not installed")
from hybrid_cache.tools.cli.export import main  # noqa: E402

pytestmark = [pytest.mark.export, pytest.mark.filterwarnings("ignore::FutureWarning")]

WINDOW, NEW = 6, 14  # up to 14 new tokens (both stop at the model's end-of-sequence token)
PROMPT = " ".join(SAMPLE.split()[:8])
IMPORT_NOISE = ("Failed to load ",)  # torchao's kernels for other torch builds, logged at its import


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    tokenizer = tiny_tokenizer(SAMPLE * 4)
    directory = tmp_path_factory.mktemp("tiny_checkpoint")
    tiny_model(vocab=len(tokenizer), window=WINDOW).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def eager_text(checkpoint: Path) -> str:
    from hybrid_cache.tools.models import load_model

    model, tokenizer = load_model(str(checkpoint))
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.float().generate(
            ids,
            max_new_tokens=NEW,
            do_sample=False,
            pad_token_id=0,
            **cache_kwargs(DynamicCache(config=model.config)),
        )
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def run_cli(capsys, argv: list[str]) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = int(exit_.code or 0)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("suffix", ["onnx", "pte"])
def test_export_then_run_equals_eager_generate(checkpoint, tmp_path, capsys, suffix):
    """Export with a progress line per stage and the file's size, generate from the file (in the same call, then
    again with --run-only): the generated text is eager `generate`'s."""
    path = tmp_path / f"tiny.{suffix}"
    common = ["--model", str(checkpoint), "--run", PROMPT, "--max-new-tokens", str(NEW)]
    code, out, err = run_cli(capsys, [str(path), "--max-cache-len", "64", "--chunk-size", "8", *common])
    assert code == 0, err
    stages = re.findall(r"^\[(\d)/4\] (\w+)", out, flags=re.M)
    expected = [("1", "model"), ("2", "export"), ("3", "lowering"), ("4", "writing")]
    assert stages == (expected if suffix == "pte" else [s for s in expected if s[1] != "lowering"]), out
    size = re.search(r"^wrote .*: ([\d.]+) MiB in \d+ s; sliding layers hold (\d+) slots, full layers 64$", out, re.M)
    assert size is not None, out
    assert abs(float(size.group(1)) - path.stat().st_size / 2**20) < 0.06 and int(size.group(2)) == WINDOW
    expected_text = eager_text(checkpoint)
    if suffix == "pte":  # ExecuTorch's runner prints no byte that is not text on its own; transformers prints U+FFFD
        expected_text = expected_text.replace("\ufffd", "")
    speed = r"\(first token after \d+ ms, then [\d.]+ ms/token; ExecuTorch's TextLLMRunner, tokenizer tiny.tokenizer.json\)"
    if suffix == "onnx":
        speed = r"\([\d.]+ ms/token\)"
    assert re.search(rf"^prompt: \d+ tokens; \d+ new in [\d.]+ s {speed}$", out, re.M), out
    assert out.rstrip("\n").endswith(expected_text), (out, expected_text)

    code, again, err = run_cli(capsys, [str(path), "--run-only", *common])
    assert code == 0, err
    assert "[2/4]" not in again and again.rstrip("\n").endswith(expected_text)


def test_mistakes_are_one_line(checkpoint, tmp_path, capsys):
    """A wrong suffix, a bad number, --run-only without a file or a prompt, a directory, a missing model, a file that
    is not a program: one line naming the problem, exit code 2, no traceback."""
    not_a_program = tmp_path / "notes.onnx"
    not_a_program.write_text(SAMPLE)
    cases = [
        ([str(tmp_path / "x.bin")], "the format comes from the suffix"),
        ([str(tmp_path / "x.pte"), "--chunk-size", "1"], "--chunk-size must be >= 2"),
        ([str(tmp_path / "x.pte"), "--max-cache-len", "0"], "--max-cache-len must be >= 1"),
        ([str(tmp_path / "x.pte"), "--rollback-margin", "-1"], "--rollback-margin must be >= 0"),
        ([str(tmp_path / "x.pte"), "--run-only"], "--run-only needs --run PROMPT"),
        ([str(tmp_path / "x.onnx"), "--quantize", "8da4w"], "--quantize 8da4w is for .pte programs"),
        ([str(tmp_path / "nosuch.pte"), "--run-only", "--run", "x"], "no such program file"),
        ([str(tmp_path)], "the format comes from the suffix"),
        ([str(tmp_path / "x.onnx"), "--model", str(tmp_path / "nosuch")], "nosuch"),
        ([str(not_a_program), "--run-only", "--run", "x", "--model", str(checkpoint)], "notes.onnx"),
    ]
    for argv, message in cases:
        code, _, err = run_cli(capsys, argv)
        assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, (argv, err)
        assert err.startswith("hybrid-cache-export: error: ") and message in err, (argv, err)


def test_console_script_is_installed(tmp_path):
    """The entry point the pyproject declares runs (`--help`) and answers a mistake in one line."""
    script = Path(sys.executable).with_name("hybrid-cache-export")
    assert script.is_file(), f"{script}: the package's console script is not installed in this venv"
    help_ = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert help_.returncode == 0 and "--max-cache-len" in help_.stdout and "--run-only" in help_.stdout
    wrong = subprocess.run([str(script), str(tmp_path / "x.txt")], capture_output=True, text=True, timeout=120)
    # Importing transformers beside torchao (which executorch brings) logs torchao's and torch's own import warnings
    # before any of this package's code runs (docs/export.md, "The torchao warnings"); the answer is one line.
    lines = [
        line for line in wrong.stderr.splitlines() if not line.startswith(IMPORT_NOISE) and "_pytree.py" not in line
    ]
    assert wrong.returncode == 2 and len(lines) == 1 and "suffix" in lines[0], wrong.stderr
