"""Tensor and pipeline parallelism with transformers' own engine (`DistributedConfig`, torchrun, gloo, CPU): every
rank's tokens and logits equal one process's run of the same weights with the same cache and seed, and each rank's
`memory_report()` equals the planner's per-process numbers.

Each layout is one `torchrun --nproc-per-node 2` (`tests/distributed/dist_worker.py`) that runs every scenario of
`tests/distributed/dist_scenarios.py` for two models; the single-process reference runs here. Bounded: a hard timeout
on the whole torchrun (`HYBRID_CACHE_TORCHRUN_TIMEOUT`, seconds), a short gloo timeout inside it, and a failing rank
ends its torchrun at once (tested).
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from builders import tiny_gemma3, tiny_gemma4
from transformers import AutoModelForCausalLM

from hybrid_cache.distributed import pipeline_layer_range
from hybrid_cache.tools.planner import plan_kv_memory

ROOT = Path(__file__).resolve().parents[2]
WORKER_DIR = Path(__file__).resolve().parents[1] / "distributed"
sys.path.insert(0, str(WORKER_DIR))
import dist_scenarios  # noqa: E402 - lives next to the worker, which imports it too

HARD_TIMEOUT = int(os.environ.get("HYBRID_CACHE_TORCHRUN_TIMEOUT", "480"))
PG_TIMEOUT = os.environ.get("HYBRID_CACHE_PG_TIMEOUT", "120")
ATOL = 1e-4  # fp32; observed differences are ~1e-6 (tensor parallel sums in another order) or 0 (pipeline)

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(
        not (dist.is_available() and dist.is_gloo_available()),
        reason="torch.distributed with the gloo backend is not available in this torch build",
    ),
]

# Gemma 3: 6 layers, 5 sliding : 1 full; pipeline stage 0 holds layers 0-2 (no full layer), stage 1 layers 3-5 (not
# layer 0). Gemma 4 with per-layer inputs and KV sharing (E2B / E4B style) under tensor parallelism; without them
# (31B / 26B-A4B style) under pipeline parallelism, which transformers 5.24 cannot run with either (see
# docs/distributed.md). KV heads 4 (sliding) / 2 (full), head sizes 8 / 16: every rank gets whole heads of each type.
MODELS = {
    "gemma3": lambda: tiny_gemma3(window=dist_scenarios.WINDOW, layers=6),
    "gemma4": lambda: tiny_gemma4(window=dist_scenarios.WINDOW, query_heads=8, kv_heads=4, global_kv_heads=2),
    "gemma4_dense": lambda: tiny_gemma4(
        window=dist_scenarios.WINDOW, query_heads=8, kv_heads=4, global_kv_heads=2, shared=0, per_layer_input=0
    ),
}
LAYOUT_MODELS = {"tp": ["gemma3", "gemma4"], "pp": ["gemma3", "gemma4_dense"]}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    for name, build in MODELS.items():
        build().save_pretrained(root / name)
    return {name: root / name for name in MODELS}


def torchrun(layout: str, dirs: list[Path], out: Path, nproc: int = 2, runs: str | None = None) -> tuple[int, str]:
    """Run the worker under torchrun; return its exit status and output. Never outlives `HARD_TIMEOUT`."""
    out.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "--max-restarts=0",
        str(WORKER_DIR / "dist_worker.py"),
        "--layout",
        layout,
        "--out",
        str(out),
        *map(str, dirs),
    ]
    if runs:
        command[-len(dirs) : -len(dirs)] = ["--runs", runs]
    env = {
        **os.environ,
        # This checkout's package, scenarios and tests/builders.py first: an installed hybrid_cache must not shadow them.
        "PYTHONPATH": os.pathsep.join(
            [str(ROOT), str(WORKER_DIR), str(WORKER_DIR.parent), os.environ.get("PYTHONPATH", "")]
        ),
        "HYBRID_CACHE_PG_TIMEOUT": PG_TIMEOUT,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    log = out / "torchrun.log"
    with open(log, "w") as handle:
        process = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            status = process.wait(timeout=HARD_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # torchrun and every rank it started
            process.wait()
            pytest.fail(f"torchrun ({layout}) ran past {HARD_TIMEOUT}s and was killed:\n{log.read_text()[-4000:]}")
    return status, log.read_text()


def _load_ranks(out: Path, nproc: int) -> list[dict]:
    return [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(nproc)]


def _layout_results(layout: str, model_dirs: dict[str, Path], out: Path) -> list[dict]:
    status, log = torchrun(layout, [model_dirs[name] for name in LAYOUT_MODELS[layout]], out)
    assert status == 0, f"torchrun ({layout}) failed with status {status}:\n{log[-6000:]}"
    return _load_ranks(out, 2)


@pytest.fixture(scope="module")
def tp_results(model_dirs, tmp_path_factory) -> list[dict]:
    return _layout_results("tp", model_dirs, tmp_path_factory.mktemp("tp"))


@pytest.fixture(scope="module")
def pp_results(model_dirs, tmp_path_factory) -> list[dict]:
    return _layout_results("pp", model_dirs, tmp_path_factory.mktemp("pp"))


@functools.cache
def _reference_model(path: str):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@functools.cache
def reference(path: str, scenario: str, cache: str) -> dict:
    """The same scenario and cache in this one process."""
    return dist_scenarios.run(_reference_model(path), scenario, cache)


def assert_same_as_one_process(ranks: list[dict], model_dir: Path, scenario: str, cache: str) -> None:
    expected = reference(str(model_dir), scenario, cache)
    for result in ranks:
        got = result[(model_dir.name, scenario, cache)]
        where = f"rank {result['rank']}, {model_dir.name}, {scenario}, {cache}"
        assert torch.equal(got["sequences"], expected["sequences"]), f"tokens differ from one process ({where})"
        torch.testing.assert_close(got["logits"], expected["logits"], atol=ATOL, rtol=0, msg=f"logits ({where})")
        assert got["tokens"] == expected["tokens"], where


def _fixed_capacity(scenario: str, cache: str) -> int | None:
    return dist_scenarios.capacity(dist_scenarios.SCENARIOS[scenario]) if cache == "ring_fixed" else None


def _cases(layout: str, exclude: tuple[str, ...] = ()) -> list:
    return [
        pytest.param(model, scenario, cache, id=f"{model}-{scenario}-{cache}")
        for model in LAYOUT_MODELS[layout]
        for scenario, cache in dist_scenarios.RUNS[layout]
        if cache not in exclude
    ]


# --- tensor parallel ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("model, scenario, cache", _cases("tp"))
def test_tensor_parallel_equals_one_process(tp_results, model_dirs, model, scenario, cache):
    """TP=2 (half the KV heads per rank): greedy, left padding longer than the window, sampling with a seed, beams,
    chunked prefill, a second turn on the same cache, fixed capacity: the tokens of one process, logits within 1e-4."""
    assert_same_as_one_process(tp_results, model_dirs[model], scenario, cache)


@pytest.mark.parametrize("model", LAYOUT_MODELS["tp"])
def test_tensor_parallel_early_initialization_allocates_the_ranks_heads(tp_results, model_dirs, model):
    """`early_initialization(num_heads=config heads / 2)` allocates each rank's heads per layer type (Gemma 4: 2
    sliding, 1 full), and `generate` then writes into those very buffers (no reallocation)."""
    config = _reference_model(str(model_dirs[model])).config
    expected = [
        None if mode == "reuse" else layer.num_key_value_heads // 2
        for layer, mode in zip(
            config.per_layer_config, getattr(config, "kv_sharing_modes", None) or [None] * config.num_hidden_layers
        )
    ]
    for result in tp_results:
        got = result[(model, "padded", "ring_early_init")]
        assert got["kv_heads"] == expected
        assert got["kept_storage"], "generate reallocated the early-initialized buffers"


@pytest.mark.parametrize("model", LAYOUT_MODELS["tp"])
@pytest.mark.parametrize("scenario, cache", [("padded", "ring"), ("padded", "ring_fixed"), ("beam", "ring")])
def test_tensor_parallel_memory_equals_planner(tp_results, model_dirs, model, scenario, cache):
    """Each rank's `memory_report()` is the planner's per-process plan with `tp_size=2`."""
    config = _reference_model(str(model_dirs[model])).config
    for result in tp_results:
        got = result[(model, scenario, cache)]
        plan = plan_kv_memory(
            config,
            got["tokens"],
            prompt_length=got["prompt"],
            batch_size=got["cache_batch"],
            dtype=torch.float32,
            tp_size=2,
            max_cache_len=_fixed_capacity(scenario, cache),
        )
        assert got["bytes_by_type"] == plan.stages[0]["ring"].bytes_by_type
        assert got["kv_bytes"] == plan.per_process("ring")


# --- pipeline parallel --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("model, scenario, cache", _cases("pp", exclude=("dynamic",)))
def test_pipeline_parallel_equals_one_process(pp_results, model_dirs, model, scenario, cache):
    """PP=2: `HybridRingCache.for_model(model)` (layers read from the model) and `stage_layers=` given explicitly are
    exact in every scenario, and so is `DynamicCache` once `restrict_to_stage` gives it the stage's layers only."""
    assert_same_as_one_process(pp_results, model_dirs[model], scenario, cache)


