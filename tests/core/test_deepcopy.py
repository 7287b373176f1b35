"""A deep copy of a cache is an independent branch: copy a prefix cache and continue two ways, each exact."""

from __future__ import annotations

import copy

import torch
from builders import VOCAB, chunked_logits, no_cache_logits, tiny_gemma3

from hybrid_cache import HybridRingCache


def test_deepcopy_prefix_cache():
    """Trap 7: copy a prefix cache (after the wrap) and continue two ways; each equals the oracle."""
    model = tiny_gemma3(window=3)
    prefix = torch.randint(3, VOCAB, (1, 9), generator=torch.Generator().manual_seed(4))
    cache = HybridRingCache(model.config)
    chunked_logits(model, cache, prefix, [9])
    for seed in (5, 6):
        suffix = torch.randint(3, VOCAB, (1, 5), generator=torch.Generator().manual_seed(seed))
        branch = copy.deepcopy(cache)
        got = chunked_logits(model, branch, suffix, [2, 1, 2])
        expected = no_cache_logits(model, torch.cat([prefix, suffix], 1))[:, 9:]
        assert (got - expected).abs().max() < 1e-4
    assert cache.get_seq_length() == 9
