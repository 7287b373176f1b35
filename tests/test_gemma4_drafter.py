"""Gemma 4's drafter (`Gemma4AssistantForCausalLM`) reads the target's cache through `shared_kv_states`: the K/V
that the target's last storing layer of each type got back from `cache.update`. With `HybridRingCache` as the target
cache, after the wrap, every drafter forward must see exactly what it sees with `DynamicCache`: its logits equal
(not only the target-verified tokens, which stay right even when the drafter is fed garbage)."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, tiny_gemma4
from transformers import DynamicCache, Gemma4TextConfig
from transformers.models.gemma4_assistant import Gemma4AssistantConfig, Gemma4AssistantForCausalLM

from hybrid_cache import HybridRingCache
from hybrid_cache.compat import cache_kwargs

WINDOW = 4


def tiny_drafter(attn: str) -> Gemma4AssistantForCausalLM:
    """A drafter whose attention reads the tiny target's shared K/V (same head sizes and KV heads per layer type)."""
    torch.manual_seed(1)
    text = Gemma4TextConfig(
        vocab_size=VOCAB, vocab_size_per_layer_input=0, hidden_size=24, hidden_size_per_layer_input=0,
        intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        global_head_dim=16, num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"], num_kv_shared_layers=2, max_position_embeddings=4096,
        attn_implementation=attn, pad_token_id=0, bos_token_id=2, eos_token_id=1,
    )
    config = Gemma4AssistantConfig(text_config=text, backbone_hidden_size=32)
    config._attn_implementation = attn
    drafter = Gemma4AssistantForCausalLM(config).eval()
    drafter.generation_config.num_assistant_tokens = 4
    return drafter


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("rollback_margin", [0, 3], ids=lambda m: f"margin{m}")
def test_drafter_logits_equal_dynamic_cache(attn, rollback_margin):
    target = tiny_gemma4(window=WINDOW, attn=attn)
    drafter = tiny_drafter(attn)
    drafted: list[torch.Tensor] = []
    forward = drafter.forward

    def recording_forward(*args, **kwargs):
        output = forward(*args, **kwargs)
        drafted.append(output.logits.clone())
        return output

    drafter.forward = recording_forward
    prompt = torch.randint(3, VOCAB, (1, 13), generator=torch.Generator().manual_seed(0))
    kwargs = dict(input_ids=prompt, attention_mask=torch.ones_like(prompt), assistant_model=drafter,
                  max_new_tokens=24, min_new_tokens=24, do_sample=False, pad_token_id=0)
    runs = {}
    with torch.no_grad():
        for name, cache in (("ring", HybridRingCache(target.config, rollback_margin=rollback_margin)),
                            ("dynamic", DynamicCache(config=target.config))):
            drafted.clear()
            runs[name] = (target.generate(**kwargs, **cache_kwargs(cache)), list(drafted))
    (ring_tokens, ring_logits), (dynamic_tokens, dynamic_logits) = runs["ring"], runs["dynamic"]
    assert torch.equal(ring_tokens, dynamic_tokens)
    assert len(ring_logits) == len(dynamic_logits) > 10, "the drafter should have run many times, past the wrap"
    worst = max((a - b).abs().max().item() for a, b in zip(ring_logits, dynamic_logits))
    assert worst <= 1e-4, f"drafter logits differ from the DynamicCache run by {worst:.3g}"
