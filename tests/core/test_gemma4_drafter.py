"""Gemma 4's drafter (`Gemma4AssistantForCausalLM`) reads the target's cache through `shared_kv_states`: the K/V
that the target's last storing layer of each type got back from `cache.update`. With `HybridRingCache` as the target
cache, after the wrap, every drafter forward must see exactly what it sees with `DynamicCache`: its logits equal
(not only the target-verified tokens, which stay right even when the drafter is fed garbage)."""

from __future__ import annotations

import random

import pytest
import torch
import transformers
from builders import VOCAB, needs_exact_rollback, tiny_gemma4
from transformers import DynamicCache, Gemma4TextConfig

from hybrid_cache import HybridRingCache
from hybrid_cache.compat import cache_kwargs

gemma4_assistant = pytest.importorskip(
    "transformers.models.gemma4_assistant", reason="Gemma 4's drafter arrived in a later transformers release"
)
Gemma4AssistantConfig = gemma4_assistant.Gemma4AssistantConfig
Gemma4AssistantForCausalLM = gemma4_assistant.Gemma4AssistantForCausalLM


def tiny_drafter(window: int, attn: str, draft_tokens: int) -> Gemma4AssistantForCausalLM:
    """A drafter whose attention reads the tiny target's shared K/V (same head sizes and KV heads per layer type)."""
    torch.manual_seed(1)
    text = Gemma4TextConfig(
        vocab_size=VOCAB,
        vocab_size_per_layer_input=0,
        hidden_size=24,
        hidden_size_per_layer_input=0,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        global_head_dim=16,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        sliding_window=window,
        layer_types=["sliding_attention", "full_attention"],
        num_kv_shared_layers=2,
        max_position_embeddings=4096,
        attn_implementation=attn,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=1,
    )
    config = Gemma4AssistantConfig(text_config=text, backbone_hidden_size=32)
    config._attn_implementation = attn
    drafter = Gemma4AssistantForCausalLM(config).eval()
    drafter.generation_config.num_assistant_tokens = draft_tokens
    drafter.generation_config.num_assistant_tokens_schedule = "constant"
    return drafter


def drafted_logits(target, drafter, cache, prompt: torch.Tensor, new_tokens: int):
    """Run assisted `generate` with `cache` as the target cache: (tokens, the drafter's logits at every call)."""
    drafted: list[torch.Tensor] = []
    forward = drafter.forward

    def recording_forward(*args, **kwargs):
        output = forward(*args, **kwargs)
        drafted.append(output.logits.clone())
        return output

    drafter.forward = recording_forward
    try:
        with torch.no_grad():
            tokens = target.generate(
                input_ids=prompt,
                attention_mask=torch.ones_like(prompt),
                assistant_model=drafter,
                **cache_kwargs(cache),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
    finally:
        drafter.forward = forward
    return tokens, drafted


def geometries(count: int, seed: int) -> list:
    """Random (window, prompt length, draft tokens, rollback margin), prompts around the window most of the time: a
    prompt just past the window is where a verification step first returns keys from a wrapped ring."""
    rng = random.Random(seed)
    cases = []
    for _ in range(count):
        window = rng.randint(2, 9)
        prompt = rng.choice([window - 1, window, window + 1, window + 2, rng.randint(2, 3 * window + 4)])
        cases.append(
            pytest.param(
                window, max(prompt, 2), rng.randint(1, 5), rng.choice([0, 0, 3]), id=f"W{window}-P{max(prompt, 2)}"
            )
        )
    return cases


@needs_exact_rollback
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("window, prompt_length, draft_tokens, margin", geometries(12, seed=16))
def test_drafter_logits_equal_dynamic_cache(attn, window, prompt_length, draft_tokens, margin, one_thread):
    """Property over windows, prompt lengths (around the window), draft lengths and rollback margins: the drafter's
    logits at every call equal those of the `DynamicCache` run (it reads the shared K/V by index, so the ring's
    verification steps must return exactly the keys transformers' sliding layer returns), and the tokens are equal."""
    target = tiny_gemma4(window=window, attn=attn)
    drafter = tiny_drafter(window, attn, draft_tokens)
    prompt = torch.randint(3, VOCAB, (1, prompt_length), generator=torch.Generator().manual_seed(prompt_length))
    new_tokens = 2 * window + 8
    try:
        dynamic_tokens, dynamic_logits = drafted_logits(
            target, drafter, DynamicCache(config=target.config), prompt, new_tokens
        )
    except TypeError as error:  # 5.18's generate builds the drafter's candidate generator without its input_ids
        pytest.skip(f"transformers {transformers.__version__} cannot run Gemma 4's drafter with any cache: {error}")
    ring_tokens, ring_logits = drafted_logits(
        target, drafter, HybridRingCache(target.config, rollback_margin=margin), prompt, new_tokens
    )
    assert torch.equal(ring_tokens, dynamic_tokens)
    assert len(ring_logits) == len(dynamic_logits) > 3, "the drafter should have run several times, past the wrap"
    for call, (ring, dynamic) in enumerate(zip(ring_logits, dynamic_logits)):
        difference = (ring - dynamic).abs().max().item()
        assert difference <= 1e-4, f"drafter call {call}: logits differ from the DynamicCache run by {difference:.3g}"
