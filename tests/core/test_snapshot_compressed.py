"""Save / load and checkpoint / restore of caches with compressed (`full_layer_quantization`) or bounded
(`full_layer_window`) full-attention layers: each storage exports and restores its own state (codes, scales and key
calibration; sink and window slots with their counters).

The oracle is the uninterrupted run of the same cache: a loaded or restored cache, fed the same chunk and then decoding
greedily, gives bit-identical logits and the same tokens. Property style: seeded random storage variants (int8 / int4 /
fp8, group sizes, calibration and rotation on / off, fixed capacity; sink tokens, windows and rollback margins), prompt
lengths before and after the rings' and the bounded layers' wrap, chunk schedules and batch sizes, on tiny Gemma 3
and Gemma 4. Then the refusals: a file or a state loaded into a cache that stores it differently names the option.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import random

import pytest
import torch
from builders import MODEL_BUILDERS, VOCAB, chunked_logits
from safetensors import safe_open
from safetensors.torch import save_file

from hybrid_cache import HybridRingCache, snapshot
from hybrid_cache.compat import cache_kwargs
from hybrid_cache.quantized import DequantWorkspace, QuantizedFullLayer
from hybrid_cache.streaming import SinkWindowFullLayer

SEEDS = int(os.environ.get("HYBRID_CACHE_SNAPSHOT_SEEDS", "12"))

pytestmark = pytest.mark.usefixtures("one_thread")


@functools.cache
def get_model(name: str, window: int):
    return MODEL_BUILDERS[name](window=window)


# Every seed's storage variant (seed modulo the table), its other options drawn at random: each one runs with both
# models at the default seed count.
VARIANTS = (
    ("int8", False, True, False),  # (mode, rotate, key calibration, fixed capacity)
    ("int4", False, True, False),
    ("fp8", False, True, False),
    ("int8", False, False, False),
    ("int4", True, True, False),
    ("fp8", False, True, True),
    ("int4", True, False, True),
    "sink_window",
)


def random_storage(rng: random.Random, seed: int, total: int) -> dict:
    """Constructor options of a compressed or bounded cache."""
    variant = VARIANTS[seed % len(VARIANTS)]
    if variant == "sink_window":
        return {
            "full_layer_window": rng.randint(2, 7),
            "full_layer_sink_tokens": rng.randint(0, 3),
            "rollback_margin": rng.choice([0, 0, 2]),
        }
    mode, rotate, calibration, fixed = variant
    options = {
        "full_layer_quantization": mode,
        "full_layer_group_size": rng.choice([64, 4, 8]),
        "full_layer_rotation": rotate,
        "full_layer_key_calibration": calibration,
        "rollback_margin": rng.choice([0, 0, 1]),
    }
    if fixed:
        options["max_cache_len"] = total + rng.randint(0, 3)  # `StaticQuantizedFullLayer`
    return options


def schedule_of(rng: random.Random, length: int) -> list[int]:
    sizes = []
    while length:
        sizes.append(min(length, rng.choice([1, 2, 3, 5, 8])))
        length -= sizes[-1]
    return sizes


def step(model, cache, tokens: torch.Tensor, held: int) -> torch.Tensor:
    mask = torch.ones(tokens.shape[0], held + tokens.shape[1], dtype=torch.long)
    with torch.no_grad():
        return model(input_ids=tokens, attention_mask=mask, **cache_kwargs(cache), use_cache=True).logits


def continue_greedy(model, cache, forced: torch.Tensor, held: int, new_tokens: int):
    """Feed `forced` (one chunk), then decode `new_tokens` greedily; return every logit and the generated tokens."""
    logits = [step(model, cache, forced, held)]
    held += forced.shape[1]
    generated = []
    for _ in range(new_tokens):
        token = logits[-1][:, -1:].argmax(-1)
        generated.append(token)
        logits.append(step(model, cache, token, held))
        held += 1
    return torch.cat(logits, dim=1), torch.cat(generated, dim=1)


def prefilled(model, options: dict, prompt: torch.Tensor, rng: random.Random) -> HybridRingCache:
    cache = HybridRingCache(model.config, **options)
    with torch.no_grad():
        chunked_logits(model, cache, prompt, schedule_of(rng, prompt.shape[1]))
    return cache


# --- the property: save / load and checkpoint / restore continue exactly -------------------------------------------
@pytest.mark.parametrize("seed", range(SEEDS), ids=lambda s: f"seed{s}")
def test_compressed_and_bounded_caches_continue_exactly(model_name, seed, tmp_path):
    rng = random.Random(f"snapshot-compressed-{model_name}-{seed}")
    window = rng.choice([3, 4, 6])
    model = get_model(model_name, window)
    prompt_length = rng.choice([rng.randint(1, window), rng.randint(window + 1, 5 * window)])
    forced_length, new_tokens = rng.randint(1, 4), rng.randint(2, 2 * window)
    total = prompt_length + forced_length + new_tokens
    batch = rng.randint(1, 2)
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, VOCAB, (batch, prompt_length), generator=generator)
    forced = torch.randint(3, VOCAB, (batch, forced_length), generator=generator)
    options = random_storage(rng, seed, total)
    label = f"{options} W={window} batch={batch} prompt={prompt_length} forced={forced_length} new={new_tokens}"

    cache = prefilled(model, options, prompt, rng)
    path = tmp_path / "cache.safetensors"
    cache.save(path)
    checkpoint = cache.checkpoint()
    saved = held(cache)
    expected_logits, expected_tokens = continue_greedy(model, cache, forced, prompt_length, new_tokens)

    loaded = HybridRingCache.load(path, model.config)
    assert loaded.options == cache.options
    assert_same_held(held(loaded), saved)  # same counters, settings, capacities and bit-identical tensors
    got_logits, got_tokens = continue_greedy(model, loaded, forced, prompt_length, new_tokens)
    assert torch.equal(got_tokens, expected_tokens), f"{label}: loaded cache generates other tokens"
    assert torch.equal(got_logits, expected_logits), f"{label}: loaded cache gives other logits"

    cache.restore(checkpoint)
    assert_same_held(held(cache), saved, capacities=False)  # a restored full layer keeps the capacity it grew to
    got_logits, got_tokens = continue_greedy(model, cache, forced, prompt_length, new_tokens)
    assert torch.equal(got_tokens, expected_tokens), f"{label}: restored cache generates other tokens"
    assert torch.equal(got_logits, expected_logits), f"{label}: restored cache gives other logits"

    # `load_into` a cache built with the same options (already used for another prompt) continues the same way.
    other_prompt = torch.randint(3, VOCAB, (batch, rng.randint(1, min(9, total))), generator=generator)
    other = prefilled(model, options, other_prompt, rng)
    snapshot.load_into(other, path)
    got_logits, got_tokens = continue_greedy(model, other, forced, prompt_length, new_tokens)
    assert torch.equal(got_logits, expected_logits), f"{label}: load_into gives other logits"


@pytest.mark.parametrize(
    "options",
    [
        {"full_layer_quantization": "int4"},
        {"full_layer_quantization": "fp8", "full_layer_key_calibration": False},
        {"full_layer_quantization": "int8", "full_layer_rotation": True, "max_cache_len": 40},
        {"full_layer_window": 5, "full_layer_sink_tokens": 2},
    ],
    ids=["int4", "fp8-uncalibrated", "int8-rotated-static", "sink-window"],
)
def test_file_holds_each_layers_own_state(options, tmp_path):
    """Files name each storage's tensors (codes and scales, never dequantized) and settings."""
    model = get_model("gemma3", 4)
    cache = prefilled(model, options, torch.randint(3, VOCAB, (1, 13)), random.Random(0))
    path = tmp_path / "cache.safetensors"
    cache.save(path)
    full = next(i for i, kind in enumerate(cache.layer_kinds) if kind == "full_attention")
    with safe_open(path, framework="pt") as handle:
        assert handle.metadata()["hybrid_cache.format_version"] == "3"
        names = {name.split(".", 2)[2] for name in handle.keys() if name.startswith(f"layers.{full}.")}
        if "full_layer_quantization" in options:
            assert handle.get_tensor(f"layers.{full}.key_codes").dtype in (torch.int8, torch.float8_e4m3fn)
    if "full_layer_window" in options:
        assert names == {"keys", "values"}
    else:
        calibrated = options.get("full_layer_key_calibration", True)
        assert names == {"key_codes", "key_scales", "value_codes", "value_scales"} | (
            {"key_shift", "key_scale"} if calibrated else set()
        )


