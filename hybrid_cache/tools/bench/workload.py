"""What the benchmark runs: the models (the embedded Gemma 3 270M, or small random models with a real model's K/V
geometry), synthesized prefills and decode-step inputs, and what a step must read."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hybrid_cache.code_attention import CODE_ATTENTION
from hybrid_cache.specs import layer_specs

from ..compare import layer_kv_geometry, text_config

__all__ = [
    "DTYPES",
    "TINY_MODELS",
    "PrefillSource",
    "TinyGeometry",
    "build_tiny_model",
    "check_bench_model",
    "exact_kv_bytes",
    "live_kv_bytes",
    "load_bench_model",
    "parameter_bytes",
    "random_prefill",
    "step_inputs",
    "synthesize_prefill",
]

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


@dataclass(frozen=True)
class TinyGeometry:
    """The K/V geometry of a real Gemma 3 model on a random model whose weights cost almost nothing.

    Attributes:
        query_heads / kv_heads / head_dim / window: as in the real model's config.
        layers: decoder layers (5 sliding : 1 full, as Gemma 3).
        source: where the numbers come from.
    """

    query_heads: int
    kv_heads: int
    head_dim: int
    window: int
    layers: int = 6
    source: str = ""


#: Random models for ``--model``: `tiny` has Gemma 3 270M's K/V geometry (window 512, its smallest); `tiny-4b` has
#: Gemma 3 4B's (``google/gemma-3-4b`` text config: 8 query heads over 4 KV heads of size 256, window 1024;
#: 34 layers there, 6 here). Both: hidden size 64 and a 512-token vocabulary, so the step is attention + cache + Python.
TINY_MODELS: dict[str, TinyGeometry] = {
    "tiny": TinyGeometry(query_heads=4, kv_heads=1, head_dim=256, window=512, source="Gemma 3 270M"),
    "tiny-4b": TinyGeometry(query_heads=8, kv_heads=4, head_dim=256, window=1024, source="Gemma 3 4B"),
}


def build_tiny_model(
    window: int = 512,
    dtype: torch.dtype = torch.float32,
    layers: int = 6,
    hidden: int = 64,
    head_dim: int = 256,
    seed: int = 0,
    query_heads: int = 4,
    kv_heads: int = 1,
) -> Any:
    """A small random Gemma 3 text model that isolates cache overhead.

    The defaults give Gemma 3 270M's K/V geometry per layer (1 KV head of ``head_dim`` 256, 4 query heads, 5 sliding :
    1 full layers) with ``hidden`` 64 and a 512-token vocabulary, so weights cost almost nothing.
    """
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    config = Gemma3TextConfig(
        vocab_size=512,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=query_heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        sliding_window=window,
        max_position_embeddings=1 << 17,
        attn_implementation=CODE_ATTENTION,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=1,
    )
    return Gemma3ForCausalLM(config).eval().to(dtype)


def load_bench_model(name: str, dtype: torch.dtype, window: int | None = None, device: str = "cpu") -> Any:
    """A name of `TINY_MODELS` -> :func:`build_tiny_model` with that geometry (`window` overrides its window);
    anything else -> :func:`hybrid_cache.tools.models.load_model` (``default`` = the embedded Gemma 3 270M).

    Models are loaded with attention implementation ``"hybrid_cache_sdpa"``: SDPA's results, long steps attending
    block by block on their band (`hybrid_cache.banded`), and the decode steps of compressed full layers on their
    codes (`hybrid_cache.code_attention`; the ``ring-int*-deq`` caches keep dequantizing). A model from `load_model`
    also has ``generate``'s prefill steps (`hybrid_cache.prefill_steps`), a tiny one only within
    ``use_code_attention``."""
    if name in TINY_MODELS:
        g = TINY_MODELS[name]
        return build_tiny_model(
            window=window or g.window,
            dtype=dtype,
            layers=g.layers,
            head_dim=g.head_dim,
            query_heads=g.query_heads,
            kv_heads=g.kv_heads,
        ).to(device)
    from hybrid_cache.tools.models import load_model  # lazy: only the real-model path needs it

    model, _ = load_model(None if name in ("default", "") else name, dtype=dtype, attn_implementation=CODE_ATTENTION)
    return model.eval().to(device)


def check_bench_model(name: str) -> None:
    """Raise what `load_bench_model` would raise about `name` as a path, without loading anything: a command checks
    its ``--model`` this way before it measures anything. `name` is one of `TINY_MODELS`, the default, an existing
    ``.gguf`` file, a directory with a config.json or, while ``HF_HUB_OFFLINE`` is set, a Hub id in the local cache.

    The checks are those of `hybrid_cache.tools.models.check_model_path`, which `load_model` makes too, and a
    ``.gguf`` file's first bytes.

    Raises:
        FileNotFoundError: a path that does not exist, or a directory without a config.json.
        ValueError: a file that is not a ``.gguf``, or does not start as one.
        OSError: offline, a Hub id that is not in the local Hugging Face cache.
    """
    from hybrid_cache.tools.models import check_model_path

    if name in TINY_MODELS:
        return
    check_model_path(name)
    path = Path(name).expanduser()
    if path.is_file():
        with open(path, "rb") as fh:
            if fh.read(4) != b"GGUF":  # an empty file too
                raise ValueError(f"model file {str(path)!r} does not start with the GGUF magic bytes: not a GGUF file")


PrefillSource = dict[int, tuple[torch.Tensor, torch.Tensor]]


def random_prefill(model: Any, batch: int, context: int, dtype: torch.dtype) -> PrefillSource:
    """Random K/V `[batch, kv_heads, context, head_dim]` for every storing layer, by layer index (layers of the same
    geometry share one tensor pair: Gemma 4's sliding and full layers differ, KV-shared layers get none)."""
    device = next(model.parameters()).device
    by_shape: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    source = {}
    for layer_idx, geometry in enumerate(layer_kv_geometry(model)):
        if geometry is None:
            continue
        if geometry not in by_shape:
            heads, head_dim = geometry
            by_shape[geometry] = tuple(
                torch.randn(batch, heads, context, head_dim, dtype=dtype, device=device) for _ in range(2)
            )
        source[layer_idx] = by_shape[geometry]
    return source


def synthesize_prefill(cache: Any, source: PrefillSource) -> None:
    """Write a prefill into every storing layer through ``cache.update``, one call per layer with the whole context.

    One `source` (see `random_prefill`) is reused across the caches compared; every cache copies what it keeps.
    A whole-context update into an empty ring is its "fresh prompt" path (returns the input, keeps the newest slots).
    """
    with torch.inference_mode():
        for layer_idx, (keys, values) in source.items():
            cache.update(keys, values, layer_idx)


def step_inputs(
    batch: int, position: int, vocab: int, generator: torch.Generator, device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    """Inputs of one decode step: random token ids `[batch, 1]` at `position` (explicit ``position_ids``)."""
    ids = torch.randint(3, vocab, (batch, 1), generator=generator)
    positions = torch.full((batch, 1), position, dtype=torch.long)
    if torch.device(device).type != "cpu":
        ids, positions = ids.to(device), positions.to(device)
    return {"input_ids": ids, "position_ids": positions}


def live_kv_bytes(model: Any, batch: int, length: int, dtype: torch.dtype) -> int:
    """K/V bytes the attention must read in one decode step at cache length `length` (window-limited), from the
    layers' specifications (`hybrid_cache.specs.layer_specs`): `min(length, window)` tokens in sliding layers (in
    chunked ones, `min(length, chunk)`: what their ring holds), `length` in full layers, nothing in KV-shared layers."""
    element = torch.empty((), dtype=dtype).element_size()
    total = 0
    for spec in layer_specs(text_config(model)):
        if not spec.stores:
            continue
        tokens = min(length, spec.window) if spec.window is not None else length
        total += 2 * batch * spec.kv_heads * spec.head_dim * element * tokens
    return total


def exact_kv_bytes(model: Any, batch: int, tokens: int, dtype: torch.dtype) -> int:
    """K/V bytes of a cache sized exactly for `tokens` tokens: every token in full layers, ``min(tokens, window)`` in
    sliding layers (``min(tokens, chunk)`` in chunked ones), nothing in KV-shared layers. What ``StaticCache(max_cache_len=tokens)`` allocates, and the floor
    for any cache that must serve the next decode step without copying."""
    return live_kv_bytes(model, batch, tokens, dtype)


def parameter_bytes(model: Any) -> int:
    """Bytes of every distinct parameter (tied embeddings counted once: the LM head reads them in full)."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total
