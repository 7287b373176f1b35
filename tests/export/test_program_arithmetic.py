"""The exported programs' arithmetic, run as it is in PyTorch (`step.EagerBackend`, no runtime): the same module the
runtimes run, over random windows, prompt lengths, chunk sizes and rollback margins, against the no-cache forward.
Fast, so the geometry can vary: the runtimes' own tests (test_programs.py) take one geometry, for the time lowering
takes."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from builders import BANDED, VOCAB, no_cache_logits, tiny_gemma3, tiny_gemma4

from hybrid_cache import CacheCapacityError, RollbackError
from hybrid_cache.code_attention import CODE_ATTENTION
from hybrid_cache.export import export_program
from hybrid_cache.export.metadata import ProgramMetadata
from hybrid_cache.export.program import Program
from hybrid_cache.export.step import EagerBackend, ProgramModule

pytest.importorskip("executorch", reason="the export extra is not installed")
from hybrid_cache.export.pte import load_llm_ops  # noqa: E402
from hybrid_cache.export.runner import RunnerEagerBackend, RunnerProgram  # noqa: E402

pytestmark = pytest.mark.export
load_llm_ops()
TOLERANCE = 1e-4


def eager_program(model, max_cache_len: int, chunk_size: int, margin: int = 0, functional: bool = False) -> Program:
    """The ONNX program's module (`functional`: state as inputs and outputs) or the ExecuTorch runner program's
    (`RunnerProgram`: counters and storage in its buffers, ExecuTorch's LLM ops run eagerly), under this package's
    runner, fed in steps of at most `chunk_size` tokens."""
    module: Any
    if functional:
        module = ProgramModule(model, max_cache_len, margin, functional=True)
        backend: Any = EagerBackend(module)
    else:
        module = RunnerProgram(model, max_cache_len, margin)
        backend = RunnerEagerBackend(module)
    runtime = "onnx" if functional else "executorch"
    return Program(backend, ProgramMetadata.describe(model, module, runtime, max_cache_len, chunk_size))


@pytest.mark.parametrize("functional", [False, True], ids=["executorch-runner", "onnx"])
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("family", ["gemma3", "gemma4"])
def test_random_geometry_matches_the_no_cache_forward(family, seed, functional):
    """Random window, chunk size, prompt (shorter / longer than both) and continuation of one-token steps and
    further chunks past several wraps: every fed token's logits against the no-cache forward."""
    rng = random.Random(f"{family}-{seed}")
    window, chunk = rng.choice([2, 3, 4, 6, 8]), rng.choice([2, 3, 5, 16])
    model = (tiny_gemma3 if family == "gemma3" else tiny_gemma4)(window=window, seed=seed)
    program = eager_program(model, 80, chunk, functional=functional)
    ids = torch.randint(3, VOCAB, (1, 70), generator=torch.Generator().manual_seed(seed))
    expected = no_cache_logits(model, ids)[0]
    end = rng.choice([1, window - 1 or 1, window + 1, 3 * window + 1, chunk + 1])
    ends = [end]
    while ends[-1] < 70:
        ends.append(min(70, ends[-1] + rng.choice([1, 1, 1, 2, window, chunk + 1])))
    for end in ends:
        got = program.logits(ids[:, :end])
        assert (got - expected[end - 1]).abs().max() < TOLERANCE, (window, chunk, end)


@pytest.mark.parametrize("margin", [1, 3])
def test_rollback_within_the_margin_is_exact(margin):
    """With `rollback_margin` M the rings hold W + M slots and `rollback(n)` is exact for n <= M + 1 after the wrap
    (the eager ring's rule, `slots.window_reaches`); a longer one is refused, changing nothing."""
    model = tiny_gemma3(window=4)
    program = eager_program(model, 64, 8, margin=margin)
    assert set(program.cache_slots().values()) == {4 + margin, 64}
    ids = torch.randint(3, VOCAB, (1, 40), generator=torch.Generator().manual_seed(margin))
    expected = no_cache_logits(model, ids)[0]
    program.logits(ids[:, :30])
    with pytest.raises(RollbackError, match="rollback_margin"):
        program.rollback(margin + 2)
    assert program.length == 30
    program.rollback(margin + 1)
    for end in range(31 - margin - 1, 36):
        assert (program.logits(ids[:, :end]) - expected[end - 1]).abs().max() < TOLERANCE


def test_capacity_is_checked_before_any_write():
    model = tiny_gemma4(window=4)
    program = eager_program(model, 24, 8)
    ids = torch.randint(3, VOCAB, (1, 30), generator=torch.Generator().manual_seed(0))
    with pytest.raises(CacheCapacityError, match="max_cache_len=24"):
        program.logits(ids[:, :25])
    assert program.length == 0
    expected = no_cache_logits(model, ids[:, :24])[0]
    assert (program.logits(ids[:, :24]) - expected[23]).abs().max() < TOLERANCE


def test_a_model_without_sliding_layers_gets_a_plain_static_cache(tmp_path):
    """Every layer full: the program keeps max_cache_len slots everywhere, and `export_program` says so."""
    pytest.importorskip("onnxruntime", reason="the export extra is not installed")
    model = tiny_gemma3(window=4, layers=2, layer_types=["full_attention"] * 2)
    stages: list[str] = []
    report = export_program(model, tmp_path / "full.onnx", max_cache_len=32, chunk_size=8, progress=stages.append)
    assert report.note is not None and "plain static cache" in report.note and report.note in stages
    assert report.slots == {0: 32, 1: 32}
    from hybrid_cache.export import load_program

    program = load_program(tmp_path / "full.onnx")
    ids = torch.randint(3, VOCAB, (1, 20), generator=torch.Generator().manual_seed(1))
    expected = no_cache_logits(model, ids)[0]
    assert (program.logits(ids) - expected[-1]).abs().max() < TOLERANCE
    program.rollback(12)  # no ring: any rollback is exact
    assert (program.logits(ids[:, :10]) - expected[9]).abs().max() < TOLERANCE


def test_export_gives_a_model_on_hybrid_cache_sdpa_its_attention_back_after_a_failure(tmp_path, monkeypatch):
    """`export_program` traces a model on `hybrid_cache_sdpa` on sdpa and switches it back, also when the export
    fails; a model on another attention it cannot trace is refused, left as it was."""
    from hybrid_cache.export import onnxrt

    seen: list[str] = []

    def failing_export(module, path, metadata, progress):
        seen.append(module.model.config._attn_implementation)
        raise RuntimeError("the exporter failed")

    monkeypatch.setattr(onnxrt, "export_onnx", failing_export)
    model = tiny_gemma3(window=4, layers=2, attn=BANDED)
    with pytest.raises(RuntimeError, match="the exporter failed"):
        export_program(model, tmp_path / "x.onnx", max_cache_len=16, chunk_size=4)
    assert seen == ["sdpa"] and model.config._attn_implementation == CODE_ATTENTION
    model.set_attn_implementation("flex_attention")
    with pytest.raises(ValueError, match="set_attn_implementation\\('sdpa'\\)"):
        export_program(model, tmp_path / "x.onnx", max_cache_len=16, chunk_size=4)
    assert model.config._attn_implementation == "flex_attention" and seen == ["sdpa"]


def runner_forward(program: RunnerProgram, ids: torch.Tensor, start: int) -> torch.Tensor:
    with torch.no_grad(), program.attention():
        return program(ids, torch.tensor([start]))


def runner_state(program: RunnerProgram) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in RunnerEagerBackend(program).state.items()}


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("family", ["gemma3", "gemma4"])
def test_runner_program_never_reads_an_unwritten_slot(family, seed):
    """The stock runner zero-fills nothing and ExecuTorch's buffers start as whatever memory held: with every state
    buffer (counters included) full of NaN, then garbage from another conversation after `start_pos == 0`, each step
    of a random schedule (prompts longer than the window in one call, decode past several wraps) equals the no-cache
    forward: a slot the program did not write is never read."""
    rng = random.Random(f"nan-{family}-{seed}")
    window = rng.choice([2, 3, 5, 8])
    model = (tiny_gemma3 if family == "gemma3" else tiny_gemma4)(window=window, seed=seed)
    program = RunnerProgram(model, 64)
    for tensor in RunnerEagerBackend(program).state.values():
        tensor.fill_(float("nan") if tensor.is_floating_point() else -(2**40))
    for conversation in range(2):
        ids = torch.randint(3, VOCAB, (1, 60), generator=torch.Generator().manual_seed(seed * 10 + conversation))
        expected = no_cache_logits(model, ids)[0]
        start = 0
        while start < 60:
            length = min(60 - start, rng.choice([1, 1, 1, window, window + 1, 3 * window + 2]))
            got = runner_forward(program, ids[:, start : start + length], start)
            assert (got[0] - expected[start + length - 1]).abs().max() < TOLERANCE, (window, start, length)
            start += length