@pytest.mark.parametrize("model", LAYOUT_MODELS["pp"])
def test_pipeline_stages_hold_transformers_split(pp_results, model_dirs, model):
    num_layers = _reference_model(str(model_dirs[model])).config.num_hidden_layers
    for result in pp_results:
        assert result[(model, "stage_layers")] == list(pipeline_layer_range(result["rank"], 2, num_layers))


@pytest.mark.parametrize("model", LAYOUT_MODELS["pp"])
def test_pipeline_plain_dynamic_cache_differs_from_one_process(pp_results, model_dirs, model):
    """What docs/distributed.md reports about transformers 5.24: a plain `DynamicCache(config=...)` on the second
    stage sizes the sliding mask from layer 0, which it never updates, so left padding is ignored there and the padded
    rows' logits differ from one process. If this fails, transformers fixed it: update docs/distributed.md."""
    expected = reference(str(model_dirs[model]), "padded", "dynamic")
    got = pp_results[0][(model, "padded", "dynamic")]
    difference = (got["logits"] - expected["logits"]).abs().amax().item()
    same_tokens = torch.equal(got["sequences"], expected["sequences"])
    print(f"\n{model}: plain DynamicCache under PP: max |dlogit| {difference:.3g}, same tokens: {same_tokens}")
    assert difference > 1e-2, f"plain DynamicCache is now exact under pipeline parallelism (max |dlogit| {difference})"


