"""What the tests build: tiny random Gemma 3 / Gemma 4 models from configs (no download), prompts, chunk schedules,
left-padded batches, the no-cache oracle and chunked logits through a cache, and the checks shared by several files.

A plain module, not a test module: test files import it as `from builders import ...` (`tests/` is on `sys.path`
through pytest's `pythonpath` setting in setup.cfg; subprocess scripts insert it themselves). Fixtures live in
conftest.py and delegate here.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence

import pytest
import torch
from transformers import DynamicCache, Gemma3ForCausalLM, Gemma3TextConfig, Gemma4ForCausalLM, Gemma4TextConfig

from hybrid_cache import HybridRingCache
from hybrid_cache.banded import banded_prefill
from hybrid_cache.code_attention import CODE_ATTENTION
from hybrid_cache.compat import ROLLBACK_SINCE, cache_kwargs, no_cache_forward_is_exact, rollback_supported

VOCAB = 101

# The attention parameter "banded": the model on `hybrid_cache_sdpa` with the banded prefill from 2-token steps, in
# blocks of 3 query rows, key ranges aligned to 2 (conftest.py enters `banded_prefill(**BANDED_TEST_SETTINGS)` for a test whose `attn` is it),
# so that the tiny models' schedules run through the banded path; oracles keep transformers' dense masks
# (`reference_masks`).
BANDED = "banded"
BANDED_TEST_SETTINGS = {"min_query_length": 2, "block_size": 3, "key_alignment": 2}


def attn_implementation(attn: str) -> str:
    """The model's attention implementation for a test's `attn` parameter (`BANDED` -> `hybrid_cache_sdpa`)."""
    return CODE_ATTENTION if attn == BANDED else attn


def reference_masks():
    """Within the block, `hybrid_cache_sdpa` builds transformers' dense masks (the oracles' path)."""
    return banded_prefill(min_query_length=None)


def tiny_gemma3(
    window: int = 6,
    layers: int = 6,
    attn: str = "sdpa",
    seed: int = 0,
    *,
    vocab: int = VOCAB,
    softcap: float | None = None,
    layer_types: list[str] | None = None,
    head_dim: int = 8,
) -> Gemma3ForCausalLM:
    """Gemma 3 text model, 5 sliding : 1 full unless `layer_types` says otherwise, GQA (4 query heads over 2 KV
    heads), final-logit soft-cap `softcap`, fp32, eval mode."""
    torch.manual_seed(seed)
    config = Gemma3TextConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        sliding_window=window,
        max_position_embeddings=4096,
        final_logit_softcapping=softcap,
        layer_types=layer_types,
        attn_implementation=attn_implementation(attn),
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=1,
    )
    return Gemma3ForCausalLM(config).eval()


def tiny_gemma4(
    window: int = 6,
    layers: int = 8,
    shared: int = 3,
    attn: str = "sdpa",
    seed: int = 0,
    *,
    query_heads: int = 4,
    kv_heads: int = 2,
    global_kv_heads: int = 1,
    per_layer_input: int = 8,
    global_head_dim: int = 16,
    vocab: int = VOCAB,
) -> Gemma4ForCausalLM:
    """Gemma 4 text model with KV-shared layers and different head size / KV heads for sliding and full layers.

    `per_layer_input=0, shared=0` is the layout of Gemma 4 31B / 26B-A4B (no per-layer inputs, no KV sharing)."""
    torch.manual_seed(seed)
    layer_types = ["sliding_attention", "sliding_attention", "full_attention"] * (layers // 3 + 1)
    layer_types = layer_types[:layers]
    layer_types[-1] = "full_attention"
    config = Gemma4TextConfig(
        vocab_size=vocab,
        vocab_size_per_layer_input=vocab,
        hidden_size=32,
        hidden_size_per_layer_input=per_layer_input,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=query_heads,
        num_key_value_heads=kv_heads,
        head_dim=8,
        global_head_dim=global_head_dim,
        num_global_key_value_heads=global_kv_heads,
        attention_k_eq_v=True,
        sliding_window=window,
        layer_types=layer_types,
        num_kv_shared_layers=shared,
        max_position_embeddings=4096,
        attn_implementation=attn_implementation(attn),
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=1,
    )
    return Gemma4ForCausalLM(config).eval()


# Token ids of the tiny multimodal models: image placeholder, begin / end of image (ids above are never sampled).
IMAGE_ID, BOI_ID, EOI_ID = VOCAB - 1, VOCAB - 2, VOCAB - 3
TEXT_IDS = (3, VOCAB - 8)  # random text tokens are drawn from this range


def tiny_gemma3_multimodal(window: int = 4, attn: str = "sdpa", tokens_per_image: int = 4, seed: int = 0):
    """Gemma3ForConditionalGeneration with a 1-layer SigLIP tower: square images of 14 x sqrt(tokens_per_image)
    pixels, one 14-pixel patch per image token. Image tokens are `IMAGE_ID`, framed by `BOI_ID` / `EOI_ID`."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig

    torch.manual_seed(seed)
    side = int(tokens_per_image**0.5)
    text = Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        sliding_window=window,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=1,
    )
    vision = SiglipVisionConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=14 * side,
        patch_size=14,
    )
    config = Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=tokens_per_image,
        image_token_index=IMAGE_ID,
        boi_token_index=BOI_ID,
        eoi_token_index=EOI_ID,
    )
    config._attn_implementation = config.text_config._attn_implementation = attn_implementation(attn)
    model = Gemma3ForConditionalGeneration(config).eval()
    model.tiny_tokens_per_image = tokens_per_image
    return model


