"""Model-level oracle: chunked prefill + decode through HybridRingCache gives the no-cache logits (fp32, 1e-4).

Property style: seeded random windows, prompt lengths (up to 6 x window), left paddings (longer than the window too),
chunk schedules (1 .. 3 x window), greedy decode across many wraps and a continuation after the generation, on tiny
random Gemma 3 and Gemma 4 models (KV-shared layers, different head sizes and KV heads per layer type), for `sdpa`,
`eager` and `banded` (`hybrid_cache_sdpa` with the banded prefill from 2-token steps: builders.BANDED).
"""

from __future__ import annotations

import os
import random

import pytest
import torch
from builders import (
    BANDED,
    MODEL_BUILDERS,
    VOCAB,
    assert_matches_oracle,
    chunked_logits,
    no_cache_logits,
    oracle_chunk_sizes,
    random_padded_batch,
    random_schedule,
    tiny_gemma3_multimodal,
)

from hybrid_cache import HybridRingCache
from hybrid_cache.compat import cache_kwargs

# Random cases per (model, attention); CI runs 25. `HYBRID_CACHE_ORACLE_SEEDS=500 pytest tests/core/test_oracle.py` to soak.
ORACLE_SEEDS = int(os.environ.get("HYBRID_CACHE_ORACLE_SEEDS", "25"))


@pytest.mark.parametrize("attn", ["sdpa", "eager", BANDED])
@pytest.mark.parametrize("seed", range(ORACLE_SEEDS), ids=lambda s: f"seed{s}")
def test_random_schedules_match_no_cache(model_name, attn, seed):
    rng = random.Random(f"{model_name}-{attn}-{seed}")
    window = rng.choice([3, 5, 8])
    model = MODEL_BUILDERS[model_name](window=window, attn=attn, seed=seed)
    length = rng.randint(window + 1, 6 * window)
    padded = random_padded_batch(rng, rng.randint(1, 3), length, window)
    input_ids, attention_mask = padded["input_ids"], padded["attention_mask"]
    schedule = random_schedule(length, lambda: rng.choice(oracle_chunk_sizes(window)))
    label = f"W={window} T={length} schedule={schedule} pads={(attention_mask == 0).sum(1).tolist()}"

    cache = HybridRingCache(model.config)
    got = chunked_logits(model, cache, input_ids, schedule, attention_mask)
    assert_matches_oracle(got, no_cache_logits(model, input_ids, attention_mask), attention_mask, label)


@pytest.mark.parametrize("attn", ["sdpa", "eager", BANDED])
def test_decode_many_wraps_then_continue(model_name, attn):
    """Prompt > window, 5 windows of greedy decode, then a new multi-token user turn and more decode, one cache."""
    window = 4
    model = MODEL_BUILDERS[model_name](window=window, attn=attn)
    rng = random.Random(7)
    padded = random_padded_batch(rng, 2, 2 * window + 3, window)
    input_ids, attention_mask = padded["input_ids"], padded["attention_mask"]
    attention_mask[1, : window + 2] = 0  # padding longer than the window, still inside it after the first wraps
    input_ids[1, : window + 2] = 0
    cache = HybridRingCache(model.config)

    with torch.no_grad():
        logits = [model(input_ids=input_ids, attention_mask=attention_mask, **cache_kwargs(cache)).logits]
        for turn in range(2):
            for _ in range(5 * window):
                next_token = logits[-1][:, -1:].argmax(-1)
                input_ids = torch.cat([input_ids, next_token], 1)
                attention_mask = torch.cat([attention_mask, torch.ones_like(next_token)], 1)
                logits.append(model(input_ids=next_token, attention_mask=attention_mask, **cache_kwargs(cache)).logits)
            if turn == 0:  # the user's next turn, longer than the window
                user = torch.randint(3, VOCAB, (2, window + 3), generator=torch.Generator().manual_seed(1))
                input_ids = torch.cat([input_ids, user], 1)
                attention_mask = torch.cat([attention_mask, torch.ones_like(user)], 1)
                logits.append(model(input_ids=user, attention_mask=attention_mask, **cache_kwargs(cache)).logits)
    got = torch.cat(logits, 1)
    assert cache.get_seq_length() == input_ids.shape[1]
    assert_matches_oracle(got, no_cache_logits(model, input_ids, attention_mask), attention_mask, "many wraps")