@pytest.mark.parametrize("options", [{}, {"full_layer_quantization": "int4"}, {"full_layer_window": 3}], ids=str)
def test_files_record_every_option_by_name(options, tmp_path):
    """`save` writes every `CacheOptions` field by name and `load` rebuilds the same options from them (nothing
    dropped back to a default): exact, compressed and bounded caches alike, and a non-default of every kind."""
    import dataclasses

    model = get_model("gemma3", 4)
    options = {**options, "rollback_margin": 2, "initial_capacity": 16, "dense_decode_mask": False}
    cache = prefilled(model, options, torch.randint(3, VOCAB, (1, 9)), random.Random(0))
    cache.save(tmp_path / "cache.safetensors")
    with safe_open(tmp_path / "cache.safetensors", framework="pt") as handle:
        saved = json.loads(handle.metadata()["hybrid_cache.state"])["options"]
    assert saved == dataclasses.asdict(cache.options)
    assert HybridRingCache.load(tmp_path / "cache.safetensors", model.config).options == cache.options


# --- checkpoints of compressed layers keep only the length: refused once their tokens were rewritten --------------
@pytest.mark.parametrize("max_cache_len", [None, 40], ids=["growing", "static"])
def test_restore_refuses_rewritten_compressed_tokens(max_cache_len):
    model = get_model("gemma3", 4)
    options = {"full_layer_quantization": "int8", "max_cache_len": max_cache_len}
    cache = prefilled(model, options, torch.randint(3, VOCAB, (1, 10)), random.Random(0))
    checkpoint = cache.checkpoint()
    step(model, cache, torch.randint(3, VOCAB, (1, 3)), 10)
    cache.restore(checkpoint)  # tokens 10..12 only: exact
    cache.reset()
    step(model, cache, torch.randint(3, VOCAB, (1, 12)), 0)  # a new prompt rewrites (and recalibrates) from 0
    with pytest.raises(ValueError, match="no longer holds its 10 tokens"):
        cache.restore(checkpoint)


