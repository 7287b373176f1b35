"""Fast tests (CPU, no download) for text loading, model loading errors and the perplexity evaluator / CLI.

The perplexity tests use a tiny random Gemma 3 and a tiny BPE tokenizer trained on the spot with `tokenizers`,
both saved to a temp dir, so the whole CLI path (load_model of a local dir -> tokenize -> stream -> JSON/PNG) runs
without any real model.
"""

from __future__ import annotations

import gzip
import json
import math
import re
from pathlib import Path

import pytest
import torch
from builders import SAMPLE, tiny_model, tiny_tokenizer
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

from hybrid_cache.code_attention import CODE_ATTENTION
from hybrid_cache.compat import cache_kwargs
from hybrid_cache.prefill_steps import PREFILL_STEP, prefill_steps_of
from hybrid_cache.tools import models
from hybrid_cache.tools.cli.perplexity import main
from hybrid_cache.tools.compare import EXACT_CACHE_NAMES, full_cache_bytes_per_token
from hybrid_cache.tools.perplexity import evaluate_perplexity, has_sliding_layers, kv_bytes
from hybrid_cache.tools.text import load_text


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    """A tiny Gemma 3 checkpoint + tokenizer in a directory, loadable with `load_model(dir)`."""
    d = tmp_path_factory.mktemp("tiny_gemma3")
    tokenizer = tiny_tokenizer(SAMPLE * 4)
    model = tiny_model(vocab=len(tokenizer))
    model.save_pretrained(d)
    tokenizer.save_pretrained(d)
    return d


# ---------------------------------------------------------------- text


def test_default_text_is_britannica_prose():
    text, desc = load_text()
    assert "Britannica" in desc
    assert text.startswith("Shakespeare, William (1564")
    assert "Stratford" in text[:2000]
    assert "### START" not in text and "p.772:0" not in text  # OCR scaffolding stripped
    assert len(text) > 200_000


def test_shakespeare_play():
    text, desc = load_text("shakespeare:hamlet")
    assert "hamlet" in desc
    assert "HAMLET" in text[:100]
    with pytest.raises(FileNotFoundError, match="unknown play 'no_such_play'.*hamlet"):
        load_text("shakespeare:no_such_play")


def test_local_plain_and_gz(tmp_path):
    plain = tmp_path / "a.txt"
    plain.write_text(SAMPLE)
    gz = tmp_path / "a.txt.gz"
    with gzip.open(gz, "wt") as fh:
        fh.write(SAMPLE)
    text_plain, desc = load_text(plain)
    text_gz, _ = load_text(str(gz))
    assert text_plain == SAMPLE == text_gz  # newlines (and the blank structure) are kept
    assert desc == str(plain)


def test_text_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_text(tmp_path / "missing.txt")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_text("./missing.txt.gz")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    with pytest.raises(ValueError, match="empty"):
        load_text(empty)
    with pytest.raises(ValueError, match="not a regular file"):
        load_text(tmp_path)
    with pytest.raises(ValueError, match="name\\[:config\\[:split\\]\\]"):
        load_text("a:b:c:d")


def test_a_file_that_is_not_utf8_text_is_named_in_one_line(tmp_path):
    """Not `datasets`' DatasetGenerationError: the file, the first byte that is not UTF-8 and where it is."""
    binary = tmp_path / "model.bin"
    binary.write_bytes("é".encode() * 3 + b"\xff\x00\x01")
    with pytest.raises(ValueError) as info:
        load_text(binary)
    assert str(info.value) == (
        f"text file {str(binary)!r} is not UTF-8 text (byte 0xff at offset 6); expected a UTF-8 text file, plain or .gz"
    )
    gz = tmp_path / "latin1.txt.gz"
    gz.write_bytes(gzip.compress("café".encode("latin-1")))
    with pytest.raises(ValueError, match=f"text file {re.escape(repr(str(gz)))} is not UTF-8 text \\(byte 0xe9\\)"):
        load_text(gz)
    not_gz = tmp_path / "plain.txt.gz"
    not_gz.write_text(SAMPLE)
    with pytest.raises(ValueError, match="could not be read as text \\(BadGzipFile: Not a gzipped file"):
        load_text(not_gz)


