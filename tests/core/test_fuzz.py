"""The stateful fuzzer: random sequences of what users do to a cache, each result checked against an oracle.

A hypothesis `RuleBasedStateMachine` builds a tiny Gemma 3 or Gemma 4 (window 3 or 4, sdpa or eager), a cache in one
storage mode (exact; fixed capacity `max_cache_len`; int8 / int4 full layers; sink + window full layers; each with or
without a rollback margin), and then drives what users do, in any order:

- steps: prompts and chunks of random lengths around the window, one-token decode steps, left-padded batches;
- `crop` (rollback), beam `reorder_cache` (repeated rows included), `batch_repeat_interleave`, `batch_select_indices`;
- `copy.deepcopy` (a branch that continues, the original left untouched), `save` + `load`, `checkpoint` + `restore`,
  `reset` (then a new prompt, of any batch size);
- a forward that raises midway (a layer's `mlp.forward` patched to raise once, as an out-of-memory would), on an
  empty cache too, then a retry without `reset`;
- a forward that raises after its last storing layer stored the step (the final norm or the output layer), then
  `crop(-n)` of that step, whatever its length;
- `activate_past_recording()`, then verification steps (a draft of several tokens, part of it cropped back), as
  assisted decoding does, across `reset`, `restore` and failed forwards;
- `key_positions(layer)` of every storing layer;
- a saved file edited by one byte;
- switching the attention implementation (`sdpa`, `eager`, `hybrid_cache_sdpa`);
- a prepared 4D attention mask of the wrong width;
- in a third of the exact and fixed-capacity sequences, every forward through `torch.compile(model)` (eager backend,
  nothing reset between sequences: frames reach the recompile limit and fall back to eager), without the failed
  forwards and prepared masks, whose contracts are eager ones (tests/core/test_compile_steps.py has the compiled ones).

What is checked:

- every logit of every step at real (unpadded) tokens: in the exact modes against the no-cache forward over the
  whole sequence (fp32, `builders.TOLERANCE`); in the approximate modes (int8 / int4 / sinks) against the same mode
  rebuilt from scratch: a second cache (the *shadow*) that replays only the operations that define the state (steps,
  crops, batch changes; after a `restore` it is rebuilt from the log), never the ones that must leave no trace
  (copies, save / load, checkpoint / restore, refused calls, failed forwards). Same chunks, same attention, one torch
  thread: the two run the same arithmetic, so the tolerance is the exact one;
- every refusal: the error is a `HybridCacheError` (or the documented `ValueError` of `restore` / `load`), and the
  cache's state (every tensor and counter of every layer) is exactly what it was before the call ("nothing written");
- after a failed forward, the cache reports the length before the step and the retry is exact (no
  `IncompleteStepError`: every step that overwrites slots keeps what undoes it);
- `crop(-n)` of the whole last step always succeeds, and so does a partial crop of a verification step while past
  recording is on (it stays on through `reset`, `restore`, copies and failed forwards); every other crop is exact or
  refused changing nothing;
- an edited file is refused at load, or loads into a cache that continues exactly as the saved one.

Budget: CI runs `FUZZ_EXAMPLES` sequences per model family (fixed seed: `derandomize=True`) of up to `FUZZ_STEPS`
rules each. The long mode is the same test with more sequences:
`HYBRID_CACHE_FUZZ_EXAMPLES=2000 pytest tests/core/test_fuzz.py` (optionally `HYBRID_CACHE_FUZZ_STEPS=60`,
`HYBRID_CACHE_FUZZ_SEED=<int>` for another fixed seed instead of derandomization). A failure prints the shrunk
sequence of rules that reproduces it (the first failure found; `report_multiple_bugs` is off to keep shrinking short).
`HYBRID_CACHE_FUZZ_OFF=failed_forward,edited_file` leaves rules out and `HYBRID_CACHE_FUZZ_MODES=exact,int8` draws
only those storage modes, to tell which rule or mode a failure needs.

Planted regressions (`HYBRID_CACHE_FUZZ_PLANT=<name>`, `PLANTS` below): each puts back one bug the recoveries had,
so that a run shows the fuzzer finds it; the number of sequences run before the failure is printed
(`HYBRID_CACHE_FUZZ_PLANT=reset_keeps_assisted_check pytest -s tests/core/test_fuzz.py -k Gemma3`).
"""

from __future__ import annotations

