"""Exported programs (`hybrid_cache.export`) in their runtimes: ExecuTorch (`.pte`, XNNPACK) and ONNX Runtime
(`.onnx`, CPU, state bound in place), on tiny Gemma 3 and Gemma 4 models (window 8, `max_cache_len` 96, chunks of
16: prompts shorter and longer than the window and the chunk, 48 new tokens = 6 wraps of the rings).

Each program is exported once per module (lowering to XNNPACK takes minutes) and reset between tests. What is
checked: greedy tokens equal eager `generate` with `DynamicCache`; every step's logits against the no-cache forward
(tolerances per runtime, `TOLERANCE`); `cache_slots()` read from the program; multi-turn continuation and the
refusal of another conversation; a step past `max_cache_len` refused before anything is written, the program then
exact; bad token ids (outside the vocabulary, floats, booleans, another shape, an empty prompt) refused by the runner
before any step, nothing written; rollback within the margin; files that are not programs refused in one line; a
model on `hybrid_cache_sdpa` (`load_model`'s attention) exported with sdpa masks and given its attention back.
"""

from __future__ import annotations

import json

import pytest
import torch
from builders import BANDED, VOCAB, no_cache_logits, tiny_gemma3, tiny_gemma4
from transformers import DynamicCache

from hybrid_cache import CacheCapacityError, ConversationMismatchError, RollbackError, cache_kwargs
from hybrid_cache.code_attention import CODE_ATTENTION

pytest.importorskip("onnxruntime", reason="the export extra is not installed")
pytest.importorskip("executorch", reason="the export extra is not installed")
from hybrid_cache.export import ProgramFormatError, export_program, load_program  # noqa: E402

pytestmark = [pytest.mark.export, pytest.mark.filterwarnings("ignore::FutureWarning")]

WINDOW, MAX_CACHE_LEN, CHUNK = 8, 96, 16
# Max |logit difference| against the no-cache forward, fp32: ONNX Runtime computes in fp32 as PyTorch does; XNNPACK
# sums in another order (and fuses), measured up to 9e-5 on the tiny Gemma 4.
TOLERANCE = {"onnx": 1e-4, "pte": 5e-4}
BUILDERS = {"gemma3": tiny_gemma3, "gemma4": tiny_gemma4}
PROGRAMS = [(family, suffix) for family in BUILDERS for suffix in ("onnx", "pte")]


@pytest.fixture(scope="module", params=PROGRAMS, ids=[f"{f}-{s}" for f, s in PROGRAMS])
def exported(request, tmp_path_factory):
    """(model, program, suffix, report) for one family and format, exported once."""
    family, suffix = request.param
    model = BUILDERS[family](window=WINDOW)
    path = tmp_path_factory.mktemp("programs") / f"{family}.{suffix}"
    stages: list[str] = []
    report = export_program(model, path, max_cache_len=MAX_CACHE_LEN, chunk_size=CHUNK, progress=stages.append)
    expected = ["export", "lowering", "writing"] if suffix == "pte" else ["export", "writing"]
    assert [stage.split(":")[0] for stage in stages] == expected, stages
    assert report.nbytes == path.stat().st_size > 0 and report.note is None
    return model, load_program(path), suffix, report