@pytest.mark.parametrize("window", [1, 2, 7])
def test_extreme_windows(window):
    """Window 1 (a token sees only itself), 2, and a window larger than the whole sequence."""
    model = MODEL_BUILDERS["gemma3"](window=window)
    input_ids = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(window))
    cache = HybridRingCache(model.config)
    got = chunked_logits(model, cache, input_ids, [2, 1, 3])
    assert_matches_oracle(got, no_cache_logits(model, input_ids), torch.ones_like(input_ids), f"W={window}")


def test_rope_positions_survive_the_wrap():
    """Trap 1: keys are stored after RoPE and never moved; a model whose local and global RoPE bases differ still
    matches the oracle far past the window (a re-rotated or shifted key would change every logit)."""
    model = MODEL_BUILDERS["gemma3"](window=3)
    assert (
        model.config.rope_parameters["sliding_attention"]["rope_theta"]
        != model.config.rope_parameters["full_attention"]["rope_theta"]
    )
    input_ids = torch.randint(3, VOCAB, (1, 40), generator=torch.Generator().manual_seed(3))
    cache = HybridRingCache(model.config)
    got = chunked_logits(model, cache, input_ids, [5] + [1] * 35)
    assert_matches_oracle(got, no_cache_logits(model, input_ids), torch.ones_like(input_ids), "rope")


def test_rollback_after_wrap_matches_oracle(model_name):
    """Trap 6: speculative pattern on the model: verify 4 tokens after the wrap, roll 3 back, continue."""
    model = MODEL_BUILDERS[model_name](window=4)
    tokens = torch.randint(3, VOCAB, (1, 30), generator=torch.Generator().manual_seed(5))
    cache = HybridRingCache(model.config, rollback_margin=3)
    with torch.no_grad():
        model(input_ids=tokens[:, :20], **cache_kwargs(cache))
        wrong = torch.randint(3, VOCAB, (1, 3), generator=torch.Generator().manual_seed(6))
        model(input_ids=torch.cat([tokens[:, 20:21], wrong], 1), **cache_kwargs(cache))
        cache.crop(-3)
        assert cache.get_seq_length() == 21
        got = chunked_logits(model, cache, tokens[:, 21:], [1, 2, 1, 4, 1])
    expected = no_cache_logits(model, tokens)[:, 21:]
    assert_matches_oracle(got, expected, torch.ones_like(got[..., 0], dtype=torch.long), "rollback")


def test_all_sliding_model_without_layer_types():
    """A Mistral-style config (a `sliding_window`, no `layer_types`): every layer gets a ring, results exact."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=4,
        attn_implementation="sdpa",
    )
    model = MistralForCausalLM(config).eval()
    cache = HybridRingCache(model.config)
    assert cache.layer_kinds == ["sliding_attention"] * 2
    input_ids = torch.randint(3, VOCAB, (2, 20), generator=torch.Generator().manual_seed(8))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :7] = 0
    got = chunked_logits(model, cache, input_ids, [6, 1, 1, 5, 1, 1, 1, 4], attention_mask)
    assert_matches_oracle(got, no_cache_logits(model, input_ids, attention_mask), attention_mask, "mistral")


def test_composite_multimodal_config_text_only():
    """`HybridRingCache(model.config)` with a composite config (Gemma3ForConditionalGeneration, text-only input):
    the decoder text config is read, logits and greedy generation match the no-cache model."""
    model = tiny_gemma3_multimodal(window=4)
    input_ids = torch.randint(3, VOCAB - 4, (2, 20), generator=torch.Generator().manual_seed(9))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :6] = 0
    cache = HybridRingCache(model.config)
    assert cache.layer_kinds == ["sliding_attention"] * 5 + ["full_attention"]
    got = chunked_logits(model, cache, input_ids, [7, 1, 1, 5, 1, 1, 4], attention_mask)
    assert_matches_oracle(got, no_cache_logits(model, input_ids, attention_mask), attention_mask, "composite")
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=12, do_sample=False)
    with torch.no_grad():
        ring = model.generate(**kwargs, **cache_kwargs(HybridRingCache(model.config)))
        assert torch.equal(ring, model.generate(**kwargs, use_cache=False))