import contextlib
import copy
import os
import random
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from builders import TOLERANCE, VOCAB, no_cache_logits, one_torch_thread, tiny_gemma3, tiny_gemma4

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, Phase, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import (  # noqa: E402
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from hybrid_cache import HybridRingCache  # noqa: E402
from hybrid_cache.compat import cache_kwargs, rollback_supported  # noqa: E402
from hybrid_cache.errors import (  # noqa: E402
    CacheCapacityError,
    HybridCacheError,
    IncompleteStepError,
    RollbackError,
)

# Minutes long: the whole suite runs it (on the project's release); the quick suite on older releases leaves it out
# (setup.cfg's `slow` marker).
pytestmark = pytest.mark.slow

FUZZ_EXAMPLES = int(os.environ.get("HYBRID_CACHE_FUZZ_EXAMPLES", "12"))
FUZZ_STEPS = int(os.environ.get("HYBRID_CACHE_FUZZ_STEPS", "25"))
FUZZ_SEED = os.environ.get("HYBRID_CACHE_FUZZ_SEED")
# Rules left out (comma-separated names, e.g. "failed_forward,edited_file"): to bisect which rule a failure needs.
RULES_OFF = set(filter(None, os.environ.get("HYBRID_CACHE_FUZZ_OFF", "").split(",")))


MAX_LENGTH = 32  # tokens per row the steps stop at (about 10 windows): keeps one sequence within a second or two
ATTENTIONS = ("sdpa", "eager", "hybrid_cache_sdpa")
APPROXIMATE = ("int8", "int4", "sinks")
MODES = ("exact", "fixed", "int8", "int4", "sinks")
# Storage modes drawn (comma-separated subset of MODES), e.g. "exact,int8": to tell which mode a failure needs.
MODES = tuple(os.environ.get("HYBRID_CACHE_FUZZ_MODES", ",".join(MODES)).split(","))


class InjectedFailure(RuntimeError):
    """The error a patched `mlp.forward` raises once (an out-of-memory midway through a forward)."""


def cache_state(cache: HybridRingCache) -> list:
    """Every tensor (cloned) and plain value each layer keeps, recursively: what "nothing written" compares.

    A step a failed forward left half-written is, for every call, already undone (`get_seq_length` does not count it;
    the next call takes it back: `hybrid_cache.steps`): the state compared is that one, so it is settled first by a
    call that settles and writes nothing else (`memory_report`)."""
    with contextlib.suppress(IncompleteStepError):
        cache.memory_report()

    def walk(value, depth: int):
        if isinstance(value, torch.Tensor):
            return ("tensor", value.detach().clone())
        if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device)):
            return value
        if isinstance(value, (list, tuple)):
            return tuple(walk(item, depth) for item in value)
        if isinstance(value, dict):
            return {key: walk(item, depth) for key, item in value.items()}
        if depth < 3 and hasattr(value, "__dict__") and type(value).__name__ != "DequantWorkspace":
            return (type(value).__name__, walk(vars(value), depth + 1))
        if depth < 3 and hasattr(value, "_fields"):  # NamedTuple
            return walk(tuple(value), depth + 1)
        return type(value).__name__

    return [walk(vars(layer), 0) for layer in cache.layers]


