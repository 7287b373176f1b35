"""torch.compile: every step a compiled model takes with the cache is exact, whatever its length, whatever Dynamo
compiled before in the process, whichever of the model's frames it compiles and which it runs eagerly.

The properties (against the no-cache forward, fp32, `builders.TOLERANCE`), over random windows, prompt lengths and
step schedules (one-token steps, chunks shorter and longer than the window, before and after the wrap), for tiny
Gemma 3 and Gemma 4 (KV-shared layers, two head sizes), through `torch.compile(model)` with the `eager` backend
(Dynamo's own graph capture: where the bug of issue 42 lived) and, in one case, inductor:

- the fixed mode (`max_cache_len`): every step exact; one-token steps compile into one graph (tests/core/test_compile.py);
- the growing mode: every step exact (its steps run outside the graph, with their eager checks);
- several models compiled in one process, without `torch._dynamo.reset()` in between, and with Dynamo's recompile
  limit reached, so that some of the model's frames run eagerly while others run their compiled graphs: the
  mixture that once returned wrong logits;
- what a compiled step refuses (a step beyond `max_cache_len`, a cache a failed forward left half-written) raises
  before it writes anything.

`transformers.StaticCache` under the same compiled model is the peer these match (exact); it is not run here, the
no-cache forward is the oracle.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch
import torch._dynamo
from builders import TOLERANCE, VOCAB, no_cache_logits, one_torch_thread, tiny_gemma3, tiny_gemma4

from hybrid_cache import HybridRingCache, cache_kwargs
from hybrid_cache.errors import CacheCapacityError, IncompleteStepError

# Minutes of compiling (Dynamo traces dozens of tiny models): the whole suite runs it on the project's release
# (setup.cfg's `slow` marker); the quick suite on older releases runs tests/core/test_compile.py.
pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    with one_torch_thread(), torch.no_grad():
        yield


def build(family: str, window: int, seed: int):
    if family == "gemma3":  # sliding layers on both sides of a full one
        types = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
        return tiny_gemma3(window=window, layers=4, seed=seed, layer_types=types)
    return tiny_gemma4(window=window, layers=5, shared=2, seed=seed)


def schedule(rng: random.Random, window: int, total: int) -> list[int]:
    """Step lengths summing to `total`: a prompt, then decode steps and chunks shorter than, equal to and longer than
    the window (some of them long after the wrap)."""
    steps = [rng.choice([1, rng.randint(1, window), rng.randint(window + 1, 4 * window + 2)])]
    while sum(steps) < total:
        steps.append(rng.choice([1, 1, 1, max(window - 1, 1), window, window + 1, 2 * window + 1, 3 * window + 2]))
    steps[-1] -= sum(steps) - total
    return [step for step in steps if step > 0]


def run_schedule(forward, model, cache, ids: torch.Tensor, steps: list[int], label: str) -> None:
    """Feed `ids` through `forward` in `steps`, each step's logits checked against the no-cache forward."""
    expected = no_cache_logits(model, ids)
    start = 0
    for count in steps:
        got = forward(input_ids=ids[:, start : start + count], **cache_kwargs(cache), use_cache=True).logits
        difference = (got - expected[:, start : start + count]).abs().max().item()
        assert difference <= TOLERANCE, (
            f"{label}: step of {count} at {start} (schedule {steps}): max |logit difference| {difference:.3g}"
        )
        start += count
    assert int(cache.get_seq_length()) == start


def random_case(seed: int) -> tuple[str, int, torch.Tensor, list[int]]:
    rng = random.Random(seed)
    family, window = rng.choice(["gemma3", "gemma4"]), rng.randint(1, 9)
    total = rng.randint(2 * window + 2, 6 * window + 12)
    ids = torch.randint(3, VOCAB, (1, total), generator=torch.Generator().manual_seed(seed))
    return family, window, ids, schedule(rng, window, total)


# --- fixed and growing mode, several models compiled in one process ------------------------------------------------
@pytest.mark.parametrize("mode", ["fixed", "growing"])
def test_compiled_steps_of_any_length_are_exact(mode):
    """Random windows, prompts and schedules, twelve models in one process (Gemma 3 and Gemma 4 mixed), nothing reset
    between them: each compiled model's every step equals the no-cache forward."""
    torch._dynamo.reset()
    for seed in range(12):
        family, window, ids, steps = random_case(100 * seed + (mode == "growing"))
        model = build(family, window, seed)
        options = {"max_cache_len": ids.shape[1] + seed % 3} if mode == "fixed" else {}
        compiled = torch.compile(model, backend="eager", dynamic=False)
        label = f"{mode} {family} window {window} seed {seed}"
        run_schedule(compiled, model, HybridRingCache(model.config, **options), ids, steps, label)


def test_compiled_steps_are_exact_past_the_recompile_limit():
    """With Dynamo's recompile limit at 2, the model's frames fall back to eager one after the other while others
    keep running their compiled graphs (the mask creation eager and the layers compiled, or the reverse): every
    step stays exact, in both modes, Gemma 3 then Gemma 4 in one process."""
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=2):
        _exact_past_the_recompile_limit()


