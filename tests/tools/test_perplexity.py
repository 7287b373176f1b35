"""Real-model exactness check: Gemma 3 270M (embedded GGUF from PyPI) on the default text, fully offline.

Streaming the first 2048 tokens (4 x the 512-token sliding window) in 512-token chunks, the perplexity with
HybridRingCache must equal the single no-cache forward's and DynamicCache's within 1e-4 relative (fp32). The
first run converts the GGUF once (~1 min, cached under $HYBRID_CACHE_HOME or ~/.cache/hybrid_cache); after that
the module takes ~2 min on 2 CPU cores.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.slow

TOKENS = 4 * 512
CHUNK = 512


@pytest.fixture(scope="module")
def gemma(embedded_model_installed):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from hybrid_cache.tools.models import load_model
    from hybrid_cache.tools.text import load_text

    model, tokenizer = load_model()
    text, _ = load_text()
    ids = tokenizer(text, return_tensors="pt").input_ids[0, :TOKENS]
    assert ids.numel() == TOKENS and ids[0].item() == tokenizer.bos_token_id
    return model, ids


@pytest.fixture(scope="module")
def reference(gemma):
    from hybrid_cache.tools.perplexity import evaluate_perplexity

    model, ids = gemma
    return evaluate_perplexity(model, ids, "none", CHUNK, progress=False)


@pytest.fixture(scope="module")
def dynamic(gemma):
    from hybrid_cache.tools.perplexity import evaluate_perplexity

    model, ids = gemma
    return evaluate_perplexity(model, ids, "dynamic", CHUNK, progress=False)


def test_config_of_the_embedded_model(gemma):
    model, _ = gemma
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size) == (18, 1, 256, 262144)
    assert cfg.sliding_window == 512
    assert cfg.layer_types == ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)]
    assert cfg.rope_parameters["sliding_attention"]["rope_theta"] == 10_000.0
    assert cfg.rope_parameters["full_attention"]["rope_theta"] == 1_000_000.0
    assert cfg.query_pre_attn_scalar == 256 and cfg.final_logit_softcapping is None
    assert getattr(cfg, "quantization_config", None) is None  # plain dense fp32 checkpoint
    assert next(model.parameters()).dtype == torch.float32


def test_reference_perplexity_is_sane(reference):
    # A working 270M model on 1911 encyclopaedia prose scores ~16; a wrong config (rope, window, scaling)
    # sends it into the hundreds or more.
    assert 5 < reference.ppl < 40, reference.ppl


def test_dynamic_matches_no_cache(dynamic, reference):
    assert abs(dynamic.ppl - reference.ppl) / reference.ppl < 1e-4, (dynamic.ppl, reference.ppl)


def test_ring_matches_no_cache_and_dynamic(gemma, reference, dynamic):
    from hybrid_cache.tools.compare import full_cache_bytes_per_token
    from hybrid_cache.tools.perplexity import evaluate_perplexity

    model, ids = gemma
    ring = evaluate_perplexity(model, ids, "ring", CHUNK, progress=False)
    assert abs(ring.ppl - reference.ppl) / reference.ppl < 1e-4, (ring.ppl, reference.ppl)
    assert abs(ring.ppl - dynamic.ppl) / dynamic.ppl < 1e-4, (ring.ppl, dynamic.ppl)
    # Memory: 3 full layers hold every token, 15 sliding layers hold the 512-token window.
    per_layer_token = 2 * 1 * 256 * 4
    assert ring.kv_bytes == per_layer_token * (3 * TOKENS + 15 * 512)
    assert full_cache_bytes_per_token(model.config, torch.float32) * TOKENS == per_layer_token * 18 * TOKENS
