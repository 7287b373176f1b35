"""Every family of the installed transformers whose decoder declares sliding or chunked layers, on a tiny random model.

The families are enumerated from transformers itself (`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`): a model type is in when
its default configuration's decoder declares `sliding_attention` or `chunked_attention` layers in `layer_types`, or
does once sliding is switched on (`use_sliding_window`, `max_window_layers`: Qwen 2 / 3, SmolLM 3, dots1, ...). Each
one is shrunk generically (`SHRINK`, plus `OVERRIDES` for the few that need more) to a 4-layer decoder that keeps
every layer type the family declares, then:

- a family whose layers the cache stores (sliding, full, chunked, KV-shared) runs the stepped oracle (a left-padded
  batch through `HybridRingCache` in chunks and single steps, against one no-cache forward) and greedy `generate`
  parity with `DynamicCache` (the same tokens);
- a family with layer types the cache does not store (`conv`, `linear_attention`, `indexed_attention`, ...), or one
  that writes cache layers its config does not declare (`dory`'s recurrent loops), is refused by the cache's
  constructor with its own error, naming `DynamicCache`;
- a family that cannot be built tiny here is skipped with the reason (`SKIPPED`).

A composite type whose decoder is another enumerated type (`gemma3` -> `gemma3_text`) is tested as that type. The
table the README quotes is what `pytest tests/core/test_families.py -rs -v` prints on transformers 5.25.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from builders import VOCAB, assert_matches_oracle, chunked_logits, left_padded_batch, no_cache_logits, tokens
from transformers import AutoModelForCausalLM, DynamicCache
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from hybrid_cache import HybridRingCache
from hybrid_cache.compat import cache_kwargs
from hybrid_cache.specs import CHUNKED, FULL, SLIDING

# Minutes of compile-free but many-model work that depends on which model types the release ships: the whole suite runs
# it on the project's release (setup.cfg's `slow` marker); older releases' quick suites leave it out.
pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]

WINDOW, LAYERS = 4, 4
STORED = {SLIDING, FULL, CHUNKED}

#: Sizes every family gets where its config has the field (fields it lacks are left out).
SHRINK = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "vocab_size": VOCAB,
    "max_position_embeddings": 256,
    "sliding_window": WINDOW,
    "num_local_experts": 4,
    "num_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "n_shared_experts": 1,
    "pad_token_id": 0,
    "bos_token_id": 2,
    "eos_token_id": 1,
}

#: What switches sliding layers on where a family's default declares none (Qwen 2 / 3, SmolLM 3, dots1).
SLIDING_ON = {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}

_GEMMA4 = {
    "global_head_dim": 16,
    "num_global_key_value_heads": 1,
    "hidden_size_per_layer_input": 8,
    "vocab_size_per_layer_input": VOCAB,
    "num_kv_shared_layers": 2,
}
#: Per-family additions to `SHRINK` (`LAYERS` and `layer_types` may be overridden too).
OVERRIDES: dict[str, dict] = {
    "dory": {"n_input_layers": 1, "n_output_layers": 1},
    "gemma3n_text": {
        "num_hidden_layers": 6,
        "layer_types": [SLIDING, FULL] * 3,
        "num_kv_shared_layers": 2,
        "hidden_size_per_layer_input": 8,
        "vocab_size_per_layer_input": VOCAB,
        "activation_sparsity_pattern": [0.95, 0.95, 0.0, 0.0, 0.0, 0.0],
        "laurel_rank": 4,
    },
    "gemma4_text": {**_GEMMA4, "num_hidden_layers": 6, "layer_types": [SLIDING, SLIDING, FULL] * 2},
    "gemma4_unified_text": {**_GEMMA4, "num_hidden_layers": 6, "layer_types": [SLIDING, SLIDING, FULL] * 2},
    "gemma4_unified_assistant": {**_GEMMA4, "num_hidden_layers": 6, "layer_types": [SLIDING, SLIDING, FULL] * 2},
    "dots3_note_text": {"num_key_value_heads": 4},
    "kolibri1_1": {"head_dim": 16, "index_num_heads": 1},
}

#: Families that cannot be built tiny here, with the reason.
SKIPPED: dict[str, str] = {}


def _declared_types(config) -> list[str]:
    decoder = config.get_text_config(decoder=True)
    return list(getattr(decoder, "layer_types", None) or [])


def _windowed(types: list[str]) -> bool:
    return any("sliding" in kind or "chunked" in kind for kind in types)


def _fields(config) -> set[str]:
    return set(config.to_dict())


@functools.cache
def _default_config(model_type: str):
    """The family's default configuration, with sliding switched on where its default declares none; `None` when it
    declares no sliding or chunked layers either way; the reason when it cannot be built by default."""
    config_class = CONFIG_MAPPING[model_type]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            config = config_class()
        except Exception as error:  # noqa: BLE001 - reported as the family's skip reason
            return f"its default configuration does not build ({type(error).__name__}: {str(error).splitlines()[-1]})"
        if not _windowed(_declared_types(config)):
            switch = {key: value for key, value in SLIDING_ON.items() if key in _fields(config)}
            if "use_sliding_window" not in switch and "max_window_layers" not in switch:
                return None
            config = config_class(**switch)
    return config if _windowed(_declared_types(config)) else None


@functools.cache
def families() -> dict[str, str]:
    """`{model_type: decoder model type}` of every causal-LM family whose decoder declares sliding / chunked layers
    (and of those whose default configuration does not build, to be skipped with the reason)."""
    found = {}
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        if model_type not in CONFIG_MAPPING:
            continue
        config = _default_config(model_type)
        if isinstance(config, str):
            found[model_type] = model_type  # layer types unknown: listed, skipped with the reason
        elif config is not None:
            found[model_type] = config.get_text_config(decoder=True).model_type
    return found


def tiny_config(model_type: str):
    """The family's configuration shrunk to `LAYERS` layers that keep each of its layer types."""
    default = _default_config(model_type)
    kinds = list(dict.fromkeys(_declared_types(default)))
    fields = _fields(default)
    kwargs = {key: value for key, value in SHRINK.items() if key in fields}
    kwargs.update({key: value for key, value in SLIDING_ON.items() if key in fields and key != "sliding_window"})
    if "use_sliding_window" not in fields:
        kwargs.pop("max_window_layers", None)
    kwargs["num_hidden_layers"] = LAYERS
    kwargs.update(OVERRIDES.get(model_type, {}))
    config_class = type(default)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = config_class(**kwargs)
        if "layer_types" not in kwargs and not set(kinds) <= set(_declared_types(config)):
            # the derived pattern lost a type at this depth: declare one that cycles through them all
            layers = kwargs["num_hidden_layers"]
            config = config_class(**kwargs, layer_types=[kinds[i % len(kinds)] for i in range(layers)])
    return config