def _exact_past_the_recompile_limit() -> None:
    for seed, (family, mode) in enumerate([("gemma3", "fixed"), ("gemma4", "growing"), ("gemma4", "fixed")]):
        rng = random.Random(seed)
        window = rng.randint(2, 6)
        total = 8 * window + 16
        ids = torch.randint(3, VOCAB, (1, total), generator=torch.Generator().manual_seed(seed))
        steps = [3 * window + 1, 1, 1, window + 2, 1, 1, 1, 2 * window + 1, 1, 1]
        steps.append(total - sum(steps))
        model = build(family, window, seed)
        options = {"max_cache_len": total} if mode == "fixed" else {}
        compiled = torch.compile(model, backend="eager", dynamic=False)
        run_schedule(compiled, model, HybridRingCache(model.config, **options), ids, steps, f"{family} {mode}")


def test_the_reported_case_with_inductor():
    """Issue 42's report: a 700-token prompt, a 600-token step and a decode token, window 7, inductor, fixed mode
    (0.118 and 0.041 off before the fix; transformers' StaticCache was exact)."""
    torch._dynamo.reset()
    model = tiny_gemma3(window=7, layers=6, seed=41)
    ids = torch.randint(3, VOCAB, (1, 1301), generator=torch.Generator().manual_seed(1))
    compiled = torch.compile(model, dynamic=False)
    cache = HybridRingCache(model.config, max_cache_len=1400)
    run_schedule(compiled, model, cache, ids, [700, 600, 1], "inductor, fixed")


# --- refusals inside a compiled step -------------------------------------------------------------------------------
def states(cache: HybridRingCache) -> list[torch.Tensor]:
    return [tensor.clone() for layer in cache.layers for tensor in layer.storage_tensors()]


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_a_compiled_step_beyond_max_cache_len_writes_nothing(backend):
    """The capacity check of a compiled one-token step is a graph op ordered before every write: the step raises
    (naming max_cache_len with the eager backend; inductor reports the index it guards) and the cache is unchanged,
    so that crop and continuing stay exact."""
    torch._dynamo.reset()
    window, capacity = 3, 10
    model = build("gemma3", window, 0)
    ids = torch.randint(3, VOCAB, (1, capacity + 1), generator=torch.Generator().manual_seed(0))
    cache = HybridRingCache(model.config, max_cache_len=capacity)
    compiled = torch.compile(model, backend=backend, dynamic=False)
    run_schedule(compiled, model, cache, ids[:, :capacity], [capacity - 2, 1, 1], "up to capacity")
    before = states(cache)
    with pytest.raises(RuntimeError, match="max_cache_len" if backend == "eager" else "max_cache_len|index"):
        compiled(input_ids=ids[:, capacity:], **cache_kwargs(cache), use_cache=True)
    assert all(torch.equal(a, b) for a, b in zip(before, states(cache))), "the refused step wrote"
    with pytest.raises(CacheCapacityError):  # a multi-token step leaves the graph: the eager check, same rule
        compiled(input_ids=ids[:, capacity - 1 :], **cache_kwargs(cache), use_cache=True)
    cache.crop(-1)  # the ring still reaches one token back: the last token again is exact
    expected = no_cache_logits(model, ids[:, :capacity])[:, -1]
    got = compiled(input_ids=ids[:, capacity - 1 : capacity], **cache_kwargs(cache), use_cache=True).logits[:, -1]
    assert (got - expected).abs().max().item() <= TOLERANCE


def test_a_compiled_step_after_a_half_written_one_is_refused(monkeypatch):
    """A forward that fails inside a compiled decode step after some layers stored it (an op of the graph failing at
    run time, as an out-of-memory would) leaves layers of different lengths, which no compiled step keeps a record to
    undo: the next compiled step refuses before writing anything, an eager call refuses with `IncompleteStepError`,
    and `reset` starts over exactly."""
    torch._dynamo.reset()
    window = 3
    model = build("gemma3", window, 0)
    ids = torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
    cache = HybridRingCache(model.config, max_cache_len=16)
    compiled = torch.compile(model, backend="eager", dynamic=False)
    run_schedule(compiled, model, cache, ids[:, :8], [7, 1], "before the failure")
    mlp = model.model.layers[2].mlp  # after the full layer (1) and the ring (2) stored the step
    healthy = mlp.forward

    def fail_at_run_time(hidden_states):  # traced into the graph; fails when the graph runs
        torch._assert_async(hidden_states.isnan().all(), "injected failure")
        return healthy(hidden_states)

    monkeypatch.setattr(mlp, "forward", fail_at_run_time)
    with pytest.raises(RuntimeError, match="injected failure"):
        compiled(input_ids=ids[:, 8:9], **cache_kwargs(cache), use_cache=True)
    monkeypatch.undo()
    assert len({int(layer.get_seq_length()) for layer in cache.layers}) > 1, "no layer stored the failed step"
    before = states(cache)
    with pytest.raises(RuntimeError, match="different numbers of tokens"):
        compiled(input_ids=ids[:, 8:9], **cache_kwargs(cache), use_cache=True)
    assert all(torch.equal(a, b) for a, b in zip(before, states(cache))), "the refused step wrote"
    with pytest.raises(IncompleteStepError):
        cache.crop(-1)
    cache.reset()
    run_schedule(compiled, model, cache, ids, [5, 1, 4, 1, 1], "after reset")