def tiny_gemma4_multimodal(window: int = 4, attn: str = "sdpa", tokens_per_image: int = 4, seed: int = 0):
    """Gemma4ForConditionalGeneration (bidirectional attention over vision blocks, KV-shared layers, per-type head
    sizes) with a 1-layer vision tower: an image is a grid of (2 x sqrt(tokens))^2 patches of 2 x 2 pixels, pooled
    2 x 2 into `tokens_per_image` soft tokens."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration, Gemma4VisionConfig

    torch.manual_seed(seed)
    text = tiny_gemma4(window=window, attn=attn, seed=seed).config
    text.use_bidirectional_attention = "vision"
    vision = Gemma4VisionConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=8,
        patch_size=2,
        pooling_kernel_size=2,
        position_embedding_size=64,
    )
    config = Gemma4Config(
        text_config=text,
        vision_config=vision,
        image_token_id=IMAGE_ID,
        boi_token_id=BOI_ID,
        eoi_token_id=EOI_ID,
        video_token_id=VOCAB - 4,
        audio_token_id=VOCAB - 5,
        boa_token_id=VOCAB - 6,
        eoa_token_index=VOCAB - 7,
    )
    config._attn_implementation = config.text_config._attn_implementation = attn_implementation(attn)
    model = Gemma4ForConditionalGeneration(config).eval()
    model.tiny_tokens_per_image = tokens_per_image
    return model


def random_images(model, count: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random pixel inputs for `count` images of a tiny multimodal model, shaped as its processor returns them."""
    generator = torch.Generator().manual_seed(seed)
    vision, side = model.config.vision_config, int(model.tiny_tokens_per_image**0.5)
    if model.config.model_type == "gemma3":
        return {"pixel_values": torch.randn(count, 3, vision.image_size, vision.image_size, generator=generator)}
    grid = 2 * side  # patches per image side before the 2 x 2 pooling
    xy = torch.stack(torch.meshgrid(torch.arange(grid), torch.arange(grid), indexing="xy"), -1).reshape(1, -1, 2)
    return {
        "pixel_values": torch.randn(count, grid * grid, 3 * vision.patch_size**2, generator=generator),
        "image_position_ids": xy.expand(count, -1, -1).contiguous(),
    }


