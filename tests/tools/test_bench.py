"""Smoke test of the decode benchmark harness on the tiny config (no timing assertions)."""

from __future__ import annotations

import json
import time

import pytest
import torch

from hybrid_cache.compat import cache_kwargs
from hybrid_cache.tools.bench import machine
from hybrid_cache.tools.bench.instrument import CacheOpTimer
from hybrid_cache.tools.bench.prefill import prefill_chunk_check
from hybrid_cache.tools.bench.workload import build_tiny_model, exact_kv_bytes, random_prefill, synthesize_prefill
from hybrid_cache.tools.cli import bench as bench_cli
from hybrid_cache.tools.compare import make_cache


def test_bench_main_json_schema(tmp_path, capsys):
    out = tmp_path / "bench.json"
    plot = tmp_path / "bench.png"
    rc = bench_cli.main(
        [
            "--model",
            "tiny",
            "--window",
            "16",
            "--contexts",
            "128",
            "--batch",
            "1",
            "2",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--reps",
            "1",
            "--bandwidth-bytes",
            str(1 << 22),
            "--json",
            str(out),
            "--plot",
            str(plot),
        ]
    )
    assert rc == 0
    data = json.loads(out.read_text())
    assert {"machine", "command", "results"} <= set(data)
    assert data["machine"]["nproc"] >= 1 and data["machine"]["copy_bandwidth_gbps"] > 0
    assert data["command"].startswith("python -m hybrid_cache.tools.cli.bench")
    results = data["results"]
    assert {(r["cache"], r["batch"]) for r in results} == {
        (c, b) for c in ("ring", "dynamic", "static") for b in (1, 2)
    }
    for r in results:
        for key in (
            "cache",
            "context",
            "batch",
            "dtype",
            "ms_per_token_median",
            "ms_per_token_min",
            "cache_ms_per_step_median",
            "kv_bytes",
            "copy_bytes_per_step",
            "roofline_pct_of_bandwidth",
        ):
            assert key in r, key
        assert r["context"] == 128 and r["dtype"] == "float32"
        assert r["ms_per_token_median"] > 0 and r["ms_per_token_min"] > 0
        assert r["cache_ms_per_step_median"] > 0 and r["kv_bytes"] > 0 and r["copy_bytes_per_step"] > 0
        assert r["bytes_must_read_per_step"] > 0 and r["roofline_pct_of_bandwidth"] > 0
        assert len(r["step_times_ms"]) == 2
    ring = {r["batch"]: r for r in results if r["cache"] == "ring"}
    # The ring of a 16-token window written in place: one token per storing layer per step (6 layers, K and V), and
    # the one slot each of the 5 rings overwrites, kept to undo the step (`ring.SlotUndo`); the full layer grew from
    # 128 to 130 slots at the warm-up step, so the counted step writes in place too.
    heads_dim_bytes = 256 * 4
    assert ring[1]["copy_bytes_per_step"] == (6 + 5) * 2 * heads_dim_bytes
    assert plot.stat().st_size > 0
    assert "ring/static" in data["table"] and "ms/tok med/min" in data["table"]  # the JSON keeps the full tables
    # The printed view is the compact one: a median per cache and the ratios, every line within 120 characters.
    printed = capsys.readouterr().out
    table = printed[printed.index("model     win") :]
    assert "ring ms/tok | dynamic ms/tok | static ms/tok |  ring/static | ring/dynamic | load" in table
    assert "ms/tok med/min" not in table and "--full-table" in table
    assert max(len(line) for line in table.splitlines() if not line.startswith("WARNING")) <= 120


def test_bench_full_table_flag(capsys):
    """--full-table prints today's full table (min times, cache ms, KV and copy MiB, peak K/V) instead."""
    rc = bench_cli.main(
        [
            "--model",
            "tiny",
            "--window",
            "16",
            "--contexts",
            "32",
            "--batch",
            "1",
            "--steps",
            "1",
            "--warmup",
            "1",
            "--reps",
            "1",
            "--bandwidth-bytes",
            str(1 << 20),
            "--full-table",
        ]
    )
    assert rc == 0
    printed = capsys.readouterr().out
    assert "ring ms/tok med/min" in printed and "copy MiB" in printed and "MiB end/peak" in printed
    assert "--full-table" in " ".join(bench_cli.build_parser().format_help().split())


