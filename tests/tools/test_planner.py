"""The memory planner equals what the caches hold: `memory_report()` for `HybridRingCache`, `kv_bytes_held` for
transformers' `DynamicCache` / `StaticCache`, on tiny models built from random configs (Gemma 4: per-type KV heads
and head sizes, KV-shared layers), on the full-size presets (models built on the meta device, no memory), layer by
layer over long decodes (whatever the growth rule), and per process under tensor / pipeline parallelism
(`tests/core/test_distributed.py`).
"""

from __future__ import annotations

import json
import os
import random
import re

import pytest
import torch
from builders import VOCAB, tiny_gemma3, tiny_gemma4
from transformers import AutoModelForCausalLM, DynamicCache, MistralConfig, StaticCache

from hybrid_cache import HybridRingCache
from hybrid_cache.compat import cache_kwargs
from hybrid_cache.full import GrowableFullLayer, StaticFullLayer
from hybrid_cache.ring import RingSlidingLayer, StaticRingSlidingLayer
from hybrid_cache.tools.cli.planner import main
from hybrid_cache.tools.compare import kv_bytes_held, layer_kv_geometry
from hybrid_cache.tools.planner import PRESETS, load_config, max_context_length, plan_kv_memory

# Random configurations per run; `HYBRID_CACHE_PLANNER_SEEDS=200 pytest tests/tools/test_planner.py` to soak.
PLANNER_SEEDS = int(os.environ.get("HYBRID_CACHE_PLANNER_SEEDS", "8"))


@torch.no_grad()
def _prompt_then_decode(model, cache, batch: int, prompt: int, total: int) -> None:
    """One forward of `prompt` tokens, then one-token forwards up to `total` tokens: the planner's scenario."""
    model(input_ids=torch.randint(3, VOCAB, (batch, prompt)), **cache_kwargs(cache), use_cache=True)
    for _ in range(total - prompt):
        model(input_ids=torch.randint(3, VOCAB, (batch, 1)), **cache_kwargs(cache), use_cache=True)


def _random_case(seed: int):
    rng = random.Random(seed)
    window = rng.randint(2, 7)
    if rng.random() < 0.5:
        model = tiny_gemma3(window=window, layers=rng.choice([3, 6, 7]), seed=seed)
    else:
        shared = rng.choice([0, 2, 3])
        model = tiny_gemma4(
            window=window,
            layers=rng.choice([6, 8]),
            shared=shared,
            seed=seed,
            kv_heads=rng.choice([1, 2, 4]),
            global_kv_heads=rng.choice([1, 2]),
            per_layer_input=8 if shared else rng.choice([0, 8]),
        )
    prompt = rng.randint(1, 3 * window)
    total = prompt + rng.randint(0, 2 * window + 2)  # long decodes: test_layer_capacity_after_follows_every_step
    options = {
        "rollback_margin": rng.choice([0, 0, 2]),
        "initial_capacity": rng.choice([0, 0, total + rng.randint(0, 3)]),
        "max_cache_len": rng.choice([None, None, total + rng.randint(0, 5)]),
    }
    return model, rng.randint(1, 3), prompt, total, options


@pytest.mark.parametrize("seed", range(PLANNER_SEEDS))
def test_plan_equals_what_every_cache_holds(seed):
    """Random window, layers, KV heads per type, KV sharing, prompt, decode length, rollback margin, initial capacity,
    fixed capacity: the plan is, byte for byte and per layer type, what each cache holds after the same steps."""
    model, batch, prompt, total, options = _random_case(seed)
    plan = plan_kv_memory(
        model.config, total, prompt_length=prompt, batch_size=batch, dtype=torch.float32, **options
    ).stages[0]

    ring = HybridRingCache(model.config, **options)
    _prompt_then_decode(model, ring, batch, prompt, total)
    report = ring.memory_report()
    assert plan["ring"].bytes_by_type == report.bytes_by_type
    assert plan["ring"].layers_by_type == report.layers_by_type
    assert {kind: sorted(set(s)) for kind, s in report.slots_by_type.items()} == {
        kind: sorted(s) for kind, s in plan["ring"].slots_by_type.items()
    }
    assert plan["full"].total_bytes == report.full_cache_bytes

    for name, cache in [
        ("dynamic", DynamicCache(config=model.config)),
        ("static", StaticCache(config=model.config, max_cache_len=options["max_cache_len"] or total)),
    ]:
        _prompt_then_decode(model, cache, batch, prompt, total)
        assert plan[name].total_bytes == kv_bytes_held(cache), name