def tiny_llama4(chunk: int = 4, layers: int = 4, attn: str = "sdpa", seed: int = 0):
    """Llama 4 text model: chunked attention (chunks of `chunk`) in every layer but every fourth (full, without
    RoPE), GQA (4 query heads over 2 KV heads), two experts, fp32, eval mode."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    torch.manual_seed(seed)
    config = Llama4TextConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        intermediate_size_mlp=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        attention_chunk_size=chunk,
        num_local_experts=2,
        max_position_embeddings=4096,
        attn_implementation=attn_implementation(attn),
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=1,
    )
    return Llama4ForCausalLM(config).eval()


LLAMA4_IMAGE_TOKEN = 110  # the tiny multimodal Llama 4's image token id (ids 110-112 are its image markers)


def tiny_llama4_multimodal(chunk: int = 4, seed: int = 0):
    """`Llama4ForConditionalGeneration`: the text model of `tiny_llama4` (vocabulary 120) and a one-layer vision tower
    that turns a 56 x 56 image into 4 tokens (16 patches of 14, pixel shuffle 0.5), fp32, sdpa, eval mode."""
    from transformers import Llama4Config, Llama4ForConditionalGeneration

    torch.manual_seed(seed)
    text = tiny_llama4(chunk=chunk).config.to_dict()
    text.update(vocab_size=120)
    vision = dict(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=128,
        image_size=56,
        patch_size=14,
        vision_output_dim=32,
        projector_input_dim=32,
        projector_output_dim=32,
        pixel_shuffle_ratio=0.5,
    )
    config = Llama4Config(
        text_config=text,
        vision_config=vision,
        image_token_index=LLAMA4_IMAGE_TOKEN,
        boi_token_index=LLAMA4_IMAGE_TOKEN + 1,
        eoi_token_index=LLAMA4_IMAGE_TOKEN + 2,
    )
    config._attn_implementation = "sdpa"
    return Llama4ForConditionalGeneration(config).eval()


MODEL_BUILDERS = {"gemma3": tiny_gemma3, "gemma4": tiny_gemma4}


needs_exact_rollback = pytest.mark.skipif(
    not rollback_supported(),
    reason=f"assisted / prompt-lookup decoding over a wrapped ring is exact from transformers {ROLLBACK_SINCE}; older "
    "releases refuse it (test_generate.py: `speculative` asserts the refusal)",
)

SPECULATIVE_CASES = ("prompt_lookup", "assisted")


def generate_case_params(cases: Sequence[str]) -> list:
    """`cases` as pytest parameters, the speculative ones (`SPECULATIVE_CASES`) marked `needs_exact_rollback`."""
    return [pytest.param(case, marks=needs_exact_rollback) if case in SPECULATIVE_CASES else case for case in cases]


def reference_cache_kwargs(model) -> dict:
    """What the no-cache oracle passes to a forward or `generate`: `use_cache=False`, or, where the release's forward
    without a cache is not the model (`hybrid_cache.compat.no_cache_forward_is_exact`: Gemma 4's KV sharing on 5.5.0 /
    5.5.1), a fresh DynamicCache for this one call."""
    if no_cache_forward_is_exact(model.config):
        return {"use_cache": False}
    return {**cache_kwargs(DynamicCache(config=model.config)), "use_cache": True}


@torch.no_grad()
def no_cache_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The oracle: one forward over the whole sequence, no cache, the model's native sliding-window mask (dense, also
    on `hybrid_cache_sdpa`: `reference_masks`). (Where the release's forward without a cache is not the model, Gemma
    4's KV sharing on 5.5.0 / 5.5.1, one forward with a fresh DynamicCache: `hybrid_cache.compat.no_cache_forward_is_exact`.)"""
    with reference_masks():
        return model(input_ids=input_ids, attention_mask=attention_mask, **reference_cache_kwargs(model)).logits


@torch.no_grad()
def chunked_logits(
    model, cache, input_ids: torch.Tensor, schedule: list[int], attention_mask=None, start: int = 0
) -> torch.Tensor:
    """Feed `input_ids[:, start:]` through `cache` (which already holds the first `start` tokens) in chunks of the
    sizes in `schedule`, each with the 2D mask up to its end; return the concatenated logits."""
    outputs, position = [], start
    for size in schedule:
        chunk = input_ids[:, position : position + size]
        mask = None if attention_mask is None else attention_mask[:, : position + size]
        outputs.append(model(input_ids=chunk, attention_mask=mask, **cache_kwargs(cache), use_cache=True).logits)
        position += size
    assert position == input_ids.shape[1]
    return torch.cat(outputs, dim=1)