def test_instrumentation_restores_patches():
    from transformers.models.gemma3 import modeling_gemma3

    model = build_tiny_model(window=8)
    cache = make_cache("ring", model, 64)
    before = modeling_gemma3.create_causal_mask, modeling_gemma3.create_sliding_window_causal_mask
    timer = CacheOpTimer()
    synthesize_prefill(cache, random_prefill(model, 1, 20, torch.float32))
    with timer.instrument(model, cache), torch.inference_mode():
        model(input_ids=torch.tensor([[5]]), position_ids=torch.tensor([[20]]), **cache_kwargs(cache), use_cache=True)
    assert timer.update_calls == 6 and timer.update_s > 0 and timer.mask_s > 0
    assert timer.max_sliding_returned == 8  # the whole ring
    assert (modeling_gemma3.create_causal_mask, modeling_gemma3.create_sliding_window_causal_mask) == before
    assert "update" not in vars(cache)


@pytest.mark.parametrize("chunk", [16])
def test_prefill_chunk_check_tiny(chunk):
    model = build_tiny_model(window=8, head_dim=16)
    result = prefill_chunk_check(model, prompt_length=100, chunk_size=chunk, max_new_tokens=2)
    assert result["generated"] == 2
    assert result["sliding_capacity_max"] == 8
    assert 8 < result["max_sliding_update_returned_tokens"] <= 8 + chunk
    assert result["within_bound"] and result["rss_peak_sampled_bytes"] > 0


