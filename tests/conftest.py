"""Shared fixtures: tiny random Gemma 3 / Gemma 4 models built from configs (no download) and the no-cache oracle."""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, Gemma4ForCausalLM, Gemma4TextConfig

VOCAB = 101


def tiny_gemma3(window: int = 6, layers: int = 6, attn: str = "sdpa", seed: int = 0) -> Gemma3ForCausalLM:
    """Gemma 3 text model, 5 sliding : 1 full, GQA (4 query heads over 2 KV heads), fp32, eval mode."""
    torch.manual_seed(seed)
    config = Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, sliding_window=window, max_position_embeddings=4096,
        attn_implementation=attn, pad_token_id=0, bos_token_id=2, eos_token_id=1,
    )
    return Gemma3ForCausalLM(config).eval()


def tiny_gemma4(window: int = 6, layers: int = 8, shared: int = 3, attn: str = "sdpa", seed: int = 0) -> Gemma4ForCausalLM:
    """Gemma 4 text model with KV-shared layers and different head size / KV heads for sliding and full layers."""
    torch.manual_seed(seed)
    layer_types = ["sliding_attention", "sliding_attention", "full_attention"] * (layers // 3 + 1)
    layer_types = layer_types[:layers]
    layer_types[-1] = "full_attention"
    config = Gemma4TextConfig(
        vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB, hidden_size=32, hidden_size_per_layer_input=8,
        intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        global_head_dim=16, num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=window,
        layer_types=layer_types, num_kv_shared_layers=shared, max_position_embeddings=4096,
        attn_implementation=attn, pad_token_id=0, bos_token_id=2, eos_token_id=1,
    )
    return Gemma4ForCausalLM(config).eval()


def tiny_gemma3_multimodal(window: int = 4, seed: int = 0):
    """Gemma3ForConditionalGeneration with a 1-layer SigLIP tower (28x28 images, 4 tokens per image); ids 98-100 are
    the image / begin-of-image / end-of-image tokens."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig

    torch.manual_seed(seed)
    text = Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, sliding_window=window,
    )
    vision = SiglipVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
    )
    config = Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=VOCAB - 1,
        boi_token_index=VOCAB - 2, eoi_token_index=VOCAB - 3,
    )
    config._attn_implementation = "sdpa"
    return Gemma3ForConditionalGeneration(config).eval()


MODEL_BUILDERS = {"gemma3": tiny_gemma3, "gemma4": tiny_gemma4}


@torch.no_grad()
def no_cache_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The oracle: one forward over the whole sequence, no cache, the model's native sliding-window mask."""
    return model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits


@torch.no_grad()
def chunked_logits(model, cache, input_ids: torch.Tensor, schedule: list[int], attention_mask=None) -> torch.Tensor:
    """Feed `input_ids` through `cache` in chunks of the sizes in `schedule`; return the concatenated logits."""
    outputs, position = [], 0
    for size in schedule:
        chunk = input_ids[:, position : position + size]
        mask = None if attention_mask is None else attention_mask[:, : position + size]
        outputs.append(model(input_ids=chunk, attention_mask=mask, cache=cache, use_cache=True).logits)
        position += size
    assert position == input_ids.shape[1]
    return torch.cat(outputs, dim=1)


@pytest.fixture(scope="module")
def single_thread():
    """Tiny models: one thread is faster and keeps wall time stable on shared 2-core machines."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(params=["gemma3", "gemma4"])
def model_name(request) -> str:
    return request.param