@pytest.mark.parametrize(
    "make_layer",
    [
        pytest.param(lambda rng: GrowableFullLayer(rng.choice([0, 0, rng.randint(1, 40)])), id="growable-full"),
        pytest.param(lambda rng: RingSlidingLayer(rng.randint(1, 50), rng.choice([0, 3])), id="ring"),
        pytest.param(lambda rng: StaticFullLayer(300), id="static-full"),
        pytest.param(lambda rng: StaticRingSlidingLayer(rng.randint(1, 50), rng.choice([0, 3])), id="static-ring"),
    ],
)
@pytest.mark.parametrize("seed", range(4))
def test_layer_capacity_after_follows_every_step(make_layer, seed):
    """Head size 1, a prompt then 250 one-token steps: after every step the layer holds `capacity_after(prompt, t)`
    slots and `nbytes() == planned_nbytes(...)`. The planner asks the layers themselves, so a change of growth rule
    changes both sides."""
    rng = random.Random(seed)
    layer = make_layer(rng)
    prompt = rng.randint(1, 45)
    layer.update(torch.zeros(2, 3, prompt, 1), torch.zeros(2, 3, prompt, 2))
    for tokens in range(prompt, prompt + 250):
        if tokens > prompt:
            layer.update(torch.zeros(2, 3, 1, 1), torch.zeros(2, 3, 1, 2))
        assert layer.capacity == layer.capacity_after(prompt, tokens), tokens
        assert layer.nbytes() == layer.planned_nbytes(2, 3, 1, 2, torch.float32, prompt, tokens)


# Layer types of the full-size presets, per `layer_kv_geometry`: the geometry the planner uses is the model's.
@pytest.mark.parametrize(
    "name", ["gemma-3-1b", "gemma-3-27b", "gemma-4-e2b", "gemma-4-e4b", "gemma-4-31b", "llama-4-scout"]
)
def test_full_size_presets_equal_memory_report_on_meta(name):
    """The full-size model of each preset, built on PyTorch's meta device (no weights, no memory): its K/V shapes per
    layer (KV heads and head size per type, KV-shared layers) give `memory_report()` = the plan."""
    config = PRESETS[name].config()
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config).eval()
    cache = HybridRingCache(model.config)
    with torch.no_grad():
        ids = torch.zeros((2, 8), dtype=torch.long, device="meta")
        model(input_ids=ids, **cache_kwargs(cache), use_cache=True)
        model(input_ids=ids[:, :1], **cache_kwargs(cache), use_cache=True)
    plan = plan_kv_memory(config, 9, prompt_length=8, batch_size=2, dtype=torch.float32)
    assert plan.stages[0]["ring"].bytes_by_type == cache.memory_report().bytes_by_type


def _bytes_per_token(heads: int, head_dim: int, element: int = 2) -> int:
    return heads * 2 * head_dim * element  # keys and values


def test_gemma4_e2b_by_hand():
    """Gemma 4 E2B, 8192 tokens, bf16: 35 layers, but the last 20 reuse earlier K/V; of the 15 that store, 12 are
    sliding (window 512, 1 KV head of 256) and 3 full (1 KV head of 512, twice the sliding size)."""
    plan = plan_kv_memory("gemma-4-e2b", 8192).stages[0]
    sliding, full = _bytes_per_token(1, 256), _bytes_per_token(1, 512)
    assert plan["ring"].bytes_by_type == {
        "sliding_attention": 12 * 512 * sliding,
        "full_attention": 3 * 8192 * full,
        "shared": 0,
    }
    assert plan["ring"].total_bytes == 54 * 2**20
    assert plan["full"].total_bytes == (12 * sliding + 3 * full) * 8192 == 144 * 2**20


