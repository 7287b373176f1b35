"""Past recording (turned on by speculative `generate`) keeps nothing alive after `generate`, and stays exact."""

from __future__ import annotations

import gc
import types

import torch
from builders import MODEL_BUILDERS, decode_record_bytes, needs_exact_rollback, tokens
from transformers import DynamicCache
from transformers.configuration_utils import PreTrainedConfig

from hybrid_cache import HybridRingCache
from hybrid_cache.compat import cache_kwargs


def reachable_tensor_bytes(root) -> int:
    """Bytes of every distinct tensor storage reachable from `root` (the config excluded): what it keeps alive."""
    seen, storages, stack = set(), {}, [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (PreTrainedConfig, type, types.ModuleType, types.FunctionType)):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storages[obj.untyped_storage().data_ptr()] = obj.untyped_storage().nbytes()
            continue
        stack.extend(gc.get_referents(obj))
    return sum(storages.values())


@needs_exact_rollback
def test_prompt_lookup_leaves_nothing_behind(model_name):
    """After a prompt-lookup generation (which turns past recording on and never off), a long next turn must not
    keep undo copies alive, and `memory_report()` counts every tensor the cache keeps alive."""
    model = MODEL_BUILDERS[model_name](window=4)
    prompt = torch.cat([tokens(5, seed=1)] * 3, 1)  # repetitive: prompt lookup finds candidates
    cache = HybridRingCache(model.config)
    kwargs = dict(do_sample=False, max_new_tokens=12, min_new_tokens=12, pad_token_id=0)
    with torch.no_grad():
        out = model.generate(
            input_ids=prompt,
            attention_mask=torch.ones_like(prompt),
            **cache_kwargs(cache),
            prompt_lookup_num_tokens=3,
            **kwargs,
        )
        assert reachable_tensor_bytes(cache) == cache.memory_report().total_bytes
        # At most what undoes a decode step (one slot per ring; nothing after a final crop), no window copy.
        assert cache.memory_report().extra_bytes <= decode_record_bytes(cache), "an undo copy survived generate"
        # A long plain forward right after: whatever it keeps is counted, and released by the next step.
        turn = torch.cat([out, tokens(40, seed=2)], 1)
        model(input_ids=turn[:, out.shape[1] :], **cache_kwargs(cache))
        assert reachable_tensor_bytes(cache) == cache.memory_report().total_bytes
        model(input_ids=tokens(1, seed=3), **cache_kwargs(cache))
        report = cache.memory_report()
        assert report.extra_bytes == decode_record_bytes(cache) and reachable_tensor_bytes(cache) == report.total_bytes
        # A new generate call on the same cache starts without recording: its prefill keeps nothing.
        turn = torch.cat([turn, tokens(1, seed=3), tokens(30, seed=4)], 1)
        model.generate(input_ids=turn, attention_mask=torch.ones_like(turn), **cache_kwargs(cache), **kwargs)
        assert cache.memory_report().extra_bytes == decode_record_bytes(cache)
        assert reachable_tensor_bytes(cache) == cache.memory_report().total_bytes


@needs_exact_rollback
def test_speculation_still_exact_after_recording_rules(model_name):
    """The recording rules (a crop releases the kept window, an un-cropped step ends recording) keep assisted
    decoding exact: tokens equal DynamicCache's."""
    model = MODEL_BUILDERS[model_name](window=4)
    prompt = torch.cat([tokens(6, seed=1)] * 3, 1)
    kwargs = dict(
        input_ids=prompt,
        attention_mask=torch.ones_like(prompt),
        do_sample=False,
        max_new_tokens=20,
        min_new_tokens=20,
        pad_token_id=0,
        prompt_lookup_num_tokens=5,
    )
    with torch.no_grad():
        ring = model.generate(**kwargs, **cache_kwargs(HybridRingCache(model.config)))
        assert torch.equal(ring, model.generate(**kwargs, **cache_kwargs(DynamicCache(config=model.config))))


@needs_exact_rollback  # before, nothing records (refused), so nothing needs the signal; 5.14 sets no such attribute
def test_generate_still_marks_the_cache_it_is_given():
    """The cache learns that a `generate` call started through the private attribute transformers' `generate` sets
    on a cache passed in (`compat.GENERATE_START_ATTRIBUTE`): this fails if a release renames it, and the hook is
    seen to run once per call."""
    import inspect

    import transformers.generation.utils as generation

    from hybrid_cache.compat import GENERATE_START_ATTRIBUTE

    assert f".{GENERATE_START_ATTRIBUTE} = True" in inspect.getsource(generation)
    model = MODEL_BUILDERS["gemma3"](window=4)
    cache = HybridRingCache(model.config)
    calls = []
    cache.on_generate_start = lambda: calls.append(cache.get_seq_length())
    prompt = tokens(6)
    model.generate(input_ids=prompt, **cache_kwargs(cache), max_new_tokens=2, do_sample=False)
    model.generate(input_ids=torch.cat([prompt, tokens(9)[:, 6:]], dim=1), **cache_kwargs(cache), max_new_tokens=1)
    assert calls == [0, 7]