# ---------------------------------------------------------------- models


def test_load_model_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        models.load_model(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        models.load_model("./no/such/model.gguf")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        models.load_model(tmp_path)


def test_load_model_local_dir(tiny_dir, tmp_path):
    model, tokenizer = models.load_model(tiny_dir)
    assert isinstance(model, Gemma3ForCausalLM) and not model.training
    assert tokenizer is not None and tokenizer("To be").input_ids[0] == 2  # BOS first
    # A bare checkpoint (no tokenizer files) still loads: tokenizer is None.
    tiny_model().save_pretrained(tmp_path / "bare")
    model, tokenizer = models.load_model(tmp_path / "bare", dtype="bfloat16")
    assert tokenizer is None and next(model.parameters()).dtype == torch.bfloat16


def test_converted_manifest_validation(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRID_CACHE_HOME", str(tmp_path / "home"))
    assert models.cache_home() == tmp_path / "home"
    d = tmp_path / "conv"
    d.mkdir()
    (d / "model.safetensors").write_bytes(b"x" * 100)
    (d / "config.json").write_text("{}")
    assert not models._converted_is_valid(d, "abc")  # no manifest: an interrupted conversion
    (d / "manifest.json").write_text(json.dumps(models._manifest_for(d, "abc")))
    assert models._converted_is_valid(d, "abc")
    assert not models._converted_is_valid(d, "other-sha")  # another GGUF
    (d / "model.safetensors").write_bytes(b"x" * 99)  # truncated
    assert not models._converted_is_valid(d, "abc")
    (d / "manifest.json").write_text("{not json")
    assert not models._converted_is_valid(d, "abc")


def _fake_conversions(monkeypatch, tmp_path) -> tuple[Path, list[Path]]:
    """A stand-in GGUF (any bytes) and a `_convert_gguf` that writes a tiny checkpoint + manifest in a second, not the
    ~55 s of the real conversion; returns the GGUF path and the list of conversions made."""
    monkeypatch.setenv("HYBRID_CACHE_HOME", str(tmp_path / "home"))
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"not really a gguf")
    conversions: list[Path] = []

    def convert(gguf_path, gguf_sha256, out_dir, fix_default_config=False):
        conversions.append(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        tiny_model().save_pretrained(out_dir)
        (out_dir / "manifest.json").write_text(json.dumps(models._manifest_for(out_dir, gguf_sha256)))

    monkeypatch.setattr(models, "_convert_gguf", convert)
    return gguf, conversions


def test_bad_load_arguments_raise_at_once_and_leave_the_cached_conversion_alone(tmp_path, monkeypatch):
    """A typo, a backend that cannot run here (flash-attn not installed), a non-float dtype or an unknown device:
    one ValueError naming the argument, and the cached conversion is neither deleted nor rebuilt."""
    gguf, conversions = _fake_conversions(monkeypatch, tmp_path)
    models.load_model(gguf)
    assert len(conversions) == 1
    out_dir = conversions[0]
    before = {p.name: p.stat().st_mtime_ns for p in out_dir.iterdir()}
    cases = [
        ({"attn_implementation": "sdpaa"}, r"unknown attn_implementation 'sdpaa'.*'eager'.*'sdpa'"),
        (
            {"attn_implementation": "flash_attention_2"},
            r"attn_implementation='flash_attention_2'.*Use "
            r"attn_implementation='sdpa'",
        ),
        ({"attn_implementation": 3}, "attn_implementation must be a string"),
        ({"dtype": torch.int8}, "not a floating-point dtype"),
        ({"dtype": "float64x"}, "unknown dtype 'float64x'"),
        ({"device": "cdua"}, "unknown device 'cdua'"),
    ]
    if not torch.cuda.is_available():
        cases.append(({"device": "cuda"}, "no CUDA device"))
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message) as info:
            models.load_model(gguf, **kwargs)
        error = info.value  # one error, no chained traceback
        assert error.__cause__ is None and (error.__context__ is None or error.__suppress_context__), kwargs
    assert len(conversions) == 1  # nothing was rebuilt
    assert {p.name: p.stat().st_mtime_ns for p in out_dir.iterdir()} == before
    model, _ = models.load_model(gguf, attn_implementation="eager", dtype="bfloat16")
    assert model.config._attn_implementation == "eager" and next(model.parameters()).dtype == torch.bfloat16


def test_only_a_corrupt_conversion_is_rebuilt(tmp_path, monkeypatch):
    """A cached conversion that fails with the caller's arguments but loads with the defaults is not the cache's
    fault: the caller's error is raised and nothing is rebuilt. One that fails with the defaults too is rebuilt."""
    gguf, conversions = _fake_conversions(monkeypatch, tmp_path)
    models.load_model(gguf)
    real_load_dir = models._load_dir

    def fails_in_bfloat16(path, **kwargs):
        if kwargs["dtype"] == torch.bfloat16:
            raise RuntimeError("bfloat16 is not supported here")
        return real_load_dir(path, **kwargs)

    monkeypatch.setattr(models, "_load_dir", fails_in_bfloat16)
    with pytest.raises(RuntimeError, match="bfloat16 is not supported here"):
        models.load_model(gguf, dtype="bfloat16")
    assert len(conversions) == 1
    monkeypatch.setattr(models, "_load_dir", real_load_dir)
    weights = conversions[0] / "model.safetensors"
    weights.write_bytes(b"\xff" * weights.stat().st_size)  # same size: the manifest still matches
    model, _ = models.load_model(gguf)
    assert len(conversions) == 2 and isinstance(model, Gemma3ForCausalLM)


def test_argument_check_blames_only_the_arguments():
    """The meta-device check raises only when the model builds with the defaults but not with the caller's
    arguments; a config that cannot give a causal LM at all is left to the load, whose own error names it."""
    from transformers import CLIPVisionConfig

    models._check_model_accepts(
        CLIPVisionConfig(), {"dtype": torch.float32, "attn_implementation": "flash_attention_2"}
    )
    config = tiny_model().config
    models._check_model_accepts(config, {"dtype": torch.float32, "attn_implementation": "eager"})
    with pytest.raises(ValueError, match="attn_implementation='flash_attention_2'"):
        models._check_model_accepts(config, {"dtype": torch.float32, "attn_implementation": "flash_attention_2"})


def test_default_model_checks_the_arguments_before_converting(tmp_path, monkeypatch):
    """On a cold cache the embedded model's arguments are checked against its official config before the one-off
    conversion: an unusable backend costs no conversion."""
    gguf, conversions = _fake_conversions(monkeypatch, tmp_path)
    monkeypatch.setattr(models, "default_gguf_path", lambda: (gguf, "0" * 64))
    with pytest.raises(ValueError, match="flash_attention_2"):
        models.load_model(None, attn_implementation="flash_attention_2")
    assert conversions == []


def test_default_attention_is_hybrid_cache_sdpa_with_prefill_steps(tiny_dir):
    """Without `attn_implementation` a model that takes it loads on `hybrid_cache_sdpa` with `generate`'s prefill
    steps; one asked for `sdpa` (or `eager`) gets exactly that and no steps."""
    model, _ = models.load_model(tiny_dir)
    assert model.config._attn_implementation == CODE_ATTENTION
    assert prefill_steps_of(model) is not None and prefill_steps_of(model).step == PREFILL_STEP
    for name in ("sdpa", "eager"):
        model, _ = models.load_model(tiny_dir, attn_implementation=name)
        assert model.config._attn_implementation == name and prefill_steps_of(model) is None


def test_default_attention_falls_back_to_sdpa_where_refused(tiny_dir, monkeypatch):
    """A model that refuses `hybrid_cache_sdpa` loads on `sdpa` by default (no steps); asked for it explicitly, the
    refusal is one ValueError naming it."""
    real = Gemma3ForCausalLM.get_correct_attn_implementation

    def refuse(self, requested, is_init_check=False):
        if requested == CODE_ATTENTION:
            raise ValueError(f"{type(self).__name__} does not take {requested}")
        return real(self, requested, is_init_check)

    monkeypatch.setattr(Gemma3ForCausalLM, "get_correct_attn_implementation", refuse)
    model, _ = models.load_model(tiny_dir)
    assert model.config._attn_implementation == "sdpa" and prefill_steps_of(model) is None
    with pytest.raises(ValueError, match=f"attn_implementation='{CODE_ATTENTION}'.*does not take"):
        models.load_model(tiny_dir, attn_implementation=CODE_ATTENTION)


def test_gemma3_270m_config_check_fixes_wrong_fields():
    config = Gemma3TextConfig(
        vocab_size=262144,
        hidden_size=640,
        intermediate_size=2048,
        num_hidden_layers=18,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        sliding_window=512,
        query_pre_attn_scalar=256,
    )
    assert models._check_gemma3_270m_config(config) == []  # transformers' defaults match the official config
    config.sliding_window = 4096
    config.final_logit_softcapping = 30.0
    fixes = models._check_gemma3_270m_config(config)
    assert len(fixes) == 2 and config.sliding_window == 512 and config.final_logit_softcapping is None


def test_make_serializable_drops_only_a_marker():
    model = tiny_model()
    model.config.quantization_config = {"quant_method": "gguf"}
    assert models._make_serializable(model)
    assert not hasattr(model.config, "quantization_config")


# ---------------------------------------------------------------- perplexity core


def _reference_nll(model, ids: torch.Tensor) -> float:
    """Plain full-logits cross entropy (fine for a tiny vocab)."""
    with torch.no_grad():
        logits = model(input_ids=ids[None], use_cache=False).logits[0, :-1].float()
    return torch.nn.functional.cross_entropy(logits, ids[1:], reduction="sum").item()


@pytest.mark.parametrize("softcap", [None, 3.0])
def test_none_matches_plain_cross_entropy(softcap):
    model = tiny_model(softcap=softcap)
    ids = torch.randint(4, 128, (41,), generator=torch.Generator().manual_seed(1))
    res = evaluate_perplexity(model, ids, "none", chunk_size=8, logits_slice=7, progress=False)
    ref = _reference_nll(model, ids)
    assert res.predicted == 40 and res.tokens == 41
    assert math.isclose(res.nll, ref, rel_tol=1e-5)
    assert math.isclose(res.ppl, math.exp(ref / 40), rel_tol=1e-5)
    assert res.kv_bytes == 0


@pytest.mark.parametrize("chunk", [1, 5, 6, 7, 13, 40])
@pytest.mark.parametrize("cache", EXACT_CACHE_NAMES)
def test_cached_runs_match_no_cache(cache, chunk):
    model = tiny_model(window=6)
    ids = torch.randint(4, 128, (41,), generator=torch.Generator().manual_seed(2))
    ref = evaluate_perplexity(model, ids, "none", chunk_size=chunk, progress=False)
    res = evaluate_perplexity(model, ids, cache, chunk_size=chunk, logits_slice=4, progress=False)
    assert abs(res.ppl - ref.ppl) / ref.ppl < 1e-5, (cache, chunk, res.ppl, ref.ppl)
    assert res.predicted == 40
    assert [t for t, _ in res.kv_trace] == [min(e, 41) for e in range(chunk, 41 + chunk, chunk)]
    assert res.kv_bytes > 0 and res.peak_rss_bytes > 0 and res.seconds > 0


def test_kv_bytes_counts_dynamic_cache():
    from transformers import DynamicCache

    model = tiny_model(window=6, layers=6)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.arange(4, 24)[None], **cache_kwargs(cache), use_cache=True)
    # 5 sliding layers keep <= 20 tokens (transformers keeps window-1 = 5 after a prefill), 1 full layer keeps 20
    per_token_layer = 2 * 2 * 8 * 4  # K+V, 2 KV heads, head_dim 8, fp32
    assert per_token_layer * 20 <= kv_bytes(cache) <= per_token_layer * 20 * 6
    assert kv_bytes(None) == 0