def prompt(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


def eager_generate(model, ids: torch.Tensor, new: int, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(
            ids,
            max_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
            **kwargs,
            **cache_kwargs(DynamicCache(config=model.config)),
        )


@pytest.mark.parametrize("length", [5, 21])
def test_greedy_tokens_equal_eager_generate(exported, length):
    model, program, _, _ = exported
    program.reset()
    ids = prompt(length, seed=length)
    assert torch.equal(program.generate(ids, max_new_tokens=48), eager_generate(model, ids, 48))


def test_every_step_matches_the_no_cache_forward(exported):
    """Prompt 21 in chunks of 16 + 5, then 40 one-token steps past the window: each step's logits within the
    runtime's tolerance of the no-cache forward over the whole sequence."""
    model, program, suffix, _ = exported
    program.reset()
    ids = prompt(61, seed=3)
    expected = no_cache_logits(model, ids)[0]
    worst = (program.logits(ids[:, :21]) - expected[20]).abs().max().item()
    for end in range(22, 62):
        worst = max(worst, (program.logits(ids[:, :end]) - expected[end - 1]).abs().max().item())
    assert worst < TOLERANCE[suffix], worst


def test_cache_slots_are_the_window_for_sliding_layers(exported):
    model, program, _, report = exported
    slots = program.cache_slots()
    specs = {layer.index: layer for layer in program.metadata.layers}
    for index, count in slots.items():
        kind = specs[index].kind
        expected = WINDOW if kind == "sliding_attention" else MAX_CACHE_LEN if specs[index].stores else 0
        assert count == expected, (index, kind, count)
    assert slots == report.slots


def test_multi_turn_continues_and_another_conversation_is_refused(exported):
    """A second turn that starts with the conversation held continues it (the tokens of one generate over the whole
    conversation); a prompt that does not is refused with nothing written, and the program then continues."""
    model, program, _, _ = exported
    program.reset()
    first = program.generate(prompt(13, seed=1), max_new_tokens=10)
    turn = torch.cat([first, prompt(6, seed=2)], 1)
    with pytest.raises(ConversationMismatchError, match="reset"):
        program.generate(prompt(30, seed=9), max_new_tokens=4)
    got = program.generate(turn, max_new_tokens=12)
    assert torch.equal(got, eager_generate(model, turn, 12))


def test_a_step_past_max_cache_len_is_refused_before_anything_is_written(exported):
    model, program, _, _ = exported
    program.reset()
    ids = prompt(80, seed=4)
    with pytest.raises(CacheCapacityError, match="max_cache_len=96"):
        program.generate(ids, max_new_tokens=20)  # 80 + 20 - 1 > 96
    assert program.length == 0
    assert torch.equal(program.generate(ids, max_new_tokens=17), eager_generate(model, ids, 17))
    held = program.length  # 96, or fewer where an end-of-sequence token stopped both generations
    turn = torch.cat([program.tokens, prompt(MAX_CACHE_LEN - held + 1, seed=5)], 1)
    with pytest.raises(CacheCapacityError):
        program.generate(turn, max_new_tokens=1)  # one token past max_cache_len: refused, the program unchanged
    assert program.length == held
    with pytest.raises(ConversationMismatchError, match="no new tokens"):
        program.generate(program.tokens, max_new_tokens=1)


def with_id(ids: torch.Tensor, position: int, value: int) -> torch.Tensor:
    ids = ids.clone()
    ids[0, position] = value
    return ids


# A bad input made from good ids `[1, n]` whose last 6 tokens are new to the program (position -3: the second chunk
# of a 21-token prompt, chunks of 16): (make, error, what the message says).
BAD_INPUTS = {
    "negative": (lambda ids: with_id(ids, -3, -1), ValueError, r"= -1 is not a token id.*vocab_size - 1 = 100"),
    "vocab-size": (lambda ids: with_id(ids, -3, VOCAB), ValueError, r"= 101 is not a token id.*vocab_size - 1 = 100"),
    "huge": (lambda ids: with_id(ids, -1, 2**40), ValueError, rf"= {2**40} is not a token id"),
    "float": (lambda ids: ids.float() + 0.2, TypeError, "integer token ids, got dtype torch.float32"),
    "float-whole": (lambda ids: ids.double(), TypeError, "integer token ids, got dtype torch.float64"),
    "bool": (lambda ids: ids > 50, TypeError, "integer token ids, got dtype torch.bool"),
    "list": (lambda ids: ids.tolist(), TypeError, "must be a torch.Tensor of token ids.*got list"),
    "1d": (lambda ids: ids[0], ValueError, r"must be \[1, tokens\].*got shape \(\d+,\).*unsqueeze\(0\)"),
    "3d": (lambda ids: ids[None], ValueError, r"must be \[1, tokens\].*got shape \(1, 1, \d+\)"),
    "batch-2": (lambda ids: ids.repeat(2, 1), ValueError, r"runs batch 1.*got shape \(2, \d+\)"),
    "empty": (lambda ids: ids[:, :0], ValueError, r"input_ids is empty \(\[1, 0\]\)"),
}


def program_state(program) -> dict[str, torch.Tensor]:
    """A copy of the program's state tensors: ONNX Runtime's, owned by the runner, or ExecuTorch's buffers."""
    return {name: tensor.clone() for name, tensor in program.backend.state.items()}


def assert_refused(program, bad, error, match) -> None:
    """`generate` and `logits` refuse `bad` with `error`, before any step: tokens, counters and state unchanged."""
    tokens, oldest, state = program.tokens.clone(), program.oldest, program_state(program)
    for call in (program.generate, program.logits):
        with pytest.raises(error, match=match) as raised:
            call(bad)
        assert "Nothing was written" in str(raised.value) and "\n" not in str(raised.value)
    assert torch.equal(program.tokens, tokens) and program.oldest == oldest
    after = program_state(program)
    assert all(torch.equal(after[name], state[name]) for name in state)


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_token_ids_are_refused_before_anything_is_written(exported, case):
    """Each bad input is refused by the runner with one error naming the problem and the fix (not the runtime's raw
    error, not a silent cast), on a fresh program (a bad id in the prompt's second chunk: the first chunk is not
    written either) and on one holding a conversation (the bad id among the new tokens): the program's tokens,
    counters and state are unchanged, and the next `generate` equals eager `generate`."""
    model, program, _, _ = exported
    make, error, match = BAD_INPUTS[case]
    program.reset()
    assert_refused(program, make(prompt(21, seed=7)), error, match)
    assert program.length == 0
    first_prompt = prompt(13, seed=1)
    first = program.generate(first_prompt, max_new_tokens=4)
    assert torch.equal(first, eager_generate(model, first_prompt, 4))
    assert any(tensor.any() for tensor in program_state(program).values())  # the state read is the program's own
    turn = torch.cat([first, prompt(6, seed=2)], 1)
    assert_refused(program, make(turn), error, match)
    assert torch.equal(program.generate(turn, max_new_tokens=12), eager_generate(model, turn, 12))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.uint8])