@pytest.mark.parametrize("model", LAYOUT_MODELS["pp"])
@pytest.mark.parametrize("cache", ["ring", "ring_fixed"])
def test_pipeline_memory_per_stage_equals_planner(pp_results, model_dirs, model, cache):
    """Each stage's `memory_report()` is the planner's plan for that stage (`pp_size=2`)."""
    config = _reference_model(str(model_dirs[model])).config
    for result in pp_results:
        got = result[(model, "padded", cache)]
        plan = plan_kv_memory(
            config,
            got["tokens"],
            prompt_length=got["prompt"],
            batch_size=got["cache_batch"],
            dtype=torch.float32,
            pp_size=2,
            max_cache_len=_fixed_capacity("padded", cache),
        )
        stage = plan.stages[result["rank"]]["ring"]
        assert got["bytes_by_type"] == stage.bytes_by_type
        assert got["kv_bytes"] == stage.total_bytes


def test_pipeline_split_across_kv_sharing_fails_fast_with_the_reason(model_dirs, tmp_path):
    """Gemma 4 with KV sharing, PP=2: stage 1 holds layer 5, which reuses layer 2's K/V from stage 0. Its cache refuses
    with the reason; that rank exits, and the other rank (already in `generate`) ends instead of waiting."""
    status, log = torchrun("pp", [model_dirs["gemma4"]], tmp_path, runs="greedy:ring")
    assert status != 0
    error = (tmp_path / "rank1.error").read_text()
    assert "Layer 5 reuses the keys/values of layer 2" in error, error
    assert not (tmp_path / "rank0.pt").exists() and not (tmp_path / "rank1.pt").exists()


def test_tensor_x_pipeline_parallel(model_dirs, tmp_path):
    """TP=2 x PP=2 (4 processes). transformers 5.24 cannot load a model that way (its TP plan still names the layers
    that pipeline parallelism removed): expected to fail there; exact like the others once transformers can."""
    status, log = torchrun("tp_pp", [model_dirs["gemma3"]], tmp_path, nproc=4, runs="padded:ring,second_turn:ring")
    if status != 0:
        # One rank hitting transformers' limitation is enough: the run cannot succeed, and which ranks reach it before
        # the others are torn down (or fail in a collective with a rank that is gone) is a race.
        errors = [path.read_text() for path in sorted(tmp_path.glob("rank*.error"))]
        if any("apply_tensor_parallelism" in error and "KeyError" in error for error in errors):
            pytest.xfail("transformers cannot combine tensor and pipeline parallelism (KeyError in its TP plan)")
        pytest.fail(f"TP x PP failed otherwise:\n{log[-6000:]}")
    ranks = _load_ranks(tmp_path, 4)
    for scenario in ("padded", "second_turn"):
        assert_same_as_one_process(ranks, model_dirs["gemma3"], scenario, "ring")