# --- mismatches name the option and the fix, and change nothing ---------------------------------------------------
@pytest.mark.parametrize(
    ("saved", "target", "option"),
    [
        ({"full_layer_quantization": "int8"}, {"full_layer_quantization": "int4"}, "full_layer_quantization"),
        (
            {"full_layer_quantization": "int8", "full_layer_group_size": 4},
            {"full_layer_quantization": "int8", "full_layer_group_size": 8},
            "full_layer_group_size",
        ),
        (
            {"full_layer_quantization": "int4"},
            {"full_layer_quantization": "int4", "full_layer_key_calibration": False},
            "full_layer_key_calibration",
        ),
        ({"full_layer_window": 5}, {"full_layer_window": 6}, "full_layer_window"),
        ({"full_layer_quantization": "fp8"}, {}, "exact full-attention storage"),
        ({}, {"full_layer_window": 5}, "bounded full-attention storage"),
    ],
    ids=["int8-into-int4", "group-size", "calibration", "window", "compressed-into-exact", "exact-into-bounded"],
)
def test_loading_into_other_storage_is_refused_clearly(model_name, saved, target, option, tmp_path):
    model = get_model(model_name, 4)
    path = tmp_path / "cache.safetensors"
    prefilled(model, saved, torch.randint(3, VOCAB, (1, 11)), random.Random(1)).save(path)
    cache = prefilled(model, target, torch.randint(3, VOCAB, (1, 7)), random.Random(2))
    before = held(cache)
    with pytest.raises(ValueError, match="saved from a cache with other storage") as error:
        snapshot.load_into(cache, path)
    assert option in str(error.value) and "HybridRingCache.load(path, config)" in str(error.value)
    assert_same_held(held(cache), before)  # a refused load changes nothing
    # `HybridRingCache.load` builds the cache the file describes instead.
    assert HybridRingCache.load(path, model.config).get_seq_length() == 11