def test_token_ids_of_any_integer_dtype_are_taken(exported, dtype):
    """Ids of another integer dtype, including the vocabulary's first and last ids (0 and vocab_size - 1), run as the
    same LongTensor would: eager `generate`'s tokens, returned as int64. (0 is the tiny models' padding id, which
    eager `generate` would mask without an attention mask; the program attends to every token it is given.)"""
    model, program, _, _ = exported
    program.reset()
    ids = with_id(with_id(prompt(21, seed=6), 0, 0), -3, VOCAB - 1)
    got = program.generate(ids.to(dtype), max_new_tokens=8)
    expected = eager_generate(model, ids, 8, attention_mask=torch.ones_like(ids))
    assert got.dtype == torch.long and torch.equal(got, expected)


def test_files_that_are_not_programs_are_refused_in_one_line(exported, tmp_path):
    _, _, suffix, report = exported
    junk = tmp_path / f"junk.{suffix}"
    junk.write_bytes(b"not a program" * 10)
    with pytest.raises(ProgramFormatError, match="junk") as error:
        load_program(junk)
    assert "\n" not in str(error.value)
    truncated = tmp_path / f"truncated.{suffix}"
    truncated.write_bytes(report.path.read_bytes()[:4096])
    with pytest.raises(ProgramFormatError, match="truncated"):
        load_program(truncated)
    with pytest.raises(ValueError, match=".pte"):
        load_program(tmp_path / "program.bin")


def test_a_program_of_another_format_version_is_refused(exported, tmp_path, monkeypatch):
    """A program whose metadata names another format version (written by an incompatible hybrid_cache) is refused
    with one line naming both versions and the fix."""
    from hybrid_cache.export import metadata

    _, _, suffix, report = exported
    monkeypatch.setattr(metadata, "FORMAT_VERSION", metadata.FORMAT_VERSION + 1)
    old, new = metadata.FORMAT_VERSION - 1, metadata.FORMAT_VERSION
    with pytest.raises(ProgramFormatError, match=f"program format {old}.*runs format {new}.*hybrid-cache-export"):
        load_program(report.path)


def test_metadata_of_an_onnx_model_without_hybrid_cache_is_refused(tmp_path):
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "plain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
    )
    path = tmp_path / "plain.onnx"
    onnx.save_model(helper.make_model(graph), path)
    with pytest.raises(ProgramFormatError, match="not one exported by hybrid_cache"):
        load_program(path)
    model = onnx.load(path)
    entry = model.metadata_props.add()
    entry.key, entry.value = "hybrid_cache_metadata", json.dumps({"format": "something else"})
    onnx.save_model(model, path)
    with pytest.raises(ProgramFormatError, match="not a hybrid_cache program"):
        load_program(path)


