"""torch.compile: with a fixed full-layer capacity the cache is compileable; a compiled decode step gives the eager
tokens and compiles once (no recompilation per step or per ring wrap: counters live in tensors, trap 8)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from builders import MODEL_BUILDERS, VOCAB
from torch._dynamo.testing import CompileCounterWithBackend

from hybrid_cache import HybridRingCache
from hybrid_cache.compat import cache_kwargs


def greedy_decode(model, cache, prompt: torch.Tensor, forward, steps: int) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=prompt, **cache_kwargs(cache)).logits  # prefill: eager, as in `generate`
        token = logits[:, -1:].argmax(-1)
        tokens = [token]
        for step in range(steps):
            position_ids = torch.full((prompt.shape[0], 1), prompt.shape[1] + step)
            logits = forward(input_ids=token, **cache_kwargs(cache), position_ids=position_ids, use_cache=True).logits
            token = logits[:, -1:].argmax(-1)
            tokens.append(token)
    return torch.cat(tokens, 1)


def test_dynamic_cache_is_not_compileable_but_fixed_is():
    model = MODEL_BUILDERS["gemma3"](window=4)
    assert not HybridRingCache(model.config).is_compileable
    assert HybridRingCache(model.config, max_cache_len=32).is_compileable


@pytest.mark.parametrize("model_name", ["gemma3", "gemma4"])
def test_compiled_decode_matches_eager_without_recompiling(model_name):
    window, steps = 4, 5 * 4  # five wraps of the ring
    model = MODEL_BUILDERS[model_name](window=window)
    prompt = torch.randint(3, VOCAB, (2, 2 * window + 1), generator=torch.Generator().manual_seed(0))
    eager = greedy_decode(model, HybridRingCache(model.config, max_cache_len=64), prompt, model.forward, steps)

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("eager")  # dynamo's own graph capture; the backend does not matter here
    compiled_forward = torch.compile(model.forward, backend=counter, fullgraph=True)
    cache = HybridRingCache(model.config, max_cache_len=64)
    compiled = greedy_decode(model, cache, prompt, compiled_forward, steps)
    assert torch.equal(eager, compiled)
    assert counter.frame_count == 1, f"recompiled: {counter.frame_count} graphs for {steps} decode steps"
    assert cache.get_seq_length() == prompt.shape[1] + steps