def held(cache: HybridRingCache) -> list:
    """Every layer's exported state: counters and settings, and a copy of its tensors."""
    states = []
    for layer in cache.layers:
        meta = layer.meta_state() if getattr(layer, "state_kind", None) else None
        states.append(None if meta is None else (meta, {k: v.clone() for k, v in layer.state().items()}))
    return states


def assert_same_held(got: list, expected: list, capacities: bool = True) -> None:
    for index, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert (a is None) == (b is None), index
        if a is not None:
            ignored = set() if capacities else {"capacity"}
            assert {k: v for k, v in a[0].items() if k not in ignored} == {
                k: v for k, v in b[0].items() if k not in ignored
            }, index
            assert a[1].keys() == b[1].keys() and all(torch.equal(a[1][k], b[1][k]) for k in a[1]), index


def test_layers_own_their_state():
    """The layer-level surface: `state()` / `load_state(meta, **state)` round trip, `state_mismatch` names the
    option, `accepts_state` checks the counters."""
    workspace = DequantWorkspace()
    int8, int4 = QuantizedFullLayer("int8", workspace), QuantizedFullLayer("int4", workspace)
    keys = torch.randn(1, 2, 5, 8)
    int8.update(keys, keys.clone())
    meta = int8.meta_state()
    assert int8.state_mismatch(meta) is None
    assert "full_layer_quantization: state 'int8', this cache 'int4'" in int4.state_mismatch(meta)
    copy = QuantizedFullLayer("int8", workspace)
    copy.load_state(meta, **int8.state())
    assert copy.meta_state() == meta
    assert all(torch.equal(copy.state()[name], tensor) for name, tensor in int8.state().items())
    assert copy.state().keys() == {"key_codes", "key_scales", "value_codes", "value_scales", "key_shift", "key_scale"}
    bounded, other = SinkWindowFullLayer(2, 3), SinkWindowFullLayer(2, 4)
    bounded.update(keys, keys.clone())
    meta = bounded.meta_state()
    assert meta["oldest"] == 2 and meta["slots"] == 5  # positions 0, 1 (sinks) and 2..4 (window 3)
    assert bounded.accepts_state(meta) and "full_layer_window" in other.state_mismatch(meta)
    assert not other.accepts_state(meta)  # another capacity as well


def test_file_whose_layers_disagree_with_its_options_is_invalid(tmp_path):
    """`load` builds the cache from the file's options: a layer saved with other settings (an edited header whose
    digest was recomputed too) is an invalid file, named as such, not a cache that would continue differently."""
    model = get_model("gemma3", 4)
    path = tmp_path / "cache.safetensors"
    prefilled(model, {"full_layer_quantization": "int8"}, torch.randint(3, VOCAB, (1, 9)), random.Random(0)).save(path)
    with safe_open(path, framework="pt") as handle:
        header = handle.metadata()
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    state, digest = json.loads(header["hybrid_cache.state"]), json.loads(header["hybrid_cache.digest"])
    state["options"]["full_layer_quantization"] = "int4"
    digest["options"] = hashlib.sha256(json.dumps(state["options"], sort_keys=True).encode()).hexdigest()
    forged = {**header, "hybrid_cache.state": json.dumps(state), "hybrid_cache.digest": json.dumps(digest)}
    save_file(tensors, path, metadata=forged)
    with pytest.raises(ValueError, match="not a valid HybridRingCache file: layer 5: full_layer_quantization"):
        HybridRingCache.load(path, model.config)