def test_evaluate_errors():
    model = tiny_model()
    ids = torch.arange(4, 14)
    with pytest.raises(ValueError, match="chunk size must be >= 1"):
        evaluate_perplexity(model, ids, "dynamic", chunk_size=0, progress=False)
    with pytest.raises(ValueError, match="fewer than one chunk \\+ 1"):
        evaluate_perplexity(model, ids, "dynamic", chunk_size=10, progress=False)
    with pytest.raises(ValueError, match="unknown cache 'paged'"):
        evaluate_perplexity(model, ids, "paged", chunk_size=4, progress=False)


def test_full_cache_bytes_and_sliding_detection():
    gemma_270m = Gemma3TextConfig(num_hidden_layers=18, num_key_value_heads=1, head_dim=256, sliding_window=512)
    assert full_cache_bytes_per_token(gemma_270m, torch.float32) == 18 * 2 * 1 * 256 * 4
    assert full_cache_bytes_per_token(gemma_270m, torch.bfloat16) == 18 * 2 * 1 * 256 * 2
    assert has_sliding_layers(gemma_270m)
    assert not has_sliding_layers(tiny_model(layer_types=["full_attention"] * 6).config)


# ---------------------------------------------------------------- CLI


def test_cli_end_to_end(tiny_dir, tmp_path, capsys):
    text_file = tmp_path / "t.txt.gz"
    with gzip.open(text_file, "wt") as fh:
        fh.write(SAMPLE * 3)
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    caches = [*EXACT_CACHE_NAMES, "none"]  # approximate caches: test_cli_reference_reports_quality
    rc = main(
        [
            "--model",
            str(tiny_dir),
            "--text",
            str(text_file),
            "--max-tokens",
            "60",
            "--chunk-size",
            "7",
            "--caches",
            ",".join(caches),
            "--json",
            str(out_json),
            "--plot",
            str(out_png),
            "--no-progress",
        ]
    )
    assert rc == 0
    printed = capsys.readouterr().out
    assert "ppl" in printed and "peak RSS" in printed
    data = json.loads(out_json.read_text())
    assert data["tokens"] == 60 and data["model"] == str(tiny_dir) and data["text"] == str(text_file)
    assert [r["cache"] for r in data["results"]] == caches
    ppls = [r["ppl"] for r in data["results"]]
    assert max(ppls) / min(ppls) - 1 < 1e-5
    for r in data["results"]:
        assert {"cache", "ppl", "seconds", "kv_bytes", "peak_rss_bytes"} <= r.keys()
        assert isinstance(r["kv_bytes"], int) and isinstance(r["peak_rss_bytes"], int)
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_ring_note_without_sliding_layers(tmp_path, capsys):
    d = tmp_path / "nosliding"
    tokenizer = tiny_tokenizer(SAMPLE * 4)
    tiny_model(vocab=len(tokenizer), layer_types=["full_attention"] * 6).save_pretrained(d)
    tokenizer.save_pretrained(d)
    text_file = tmp_path / "t.txt"
    text_file.write_text(SAMPLE * 3)
    rc = main(
        [
            "--model",
            str(d),
            "--text",
            str(text_file),
            "--max-tokens",
            "30",
            "--chunk-size",
            "8",
            "--caches",
            "ring,none",
            "--no-progress",
        ]
    )
    captured = capsys.readouterr()
    assert "no sliding-window layers" in captured.out
    assert rc == 0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--caches", "ring,paged"], "unknown cache"),
        (["--chunk-size", "0"], "--chunk-size must be >= 1"),
        (["--model", "/no/such/model_dir"], "does not exist"),
        (["--chunk-size", "500", "--max-tokens", "100"], "fewer than one chunk \\+ 1"),
    ],
)
def test_cli_errors(argv, message, tiny_dir, tmp_path, capsys):
    text_file = tmp_path / "t.txt"
    text_file.write_text(SAMPLE * 3)
    base = ["--model", str(tiny_dir), "--text", str(text_file), "--no-progress"]
    with pytest.raises(SystemExit) as excinfo:
        main(base + argv)
    assert excinfo.value.code == 2
    assert re.search(message, capsys.readouterr().err)