def test_bench_compile_smoke_eager_backend(tmp_path):
    """--compile with the 'eager' backend (graph capture only; inductor is too slow for CI): one graph per cache
    (the ring over a wrapped 16-slot window, across two reps with fresh caches), compiled logits = eager logits."""
    out = tmp_path / "compiled.json"
    rc = bench_cli.main(
        [
            "--model",
            "tiny",
            "--window",
            "16",
            "--contexts",
            "40",
            "--batch",
            "2",
            "--steps",
            "2",
            "--warmup",
            "2",
            "--reps",
            "2",
            "--bandwidth-bytes",
            str(1 << 22),
            "--compile",
            "--compile-backend",
            "eager",
            "--compile-check-steps",
            "2",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    data = json.loads(out.read_text())
    results = data["results"]
    assert {r["cache"] for r in results} == {"ring", "static"}  # dynamic is not compileable: skipped
    for r in results:
        assert r["compiled"] is True and r["compile_backend"] == "eager" and r["compile_mask"] == "inside"
        assert r["compile_seconds"] > 0 and r["compile_seconds_total"] >= r["compile_seconds"]
        assert r["ms_per_token_median"] > 0 and len(r["step_times_ms"]) == 2 * 2
        assert r["compiled_check_steps"] == 2 and r["compiled_matches_eager"] is True
        assert r["compiled_argmax_agree"] == 1.0 and r["compiled_max_abs_logit_diff"] < 1e-4
        assert r["recompiled_during_timing"] is False
        assert r["device"] == "cpu" and r["cache_ms_per_step_median"] is None
    by_cache = {r["cache"]: r for r in results}
    assert by_cache["ring"]["graphs"] == 1 and by_cache["ring"]["recompiles"] == 0
    assert by_cache["ring"]["compile_dynamic"] is False
    # StaticCache's sliding layers branch on a Python int: with dynamic=None one recompilation makes it symbolic.
    assert by_cache["static"]["graphs"] <= 2 and by_cache["static"]["compile_dynamic"] is None
    assert "ring/static" in data["compiled_table"]


def test_prefill_json_keys_exactness_and_memory(tmp_path):
    """--prefill: one row per (cache, context, chunk, dtype) with the documented keys; every cache's last logits equal
    DynamicCache's (fp32); the ring's peak K/V is exactly what a cache sized for the prompt holds (5 rings of 16 slots
    + the full layer's 48 tokens), while DynamicCache's sliding layers hold window - 1 + chunk tokens of storage."""
    out = tmp_path / "prefill.json"
    rc = bench_cli.main(
        [
            "--model",
            "tiny",
            "--window",
            "16",
            "--prefill",
            "--contexts",
            "48",
            "--chunk-size",
            "16",
            "64",
            "--reps",
            "2",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["mode"] == "prefill" and "ring/dynamic" in data["prefill_table"]
    rows = data["results"]
    assert {(r["cache"], r["chunk"]) for r in rows} == {
        (c, k) for c in ("ring", "dynamic", "static") for k in (16, 64)
    }
    for r in rows:
        for key in ("cache", "context", "chunk", "dtype", "prefill_ms_median", "tokens_per_s", "peak_kv_bytes"):
            assert key in r, key
        assert r["context"] == 48 and r["dtype"] == "float32" and len(r["prefill_ms"]) == 2
        assert r["prefill_ms_median"] > 0 and r["tokens_per_s"] > 0 and isinstance(r["competing_load"], bool)
        assert r["max_abs_logit_diff"] < 1e-4, r
    model = build_tiny_model(window=16)
    exact = exact_kv_bytes(model, 1, 48, torch.float32)
    by = {(r["cache"], r["chunk"]): r for r in rows}
    token_layer = 2 * 256 * 4  # K and V, 1 KV head of 256, fp32
    assert exact == token_layer * (5 * 16 + 48)
    assert by["ring", 16]["peak_kv_bytes"] == by["ring", 64]["peak_kv_bytes"] == exact
    assert by["dynamic", 16]["peak_kv_bytes"] >= token_layer * (5 * (15 + 16) + 48)


def test_decode_memory_within_a_64th_of_exact(tmp_path):
    """After a 640-token prefill, decode steps grow the ring's full layer by 1/64 (640 -> 650 slots): at every point
    of the run the ring holds at most 1/64 more than an exactly sized cache for the same tokens, i.e. within 2% of a
    StaticCache holding them."""
    out = tmp_path / "decode.json"
    rc = bench_cli.main(
        [
            "--model",
            "tiny",
            "--window",
            "16",
            "--contexts",
            "640",
            "--batch",
            "1",
            "--steps",
            "3",
            "--warmup",
            "1",
            "--reps",
            "1",
            "--bandwidth-bytes",
            str(1 << 22),
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    data = json.loads(out.read_text())
    rows = {r["cache"]: r for r in data["results"]}
    ring = rows["ring"]
    assert len(ring["kv_trace"]) == 1 + 1 + 1 + 3  # after the prefill, the warm-up, the counted and the timed steps
    model = build_tiny_model(window=16)
    # K/V storage only: the slot each ring's last step overwrote (`ring.SlotUndo`) is bookkeeping, counted by
    # `memory_report()` as extra bytes, as the counters are.
    for tokens, held in ring["kv_trace"]:
        assert held <= exact_kv_bytes(model, 1, tokens, torch.float32) * (1 + 1 / 64)
    assert 1.0 < ring["kv_ratio_to_exact_max"] <= 1 + 1 / 64
    assert ring["kv_bytes"] <= rows["static"]["kv_bytes"] * 1.02
    assert "ring/dynamic end, max" in data["memory_table"]


def test_help_shows_defaults_and_registered_caches(monkeypatch):
    from hybrid_cache.tools import compare

    text = bench_cli.build_parser().format_help()
    for expected in (
        "(default: 16)",
        "(default: 3)",
        "(default 1024 4096 16384",
        "(default 4096 16384",
        "(default 128 512 2048",
        "(default: float32)",
        "'tiny-4b'",
    ):
        assert expected in " ".join(text.split()), expected
    # The exact caches by default; a cache registered in hybrid_cache.compare can be chosen.
    assert bench_cli.build_parser().parse_args([]).caches == ["ring", "dynamic", "static"]
    monkeypatch.setattr(compare, "CACHE_NAMES", (*compare.CACHE_NAMES, "ring-new"))
    assert bench_cli.build_parser().parse_args(["--caches", "ring-new"]).caches == ["ring-new"]


def test_contention_meter_sees_a_competing_process():
    """A busy-looping process on our CPUs shows as ~1 core of other work: the interval is flagged, and the warning
    says what to do."""
    import subprocess
    import sys

    meter = machine.ContentionMeter(threads=machine.usable_cpus())
    if machine._busy_seconds(None) is None:
        pytest.skip("no /proc/stat on this platform")
    spinner = subprocess.Popen(
        [sys.executable, "-c", "import time\nend = time.time() + 3\nwhile time.time() < end: pass"]
    )
    try:
        time.sleep(0.3)
        contention = meter.probe(1.5)
    finally:
        spinner.kill()
        spinner.wait()
    assert contention.other_cores is not None and contention.other_cores > 0.5, contention
    assert meter.competing(contention)
    warning = machine.busy_machine_warning(meter, contention)
    assert warning and "quiet machine" in warning and "competing_load" in warning
    quiet = machine.Contention(wall_s=10.0, other_cpu_s=0.5, loadavg_max=0.1)
    assert (
        not machine.ContentionMeter(threads=1).competing(quiet) and machine.busy_machine_warning(meter, quiet) is None
    )


@pytest.fixture
def no_measurement(monkeypatch):
    """Fails a test if the bench measures the machine or loads a model: its checks come before both."""

    def measured(*args, **kwargs):
        raise AssertionError("measured the machine or loaded a model before checking the command line")

    for name in ("machine_info", "measure_bandwidth", "load_bench_model"):
        monkeypatch.setattr(bench_cli, name, measured)
    monkeypatch.setattr(bench_cli.ContentionMeter, "probe", measured)


def _one_line_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        bench_cli.main(argv)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured
    assert captured.err.startswith("hybrid-cache-bench: error: "), captured.err
    return captured.err


def test_model_mistakes_are_one_line(capsys, no_measurement):
    """A Hub id that is not cached (offline) or a path that does not exist ends the command with one clear line."""
    for model in ("google/gemma-3-270m", "./no/such/checkpoint"):
        message = _one_line_error(["--model", model, "--contexts", "8", "--batch", "1"], capsys)
        assert ("Hub" in message or "does not exist" in message) and model in message


def _prefill_script(name: str = "prefill"):
    """benchmarks/<name>.py as a module."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"{name}_benchmark", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_banded_flops_script_counts_the_band(capsys):
    """benchmarks/banded_flops.py on the tiny model past the banded threshold: the band's time holds its SDPA calls'
    time, its FLOPs are counted, and the patched functions are torch's and the package's again afterwards."""
    import torch.nn.functional as F

    from hybrid_cache import code_attention

    sdpa, attention = F.scaled_dot_product_attention, code_attention.banded_attention
    totals = _prefill_script("banded_flops").main(["--model", "tiny", "--context", "1200", "--threads", "1"])
    assert 0 < totals["band_sdpa"] <= totals["band"] < totals["total"] and totals["band_flop"] > 0
    assert F.scaled_dot_product_attention is sdpa and code_attention.banded_attention is attention
    printed = capsys.readouterr().out
    assert "machine:" in printed and "GFLOP/s in SDPA" in printed and "Python loop costs" in printed


def test_ttft_benchmark_script_quick_defaults():
    """--quick is a smoke run (one 600-token prompt, one rep, a short warm-up); options given still win."""
    script = _prefill_script()
    args = script.parse_args([])
    assert (args.contexts, args.reps, args.warmup_tokens) == ([2048, 8192, 16384, 32000], 2, 1024)
    args = script.parse_args(["--quick"])
    assert (args.contexts, args.reps, args.warmup_tokens, args.quick) == ([600], 1, 64, True)
    args = script.parse_args(["--quick", "--contexts", "700", "--reps", "3"])
    assert (args.contexts, args.reps, args.warmup_tokens) == ([700], 3, 64)


def test_ttft_benchmark_script_side_by_side(tmp_path, capsys):
    """benchmarks/prefill.py on the tiny model: every variant timed per prompt length (reps interleaved), the same
    first token everywhere, the table with the ratios of ring-banded, JSON rows with the documented keys, a plot."""
    script = _prefill_script()
    out, plot = tmp_path / "ttft.json", tmp_path / "ttft.png"
    argv = ["--model", "tiny", "--contexts", "40", "600", "--reps", "2", "--warmup-tokens", "16"]
    argv += ["--variants", "sdpa", "sdpa-chunk512", "ring-banded", "--json", str(out), "--plot", str(plot)]
    assert script.main(argv) == 0
    printed = capsys.readouterr().out
    assert "machine:" in printed and "threads" in printed and "load average" in printed
    assert "ring-banded/sdpa-chunk512" in printed and "ring-banded/best chunk" in printed
    rows = json.loads(out.read_text())["rows"]
    assert {(r["variant"], r["context"]) for r in rows} == {
        (v, c) for v in ("sdpa", "sdpa-chunk512", "ring-banded") for c in (40, 600)
    }
    for r in rows:
        assert len(r["ttft_s"]) == 2 and r["ttft_s_median"] > 0 and r["same_token"], r
        assert r["max_abs_logit_diff"] < 1e-4 and r["peak_rss_delta_bytes"] >= 0
    assert plot.stat().st_size > 0
    # --from-json: the same table from the saved rows, nothing measured; a file that is not one is one line
    joined = tmp_path / "joined.png"
    assert script.main(["--from-json", str(out), "--plot", str(joined)]) == 0
    again = capsys.readouterr().out
    saved = [line for line in again.splitlines() if line.startswith("float32")]
    assert len(saved) == 2 and all(line in printed.splitlines() for line in saved)
    assert joined.stat().st_size > 0
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(SystemExit, match="bad.json' is not a file written by"):
        script.main(["--from-json", str(tmp_path / "bad.json")])


@pytest.mark.parametrize(
    "make, expected",
    [
        (lambda d: d / "missing", "model path '{path}' does not exist"),
        (lambda d: d / "missing.gguf", "model path '{path}' does not exist"),
        (lambda d: d, "model directory '{path}' has no config.json"),
        (lambda d: (d / "notes.txt").write_text("text") and d / "notes.txt", "'{path}' is neither a directory nor"),
        (lambda d: (d / "empty.gguf").write_bytes(b"") or d / "empty.gguf", "'{path}' does not start with the GGUF"),
        (lambda d: (d / "t.gguf").write_bytes(b"\xffGGUF") and d / "t.gguf", "'{path}' does not start with the GGUF"),
    ],
)
def test_a_wrong_model_path_is_one_line_before_anything_is_measured(make, expected, tmp_path, capsys, no_measurement):
    path = make(tmp_path)
    message = _one_line_error(["--model", str(path)], capsys)
    assert expected.format(path=path) in message, message


@pytest.mark.parametrize("option", ["--json", "--plot", "--profile-out"])
def test_an_output_file_that_cannot_be_written_is_one_line_before_anything_is_measured(
    option, tmp_path, capsys, no_measurement
):
    message = _one_line_error(["--model", "tiny", option, str(tmp_path)], capsys)
    assert f"{option} '{tmp_path}' is a directory; expected the path of a file" in message
    path = tmp_path / "no_folder" / "out.json"
    message = _one_line_error(["--model", "tiny", option, str(path)], capsys)
    assert f"cannot write {option} '{path}': the folder '{path.parent}' does not exist" in message