def same_state(a, b) -> bool:
    if isinstance(a, tuple) and len(a) == 2 and a[0] == "tensor":
        return isinstance(b, tuple) and len(b) == 2 and b[0] == "tensor" and _same_tensor(a[1], b[1])
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    return a == b


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal, NaN where NaN (a fully padded row's attention gives NaN, which later layers store as keys)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def state_difference(before: list, after: list) -> str:
    """The first layer and attribute whose state differs (for the failure message)."""
    for index, (a, b) in enumerate(zip(before, after)):
        if not same_state(a, b):
            keys = [key for key in a if key not in b or not same_state(a[key], b[key])] if isinstance(a, dict) else []
            return f"layer {index}: {keys or 'structure'}"
    return "layer count" if len(before) != len(after) else "none"


def assert_nothing_written(before: list, cache: HybridRingCache, what: str) -> None:
    after = cache_state(cache)
    assert same_state(before, after), f"{what} was refused but changed the cache ({state_difference(before, after)})"


def build_model(family: str, window: int, attn: str, seed: int):
    if family == "gemma3":  # 3 sliding layers and a full one: duplicated or missing keys show in the full layer
        types = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
        return tiny_gemma3(window=window, layers=4, attn=attn, seed=seed, layer_types=types)
    return tiny_gemma4(window=window, layers=5, shared=2, attn=attn, seed=seed)


def cache_options(mode: str, window: int, margin: int, capacity: int) -> dict:
    options: dict = {"rollback_margin": margin}
    if mode == "fixed":
        options["max_cache_len"] = capacity
    elif mode in ("int8", "int4"):
        options["full_layer_quantization"] = mode
    elif mode == "sinks":
        options.update(full_layer_window=window + 1, full_layer_sink_tokens=2)
    return options


def mlp_modules(model) -> list[torch.nn.Module]:
    return [layer.mlp for layer in model.model.layers]


@dataclass
class Op:
    """One state-defining operation, replayed into the shadow cache: `("step", ids, mask, attention)`, `("crop", n)`,
    `("reorder", index)`, `("repeat", n)`, `("select", index)`, `("record",)` (past recording on, before a
    verification step)."""

    kind: str
    args: tuple = ()


@dataclass
class Checkpoint:
    checkpoint: object
    ids: torch.Tensor
    mask: torch.Tensor
    log: list = field(default_factory=list)


class CacheMachine(RuleBasedStateMachine):
    """See the module docstring. `family` is set by the subclass per model family."""

    family = "gemma3"

    sequences = 0  # sequences started in this process (printed with a planted regression: `PLANTS`)

    def __init__(self) -> None:
        super().__init__()
        CacheMachine.sequences += 1
        self.speculating = False  # past recording was turned on (`activate_past_recording`): verification steps
        # The last step was a multi-token one while recording, not cropped since: the next update ends recording.
        self.recorded_step_pending = False
        self._threads = one_torch_thread()
        self._threads.__enter__()
        self._grad = torch.no_grad()
        self._grad.__enter__()
        self._tmp = tempfile.TemporaryDirectory()
        self.file = Path(self._tmp.name) / "cache.safetensors"
        self.pending_failure_check = False
        self.shadow_logits: torch.Tensor | None = None

    def teardown(self) -> None:
        self._tmp.cleanup()
        self._grad.__exit__(None, None, None)
        self._threads.__exit__(None, None, None)

    # --- set-up ------------------------------------------------------------------------------------------------------
    @initialize(
        window=st.sampled_from([3, 4]),
        attn=st.sampled_from(["sdpa", "eager"]),
        mode=st.sampled_from(MODES),
        margin=st.sampled_from([0, 0, 1, 3]),
        capacity=st.integers(12, MAX_LENGTH + 4),
        seed=st.integers(0, 3),
        compiled=st.sampled_from([False, False, True]),
    )
    def start(self, window, attn, mode, margin, capacity, seed, compiled):
        self.window, self.mode = window, mode
        self.model = build_model(self.family, window, attn, seed)
        # Some exact and fixed sequences run every forward through `torch.compile(model)` (Dynamo's capture, eager
        # backend; nothing reset between sequences, so frames reach the recompile limit and fall back to eager).
        self.compiled = compiled and mode in ("exact", "fixed")
        self.compiled_model = torch.compile(self.model, backend="eager", dynamic=False) if self.compiled else None
        self.options = cache_options(mode, window, margin, capacity)
        self.cache = HybridRingCache(self.model.config, **self.options)
        self.shadow = HybridRingCache(self.model.config, **self.options) if mode in APPROXIMATE else None
        self.ids = torch.zeros(1, 0, dtype=torch.long)
        self.mask = torch.zeros(1, 0, dtype=torch.long)
        self.log: list[Op] = []
        self.saved_checkpoint: Checkpoint | None = None

    # --- helpers -----------------------------------------------------------------------------------------------------
    @property
    def length(self) -> int:
        return self.ids.shape[1]

    @property
    def batch(self) -> int:
        return self.ids.shape[0]

    def attention(self) -> str:
        return self.model.config._attn_implementation

    def forward(self, cache, ids, mask, attention: str | None = None):
        """One step of `ids` (the new tokens) with the 2D mask `mask` (every column so far), through `cache`."""
        if attention is not None and attention != self.attention():
            previous = self.attention()
            self.model.set_attn_implementation(attention)
            try:
                return self.forward(cache, ids, mask)
            finally:
                self.model.set_attn_implementation(previous)
        model = self.compiled_model if self.compiled_model is not None else self.model
        return model(input_ids=ids, attention_mask=mask, **cache_kwargs(cache), use_cache=True).logits

    def replay_shadow(self) -> None:
        """Rebuild the shadow from scratch: a fresh cache of the same mode given every logged operation, recording
        past as the cache now does (`sync_shadow_recording`)."""
        if self.shadow is None:
            return
        self.shadow = HybridRingCache(self.model.config, **self.options)
        for op in self.log:
            self.apply_to_shadow(op)
        self.sync_shadow_recording()

    def sync_shadow_recording(self) -> None:
        """Past recording is a mode of the cache, not of its tokens (restore, reset and copies keep it; a loaded
        cache starts without it): the shadow, rebuilt from the log of operations, takes the cache's mode."""
        if self.shadow is None:
            return
        if any(getattr(layer, "record_past", False) for layer in self.cache.layers):
            self.shadow.activate_past_recording()
        else:
            self.shadow.deactivate_past_recording()

    def apply_to_shadow(self, op: Op) -> None:
        if self.shadow is None:
            return
        if op.kind == "step":
            self.shadow_logits = self.forward(self.shadow, *op.args)
        elif op.kind == "crop":
            self.shadow.crop(-op.args[0])
        elif op.kind == "reorder":
            self.shadow.reorder_cache(op.args[0])
        elif op.kind == "repeat":
            self.shadow.batch_repeat_interleave(op.args[0])
        elif op.kind == "select":
            self.shadow.batch_select_indices(op.args[0])
        elif op.kind == "record":
            self.shadow.activate_past_recording()

    def record(self, op: Op) -> None:
        self.log.append(op)

    def new_tokens(self, rng: random.Random, batch: int, count: int) -> torch.Tensor:
        return torch.tensor([[rng.randrange(3, VOCAB) for _ in range(count)] for _ in range(batch)])

    def compare(self, got: torch.Tensor, expected: torch.Tensor, mask: torch.Tensor, what: str) -> None:
        real = mask[:, -got.shape[1] :].bool()
        assert not torch.isnan(got[real]).any(), f"{what}: NaN at a real token"
        difference = (got[real] - expected[real]).abs().max().item() if real.any() else 0.0
        assert difference <= TOLERANCE, f"{what}: max |logit difference| = {difference:.3g} > {TOLERANCE}"

    def step_fits(self, count: int) -> bool:
        capacity = self.options.get("max_cache_len")
        return capacity is None or self.length + count <= capacity

    # --- steps -------------------------------------------------------------------------------------------------------
    @precondition(lambda self: self.length < MAX_LENGTH)
    @rule(
        count=st.sampled_from(["one", "one", "below", "window", "above", "long"]),
        batch=st.integers(1, 3),
        pad=st.integers(0, 8),
        pass_mask=st.booleans(),
        seed=st.integers(0, 2**16),
    )
    def step(self, count, batch, pad, pass_mask, seed):
        """A prompt (a left-padded batch when the cache is empty), a chunk around the window, or a decode step. It
        ends speculation: a recorded step followed by another update turns past recording off (`activate_recording`
        starts it again)."""
        self.speculating = self.speculating and not self.recorded_step_pending
        rng = random.Random(seed)
        window = self.window
        count = {"one": 1, "below": max(window - 1, 1), "window": window, "above": window + 1, "long": 2 * window + 1}[
            count
        ]
        count = min(count, MAX_LENGTH - self.length)
        if self.length == 0:  # a new prompt: any batch size, the rows after the first left-padded
            new_ids = self.new_tokens(rng, batch, count)
            new_mask = torch.ones_like(new_ids)
            for row in range(1, batch):
                new_mask[row, : min(rng.randint(0, pad), count - 1)] = 0
            new_ids = new_ids.masked_fill(new_mask == 0, 0)
            self.ids, self.mask = new_ids[:, :0], new_mask[:, :0]
        else:
            new_ids = self.new_tokens(rng, self.batch, count)
            new_mask = torch.ones_like(new_ids)
        self.run_step(new_ids, new_mask, pass_mask or bool((self.mask == 0).any() or (new_mask == 0).any()))

    def run_step(self, new_ids: torch.Tensor, new_mask: torch.Tensor, pass_mask: bool, attention: str | None = None):
        full_ids = torch.cat([self.ids, new_ids], 1)
        full_mask = torch.cat([self.mask, new_mask], 1)
        mask = full_mask if pass_mask else None
        recovering, self.pending_failure_check = self.pending_failure_check, False
        before = cache_state(self.cache)
        if not self.step_fits(new_ids.shape[1]):
            # A compiled one-token step checks inside its graph: a RuntimeError naming max_cache_len.
            refusal = (CacheCapacityError, RuntimeError) if self.compiled else CacheCapacityError
            with pytest.raises(refusal, match="max_cache_len"):
                self.forward(self.cache, new_ids, mask, attention)
            assert_nothing_written(before, self.cache, "a step beyond max_cache_len")
            return
        got = self.forward(self.cache, new_ids, mask, attention)  # after a failed forward too: it was undone
        op = Op("step", (new_ids, mask, attention or self.attention()))
        self.recorded_step_pending = self.speculating and new_ids.shape[1] > 1
        if self.shadow is not None:
            self.apply_to_shadow(op)
            expected = self.shadow_logits
        else:
            expected = no_cache_logits(self.model, full_ids, full_mask)[:, -new_ids.shape[1] :]
        self.record(op)
        self.ids, self.mask = full_ids, full_mask
        what = f"step of {new_ids.shape[1]} at length {self.length - new_ids.shape[1]}"
        self.compare(got, expected, full_mask, what + (" (after a failed forward)" if recovering else ""))

    # --- rollback and batch operations -------------------------------------------------------------------------------
    @precondition(lambda self: self.length > 1)
    @rule(tokens=st.integers(1, 6))
    def crop(self, tokens):
        tokens = min(tokens, self.length - 1)
        before = cache_state(self.cache)
        try:
            self.cache.crop(-tokens)
        except RollbackError:
            assert_nothing_written(before, self.cache, f"crop(-{tokens})")
            return
        op = Op("crop", (tokens,))
        self.recorded_step_pending = False  # a crop resolves the last step
        self.apply_to_shadow(op)
        self.record(op)
        self.ids, self.mask = self.ids[:, :-tokens], self.mask[:, :-tokens]
        assert self.cache.get_seq_length() == self.length

    @precondition(lambda self: self.length > 0)
    @rule(rows=st.lists(st.integers(0, 5), min_size=4, max_size=4))
    def reorder(self, rows):
        """A beam reorder: each row replaced by any row (repeats allowed)."""
        index = torch.tensor([row % self.batch for row in rows[: self.batch]])
        self.cache.reorder_cache(index)
        self.batch_changed(Op("reorder", (index,)), index)

    @precondition(lambda self: self.length > 0 and self.batch <= 2)
    @rule(repeats=st.sampled_from([2]))
    def repeat(self, repeats):
        self.cache.batch_repeat_interleave(repeats)
        self.batch_changed(Op("repeat", (repeats,)), torch.arange(self.batch).repeat_interleave(repeats))

    @precondition(lambda self: self.length > 0 and self.batch > 1)
    @rule(keep=st.lists(st.booleans(), min_size=4, max_size=4))
    def select(self, keep):
        index = torch.tensor([row for row in range(self.batch) if keep[row]] or [self.batch - 1])
        self.cache.batch_select_indices(index)
        self.batch_changed(Op("select", (index,)), index)

    def batch_changed(self, op: Op, rows: torch.Tensor) -> None:
        self.recorded_step_pending = False  # a batch change drops what undoes the last step
        self.apply_to_shadow(op)
        self.record(op)
        self.ids, self.mask = self.ids[rows], self.mask[rows]

    # --- copies, files, snapshots, reset -----------------------------------------------------------------------------
    @precondition(lambda self: 0 < self.length < MAX_LENGTH and not self.pending_failure_check)
    @rule(keep_copy=st.booleans(), seed=st.integers(0, 2**16))
    def deepcopy(self, keep_copy, seed):
        """A deep copy continues as the original would; the original is left untouched by it."""
        if not self.step_fits(1):  # a full fixed-capacity cache: the copy's step would be refused
            return
        original, before = self.cache, cache_state(self.cache)
        self.cache = copy.deepcopy(original)
        self.speculating = self.speculating and not self.recorded_step_pending  # the step below (see `step`)
        self.run_step(
            self.new_tokens(random.Random(seed), self.batch, 1), torch.ones(self.batch, 1, dtype=torch.long), True
        )
        assert same_state(before, cache_state(original)), "a step on a deep copy changed the original"
        if not keep_copy:  # back to the original: undo the step on the books
            self.cache = original
            self.ids, self.mask = self.ids[:, :-1], self.mask[:, :-1]
            self.log.pop()
            self.replay_shadow()

    @precondition(lambda self: self.length > 0)
    @rule()
    def save_and_load(self):
        self.cache.save(self.file)
        self.cache = HybridRingCache.load(self.file, self.model.config)
        self.speculating = False  # a loaded cache is a new one: past recording off
        self.sync_shadow_recording()
        assert self.cache.get_seq_length() == self.length

    @precondition(lambda self: 0 < self.length < MAX_LENGTH)
    @rule(
        edit=st.sampled_from(["header_digit", "header", "anywhere"]),
        where=st.integers(0, 10**9),
        byte=st.sampled_from([*b'0123456789"{}:, aezft', None]),
        seed=st.integers(0, 2**16),
    )
    def edited_file(self, edit, where, byte, seed):
        """A saved file with one byte changed is refused at load, or loads into a cache that continues exactly as the
        unedited file's does (damage in unused capacity is harmless); an error at the first step after the load is
        damage the load missed. `edit`: `header_digit`, one digit of the JSON header (a counter, a setting, a shape, an
        offset, a checksum) changed to the next digit, so the header stays valid JSON; `header` / `anywhere`: any
        byte of the header / file set to `byte` (`None`: its lowest bit flipped)."""
        if not self.step_fits(1):  # a full fixed-capacity cache: the step that checks the loaded file would not fit
            return
        self.cache.save(self.file)
        raw = bytearray(self.file.read_bytes())
        header = int.from_bytes(raw[:8], "little") + 8
        if edit == "header_digit":
            digits = [index for index in range(8, header) if chr(raw[index]).isdigit()]
            position = digits[where % len(digits)]
            raw[position] = ord("0") + (raw[position] - ord("0") + 1) % 10
        else:
            position = 8 + where % (header - 8) if edit == "header" else where % len(raw)
            raw[position] = raw[position] ^ 1 if byte is None else byte
        edited = Path(self._tmp.name) / "edited.safetensors"
        edited.write_bytes(bytes(raw))
        original = self.file.read_bytes()[max(8, position - 30) : position + 10]
        edited_bytes = bytes(raw[max(8, position - 30) : position + 10])
        where = f"byte {position} of {len(raw)} (header: {header} bytes; {original!r} -> {edited_bytes!r})"
        try:
            loaded = HybridRingCache.load(edited, self.model.config)
        except (HybridCacheError, ValueError, OSError):
            return
        intact = HybridRingCache.load(self.file, self.model.config)
        assert loaded.get_seq_length() == intact.get_seq_length(), f"{where}: another length"
        new_ids = self.new_tokens(random.Random(seed), self.batch, 1)
        mask = torch.cat([self.mask, torch.ones_like(new_ids)], 1)
        expected = self.forward(intact, new_ids, mask)
        got = self.forward(loaded, new_ids, mask)  # damage found only now (an error here) is damage missed at load
        assert torch.equal(got, expected), (
            f"a file edited at {where} loaded without error and continues "
            f"{(got - expected).abs().max().item():.3g} off the unedited file"
        )

    @precondition(lambda self: self.length > 0)
    @rule()
    def take_checkpoint(self):
        self.saved_checkpoint = Checkpoint(self.cache.checkpoint(), self.ids, self.mask, list(self.log))

    @precondition(lambda self: self.saved_checkpoint is not None)
    @rule(speculate=st.booleans(), draft=st.integers(2, 6), kept=st.integers(0, 5), seed=st.integers(0, 2**16))
    def restore(self, speculate, draft, kept, seed):
        """`restore(checkpoint)`; while speculating, optionally the verification step a speculative decoder runs next
        (restore keeps past recording on: its crop must be exact)."""
        saved = self.saved_checkpoint
        before = cache_state(self.cache)
        try:
            self.cache.restore(saved.checkpoint)
        except ValueError as error:  # documented refusals: another batch size, full layers rewritten below it
            assert isinstance(error, HybridCacheError) or "restore" in str(error) or "checkpoint" in str(error)
            assert_nothing_written(before, self.cache, "restore")
            return
        self.ids, self.mask, self.log = saved.ids, saved.mask, list(saved.log)
        self.recorded_step_pending = False  # a restored state has no last step to undo
        self.replay_shadow()
        assert self.cache.get_seq_length() == self.length
        if speculate and self.speculating and 0 < self.length < MAX_LENGTH - 1:
            self.verification_step(draft, kept, seed)

    @rule()
    def reset(self):
        self.do_reset()

    def do_reset(self) -> None:
        self.recorded_step_pending = False
        self.cache.reset()
        self.ids, self.mask = self.ids[:1, :0], self.mask[:1, :0]
        self.log.clear()
        self.replay_shadow()  # a fresh cache of the mode: what the reset one must behave as

    # --- failures, attention, prepared masks -------------------------------------------------------------------------
    def new_step_ids(self, seed: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`count` new tokens for every row, and the 2D mask of the whole sequence after them."""
        new_ids = self.new_tokens(random.Random(seed), self.batch, count)
        return new_ids, torch.cat([self.mask, torch.ones_like(new_ids)], 1)

    @precondition(lambda self: self.length < MAX_LENGTH and not self.pending_failure_check and not self.compiled)
    @rule(layer=st.integers(0, 4), count=st.sampled_from([1, 2, 5, 9]), seed=st.integers(0, 2**16))
    def failed_forward(self, layer, count, seed):
        """A forward that raises in layer `layer`'s MLP (after the earlier layers stored the step; on an empty cache
        too): the cache reports the length before it, and the next step (the retry) must be exact."""
        count = min(count, MAX_LENGTH - self.length)
        # A layer before the last storing one: a failure after the last storing layer stored the step keeps it, the
        # documented limit no cache can see (rule `failure_after_the_last_storing_layer`).
        last_storing = max(i for i, spec in enumerate(self.cache.specs) if spec.stores)
        if last_storing == 0:
            return
        module = mlp_modules(self.model)[layer % last_storing]

        def raise_once(*args, **kwargs):
            del module.forward
            raise InjectedFailure("injected failure in an MLP")

        module.forward = raise_once
        new_ids, mask = self.new_step_ids(seed, count)
        try:
            with pytest.raises((InjectedFailure, CacheCapacityError)):
                self.forward(self.cache, new_ids, mask)
        finally:
            module.__dict__.pop("forward", None)
        self.cache.memory_report()  # settles: the failed step is undone (never `IncompleteStepError`)
        assert self.cache.get_seq_length() == self.length
        self.pending_failure_check = True

    @precondition(lambda self: self.length < MAX_LENGTH and not self.pending_failure_check and not self.compiled)
    @rule(
        count=st.sampled_from([1, 1, 2, 5, 9]), where=st.sampled_from(["norm", "lm_head"]), seed=st.integers(0, 2**16)
    )
    def failure_after_the_last_storing_layer(self, count, where, seed):
        """A forward that raises after its last storing layer stored the step (the final norm, the output layer: an
        out-of-memory in the logits) leaves the step stored, as every cache does; `crop(-count)` takes it back
        exactly, whatever its length, and the next step continues as if it had never run."""
        count = min(count, MAX_LENGTH - self.length)
        if not self.step_fits(count):
            return
        module = self.model.model.norm if where == "norm" else self.model.lm_head

        def raise_once(*args, **kwargs):
            del module.forward
            raise InjectedFailure(f"injected failure in {where}")

        module.forward = raise_once
        new_ids, mask = self.new_step_ids(seed, count)
        try:
            with pytest.raises(InjectedFailure):
                self.forward(self.cache, new_ids, mask)
        finally:
            module.__dict__.pop("forward", None)
        assert self.cache.get_seq_length() == self.length + count  # complete: kept, as in DynamicCache
        self.cache.crop(-count)  # never refused: the last step's record undoes it
        self.recorded_step_pending = False
        assert self.cache.get_seq_length() == self.length

    # --- speculative decoding ------------------------------------------------------------------------------------
    @precondition(lambda self: rollback_supported())
    @rule()
    def activate_recording(self):
        """`activate_past_recording()`, as assisted / prompt-lookup decoding calls it once per `generate`."""
        self.cache.activate_past_recording()
        self.speculating, self.recorded_step_pending = True, False
        self.record(Op("record"))  # the shadow records too: its crops must be the same
        self.apply_to_shadow(Op("record"))

    @precondition(
        lambda self: self.speculating and not self.recorded_step_pending and 0 < self.length < MAX_LENGTH - 1
    )
    @rule(draft=st.integers(2, 6), kept=st.integers(0, 5), seed=st.integers(0, 2**16))
    def verification_step(self, draft, kept, seed):
        """A verification step of `draft` tokens, then `crop` of the rejected ones (all but `kept`): always exact while
        past recording is on (assisted decoding), which `reset`, `restore`, copies and failed forwards keep on."""
        draft = min(draft, MAX_LENGTH - self.length)
        kept = min(kept, draft - 1)
        if not self.step_fits(draft):
            return
        self.record(Op("record"))
        self.apply_to_shadow(Op("record"))
        new_ids, _ = self.new_step_ids(seed, draft)
        self.run_step(new_ids, torch.ones_like(new_ids), True)
        rejected = draft - kept
        self.cache.crop(-rejected)  # never refused while recording
        self.recorded_step_pending = False
        op = Op("crop", (rejected,))
        self.apply_to_shadow(op)
        self.record(op)
        self.ids, self.mask = self.ids[:, :-rejected], self.mask[:, :-rejected]
        assert self.cache.get_seq_length() == self.length

    @precondition(lambda self: self.length > 0)
    @rule()
    def key_positions(self):
        """`key_positions(layer)` answers for every storing layer (compressed and bounded ones too): one position per
        key the last step returned, each held position once."""
        for index, spec in enumerate(self.cache.specs):
            if spec.stores:
                positions = self.cache.key_positions(index)
                held = positions[positions >= 0]
                assert positions.ndim == 1 and held.unique().numel() == held.numel(), (index, positions)

    @rule(attention=st.sampled_from(ATTENTIONS))
    def switch_attention(self, attention):
        self.model.set_attn_implementation(attention)

    @precondition(lambda self: self.length > 0 and self.length < MAX_LENGTH and not self.compiled)
    @rule(query=st.integers(1, 3), off_by=st.sampled_from([-1, 1]))
    def prepared_mask_of_the_wrong_width(self, query, off_by):
        """A prepared 4D mask whose key width is not what the cache returns is refused, nothing written."""
        query = min(query, MAX_LENGTH - self.length)
        if not self.step_fits(query):
            return
        width = self.returned_width(query) + off_by
        mask = torch.ones(self.batch, 1, query, max(width, 1), dtype=torch.bool)
        new_ids = self.new_tokens(random.Random(query), self.batch, query)
        before = cache_state(self.cache)
        with pytest.raises(HybridCacheError):
            self.model(input_ids=new_ids, attention_mask=mask, **cache_kwargs(self.cache), use_cache=True)
        assert_nothing_written(before, self.cache, f"a prepared 4D mask {width} keys wide")

    def returned_width(self, query: int) -> int:
        """The key width the first storing layer returns for a step of `query` tokens (`get_mask_sizes`)."""
        kv_length, _ = self.cache.layers[0].get_mask_sizes(query)
        return int(kv_length)

    # --- invariants --------------------------------------------------------------------------------------------------
    @invariant()
    def length_is_consistent(self):
        if hasattr(self, "cache") and not self.pending_failure_check:
            assert self.cache.get_seq_length() == self.length, (self.cache.get_seq_length(), self.length)


# --- planted regressions ------------------------------------------------------------------------------------------
def _plant_reset_keeps_assisted_check() -> None:
    """Fix 1 undone: `reset()` leaves the assisted-start check of `activate_past_recording` behind."""
    from hybrid_cache.steps import StepAdmission

    original = StepAdmission.forget

    def forget(self, held_tokens=None):
        pending = self.assisted_start
        original(self, held_tokens)
        self.assisted_start = self.assisted_start or pending

    StepAdmission.forget = forget


def _plant_restore_stops_recording() -> None:
    """Fix 2 undone: restoring a layer's state (`restore`, through `reset`) turns past recording off."""
    from hybrid_cache.ring import UndoableStepLayer

    original = UndoableStepLayer.reset

    def reset(self):
        original(self)
        self.record_past = False

    UndoableStepLayer.reset = reset


def _plant_no_key_positions_for_compressed_layers() -> None:
    """Fix 3 undone: compressed full layers have no `key_positions`."""
    from hybrid_cache.quantized import QuantizedFullLayer

    def key_positions(self):
        raise AttributeError("'QuantizedFullLayer' object has no attribute 'key_positions'")

    QuantizedFullLayer.key_positions = key_positions


def _plant_no_undo_into_an_empty_layer() -> None:
    """Fix 4 undone: a step into an empty ring keeps no record (a prompt longer than the window that failed midway
    cannot be undone)."""
    from hybrid_cache.ring import UndoableStepLayer

    original = UndoableStepLayer._keep_overwritten

    def keep(self, runs, query_length):
        original(self, runs, query_length)
        if self._undo.length == 0:
            self._undo = None

    UndoableStepLayer._keep_overwritten = keep


def _plant_no_undo_of_multi_token_steps() -> None:
    """Fix 5 undone: a multi-token step that overwrote held slots keeps no record (`crop(-n)` of it refused)."""
    from hybrid_cache.ring import UndoableStepLayer

    original = UndoableStepLayer._keep_overwritten

    def keep(self, runs, query_length):
        original(self, runs, query_length)
        if query_length > 1 and self._undo.length > 0:
            self._undo = None

    UndoableStepLayer._keep_overwritten = keep


def _plant_compiled_steps_mixed_with_eager_ones() -> None:
    """Issue 42: every cache call of a compiled forward ran inside the graph being traced (Dynamo then ran some of a
    forward's layers eagerly and others traced, around the ring's graph breaks), and the step journal judged a step by
    the layers it saw store it (a step whose other layers stored it in a graph looked dead and was "undone")."""
    from hybrid_cache import cache as cache_module
    from hybrid_cache import steps as steps_module

    cache_module._in_graph = lambda layer, query_length: True
    steps_module.behind_first_layer = lambda layers, storing, layer_idx: False

    def is_open(self, layers):
        return bool(self.written) and (self.failed or not self.complete)

    def settle(self, layers):
        if self.broken is not None:
            raise IncompleteStepError(self.broken)
        if not self.is_open(layers):
            return
        for index in self.written:
            layers[index].crop(-self.query_length)
            if self._previous.get(index) is not None:
                layers[index].restore_step_bookkeeping(self._previous[index])
        self.written, self.failed, self._previous = [], False, {}

    steps_module.StepJournal.is_open = is_open
    steps_module.StepJournal.settle = settle


PLANTS = {
    "compiled_steps_mixed_with_eager_ones": _plant_compiled_steps_mixed_with_eager_ones,
    "reset_keeps_assisted_check": _plant_reset_keeps_assisted_check,
    "restore_stops_recording": _plant_restore_stops_recording,
    "no_key_positions_for_compressed_layers": _plant_no_key_positions_for_compressed_layers,
    "no_undo_into_an_empty_layer": _plant_no_undo_into_an_empty_layer,
    "no_undo_of_multi_token_steps": _plant_no_undo_of_multi_token_steps,
}
PLANT = os.environ.get("HYBRID_CACHE_FUZZ_PLANT")
if PLANT:
    if PLANT not in PLANTS:
        raise ValueError(f"HYBRID_CACHE_FUZZ_PLANT={PLANT!r} is none of {sorted(PLANTS)}")
    PLANTS[PLANT]()


@pytest.fixture(autouse=True)
def _report_sequences():
    """With a planted regression: how many sequences ran until the fuzzer failed (or passed without finding it)."""
    CacheMachine.sequences = 0
    yield
    if PLANT:
        print(f"\n[fuzz] planted {PLANT}: {CacheMachine.sequences} sequences run")


def _settings(examples: int) -> settings:
    # With a planted regression, no shrinking: the sequences counted are those run until the first failure.
    phases = (Phase.explicit, Phase.generate) if PLANT else tuple(Phase)
    return settings(
        phases=phases,
        max_examples=examples,
        stateful_step_count=FUZZ_STEPS,
        deadline=None,
        derandomize=FUZZ_SEED is None,
        database=None,
        suppress_health_check=list(HealthCheck),
        print_blob=False,
        report_multiple_bugs=False,
    )


class Gemma3Machine(CacheMachine):
    family = "gemma3"


class Gemma4Machine(CacheMachine):
    family = "gemma4"


def _leave_out(machine: type[CacheMachine], name: str) -> None:
    """Hide the rule `name` from `machine` (a plain method is no rule), instead of a precondition that is never met:
    hypothesis would still draw the rule and retry."""
    if not callable(getattr(CacheMachine, name, None)) or name.startswith("_"):
        raise ValueError(f"HYBRID_CACHE_FUZZ_OFF names {name!r}, which is no rule of the fuzzer")
    setattr(machine, name, lambda self, **kwargs: None)


for _name in RULES_OFF:
    _leave_out(Gemma3Machine, _name)
    _leave_out(Gemma4Machine, _name)


TestGemma3Fuzz = Gemma3Machine.TestCase
TestGemma3Fuzz.settings = _settings(FUZZ_EXAMPLES)
TestGemma4Fuzz = Gemma4Machine.TestCase
TestGemma4Fuzz.settings = _settings(FUZZ_EXAMPLES)
if FUZZ_SEED is not None:
    TestGemma3Fuzz = hypothesis.seed(int(FUZZ_SEED))(TestGemma3Fuzz)
    TestGemma4Fuzz = hypothesis.seed(int(FUZZ_SEED))(TestGemma4Fuzz)