def _params():
    params = []
    for model_type, decoder in families().items():
        reason = SKIPPED.get(model_type) or (
            default if isinstance(default := _default_config(model_type), str) else None
        )
        marks = [pytest.mark.skip(reason=reason)] if reason else []
        if decoder != model_type and decoder in families():
            marks = [pytest.mark.skip(reason=f"composite: its decoder is tested as {decoder!r}")]
        params.append(pytest.param(model_type, marks=marks, id=model_type))
    return params


def test_enumeration_finds_the_known_families():
    """The enumeration sees what the package's own tests use, so an empty or broken one cannot pass silently."""
    assert {"gemma3_text", "gemma4_text"} <= set(families())


@pytest.mark.parametrize("model_type", _params())
def test_family_exact_or_refused(model_type):
    config = tiny_config(model_type)
    kinds = set(_declared_types(config))
    assert _windowed(sorted(kinds)), f"{model_type}: the tiny config lost its sliding / chunked layers ({kinds})"
    unstored = kinds - STORED - {"shared"}
    decoder = config.get_text_config(decoder=True)
    recurrent = (
        getattr(decoder, "n_recurrent_loops", 1) > 1 or getattr(decoder, "recurrent_kv_cache_mode", "") == "last_loop"
    )
    if unstored or recurrent:
        with pytest.raises(ValueError, match="DynamicCache") as refusal:
            HybridRingCache(config)
        named = model_type if recurrent else sorted(unstored)[0]
        assert str(named) in str(refusal.value) or repr(named) in str(refusal.value)
        return

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(config).eval()
    batch = left_padded_batch([tokens(4 * WINDOW, seed=1)[0], tokens(2 * WINDOW + 1, seed=2)[0]])
    input_ids, attention_mask = batch["input_ids"], batch["attention_mask"]

    # stepped oracle: chunks longer and shorter than the window, single steps across the wrap
    cache = HybridRingCache(model.config)
    schedule = [WINDOW + 1, 1, 1, WINDOW - 1, 1, 1, 2, 1]
    schedule.append(input_ids.shape[1] - sum(schedule))
    got = chunked_logits(model, cache, input_ids, schedule, attention_mask)
    expected = no_cache_logits(model, input_ids, attention_mask)
    assert_matches_oracle(got, expected, attention_mask, model_type)

    # generate: the same greedy tokens as DynamicCache, past several wraps
    kwargs = dict(**batch, max_new_tokens=3 * WINDOW, do_sample=False)
    with torch.no_grad():
        ring = model.generate(**kwargs, **cache_kwargs(HybridRingCache(model.config)))
        dynamic = model.generate(**kwargs, **cache_kwargs(DynamicCache(config=model.config)))
    assert torch.equal(ring, dynamic), f"{model_type}: generate differs from DynamicCache"