@functools.cache
def get_model(name: str, window: int = 6, dtype: torch.dtype = torch.float32, attn: str = "sdpa"):
    """The tiny `name` model ("gemma3" / "gemma4", default weights), built once per process and shared: callers must
    not modify it."""
    return MODEL_BUILDERS[name](window=window, attn=attn).to(dtype)


# --- prompts, schedules, padded batches -------------------------------------------------------------------------------
def decode_step_mask(
    batch: int, history: int, query: int, kind: str, dtype: torch.dtype, padding: int
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The mask of a step of `query` tokens after `history` stored ones, as a model would pass it to attention:
    `(mask, allowed)`, `allowed` `[batch, 1, query, history + query]` boolean (the history visible, the step's own
    tokens causal, and with `batch > 1` and a mask the last row's first `padding` tokens left padding), `mask` the same
    as `kind` "bool", "float" (additive, in `dtype`) or "none" (None)."""
    allowed = torch.ones(batch, 1, query, history + query, dtype=torch.bool)
    allowed[..., history:] = torch.ones(query, query, dtype=torch.bool).tril()
    if batch > 1 and kind != "none":
        allowed[-1, ..., : min(padding, history)] = False  # left padding of the last row
    mask = {
        "bool": allowed,
        "none": None,
        "float": torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min),
    }[kind]
    return mask, allowed


def decode_record_bytes(cache: HybridRingCache) -> int:
    """Bytes a wrapped ring keeps after a one-token step to undo it (the one slot it overwrote, `ring.SlotUndo`),
    summed over the cache's rings: what `memory_report().extra_bytes` holds after a decode step besides counters."""
    total = 0
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False) and getattr(layer, "is_initialized", False):
            total += layer.batch_size * layer.num_heads * (layer.k_head_dim + layer.v_head_dim) * layer.dtype.itemsize
    return total


def tokens(length: int, batch: int = 1, seed: int = 0) -> torch.Tensor:
    """Random token ids `[batch, length]` from 3 upwards (0, 1, 2 are pad / eos / bos)."""
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def prompt(batch: int = 1, length: int = 15, pad: int = 0, seed: int = 0) -> dict[str, torch.Tensor]:
    """`generate` inputs: random tokens, the last row left-padded by `pad` tokens."""
    input_ids = tokens(length, batch, seed)
    attention_mask = torch.ones_like(input_ids)
    if pad:
        input_ids[-1, :pad], attention_mask[-1, :pad] = 0, 0
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def repetitive_prompt() -> dict[str, torch.Tensor]:
    """18 tokens, a repeated 7-gram: prompt lookup finds candidates in it."""
    pattern = [5, 17, 29, 41, 53, 65, 77]
    input_ids = torch.tensor([pattern * 2 + pattern[:4]])
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}


def random_schedule(total: int, draw: Callable[[], int]) -> list[int]:
    """Chunk sizes summing to `total`: `draw()` gives each next size, the last one is cut to what is left."""
    schedule, left = [], total
    while left:
        size = min(left, draw())
        schedule.append(size)
        left -= size
    return schedule


def oracle_chunk_sizes(window: int) -> list[int]:
    """The chunk sizes the oracle tests draw from for a sliding window `window` (1 counted twice)."""
    return [1, 1, 2, window - 1 or 1, window, window + 1, 2 * window, 3 * window]


def seeded_chunk_sizes(seed: int, one_token_share: float, high: int) -> Callable[[], int]:
    """A `draw` for `random_schedule` from a torch generator seeded with `seed`: a one-token step with probability
    `one_token_share`, else a chunk of 2 .. `high - 1` tokens."""
    generator = torch.Generator().manual_seed(seed)
    return lambda: (
        1
        if torch.rand((), generator=generator) < one_token_share
        else int(torch.randint(2, high, (), generator=generator))
    )