@pytest.mark.parametrize(
    "option, make",
    [
        ("--text", lambda d: (d / "weights.bin").write_bytes(b"\x00\xffGGUF") and d / "weights.bin"),
        ("--text", lambda d: (d / "empty.txt").write_text("") or d / "empty.txt"),
        ("--text", lambda d: d),
        ("--text", lambda d: d / "missing.txt"),
        ("--json", lambda d: d),
        ("--plot", lambda d: d),
        ("--quality-plot", lambda d: d),
    ],
)
def test_cli_file_mistakes_are_one_line_before_the_model_loads(option, make, tmp_path, capsys, monkeypatch):
    """A text file that is not UTF-8 text (or empty, a directory, missing) or an output path that is a directory:
    status 2 and one line on stderr naming the file and what was expected, and no model loaded."""
    loaded = []
    monkeypatch.setattr("hybrid_cache.tools.cli.perplexity.load_model", lambda *a, **k: loaded.append(a))
    text_file = tmp_path / "t.txt"
    text_file.write_text(SAMPLE * 3)
    path = make(tmp_path)
    argv = ["--text", str(text_file), "--no-progress", option, str(path)]
    if option == "--quality-plot":
        argv += ["--reference", "ring"]
    with pytest.raises(SystemExit) as excinfo:
        main(argv)
    assert excinfo.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured.err
    assert captured.err.startswith("hybrid-cache-perplexity: error: ") and repr(str(path)) in captured.err
    assert re.search("; expected |does not exist", captured.err), captured.err
    assert not loaded