# --- the edges: cache layers the config does not declare, encoder-decoder models -------------------------------------
needs_dory = pytest.mark.skipif("dory" not in CONFIG_MAPPING, reason="this transformers release has no `dory` model")


def _tiny_dory(loops: int, mode: str = "per_loop"):
    torch.manual_seed(0)
    config = tiny_config("dory")
    config.n_recurrent_loops, config.recurrent_kv_cache_mode = loops, mode
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_config(config).eval()


@needs_dory
@pytest.mark.parametrize("mode", ["per_loop", "last_loop"])
def test_recurrent_loops_are_refused_on_construction(mode):
    """`dory` runs its recurrent layers `n_recurrent_loops` times, each loop on cache layers it appends to
    `cache.layers` (deep copies, or read-only views in `last_loop` mode): the cache refuses the config up front,
    naming the model type and `DynamicCache` (in `last_loop` mode whatever the loop count); one `per_loop` loop writes
    only the declared layers and is exact."""
    model = _tiny_dory(loops=2, mode=mode)
    with pytest.raises(ValueError, match=r"'dory'.*n_recurrent_loops=2.*DynamicCache"):
        HybridRingCache(model.config)
    model.config.n_recurrent_loops = 1
    if mode == "last_loop":
        with pytest.raises(ValueError, match=r"'dory'.*read-only views.*DynamicCache"):
            HybridRingCache(model.config)
        model.config.recurrent_kv_cache_mode = "per_loop"
    input_ids = tokens(3 * WINDOW, batch=2, seed=3)
    attention_mask = torch.ones_like(input_ids)
    got = chunked_logits(model, HybridRingCache(model.config), input_ids, [WINDOW + 1, 1, 1, 2 * WINDOW - 3])
    assert_matches_oracle(got, no_cache_logits(model, input_ids, attention_mask), attention_mask, "dory, 1 loop")


