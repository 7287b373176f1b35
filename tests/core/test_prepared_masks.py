"""A prepared 4D attention mask is refused after the wrap (even after an exact crop), with the cache unchanged."""

from __future__ import annotations

import pytest
import torch
from builders import assert_close, assert_unchanged, chunked_logits, no_cache_logits, snapshot, tiny_gemma3, tokens

from hybrid_cache import HybridRingCache
from hybrid_cache.compat import cache_kwargs


def test_prepared_4d_mask_refused_after_crop():
    model = tiny_gemma3(window=3)
    cache = HybridRingCache(model.config)
    ids = tokens(9)
    chunked_logits(model, cache, ids[:, :7], [6, 1])  # the last step was a wrapped one-token step
    cache.crop(-1)  # exact: back to before that step
    before = snapshot(cache)
    # A mask as wide as the keys the ring returns (3): refused as a layout no mask was built for; one 7 keys wide
    # (all the tokens): refused first on its width. Neither writes anything.
    for width, message in ((3, "4D attention mask"), (7, "7 keys wide, but HybridRingCache returns 3 keys")):
        mask_4d = torch.ones(1, 1, 1, width, dtype=torch.bool)
        with pytest.raises(RuntimeError, match=message), torch.no_grad():
            model(input_ids=ids[:, 6:7], attention_mask=mask_4d, **cache_kwargs(cache))
        assert_unchanged(before, cache)
    assert_close(chunked_logits(model, cache, ids[:, 6:], [1, 1, 1]), no_cache_logits(model, ids)[:, 6:], "resume")