def test_gemma3_27b_and_gemma4_31b_by_hand():
    """The numbers of docs/distributed.md: 128K tokens, bf16, batch 1, TP 2 (Gemma 3 27B: 16 KV heads of 128 in all
    62 layers, 10 full; Gemma 4 31B at 256K: 50 sliding with 16 KV heads of 256, 10 full with 4 KV heads of 512)."""
    plan = plan_kv_memory("gemma-3-27b", 131072, tp_size=2).stages[0]
    assert plan["ring"].bytes_by_type["sliding_attention"] == 52 * 1024 * _bytes_per_token(8, 128)
    assert plan["ring"].bytes_by_type["full_attention"] == 10 * 131072 * _bytes_per_token(8, 128) == 5 * 2**30
    assert plan["full"].total_bytes == 62 * 131072 * _bytes_per_token(8, 128)
    plan = plan_kv_memory("gemma-4-31b", 262144, tp_size=2).stages[0]
    assert plan["ring"].bytes_by_type["sliding_attention"] == 50 * 1024 * _bytes_per_token(8, 256)
    assert plan["ring"].bytes_by_type["full_attention"] == 10 * 262144 * _bytes_per_token(2, 512) == 10 * 2**30


def test_per_process_split_under_tensor_and_pipeline_parallelism():
    one = plan_kv_memory("gemma-3-27b", 4096)
    tp = plan_kv_memory("gemma-3-27b", 4096, tp_size=4)
    pp = plan_kv_memory("gemma-3-27b", 4096, pp_size=2)
    assert tp.per_process("ring") * 4 == one.per_process("ring")
    assert pp.stage_layers == [list(range(31)), list(range(31, 62))]
    assert sum(stage["ring"].total_bytes for stage in pp.stages) == one.per_process("ring")
    assert pp.stages[0]["ring"].layers_by_type["other_stage"] == 31


def test_splits_that_cannot_run_are_refused():
    with pytest.raises(ValueError, match="1 KV heads, which tensor parallelism cannot split over 2"):
        plan_kv_memory("gemma-4-e2b", 1024, tp_size=2)
    with pytest.raises(ValueError, match="Layer 18 reuses the keys/values of layer 1[34]"):
        plan_kv_memory("gemma-4-e2b", 1024, pp_size=2)  # stage 1 holds layers 18-34, their producers are 13 and 14
    with pytest.raises(ValueError, match="cannot hold a context"):
        plan_kv_memory("gemma-3-1b", 1024, max_cache_len=1000)
    with pytest.raises(ValueError, match="prompt_length"):
        plan_kv_memory("gemma-3-1b", 1024, prompt_length=2000)


@pytest.mark.parametrize("cache", ["ring", "dynamic", "static", "full"])
@pytest.mark.parametrize(
    "name, budget", [("gemma-3-27b", 3 * 2**30), ("gemma-4-31b", 5 * 10**9), ("gemma-4-e2b", 2**27)]
)
@pytest.mark.parametrize("new_tokens, fixed", [(0, False), (1000, False), (0, True)])
def test_max_context_length_is_the_largest_that_fits(cache, name, budget, new_tokens, fixed):
    """Whole context as a prompt, a prompt then 1000 generated tokens (the ring's full layers grow), fixed capacity."""
    fits = max_context_length(name, budget, cache, batch_size=2, new_tokens=new_tokens, fixed=fixed)
    assert fits and fits > new_tokens

    def held(tokens: int) -> int:
        plan = plan_kv_memory(
            name, tokens, prompt_length=tokens - new_tokens, batch_size=2, max_cache_len=tokens if fixed else None
        )
        return plan.per_process(cache)

    assert held(fits) <= budget < held(fits + 1)


def test_max_context_length_bounds():
    sliding_only = MistralConfig(num_hidden_layers=4, num_key_value_heads=2, head_dim=8, sliding_window=64)
    assert max_context_length(sliding_only, 2**20, "ring") is None  # nothing grows with the context
    assert max_context_length(sliding_only, 2**20, "full") < 2**20
    assert max_context_length("gemma-3-27b", 100, "ring") == 0


def test_presets_cite_their_source():
    for preset in PRESETS.values():
        assert "huggingface/transformers" in preset.source and "commit" in preset.source
        config = preset.config()
        assert len(layer_kv_geometry(config)) == config.num_hidden_layers


def test_load_config_from_a_file_and_a_directory(tmp_path):
    model = tiny_gemma4(window=3)
    model.config.save_pretrained(tmp_path)
    for source in (tmp_path, tmp_path / "config.json"):
        plan = plan_kv_memory(source, 20, dtype=torch.float32)
        assert plan.stages[0] == plan_kv_memory(model.config, 20, dtype=torch.float32).stages[0]
    with pytest.raises(ValueError, match="neither a preset"):
        load_config(tmp_path / "missing.json")