@needs_dory
def test_cache_layers_the_config_does_not_declare_are_refused_before_any_write():
    """A cache built while the model ran one loop, used after it was switched to two: the model appends copies of the
    cache's layers and updates layer indices the cache has no spec for. The cache refuses at the first update, before
    any layer stores the step, with `cache.layers` put back; the cache then serves the one-loop model exactly."""
    model = _tiny_dory(loops=1)
    cache = HybridRingCache(model.config)
    layers = list(cache.layers)
    model.config.n_recurrent_loops = 2
    input_ids = tokens(2 * WINDOW, seed=4)
    with torch.no_grad(), pytest.raises(IndexError, match=r"'dory' model appended .*DynamicCache"):
        model(input_ids=input_ids, **cache_kwargs(cache), use_cache=True)
    assert len(cache.layers) == len(cache.specs) and all(a is b for a, b in zip(cache.layers, layers))
    assert cache.get_seq_length() == 0
    model.config.n_recurrent_loops = 1
    got = chunked_logits(model, cache, input_ids, [WINDOW + 1, 1, 1, WINDOW - 3])
    assert_matches_oracle(got, no_cache_logits(model, input_ids), torch.ones_like(input_ids), "dory after refusal")


def _tiny_t5gemma():
    from transformers import T5GemmaConfig, T5GemmaForConditionalGeneration, T5GemmaModuleConfig

    module = dict(SHRINK, num_hidden_layers=LAYERS, layer_types=[SLIDING, FULL] * (LAYERS // 2))
    module = {key: value for key, value in module.items() if key in _fields(T5GemmaModuleConfig())}
    config = T5GemmaConfig(
        encoder=T5GemmaModuleConfig(**module),
        decoder=T5GemmaModuleConfig(**module),
        vocab_size=VOCAB,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=1,
        decoder_start_token_id=2,
    )
    torch.manual_seed(0)
    return T5GemmaForConditionalGeneration(config).eval()


def test_encoder_decoder_takes_the_ring_as_its_self_attention_cache():
    """T5Gemma: the decoder's self-attention gets the ring, cross-attention a `DynamicCache`, in an
    `EncoderDecoderCache` (transformers refuses a bare cache for encoder-decoder models). Stepped decoder logits are
    the no-cache forward's, and `generate` gives `DynamicCache`'s tokens, left padding included."""
    from transformers import EncoderDecoderCache

    model = _tiny_t5gemma()
    batch = left_padded_batch([tokens(2 * WINDOW, seed=5)[0], tokens(WINDOW, seed=6)[0]])
    decoder_ids = tokens(4 * WINDOW, batch=2, seed=7)
    cache = EncoderDecoderCache(HybridRingCache(model.config), DynamicCache())
    assert isinstance(cache.self_attention_cache, HybridRingCache)
    logits, position = [], 0
    with torch.no_grad():
        for size in [WINDOW + 1, 1, 1, WINDOW - 1, 1, 1, 2 * WINDOW - 4]:
            chunk = decoder_ids[:, position : position + size]
            step = model(**batch, decoder_input_ids=chunk, **cache_kwargs(cache), use_cache=True)
            logits.append(step.logits)
            position += size
        expected = model(**batch, decoder_input_ids=decoder_ids, use_cache=False).logits
    assert position == decoder_ids.shape[1] and cache.get_seq_length() == position
    assert_matches_oracle(torch.cat(logits, 1), expected, torch.ones_like(decoder_ids), "t5gemma decoder")

    kwargs = dict(**batch, max_new_tokens=3 * WINDOW, do_sample=False)
    with torch.no_grad():
        ring = model.generate(
            **kwargs, **cache_kwargs(EncoderDecoderCache(HybridRingCache(model.config), DynamicCache()))
        )
        dynamic = model.generate(**kwargs, **cache_kwargs(EncoderDecoderCache(DynamicCache(), DynamicCache())))
        with pytest.raises(ValueError, match="EncoderDecoderCache"):  # transformers' own refusal of a bare cache
            model.generate(**kwargs, **cache_kwargs(HybridRingCache(model.config)))
    assert torch.equal(ring, dynamic)
