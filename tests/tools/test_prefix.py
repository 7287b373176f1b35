"""The prefix-cache tool (`hybrid_cache.prefix`): the `prefill` helper that `generate` continues exactly, the TTFT
benchmark's bookkeeping on a tiny model, and (slow) the CLI and the example end to end on the embedded model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from builders import MODEL_BUILDERS, VOCAB, random_padded_batch

from hybrid_cache import HybridRingCache
from hybrid_cache.compat import cache_kwargs
from hybrid_cache.tools.prefix import format_bench, prefill, run_bench, time_to_first_token

REPO = Path(__file__).resolve().parents[2]


pytestmark = pytest.mark.usefixtures("one_thread")


def test_prefill_then_generate_equals_generate_from_scratch(model_name):
    """`prefill` gives a left-padded batch the position ids `generate` uses, so `generate` continues it exactly
    (plain `model(...)` calls would number padded rows differently)."""
    import random

    model = MODEL_BUILDERS[model_name](window=5)
    padded = random_padded_batch(random.Random(3), 3, 24, 5)
    input_ids, attention_mask = padded["input_ids"], padded["attention_mask"]
    cache = HybridRingCache(model.config)
    prefill(model, cache, input_ids[:, :11], attention_mask[:, :11], chunk_size=4)
    prefill(model, cache, input_ids[:, 11:19], attention_mask[:, :19])
    kwargs = {"max_new_tokens": 10, "min_new_tokens": 10, "do_sample": False}
    got = model.generate(input_ids=input_ids, attention_mask=attention_mask, **cache_kwargs(cache), **kwargs)
    expected = model.generate(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **kwargs)
    assert torch.equal(got, expected)


class _CharacterTokenizer:
    """Enough of a tokenizer for `run_bench`: one id per character."""

    def __call__(self, text: str, return_tensors: str = "pt"):
        ids = torch.tensor([[3 + ord(c) % (VOCAB - 3) for c in text]])
        return type("Encoding", (), {"input_ids": ids})()


def test_bench_on_a_tiny_model(tmp_path):
    model = MODEL_BUILDERS["gemma4"](window=8)
    text = tmp_path / "text.txt"
    text.write_text("a prefix that is much longer than the sliding window of eight tokens, " * 3)
    result = run_bench(
        model,
        _CharacterTokenizer(),
        prefix_tokens=100,
        question_tokens=7,
        repeats=2,
        workdir=tmp_path,
        text=str(text),
        warmup=1,
    )
    assert result["same_first_token"]
    assert result["max_abs_logit_difference_warm_vs_cold"] < 1e-4
    assert set(result["ttft"]) == {"cold", "warm_file", "warm_checkpoint"}
    assert all(len(v["all_ms"]) == 2 for v in result["ttft"].values())
    assert result["checkpoint_bytes"] < result["deep_copy_bytes"] == result["kv_bytes_held"]
    assert result["file_bytes"] > result["kv_bytes_held"]  # tensors + a header
    assert "load average" in format_bench(result)
    json.dumps(result)


def test_time_to_first_token_counts_the_cache_construction():
    model = MODEL_BUILDERS["gemma3"](window=4)
    ids = torch.randint(3, VOCAB, (1, 9))

    def slow_cache():
        import time

        time.sleep(0.2)
        return HybridRingCache(model.config)

    seconds, output = time_to_first_token(model, ids, slow_cache, max_new_tokens=3)
    assert seconds >= 0.2 and output.shape == (1, 12)


@pytest.mark.slow
def test_cli_and_example_on_the_embedded_model(tmp_path):
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
    }
    cli = [sys.executable, "-m", "hybrid_cache.tools.cli.prefix"]
    path = tmp_path / "prefix.safetensors"

    def run(*args: str) -> str:
        done = subprocess.run([*args], cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    built = run(*cli, "build", "default", "-o", str(path), "--max-tokens", "600")
    assert "prefix: 600 tokens" in built and path.is_file()
    asked = run(*cli, "ask", str(path), "\n\nQuestion: Where was Shakespeare born?\nAnswer:", "--max-new-tokens", "4")
    assert "answers identical" in asked
    bench = run(
        *cli,
        "bench",
        "--prefix-tokens",
        "600",
        "--question-tokens",
        "8",
        "--repeats",
        "1",
        "--warmup",
        "0",
        "--json",
        str(tmp_path / "bench.json"),
    )
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["same_first_token"] and "cold" in bench
    assert abs(result["file_over_kv_bytes"] - 1) < 0.01  # the file is the K/V held, plus a small header
    example = run(
        sys.executable,
        "examples/prefix_cache.py",
        "--prefix-tokens",
        "600",
        "--max-new-tokens",
        "3",
        "--questions",
        "1",
    )
    assert "DIFFERENT" not in example and example.count("identical") == 1 and "restored" in example


# --- the command line: mistakes in one line, --model on either side of the command ---------------------------------
@pytest.fixture(scope="module")
def tiny_checkpoints(tmp_path_factory) -> tuple[Path, Path]:
    """Two tiny Gemma 3 checkpoints with a tokenizer: window 6, and window 4 (another model's geometry)."""
    from builders import SAMPLE, tiny_model, tiny_tokenizer

    tokenizer = tiny_tokenizer(SAMPLE * 4)
    dirs = []
    for window in (6, 4):
        d = tmp_path_factory.mktemp(f"tiny_window{window}")
        tiny_model(vocab=len(tokenizer), window=window).save_pretrained(d)
        tokenizer.save_pretrained(d)
        dirs.append(d)
    return dirs[0], dirs[1]


def _one_line_error(capsys, argv: list[str]) -> str:
    from hybrid_cache.tools.cli.prefix import main

    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("hybrid-cache-prefix: error: "), err
    return err


def test_cli_file_mistakes_are_one_line(tmp_path, capsys, tiny_checkpoints):
    """A missing file, a text file, a truncated file, a directory, a saved cache that `build` did not write, and a
    file built for another model: one line naming the file and what to do, exit code 2."""
    from builders import SAMPLE

    err = _one_line_error(capsys, ["ask", str(tmp_path / "nosuch.safetensors"), "x"])
    assert "nosuch.safetensors: no such file" in err and "hybrid-cache-prefix build" in err
    notes = tmp_path / "notes.txt"
    notes.write_text(SAMPLE)
    err = _one_line_error(capsys, ["ask", str(notes), "x"])
    assert "not a readable safetensors file" in err and f"hybrid-cache-prefix build {notes} -o" in err
    err = _one_line_error(capsys, ["ask", str(tmp_path), "x"])
    assert "is a directory" in err

    small, other = tiny_checkpoints
    path = tmp_path / "prefix.safetensors"
    from hybrid_cache.tools.cli.prefix import main

    assert main(["build", str(notes), "-o", str(path), "--max-tokens", "30", "--model", str(small)]) == 0
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    err = _one_line_error(capsys, ["ask", str(truncated), "x"])
    assert str(truncated) in err and "truncated or corrupted" in err
    bare = tmp_path / "bare.safetensors"
    HybridRingCache.load(path, _config(small)).save(bare)
    err = _one_line_error(capsys, ["ask", str(bare), "x"])
    assert "without the 'prefix.token_ids' metadata" in err
    err = _one_line_error(capsys, ["ask", str(path), "x", "--model", str(other)])
    assert "sliding_window" in err and str(small) in err  # names the field and the model it was built with
    err = _one_line_error(capsys, ["build", str(tmp_path / "nosuch.txt"), "-o", str(path), "--model", str(small)])
    assert "nosuch.txt" in err and "does not exist" in err
    err = _one_line_error(capsys, ["build", "default", "-o", str(tmp_path / "no" / "dir.safetensors")])
    assert "does not exist" in err


def _config(checkpoint: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(checkpoint)


def test_cli_model_before_or_after_the_command_and_a_whole_description():
    from hybrid_cache.tools.cli.prefix import build_parser

    parser = build_parser()
    assert parser.parse_args(["--model", "m", "ask", "f", "x"]).model == "m"
    assert parser.parse_args(["ask", "f", "x", "--model", "m"]).model == "m"
    assert parser.parse_args(["build", "t", "-o", "f", "--model", "m"]).model == "m"
    assert parser.parse_args(["bench"]).model is None
    assert parser.description.endswith("against warm (the saved file loaded).")


def test_cli_ask_warms_up_untimed_then_compares(tmp_path, capsys, tiny_checkpoints):
    """`ask` on a tiny model: the first load and the first answer run untimed before the compared pair (whose
    answers are identical), and the load average is printed with the timings."""
    from builders import SAMPLE

    from hybrid_cache.tools.cli.prefix import main

    small, _ = tiny_checkpoints
    text = tmp_path / "text.txt"
    text.write_text(SAMPLE * 2)
    path = tmp_path / "prefix.safetensors"
    assert main(["--model", str(small), "build", str(text), "-o", str(path), "--max-tokens", "40"]) == 0
    capsys.readouterr()
    assert main(["ask", str(path), "To be", "Whether", "--max-new-tokens", "3", "--model", str(small)]) == 0
    out = capsys.readouterr().out
    assert out.index("untimed warm-up: first load of the file") < out.index("TTFT warm")
    assert out.count("answers identical") == 2 and "load average" in out