def test_cli(capsys, tmp_path):
    assert main(["gemma-3-27b", "--context", "131072", "--tp", "2", "--budget", "16GiB"]) == 0
    text = capsys.readouterr().out
    assert "HybridRingCache" in text and "5.20 GiB" in text and "Longest context within 16.00 GiB" in text
    assert main(["gemma-4-31b", "--context", "8192", "--pp", "2", "--json"]) == 0
    output = json.loads(capsys.readouterr().out)
    expected = plan_kv_memory("gemma-4-31b", 8192, pp_size=2).to_dict()
    assert output["stages"] == json.loads(json.dumps(expected["stages"]))
    assert main(["gemma-4-e2b", "--tp", "2"]) == 2
    assert "cannot split" in capsys.readouterr().err
    assert main(["--list-presets"]) == 0
    assert capsys.readouterr().out.count("source: huggingface/transformers") == len(PRESETS)


def _write(path, content: bytes):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    return path


@pytest.mark.parametrize(
    "make, expected",
    [
        (lambda d: _write(d / "config.json", b"\xff\xfe{}"), "is not UTF-8 text \\(byte 0xff at offset 0\\)"),
        (lambda d: _write(d / "empty.json", b""), "is empty"),
        (lambda d: _write(d / "broken.json", b'{"model_type": '), "is not JSON \\(Expecting value at line 1"),
        (lambda d: _write(d / "list.json", b"[1, 2]"), "holds a JSON list, not an object"),
        (lambda d: _write(d / "nomodel.json", b'{"hidden_size": 8}'), "has no model_type"),
        (lambda d: _write(d / "unknown.json", b'{"model_type": "nosuch"}'), "model_type 'nosuch', which transformers"),
        (lambda d: _write(d / "model" / "config.json", b"\xff") and d / "model", "model/config.json' is not UTF-8"),
        (lambda d: (d / "empty_dir").mkdir() or d / "empty_dir", "model directory .* has no config.json"),
    ],
)
def test_cli_refuses_a_file_that_is_not_a_config_in_one_line(make, expected, tmp_path, capsys, monkeypatch):
    """`hybrid-cache-plan FILE` on a file that is not a model's config.json: status 2 and one line naming the file
    and what was expected, before anything is planned."""
    planned = []
    monkeypatch.setattr("hybrid_cache.tools.cli.planner.plan_kv_memory", lambda *a, **k: planned.append(a))
    path = make(tmp_path)
    assert main([str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured.err
    assert captured.err.startswith(f"error: '{path}") or captured.err.startswith(f"error: model directory '{path}'")
    assert re.search(expected, captured.err) and "expected a" in captured.err, captured.err
    assert not planned


@pytest.mark.slow
def test_gemma3_270m_preset_is_the_embedded_model():
    """The preset's geometry is the real Gemma 3 270M's (the converted checkpoint of `hybrid_cache.models`)."""
    from hybrid_cache.tools.models import load_model

    model, _ = load_model()
    preset = PRESETS["gemma-3-270m"].config()
    assert layer_kv_geometry(model.config) == layer_kv_geometry(preset)
    assert model.config.layer_types == preset.layer_types
    assert model.config.sliding_window == preset.sliding_window
    assert plan_kv_memory(model.config, 8192).stages[0] == plan_kv_memory(preset, 8192).stages[0]


def test_llama4_chunked_layers_hold_one_chunk():
    """Llama 4 Scout at 131,072 tokens, bf16: the 36 chunked layers hold one chunk of 8192 (what DynamicCache keeps
    alive after generation), the 12 full layers the context; 24 GiB when every layer stores every token."""
    plan = plan_kv_memory("llama-4-scout", 131_072, prompt_length=131_072 - 1024, dtype=torch.bfloat16).stages[0]
    per_token = _bytes_per_token(8, 128)
    assert plan["ring"].bytes_by_type["chunked_attention"] == 36 * 8192 * per_token
    assert plan["dynamic"].bytes_by_type["chunked_attention"] == 36 * 8192 * per_token
    assert plan["full"].total_bytes == 48 * 131_072 * per_token