def left_padded_batch(rows: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Token rows of different lengths, left-padded with id 0 to the longest: `{"input_ids", "attention_mask"}`,
    each `[len(rows), longest]`."""
    width = max(len(row) for row in rows)
    input_ids = torch.zeros((len(rows), width), dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for index, row in enumerate(rows):
        input_ids[index, width - len(row) :] = row
        attention_mask[index, width - len(row) :] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def random_padded_batch(rng, batch: int, length: int, window: int) -> dict[str, torch.Tensor]:
    """Random tokens `[batch, length]`; row 0 unpadded, other rows left-padded by 0 .. 2 x window tokens (pad id 0).
    `rng` is a `random.Random`."""
    input_ids = tokens(length, batch, seed=rng.randint(0, 10**6))
    pads = [0] + [rng.randint(0, min(length - 1, 2 * window)) for _ in range(1, batch)]
    return left_padded_batch([row[pad:] for row, pad in zip(input_ids, pads)])


# --- checks ----------------------------------------------------------------------------------------------------------
TOLERANCE = 1e-4  # fp32 logits against the no-cache oracle


def assert_matches_oracle(got: torch.Tensor, expected: torch.Tensor, attention_mask: torch.Tensor, label: str):
    """Logits at real (unmasked) tokens: no NaN, and within `TOLERANCE` of the oracle's."""
    real = attention_mask.bool()
    assert not torch.isnan(got[real]).any(), f"{label}: NaN at a real token"
    difference = (got[real] - expected[real]).abs().max().item()
    assert difference <= TOLERANCE, f"{label}: max |logit difference| = {difference:.3g} > {TOLERANCE}"


def assert_close(got: torch.Tensor, expected: torch.Tensor, label: str = "") -> None:
    """Every logit within `TOLERANCE`."""
    difference = (got - expected).abs().max().item()
    assert difference <= TOLERANCE, f"{label}: max |logit difference| = {difference:.3g}"


def snapshot(cache: HybridRingCache) -> list:
    """Everything that defines the cache's state, to check that a refused call changed nothing."""
    state = []
    for layer in cache.layers:
        if isinstance(getattr(layer, "keys", None), torch.Tensor):
            state.append(
                (layer.get_seq_length(), getattr(layer, "_oldest", None), layer.keys.clone(), layer.values.clone())
            )
    return state


def assert_unchanged(before: list, cache: HybridRingCache) -> None:
    """`cache` holds what `snapshot` recorded in `before`."""
    after = snapshot(cache)
    assert len(before) == len(after)
    for (length, oldest, keys, values), (length2, oldest2, keys2, values2) in zip(before, after):
        assert (length, oldest) == (length2, oldest2) and torch.equal(keys, keys2) and torch.equal(values, values2)


# --- threads ---------------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """One torch thread inside the block: tiny models run faster, and logits are bit-reproducible across processes
    (the summation order of a kernel depends on its thread count)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


# --- the tiny text model and tokenizer of the tools' tests ---------------------------------------------------------
SAMPLE = (
    "To be, or not to be, that is the question:\n"
    "Whether 'tis nobler in the mind to suffer\n"
    "The slings and arrows of outrageous fortune,\n"
    "Or to take arms against a sea of troubles\n"
    "And by opposing end them. To die, to sleep;\n"
)


def tiny_model(
    vocab: int = 128,
    window: int = 6,
    layers: int = 6,
    softcap: float | None = None,
    layer_types: list[str] | None = None,
    seed: int = 0,
) -> Gemma3ForCausalLM:
    """The tools' tiny Gemma 3: `tiny_gemma3` with a vocabulary sized for `tiny_tokenizer` (128 by default)."""
    return tiny_gemma3(window, layers, seed=seed, vocab=vocab, softcap=softcap, layer_types=layer_types)


def tiny_tokenizer(text: str):
    """A byte-level BPE tokenizer trained on `text` (no download), ids 0..3 = pad, eos, bos, unk like Gemma."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers, processors, trainers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<pad>", "<eos>", "<bos>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([text], trainer)
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )


# --- decoding ------------------------------------------------------------------------------------------------------
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