@pytest.mark.parametrize(
    "case",
    ["gap", "past-capacity", "rollback-beyond-the-window"],
)
def test_runner_program_refuses_a_step_it_cannot_make_exact_before_writing(case):
    """What the stock runner could send that no exact step follows: a start past the tokens held, a step past
    `max_cache_len`, a start further back than the rings reach. The program raises at its first operation (an index
    out of range: in ExecuTorch, an error the runner reports), every buffer unchanged; a rollback the rings reach and
    the conversation's next step stay exact."""
    model = tiny_gemma3(window=4)
    program = RunnerProgram(model, 32)
    ids = torch.randint(3, VOCAB, (1, 40), generator=torch.Generator().manual_seed(3))
    expected = no_cache_logits(model, ids[:, :32])[0]
    runner_forward(program, ids[:, :20], 0)
    start, length = {"gap": (21, 1), "past-capacity": (20, 13), "rollback-beyond-the-window": (18, 1)}[case]
    before = runner_state(program)
    with pytest.raises((IndexError, RuntimeError)):
        runner_forward(program, ids[:, start : start + length], start)
    after = runner_state(program)
    assert all(torch.equal(after[name], before[name]) for name in before), case
    got = runner_forward(program, ids[:, 19:20], 19)  # a rollback of one token after the wrap: exact
    assert (got[0] - expected[19]).abs().max() < TOLERANCE
    got = runner_forward(program, ids[:, 20:32], 20)
    assert (got[0] - expected[31]).abs().max() < TOLERANCE