def test_rollback_beyond_the_window_is_refused_and_changes_nothing(exported):
    """Without a rollback margin, one token can be taken back after the wrap (as the eager ring's `crop(-1)`), two
    cannot; the refusal changes nothing and the program continues exactly."""
    model, program, suffix, _ = exported
    program.reset()
    ids = prompt(20, seed=5)
    program.logits(ids)
    with pytest.raises(RollbackError, match="rollback_margin"):
        program.rollback(2)
    program.rollback(1)
    expected = no_cache_logits(model, ids)[0, -1]
    assert (program.logits(ids) - expected).abs().max() < TOLERANCE[suffix]


@pytest.mark.parametrize("suffix", ["onnx", "pte"])
def test_a_model_on_hybrid_cache_sdpa_is_exported_with_sdpa_masks(tmp_path, suffix):
    """`load_model`'s attention, `hybrid_cache_sdpa` (sdpa's results): `export_program` switches the model to sdpa
    for the export and back afterwards; the program's tokens are eager `generate`'s (window 5, chunks of 8, a prompt
    of two chunks and generation past several wraps)."""
    model = tiny_gemma3(window=5, layers=3, attn=BANDED)
    assert model.config._attn_implementation == CODE_ATTENTION
    path = tmp_path / f"tiny.{suffix}"
    export_program(model, path, max_cache_len=40, chunk_size=8)
    assert model.config._attn_implementation == CODE_ATTENTION
    program = load_program(path)
    ids = prompt(13, seed=8)
    assert torch.equal(program.generate(ids, max_new_tokens=20), eager_generate(model, ids, 20))


# --- ExecuTorch's stock runner ---------------------------------------------------------------------------------------
# Run in a fresh process that imports only ExecuTorch's runner and ops (no hybrid_cache): the runner's token pieces for
# each call, or "refused" where generate raised.
STOCK_RUNNER = """
import json, sys
import executorch.extension.llm.custom_ops.custom_ops  # the llama:: ops the program calls
from executorch.extension.llm.runner import GenerationConfig, TextLLMRunner

pte, tokenizer, calls = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
runner = TextLLMRunner(pte, tokenizer)
results = []
for call in calls:
    if call == "reset":
        runner.reset()
        continue
    text, new = call
    pieces = []
    try:
        runner.generate(text, GenerationConfig(max_new_tokens=new, temperature=0, num_bos=0, echo=False), pieces.append)
    except RuntimeError:
        pieces = "refused"
    results.append(pieces)
print("RESULTS " + json.dumps(results))
"""


def character_tokenizer(path) -> object:
    """A tokenizer of the tiny models' vocabulary (`VOCAB`): one token per character, the rest unused; written as a
    Hugging Face `tokenizer.json`, the format ExecuTorch's runner reads."""
    import string

    from tokenizers import Tokenizer, models

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2}
    for character in string.ascii_letters + string.digits + " .,!?;:'-":
        vocab[character] = len(vocab)
    vocab.update({f"<unused{i}>": i for i in range(len(vocab), VOCAB)})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.add_special_tokens(["<pad>", "<eos>", "<bos>"])
    tokenizer.save(str(path))
    return tokenizer


