"""Smoke test of the decode benchmark harness on the tiny config (no timing assertions)."""

from __future__ import annotations

import json

import pytest
import torch

from hybrid_cache import bench


def test_bench_main_json_schema(tmp_path):
    out = tmp_path / "bench.json"
    plot = tmp_path / "bench.png"
    rc = bench.main([
        "--model", "tiny", "--window", "16", "--contexts", "40", "--batch", "1", "2", "--steps", "2", "--warmup", "1",
        "--reps", "1", "--bandwidth-bytes", str(1 << 22), "--json", str(out), "--plot", str(plot),
    ])
    assert rc == 0
    data = json.loads(out.read_text())
    assert {"machine", "command", "results"} <= set(data)
    assert data["machine"]["nproc"] >= 1 and data["machine"]["copy_bandwidth_gbps"] > 0
    assert data["command"].startswith("python -m hybrid_cache.bench")
    results = data["results"]
    assert {(r["cache"], r["batch"]) for r in results} == {(c, b) for c in bench.CACHE_NAMES for b in (1, 2)}
    for r in results:
        for key in ("cache", "context", "batch", "dtype", "ms_per_token_median", "ms_per_token_min",
                    "cache_ms_per_step_median", "kv_bytes", "copy_bytes_per_step", "roofline_pct_of_bandwidth"):
            assert key in r, key
        assert r["context"] == 40 and r["dtype"] == "float32"
        assert r["ms_per_token_median"] > 0 and r["ms_per_token_min"] > 0
        assert r["cache_ms_per_step_median"] > 0 and r["kv_bytes"] > 0 and r["copy_bytes_per_step"] > 0
        assert r["bytes_must_read_per_step"] > 0 and r["roofline_pct_of_bandwidth"] > 0
        assert len(r["step_times_ms"]) == 2
    ring = {r["batch"]: r for r in results if r["cache"] == "ring"}
    # The ring of a 16-token window written in place: one token per storing layer per step (6 layers, K and V).
    heads_dim_bytes = 256 * 4
    assert ring[1]["copy_bytes_per_step"] == 6 * 2 * heads_dim_bytes
    assert plot.stat().st_size > 0
    assert "ring/static" in data["table"]


def test_instrumentation_restores_patches():
    from transformers.models.gemma3 import modeling_gemma3

    model = bench.build_tiny_model(window=8)
    cache = bench.make_cache("ring", model, 64)
    before = modeling_gemma3.create_causal_mask, modeling_gemma3.create_sliding_window_causal_mask
    timer = bench.CacheOpTimer()
    bench.synthesize_prefill(cache, bench.random_prefill(model, 1, 20, torch.float32))
    with timer.instrument(model, cache), torch.inference_mode():
        model(input_ids=torch.tensor([[5]]), position_ids=torch.tensor([[20]]), cache=cache, use_cache=True)
    assert timer.update_calls == 6 and timer.update_s > 0 and timer.mask_s > 0
    assert timer.max_sliding_returned == 8  # the whole ring
    assert (modeling_gemma3.create_causal_mask, modeling_gemma3.create_sliding_window_causal_mask) == before
    assert "update" not in vars(cache)


@pytest.mark.parametrize("chunk", [16])
def test_prefill_chunk_check_tiny(chunk):
    model = bench.build_tiny_model(window=8, head_dim=16)
    result = bench.prefill_chunk_check(model, prompt_length=100, chunk_size=chunk, max_new_tokens=2)
    assert result["generated"] == 2
    assert result["sliding_capacity_max"] == 8
    assert 8 < result["max_sliding_update_returned_tokens"] <= 8 + chunk
    assert result["within_bound"] and result["rss_peak_sampled_bytes"] > 0


def test_bench_compile_smoke_eager_backend(tmp_path):
    """--compile with the 'eager' backend (graph capture only; inductor is too slow for CI): one graph per cache
    (the ring over a wrapped 16-slot window, across two reps with fresh caches), compiled logits = eager logits."""
    out = tmp_path / "compiled.json"
    rc = bench.main([
        "--model", "tiny", "--window", "16", "--contexts", "40", "--batch", "2", "--steps", "2", "--warmup", "2",
        "--reps", "2", "--bandwidth-bytes", str(1 << 22), "--compile", "--compile-backend", "eager",
        "--compile-check-steps", "2", "--json", str(out),
    ])
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
