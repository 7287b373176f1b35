"""The banded prefill (`hybrid_cache.banded`): a long step's masks are described, not built, and attention runs block
by block on the keys each block can see.

Oracles: transformers' own `sdpa_mask` (the described mask, entry for entry, and no visible key outside a block's
range), `sdpa_attention_forward` with that dense mask (attention, fp32 1e-5), and whole models on transformers' SDPA
with `DynamicCache` (logits within 1e-5, greedy / beam / speculative tokens equal). Property style: seeded random
windows, lengths, offsets, paddings, image blocks, thresholds and block sizes; the threshold is lowered
(`banded_prefill`) so that the tiny models take the banded path. A `TorchDispatchMode` records every op output of a
long prefill: no tensor has two dimensions of half the prompt or more.
"""

from __future__ import annotations

import random

import pytest
import torch
from builders import (
    BANDED_TEST_SETTINGS,
    left_padded_batch,
    random_padded_batch,
    repetitive_prompt,
    tiny_gemma3,
    tiny_gemma4,
    tokens,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import DynamicCache, masking_utils
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import (
    and_masks,
    causal_mask_function,
    or_masks,
    padding_mask_function,
    sdpa_mask,
    sliding_window_causal_mask_function,
    sliding_window_overlay,
)

import hybrid_cache.code_attention as code_attention
from hybrid_cache import HybridRingCache, WindowMismatchError, cache_kwargs, use_code_attention
from hybrid_cache.banded import (
    BandedMask,
    BandedMaskError,
    _initial_settings,
    banded_attention,
    banded_prefill,
    banded_sdpa_mask,
    banded_settings,
    key_bounds,
)
from hybrid_cache.code_attention import CODE_ATTENTION
from hybrid_cache.compat import rollback_supported

#: Gemma 3 / 4's image-block mask piece; not in transformers 5.5 (its models use one of their own there).
blockwise_overlay = getattr(masking_utils, "blockwise_overlay", None)

FP32 = 1e-5
BUILDERS = {"gemma3": tiny_gemma3, "gemma4": tiny_gemma4}


class GQA(torch.nn.Module):
    """What the attention functions read of a module."""

    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, True


@pytest.fixture
def banded_calls(monkeypatch):
    """How many times `hybrid_cache_sdpa` took the banded path."""
    calls = []

    def spy(*args, **kwargs):
        calls.append(args[4].q_length)
        return banded_attention(*args, **kwargs)

    monkeypatch.setattr(code_attention, "banded_attention", spy)
    return calls


# --- the description: transformers' mask, entry for entry ----------------------------------------------------------
def random_mask_call(rng: random.Random) -> dict:
    """A mask call as transformers makes it for a step: `q` new tokens after `past`, keys held from `kv_offset`,
    left padding, and a random mask function of causal / sliding / image-block pieces (or an unknown one)."""
    batch, q, past, window = rng.randint(1, 3), rng.randint(1, 40), rng.randint(0, 30), rng.randint(1, 12)
    kv_offset = rng.choice([0, max(0, past - window + 1), rng.randint(0, past)])
    total = past + q
    ids = torch.full((batch, total), -1)
    for row in range(batch):  # image blocks: contiguous runs, numbered in order as transformers numbers them
        start, group = rng.randint(0, total), 0
        while start < total and rng.random() < 0.7:
            length = rng.randint(1, 2 * window)
            ids[row, start : start + length] = group
            start, group = start + length + rng.randint(1, 5), group + 1
    # Without blockwise_overlay (transformers 5.5) the kinds with image blocks are not drawn (a placeholder builds).
    blocks = blockwise_overlay(ids) if blockwise_overlay else causal_mask_function
    kinds = ["causal", "sliding", "gemma3-images", "full-images", "or-window", "and-custom", "unknown"]
    with_blocks = ("gemma3-images", "full-images", "or-window")
    kind = rng.choice([k for k in kinds if blockwise_overlay or k not in with_blocks])
    custom = lambda b, h, q_idx, kv_idx: (q_idx + kv_idx) % 3 != 0  # noqa: E731 (a function it cannot read)
    function = {
        "causal": causal_mask_function,
        "sliding": sliding_window_causal_mask_function(window),
        "gemma3-images": and_masks(or_masks(causal_mask_function, blocks), sliding_window_overlay(window)),
        "full-images": or_masks(causal_mask_function, blocks),
        "or-window": or_masks(sliding_window_causal_mask_function(window), blocks),
        "and-custom": and_masks(causal_mask_function, custom),  # bounded by its causal part
        "unknown": or_masks(causal_mask_function, custom),  # no upper bound
    }[kind]
    padding = None
    if rng.random() < 0.6:
        padding = torch.ones((batch, total), dtype=torch.bool)
        for row in range(1, batch):
            padding[row, : rng.randint(0, total)] = False
        if rng.random() < 0.2:
            padding = padding[:, : total - 1]  # narrower than the keys: transformers pads it with masked columns
    return {
        "batch_size": batch,
        "q_length": q,
        "kv_length": total - kv_offset,
        "q_offset": past,
        "kv_offset": kv_offset,
        "mask_function": function,
        "attention_mask": padding,
        "use_vmap": kind != "causal" and rng.random() < 0.5,
        "kind": kind,
    }


def dense_mask(call: dict) -> torch.Tensor:
    args = {key: value for key, value in call.items() if key != "kind"}
    return sdpa_mask(**args, allow_is_causal_skip=False)


@pytest.mark.parametrize("seed", range(60), ids=lambda s: f"seed{s}")
def test_description_is_transformers_mask_and_bounds_hold(seed):
    """The described mask is `sdpa_mask`'s, entry for entry; every key a query sees lies in its bound; no row of a
    block sees a key outside the block's range; the plain (no padding, no overlay) geometry cache changes nothing."""
    rng = random.Random(seed)
    call = random_mask_call(rng)
    expected = dense_mask(call)
    with banded_prefill(min_query_length=1):
        described = banded_sdpa_mask(**{key: value for key, value in call.items() if key != "kind"})
    if call["kind"] == "unknown":  # no upper bound: transformers' own call, unchanged
        unchanged = sdpa_mask(**{key: value for key, value in call.items() if key != "kind"})
        assert not isinstance(described, BandedMask)
        assert (described is None and unchanged is None) or torch.equal(described, unchanged)
        return
    assert isinstance(described, BandedMask), call["kind"]
    assert torch.equal(described.dense(), expected)
    queries = torch.arange(call["q_length"]) + call["q_offset"]
    lo, hi = key_bounds(call["mask_function"], queries)
    keys = torch.arange(call["kv_length"]) + call["kv_offset"]
    inside = (keys >= lo[..., None]) & (keys <= hi[..., None])  # [batch | 1, q, k]
    assert not (expected[:, 0] & ~inside).any(), "a visible key outside its query's bound"
    for _ in range(5):
        start = rng.randint(0, call["q_length"] - 1)
        stop = rng.randint(start + 1, call["q_length"])
        alignment = rng.choice([1, 2, 5, 16])
        low, high, pad = described.key_range(start, stop, alignment)
        rows = expected[:, 0, start:stop]
        assert not rows[..., :low].any() and not rows[..., high:].any()
        first = call["kv_offset"] + low - pad  # the aligned start, in absolute positions
        assert first % alignment == 0 and pad == max(call["kv_offset"] - first, 0) and 0 <= low < high
        assert high == call["kv_length"] or (call["kv_offset"] + high) % alignment == 0
        block = described.additive_block(start, stop, low, high, torch.float32, pad)
        assert (block[..., :pad] == -torch.inf).all()
        assert torch.equal(block[..., pad:] == 0, rows[..., None, :, low:high].expand_as(block[..., pad:]))
    size = rng.randint(1, 12)
    blocks = described.row_blocks(size, granularity := rng.randint(1, min(size, 4)))
    assert blocks[0][0] == 0 and blocks[-1][1] == call["q_length"] and all(a < b for a, b in blocks)
    assert all(b == c for (_, b), (c, _) in zip(blocks, blocks[1:]))
    starts = [call["q_offset"] + a for a, _ in blocks[1:]]
    assert all(p % granularity == 0 for p in starts) and all(b - a <= size for a, b in blocks)


def test_bounds_of_transformers_pieces():
    """`key_bounds` reads causal, sliding windows, image blocks, and/or; an unknown function is unbounded."""
    queries = torch.tensor([0, 5, 9])
    lo, hi = key_bounds(sliding_window_causal_mask_function(4), queries)
    assert lo.tolist() == [[-3, 2, 6]] and hi.tolist() == [[0, 5, 9]]
    if blockwise_overlay:
        ids = torch.tensor([[-1, 0, 0, 0, -1, -1, 1, 1, 1, 1]])
        lo, hi = key_bounds(or_masks(causal_mask_function, blockwise_overlay(ids)), torch.tensor([1, 4, 7]))
        assert hi.tolist() == [[3, 4, 9]]  # an image token sees the end of its block; a text token only the past
    lo, hi = key_bounds(padding_mask_function(torch.ones(1, 10, dtype=torch.bool)), queries)
    assert (lo < -(2**60)).all() and (hi > 2**60).all()


def test_short_steps_are_transformers_masks_unchanged():
    """Below the threshold the mask function is `sdpa_mask`: the same result (a tensor, or None where it skips)."""
    padding = torch.ones(2, 12, dtype=torch.bool)
    padding[1, :3] = False
    for function, attention_mask, local in (
        (causal_mask_function, None, None),
        (sliding_window_causal_mask_function(4), padding, 4),
        (causal_mask_function, padding, None),
    ):
        for q_length, q_offset in ((1, 11), (5, 7), (12, 0)):
            args = dict(
                batch_size=2,
                q_length=q_length,
                kv_length=12,
                q_offset=q_offset,
                kv_offset=0,
                mask_function=function,
                attention_mask=attention_mask,
                local_size=local,
            )
            with banded_prefill(min_query_length=13):
                got = banded_sdpa_mask(**args)
            expected = sdpa_mask(**args)
            assert (got is None and expected is None) or torch.equal(got, expected)
    with banded_prefill(min_query_length=None):  # off
        off = banded_sdpa_mask(2, 40, 40, mask_function=sliding_window_causal_mask_function(4), local_size=4)
        assert isinstance(off, torch.Tensor) and off.shape == (2, 1, 40, 40)


# --- the attention: SDPA with the dense mask ------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(30), ids=lambda s: f"seed{s}")
def test_attention_equals_sdpa_with_the_dense_mask(seed):
    """Random masks, grouped-query layouts (1, 2 or all KV heads), head sizes and block sizes: the output of every
    query row equals transformers' SDPA with the dense mask (fully masked rows too: zeros)."""
    rng = random.Random(1000 + seed)
    call = random_mask_call(rng)
    while call["kind"] == "unknown":
        call = random_mask_call(rng)
    heads = rng.choice([2, 4])
    kv_heads = rng.choice([1, 2, heads])
    dim = rng.choice([4, 8, 16])
    generator = torch.Generator().manual_seed(seed)
    batch, q, k = call["batch_size"], call["q_length"], call["kv_length"]
    query = torch.randn(batch, heads, q, dim, generator=generator)
    key = torch.randn(batch, kv_heads, k, dim, generator=generator)
    value = torch.randn(batch, kv_heads, k, dim, generator=generator)
    module = GQA(heads // kv_heads)
    expected, _ = sdpa_attention_forward(module, query, key, value, dense_mask(call), scaling=0.3)
    with banded_prefill(min_query_length=1, block_size=rng.randint(1, 9), key_alignment=rng.choice([1, 2, 8, 512])):
        mask = banded_sdpa_mask(**{key_: value_ for key_, value_ in call.items() if key_ != "kind"})
        got, weights = banded_attention(module, query, key, value, mask, scaling=0.3)
    assert weights is None and got.shape == expected.shape == (batch, q, heads, dim)
    torch.testing.assert_close(got, expected, rtol=0, atol=FP32)


def test_whole_prompt_causal_layer_is_one_maskless_call():
    """A causal full layer over the whole prompt, no padding: SDPA's own causal path (one call, no mask)."""
    query, key = torch.randn(1, 4, 50, 8), torch.randn(1, 1, 50, 8)
    with banded_prefill(min_query_length=1, block_size=4):
        mask = banded_sdpa_mask(1, 50, 50, mask_function=causal_mask_function)
        got, _ = banded_attention(GQA(4), query, key, key, mask)
    expected, _ = sdpa_attention_forward(GQA(4), query, key, key, None)
    torch.testing.assert_close(got, expected, rtol=0, atol=FP32)


def test_bfloat16_within_its_own_rounding():
    """bf16: the banded result is as far from the fp32 result as SDPA's own bf16 result (within 1.5x, plus one bf16
    step at the output's scale)."""
    generator = torch.Generator().manual_seed(3)
    query, key, value = (torch.randn(2, 4, 300, 32, generator=generator) for _ in range(3))
    padding = torch.ones(2, 300, dtype=torch.bool)
    padding[1, :40] = False
    call = dict(batch_size=2, q_length=300, kv_length=300, mask_function=sliding_window_causal_mask_function(64))
    dense = sdpa_mask(**call, attention_mask=padding, allow_is_causal_skip=False)
    exact, _ = sdpa_attention_forward(GQA(1), query, key, value, dense)
    low = [t.bfloat16() for t in (query, key, value)]
    sdpa_bf16, _ = sdpa_attention_forward(GQA(1), *low, dense)
    with banded_prefill(min_query_length=1, block_size=32):
        banded_bf16, _ = banded_attention(GQA(1), *low, banded_sdpa_mask(**call, attention_mask=padding))
    sdpa_error = (sdpa_bf16.float() - exact).abs().max().item()
    banded_error = (banded_bf16.float() - exact).abs().max().item()
    assert banded_error <= 1.5 * sdpa_error + 2**-8, (banded_error, sdpa_error)


def embedded_geometry(length: int, dtype: torch.dtype, seed: int = 0):
    """Query / keys / values of one layer of the embedded model (4 query heads over 1 KV head of 256)."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(1, h, length, 256, generator=generator).to(dtype) for h in (4, 1, 1)]


@pytest.mark.parametrize("block", [512, 384, 130])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_bit_identical_to_sdpa_on_the_whole_prompt(dtype, block):
    """With key ranges aligned to torch's CPU kernel (KEY_ALIGNMENT) and blocks starting on ROW_GRANULARITY rows,
    whatever the block size: a sliding layer (W = 512), a padded full layer and a causal one over 2048 tokens give
    transformers' SDPA output with the dense mask bit for bit; so do prefill steps of 512 / 1024 tokens (a sliding
    layer's step holding only the W - 1 keys before it), row for row against the whole prompt's."""
    query, key, value = embedded_geometry(2048, dtype)
    padding = torch.ones(1, 2048, dtype=torch.bool)
    padding[0, :37] = False  # left padding: the full layer needs its own mask
    module = GQA(4)
    for function, attention_mask, window in (
        (sliding_window_causal_mask_function(512), None, 512),
        (causal_mask_function, padding, None),
        (causal_mask_function, None, None),
    ):
        call = dict(mask_function=function, attention_mask=attention_mask, local_size=window)
        dense = sdpa_mask(1, 2048, 2048, **call)  # None for the causal layer: SDPA's causal path
        expected, _ = sdpa_attention_forward(module, query, key, value, dense)
        with banded_prefill(block_size=block):
            got, _ = banded_attention(module, query, key, value, banded_sdpa_mask(1, 2048, 2048, **call))
            assert torch.equal(got, expected), function
            for step in (512, 1024):
                for past in range(step, 2048, step):
                    first = max(0, past - 511) if window else 0  # what a ring / DynamicCache returns
                    keys = slice(first, past + step)
                    mask = banded_sdpa_mask(1, step, past + step - first, past, first, **call)
                    rows, _ = banded_attention(
                        module, query[:, :, past : past + step], key[:, :, keys], value[:, :, keys], mask
                    )
                    assert torch.equal(rows, expected[:, past : past + step]), (function, step, past)


# --- misuse ---------------------------------------------------------------------------------------------------------
def test_misuse_raises_clear_errors():
    with banded_prefill(min_query_length=1):
        mask = banded_sdpa_mask(1, 20, 20, mask_function=sliding_window_causal_mask_function(4))
    assert isinstance(mask, BandedMask) and mask.shape == (1, 1, 20, 20)
    with pytest.raises(BandedMaskError, match="hybrid_cache_sdpa.*attn_implementation='sdpa'"):
        torch.cat([mask, mask])  # what another consumer of the mask would do
    with pytest.raises(BandedMaskError, match="torch function"):
        torch.where(mask, 0.0, 1.0)
    with pytest.raises(BandedMaskError, match="slice of query rows"):
        mask[0]
    rows = mask[:, :, slice(-3, None), :]  # Gemma 4's selection before its KV-shared layers
    assert (rows.q_length, rows.q_offset) == (3, 17)
    assert torch.equal(rows.dense(), mask.dense()[:, :, -3:])
    with pytest.raises(BandedMaskError, match="another step"):
        banded_attention(GQA(1), torch.randn(1, 2, 19, 4), torch.randn(1, 2, 20, 4), torch.randn(1, 2, 20, 4), mask)
    with pytest.raises(ValueError, match="softcap"):
        banded_attention(GQA(1), *(torch.randn(1, 2, 20, 4),) * 3, mask, softcap=30.0)
    for bad in (
        {"min_query_length": 0},
        {"block_size": None},
        {"block_size": 2.5},
        {"min_query_length": True},
        {"key_alignment": 0},
    ):
        with pytest.raises(BandedMaskError, match="positive int"):
            with banded_prefill(**bad):
                pass
    before = banded_settings()
    with banded_prefill(min_query_length=7, block_size=3, key_alignment=2):
        assert banded_settings() == (7, 3, 2)
    assert banded_settings() == before


def test_environment_switch(monkeypatch):
    monkeypatch.setenv("HYBRID_CACHE_BANDED", "off")
    assert _initial_settings().min_query_length is None
    monkeypatch.setenv("HYBRID_CACHE_BANDED", "sometimes")
    with pytest.raises(BandedMaskError, match="auto.*off"):
        _initial_settings()


# --- whole models: transformers' SDPA + DynamicCache ----------------------------------------------------------------
@torch.no_grad()
def reference_logits(model, batch) -> torch.Tensor:
    """transformers' own SDPA and DynamicCache, the whole prompt in one forward."""
    model.set_attn_implementation("sdpa")
    try:
        cache = DynamicCache(config=model.config)
        return model(**batch, **cache_kwargs(cache), use_cache=True).logits
    finally:
        model.set_attn_implementation(CODE_ATTENTION)


def cache_for(kind: str, model):
    return {"none": None, "dynamic": DynamicCache(config=model.config), "ring": HybridRingCache(model.config)}[kind]


@pytest.mark.parametrize("kind", ["none", "dynamic", "ring"])
@pytest.mark.parametrize("seed", range(8), ids=lambda s: f"seed{s}")
def test_models_match_sdpa_dynamic_cache(model_name, kind, seed, banded_calls):
    """Random windows, prompt lengths (shorter and longer than the window), left paddings, batch sizes, thresholds
    (just below, at and above the prompt) and block sizes: fp32 logits within 1e-5 of transformers' SDPA with
    DynamicCache over the whole prompt; the banded path ran exactly when the prompt reached the threshold."""
    rng = random.Random(f"{model_name}-{kind}-{seed}")
    window = rng.choice([3, 5, 8])
    model = BUILDERS[model_name](window=window, attn=CODE_ATTENTION, seed=seed)
    length = rng.randint(2, 6 * window)
    batch = random_padded_batch(rng, rng.randint(1, 3), length, window)
    threshold = rng.choice([length - 1, length, length + 1, 2]) or 1
    expected = reference_logits(model, batch)
    settings = dict(block_size=rng.randint(1, 2 * window), key_alignment=rng.choice([1, 2, 4, 512]))
    with torch.no_grad(), banded_prefill(min_query_length=threshold, **settings):
        cache = cache_for(kind, model)
        extra = {} if cache is None else {**cache_kwargs(cache), "use_cache": True}
        got = model(**batch, **extra).logits
    real = batch["attention_mask"].bool()
    difference = (got[real] - expected[real]).abs().max().item()
    assert difference <= FP32, f"W={window} T={length} threshold={threshold}: {difference:.3g}"
    assert bool(banded_calls) == (length >= threshold)


def generate(model, inputs, cache: str, new_tokens: int = 12, **kwargs) -> torch.Tensor:
    made = cache_for(cache, model)
    with torch.no_grad():
        return model.generate(
            **inputs,
            **({} if made is None else cache_kwargs(made)),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=0,
            **kwargs,
        )


GENERATE_CASES = {
    "greedy-padded": ("padded", {"do_sample": False}),
    "beams3": ("padded", {"num_beams": 3, "do_sample": False}),
    "beams3-return2": ("single", {"num_beams": 3, "num_return_sequences": 2, "do_sample": False}),
    "prefill-chunks": ("single", {"do_sample": False, "prefill_chunk_size": 7}),
    "prompt-lookup": ("repetitive", {"do_sample": False, "prompt_lookup_num_tokens": 3}),
    "assisted": ("single", {"do_sample": False}),
    "fixed-capacity": ("padded", {"do_sample": False}),
}


@pytest.mark.parametrize("case", list(GENERATE_CASES))
def test_generate_matches_sdpa_dynamic_cache(model_name, case, banded_calls):
    """`generate` through the ring on the banded path (prefill, chunks, verification steps of 2+ tokens) gives
    transformers' SDPA + DynamicCache tokens."""
    if case in ("assisted", "prompt-lookup") and not rollback_supported():
        pytest.skip("speculative decoding past the window is exact from transformers 5.18 (compat.ROLLBACK_SINCE)")
    batch_kind, kwargs = GENERATE_CASES[case]
    model = BUILDERS[model_name](window=5, attn=CODE_ATTENTION)
    inputs = {
        "padded": lambda: left_padded_batch([tokens(23, seed=1)[0], tokens(9, seed=2)[0]]),
        "single": lambda: left_padded_batch([tokens(19, seed=3)[0]]),
        "repetitive": repetitive_prompt,
    }[batch_kind]()
    if case == "assisted":
        kwargs = {**kwargs, "assistant_model": tiny_gemma3(window=5, layers=2, seed=7)}
    model.set_attn_implementation("sdpa")
    expected = generate(model, inputs, "dynamic", **kwargs)
    model.set_attn_implementation(CODE_ATTENTION)
    with banded_prefill(**BANDED_TEST_SETTINGS):
        if case == "fixed-capacity":
            cache = HybridRingCache(model.config, max_cache_len=64)
            with torch.no_grad():
                got = model.generate(
                    **inputs, **cache_kwargs(cache), max_new_tokens=12, min_new_tokens=12, pad_token_id=0, **kwargs
                )
        else:
            got = generate(model, inputs, "ring", **kwargs)
    assert torch.equal(got, expected), f"{case}: {got.tolist()} != {expected.tolist()}"
    assert banded_calls


def test_multi_turn_after_the_wrap(model_name, banded_calls):
    """Two `generate` turns on one ring, the second prompt longer than the window after the wrap (a held window
    plus a long step): the same tokens as SDPA + DynamicCache."""
    model = BUILDERS[model_name](window=4, attn=CODE_ATTENTION)
    first = left_padded_batch([tokens(15, seed=4)[0], tokens(11, seed=5)[0]])
    user = tokens(13, seed=6).expand(2, -1)

    def chat(cache):
        out = model.generate(**first, **cache_kwargs(cache), max_new_tokens=9, min_new_tokens=9, do_sample=False)
        ids = torch.cat([out, user], 1)
        mask = torch.cat([first["attention_mask"], torch.ones_like(ids[:, first["input_ids"].shape[1] :])], 1)
        return model.generate(
            input_ids=ids, attention_mask=mask, **cache_kwargs(cache), max_new_tokens=9, min_new_tokens=9
        )

    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        expected = chat(DynamicCache(config=model.config))
        model.set_attn_implementation(CODE_ATTENTION)
        with banded_prefill(**BANDED_TEST_SETTINGS):
            got = chat(HybridRingCache(model.config))
    assert torch.equal(got, expected)
    assert max(banded_calls) >= 13


def test_window_check_still_guards_long_steps():
    """A ring built for a smaller window than the model's: a long step after the wrap is refused by the mask hook
    (`HeldFromOffset`) before the banded mask is described."""
    import copy

    model = tiny_gemma3(window=6, attn=CODE_ATTENTION)
    small = copy.deepcopy(model.config)
    small.sliding_window = 4
    cache = HybridRingCache(small)
    with torch.no_grad(), banded_prefill(**BANDED_TEST_SETTINGS):
        model(input_ids=tokens(9), **cache_kwargs(cache), use_cache=True)
        with pytest.raises(WindowMismatchError, match="sliding_window=6"):
            model(input_ids=tokens(8, seed=1), **cache_kwargs(cache), use_cache=True)


# --- no tensor of two dimensions of half the prompt ------------------------------------------------------------------
class LargeTensors(TorchDispatchMode):
    """Records every op output with two or more dimensions of at least `limit`."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit, self.found = limit, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and sum(size >= self.limit for size in tensor.shape) >= 2:
                self.found.append((str(func), tuple(tensor.shape)))
        return out


def prefill_large_tensors(model, length: int, cache_kind: str, padded: bool = False, **generate_kwargs) -> list:
    ids = tokens(length, batch=2 if padded else 1, seed=8).clamp(max=model.config.get_text_config().vocab_size - 1)
    mask = torch.ones_like(ids)
    if padded:
        mask[1, : length // 3] = 0
    recorder = LargeTensors(length // 2)
    cache = cache_for(cache_kind, model)
    with torch.inference_mode(), use_code_attention(model), recorder:
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            **({} if cache is None else cache_kwargs(cache)),
            max_new_tokens=1,
            do_sample=False,
            pad_token_id=0,
            **generate_kwargs,
        )
    return recorder.found


@pytest.mark.parametrize("steps", [None, 100], ids=["one-forward", "steps"])
@pytest.mark.parametrize("padded", [False, True], ids=["one", "padded"])
@pytest.mark.parametrize("cache_kind", ["ring", "dynamic"])
def test_no_quadratic_tensor_in_a_long_prefill(model_name, cache_kind, padded, steps):
    """A 256-token prompt (every model dimension below 128): no op output of 128 x 128 or more, with the ring or
    DynamicCache, padded or not, in one forward or in prefill steps; transformers' SDPA path does make them (so the
    recorder sees them)."""
    model = BUILDERS[model_name](window=6, attn="sdpa")
    with banded_prefill(min_query_length=16, block_size=8):
        assert prefill_large_tensors(model, 256, cache_kind, padded, prefill_chunk_size=steps) == []
    with banded_prefill(min_query_length=None):
        assert prefill_large_tensors(model, 256, cache_kind, padded, prefill_chunk_size=None), "no dense mask seen"


@pytest.mark.slow
def test_embedded_model_long_prefill_is_exact_and_linear():
    """The embedded Gemma 3 270M (18 layers, 15 sliding, W = 512): an 8192-token prompt through `generate` with
    `use_code_attention` and HybridRingCache makes no tensor of two dimensions >= 4096 (in prefill steps and in one
    forward); a 2048-token prompt's fp32 logits are within 1e-5 of SDPA + DynamicCache's (one forward, and chunks of
    512 through the ring), and `generate` (prefill steps) gives its greedy tokens."""
    from hybrid_cache.tools.models import load_model

    model, _ = load_model(None, dtype=torch.float32, attn_implementation="sdpa")
    assert prefill_large_tensors(model, 8192, "ring") == []  # in prefill steps (use_code_attention's default)
    assert prefill_large_tensors(model, 8192, "ring", prefill_chunk_size=None) == []  # one forward
    ids = tokens(2048, seed=11).clamp(max=20000)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    with torch.no_grad():
        expected = model(**batch, **cache_kwargs(DynamicCache(config=model.config)), use_cache=True).logits
        with use_code_attention(model):
            got = model(**batch, **cache_kwargs(HybridRingCache(model.config)), use_cache=True).logits
            ring, chunks = HybridRingCache(model.config), []
            for start in range(0, 2048, 512):
                chunks.append(
                    model(input_ids=ids[:, start : start + 512], **cache_kwargs(ring), use_cache=True).logits
                )
    # The attention is SDPA's bit for bit (the tests above); the whole model within the 1e-5 (fp32), since
    # the other layers' matmuls may round rows of 512 otherwise than rows of 2048.
    assert (got - expected).abs().max().item() < 1e-5
    assert (torch.cat(chunks, 1) - expected).abs().max().item() < 1e-5
    kwargs = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False)
    with torch.no_grad():
        reference = model.generate(**batch, **cache_kwargs(DynamicCache(config=model.config)), **kwargs)
        with use_code_attention(model):
            ring = model.generate(**batch, **cache_kwargs(HybridRingCache(model.config)), **kwargs)
    assert torch.equal(ring, reference)
