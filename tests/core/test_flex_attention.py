"""`attn_implementation="flex_attention"`: the hook evaluates the model's mask function at each ring slot's position
as a flex `mask_mod`, so wrapped rings are exact with flex attention too (CPU, compiled flex kernels).

torch 2.13's CPU flex-attention template fails to compile once `torch.compile` turns a shape dynamic (every cache hits
it: transformers' `DynamicCache` fails at its first decode step); these tests compile with static shapes, one graph
per shape, which is what works on CPU today."""

from __future__ import annotations

import pytest
import torch
from builders import MODEL_BUILDERS, VOCAB, chunked_logits, no_cache_logits

from hybrid_cache import HybridRingCache
from hybrid_cache.code_kernel import cpu_features
from hybrid_cache.mask_hook import RingLayout

# transformers' own flex integration warns on CPU (its `create_block_mask(_compile=True)` flag is deprecated in torch
# 2.13; torch notes an unfused fallback while tracing): not about this package, and the same with every cache.
pytestmark = [
    pytest.mark.filterwarnings("ignore:_compile flag on create_block_mask:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile:UserWarning"),
]


@pytest.fixture(autouse=True)
def _static_shapes():
    # torch's own scoped config patch (monkeypatch would delete the entry on undo: config modules keep their values
    # outside `__dict__`, so it sees nothing to restore and every later compile fails).
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
        yield
    torch._dynamo.reset()


# On a CPU without AVX-512 (an AVX2 AMD EPYC here), torch 2.13's compiled CPU flex kernels give logits 0.13 off the
# no-cache forward at the second one-token step of this schedule with transformers' own DynamicCache as with the ring
# (measured side by side: 0.1308 both); not a cache defect, and exact on the AVX-512 machines CI ran on before.
@pytest.mark.xfail(
    "avx512f" not in cpu_features(),
    reason="torch's CPU flex attention is not exact without AVX-512 (DynamicCache is off identically)",
    strict=False,
)
def test_flex_attention_exact_after_the_wrap(model_name):
    model = MODEL_BUILDERS[model_name](window=4, attn="flex_attention")
    ids = torch.randint(3, VOCAB, (2, 14), generator=torch.Generator().manual_seed(0))
    attention_mask = torch.ones_like(ids)
    attention_mask[1, :3] = 0
    cache = HybridRingCache(model.config)
    # Prompt longer than the window, one-token steps over the wrapped ring, a chunk, more one-token steps.
    got = chunked_logits(model, cache, ids, [6, 1, 1, 3, 1, 1, 1], attention_mask)
    assert isinstance(cache.get_mask_sizes(1, cache.is_sliding.index(True))[1], RingLayout)
    expected = no_cache_logits(model, ids, attention_mask)
    real = attention_mask.bool()
    difference = (got[real] - expected[real]).abs().max().item()
    assert difference <= 1e-4, f"max |logit difference| = {difference:.3g}"