def test_executorch_stock_runner_runs_the_program(exported, tmp_path):
    """ExecuTorch's `TextLLMRunner`, in a process without hybrid_cache: a prompt of 4 windows in one call, then a
    second `generate` that continues the conversation (the runner does not feed its last generated token), a prompt
    past `max_cache_len` refused without a crash, and after `reset()` the first conversation again: each call's tokens
    equal eager `generate`'s with `DynamicCache` over the conversation as the runner holds it."""
    import json
    import subprocess
    import sys

    model, _, suffix, report = exported
    if suffix != "pte":
        pytest.skip("ExecuTorch's runner runs .pte programs")
    tokenizer = character_tokenizer(tmp_path / "tokenizer.json")
    first, second = "The ring holds a window of keys, no more.", " Then it wraps!"
    calls = [[first, 12], [second, 10], ["x" * (MAX_CACHE_LEN + 1), 2], "reset", [first, 12]]
    done = subprocess.run(
        [sys.executable, "-c", STOCK_RUNNER, str(report.path), str(tmp_path / "tokenizer.json"), json.dumps(calls)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.split("RESULTS ", 1)[1])

    def eager(ids: list[int], new: int) -> list[int]:
        return eager_generate(model, torch.tensor([ids]), new)[0, len(ids) :].tolist()

    def pieces(ids: list[int]) -> list[str]:
        return [tokenizer.id_to_token(token) for token in ids]

    ids = tokenizer.encode(first).ids
    assert len(ids) > 4 * WINDOW
    turn1 = eager(ids, 12)
    assert results[0] == pieces(turn1)
    held = ids + turn1[:-1] + tokenizer.encode(second).ids  # the last generated token is not fed
    assert results[1] == pieces(eager(held, 10))
    assert results[2] == "refused"
    assert results[3] == results[0]


@pytest.mark.parametrize("family", ["gemma4"])  # per-layer input embeddings, two head sizes; one lowering (CI time)
def test_quantized_program_agrees_with_the_quantized_model(family, tmp_path):
    """`quantize="8da4w"`: the model given is left as it is; the program, fed a conversation step by step (a prompt
    of 3 windows in one call, then one token at a time past several wraps), gives the logits of the same quantized
    model without a cache (one forward of the whole sequence, teacher-forced) within 0.05 (XNNPACK quantizes
    activations in its kernels, torchao's reference emulates it), and predicts its token wherever the reference's
    two best logits are further apart than that (a tiny random model has near ties)."""
    import copy

    from hybrid_cache.export.quantize import quantize_model

    model = BUILDERS[family](window=WINDOW)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    path = tmp_path / f"{family}-8da4w.pte"
    stages: list[str] = []
    report = export_program(model, path, max_cache_len=64, quantize="8da4w", progress=stages.append)
    assert stages[0].startswith("quantizing: 8da4w")
    assert all(torch.equal(tensor, before[name]) for name, tensor in model.state_dict().items())
    program = load_program(path)
    assert program.metadata.quantization == "8da4w" and set(report.slots.values()) >= {WINDOW, 64}
    reference = quantize_model(copy.deepcopy(model), "8da4w")
    ids = prompt(60, seed=11)
    expected = no_cache_logits(reference, ids)[0]
    worst, agree = 0.0, 0
    for end in range(3 * WINDOW, 61):
        got, want = program.logits(ids[:, :end])[0], expected[end - 1]
        worst = max(worst, float((got - want).abs().max()))
        agree += int(got.argmax() == want.argmax())
        assert got.argmax() == want.argmax() or want.max() - want[got.argmax()] < 0.05, end
    assert worst < 0.05 and agree >= 60 - 3 * WINDOW - 3, (worst, agree)


def test_the_step_profile_counts_the_fused_ops(exported):
    """benchmarks/profile_step.py (docs/export.md's per-op table) on the program: ETDump's events of a decode step
    after a prompt of two windows name ExecuTorch's fused ops, as many calls per step as the layers make, each row
    within the step's time."""
    import importlib.util
    from pathlib import Path

    model, _, suffix, report = exported
    if suffix != "pte":
        pytest.skip("ETDump profiles .pte programs")
    path = Path(__file__).parents[2] / "benchmarks" / "profile_step.py"
    spec = importlib.util.spec_from_file_location("profile_step", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rows, step_us = module.profile(str(report.path), context=2 * WINDOW + 3, steps=4, piece=CHUNK)
    calls = {row["event"]: row["calls_per_step"] for row in rows}
    types = model.config.layer_types
    stores = [i for i in range(len(types)) if i < len(types) - getattr(model.config, "num_kv_shared_layers", 0)]
    rings = sum(types[i] == "sliding_attention" for i in stores)
    assert calls["llama::update_cache_with_indices.out"] == 2 * rings  # keys and values of each storing ring
    assert calls["llama::update_cache.out"] == 2 * (len(stores) - rings)
    assert calls["llama::custom_sdpa.out"] == len(types) + sum(t == "sliding_attention" for t in types)
    assert step_us > 0 and all(0 <= row["us_per_step"] <= step_us for row in rows)