def test_kv_bytes_equals_memory_report_and_gemma4_geometry():
    """`kv_bytes` (distinct storages) equals HybridRingCache's own report of K/V bytes; the full-cache baseline reads Gemma 4's
    per-layer geometry (sliding head 8 x 2 KV heads, full head 16 x 1 KV head, KV-shared layers excluded)."""
    from builders import chunked_logits, tiny_gemma4

    from hybrid_cache import HybridRingCache

    model = tiny_gemma4(window=4)
    cache = HybridRingCache(model.config)
    chunked_logits(model, cache, torch.randint(3, 100, (2, 15)), [9, 1, 5])
    report = cache.memory_report()
    # K/V storage; the report's extra bytes are the slots the last step overwrote, kept to undo it (`ring.SlotUndo`)
    assert kv_bytes(cache) == report.kv_bytes == report.total_bytes - report.extra_bytes > 0
    # layers: S S F S S | shared x3  ->  4 sliding x (2 x 2 x 8) + 1 full x (2 x 1 x 16), fp32
    assert full_cache_bytes_per_token(model.config, torch.float32) == (4 * 2 * 2 * 8 + 1 * 2 * 1 * 16) * 4


def test_cli_reference_reports_quality(tiny_dir, tmp_path, capsys):
    """--reference: every cache streamed in lockstep with the exact ring; KL / top-1 / bytes in the table and JSON."""
    text_file = tmp_path / "t.txt"
    text_file.write_text(SAMPLE * 3)
    out_json, out_png = tmp_path / "q.json", tmp_path / "q.png"
    caches = ["ring", "ring-int8", "ring-int4", "ring-stream", "none"]
    rc = main(
        [
            "--model",
            str(tiny_dir),
            "--text",
            str(text_file),
            "--max-tokens",
            "60",
            "--chunk-size",
            "7",
            "--caches",
            ",".join(caches),
            "--reference",
            "ring",
            "--json",
            str(out_json),
            "--quality-plot",
            str(out_png),
            "--no-progress",
        ]
    )
    assert rc == 0
    assert "KL mean" in capsys.readouterr().out
    results = {r["cache"]: r for r in json.loads(out_json.read_text())["results"]}
    assert set(results) == set(caches)
    assert results["ring"]["kl_mean"] == 0 and results["ring"]["top1_agreement"] == 1
    assert results["ring-int4"]["kl_mean"] > results["ring-int8"]["kl_mean"] > 0
    assert results["ring-int8"]["kv_bytes"] < results["ring"]["kv_bytes"]
    assert results["ring-stream"]["kl_mean"] == 0  # 60 tokens fit its 2048-token budget: exact
    assert abs(results["none"]["ppl"] / results["ring"]["ppl"] - 1) < 1e-5
    assert out_png.stat().st_size > 0
    with pytest.raises(SystemExit):
        main(["--model", str(tiny_dir), "--text", str(text_file), "--quality-plot", str(out_png)])
