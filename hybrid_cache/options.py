"""`CacheOptions`: the constructor options of a `HybridRingCache`, checked together once.

The options depend on each other (compressed or bounded full layers, compiled mode, attention on codes): one frozen
object validates every combination before anything is built, and names the storage each kind of layer gets.
"""

from __future__ import annotations

from dataclasses import dataclass

from .code_attention import CODE_ATTENTION_MODES
from .frozen import Frozen
from .quantizer import QUANTIZATION_MODES

__all__ = ["CacheOptions"]

#: Sink tokens of bounded full layers when `full_layer_window` is given alone.
DEFAULT_SINK_TOKENS = 4


@dataclass(unsafe_hash=True, kw_only=True)
class CacheOptions(Frozen):
    """The storage options of `HybridRingCache` (its keyword arguments besides `config` and `stage_layers`),
    validated together on construction.

    Args:
        max_cache_len (`int`, *optional*): fixed capacity of the full-attention layers (prompt + new tokens). Makes
            the cache compileable; exceeding it raises `CacheCapacityError`. Default: storage that grows.
        rollback_margin (`int`, defaults to 0): extra ring slots so that `crop(-n)` is exact for
            `n <= rollback_margin + 1` after the wrap. Not needed for `generate`'s assisted / prompt-lookup decoding:
            with past recording on, the last multi-token step can always be undone exactly.
        initial_capacity (`int`, defaults to 0): minimum first allocation of the growing full-attention buffers
            (the default allocates the prompt length; growth is by 1/64, see `layers.GROWTH_FACTOR`).
        dense_decode_mask (`bool`, *optional*): materialize the mask of one-token steps instead of letting SDPA run
            without one. Default (`None`): on CPU for grouped-query layers, where transformers' mask-less path
            (`enable_gqa`) is several times slower than its masked, packed path; never on accelerators, whose
            mask-less kernels are the fast ones. Results are the same either way (same mask semantics).
        full_layer_quantization (`str`, *optional*): store the full-attention layers compressed: `"int8"`, `"int4"`
            or `"fp8"` (per-token groups of `full_layer_group_size` channels, one scale each; see
            `hybrid_cache.quantized` and docs/quantization.md). Approximate. Sliding rings stay exact in the model
            dtype. Default `None`: exact storage.
        full_layer_group_size (`int`, defaults to 64): channels per quantization scale.
        full_layer_rotation (`bool`, *optional*): Hadamard rotation within each group before quantizing. Default
            (`None`): on for `"int4"` (where it lowers the error 3-4x and is what meets int4's perplexity goal on
            every measured text; free for decode steps on the codes, a tiled 64 x 64 product per dequantized
            step otherwise), off for `"int8"` and `"fp8"` and for a `full_layer_group_size` that is not a power of
            two. Resolved on construction: `cache.options.full_layer_rotation` is always a `bool`.
        full_layer_key_calibration (`bool`, defaults to True): center and equalize the key channels before the
            per-token grouping, with a per-channel mean and spread taken from the first update of each full layer
            (the prompt). Lowers the compressed modes' error several-fold on Gemma (docs/quantization.md) for one
            extra pass over the keys per step; no effect without `full_layer_quantization`.
        full_layer_code_attention (`bool`, *optional*): whether decode steps (up to
            `code_attention.MAX_CODE_QUERY_LENGTH` tokens) of `"int8"` / `"int4"` full layers attend on the codes
            (`hybrid_cache.code_attention`: no dequantized history; needs the model's attention implementation to be
            `"hybrid_cache_sdpa"`, which is SDPA for every other call) instead of returning dequantized keys and
            values. Default (`None`): follow the model, i.e. on exactly while `config._attn_implementation ==
            "hybrid_cache_sdpa"` (switch with `model.set_attn_implementation(...)` or
            `hybrid_cache.use_code_attention(model)`). `True` with another attention function raises at its first
            decode step; `False` never. Not with `max_cache_len` (the compileable layers keep the dequantizing path).
        full_layer_window (`int`, *optional*): bound every full-attention layer to `full_layer_sink_tokens` +
            the last `full_layer_window` tokens (StreamingLLM-style, keys at their absolute positions; approximate;
            see `hybrid_cache.streaming`). The whole cache then has a fixed size. Default `None`: unbounded.
        full_layer_sink_tokens (`int`, defaults to 4 with `full_layer_window`): first tokens the bounded full
            layers keep forever.

    Raises:
        ValueError: an unknown quantization mode, or options that cannot be combined (the message names the fix).

    Built by keyword only (`HybridRingCache` passes each of its options by name; the file format writes and reads
    every field by name, `snapshot.py`). Fixed at construction (`frozen.Frozen`: exporters may assign a field its own
    value, nothing else).
    """

    max_cache_len: int | None = None
    rollback_margin: int = 0
    initial_capacity: int = 0
    dense_decode_mask: bool | None = None
    full_layer_quantization: str | None = None
    full_layer_group_size: int = 64
    full_layer_rotation: bool | None = None
    full_layer_key_calibration: bool = True
    full_layer_window: int | None = None
    full_layer_sink_tokens: int | None = None
    full_layer_code_attention: bool | None = None

    def __post_init__(self) -> None:
        quantization, window, compiled = self.full_layer_quantization, self.full_layer_window, self.max_cache_len
        if quantization is not None and quantization not in QUANTIZATION_MODES:
            raise ValueError(
                f"Unknown full_layer_quantization {quantization!r}; choose one of {QUANTIZATION_MODES}, or None for "
                f"exact full-attention layers."
            )
        if self.full_layer_rotation and quantization is None:
            raise ValueError("full_layer_rotation=True needs full_layer_quantization ('int8', 'int4' or 'fp8').")
        if self.full_layer_rotation is None:
            group = self.full_layer_group_size
            default = quantization == "int4" and group > 0 and not group & (group - 1)
            object.__setattr__(self, "full_layer_rotation", default)
        if self.full_layer_sink_tokens is not None and window is None:
            raise ValueError(
                "full_layer_sink_tokens bounds the full-attention layers only together with full_layer_window (the "
                "recent tokens kept): pass both, e.g. full_layer_sink_tokens=4, full_layer_window=1024."
            )
        if window is not None and quantization is not None:
            raise ValueError(
                "Bounded full layers (full_layer_window) and full_layer_quantization cannot be combined yet: the "
                "bounded layers are already a fixed size. Use one of the two."
            )
        if window is not None and compiled is not None:
            raise ValueError(
                "Bounded full layers (full_layer_window) have no compileable variant: drop max_cache_len (the bounded "
                "cache already has a fixed size) or drop full_layer_window to compile."
            )
        if self.full_layer_code_attention and quantization not in CODE_ATTENTION_MODES:
            raise ValueError(
                f"full_layer_code_attention=True attends on integer codes: it needs full_layer_quantization in "
                f"{CODE_ATTENTION_MODES}, got {quantization!r}. Drop the option or pick one of those modes."
            )
        if self.full_layer_code_attention and compiled is not None:
            raise ValueError(
                "full_layer_code_attention=True has no compileable variant: the fixed-capacity layers (max_cache_len) "
                "keep the dequantizing path. Drop max_cache_len or the option."
            )

    @property
    def sink_tokens(self) -> int:
        """First tokens the bounded full layers keep (`full_layer_sink_tokens`, default `DEFAULT_SINK_TOKENS`)."""
        return DEFAULT_SINK_TOKENS if self.full_layer_sink_tokens is None else self.full_layer_sink_tokens

    @property
    def compiled(self) -> bool:
        """Whether the storage is fixed-size with static addresses (`max_cache_len`): compileable."""
        return self.max_cache_len is not None

    def storage(self, kind: str) -> str:
        """The storage a layer of `kind` (`specs.SLIDING` / `specs.FULL` / `specs.CHUNKED`) gets: `"ring"`,
        `"static_ring"`, `"sink_window"`, `"quantized"`, `"static_quantized"`, `"growable"` or `"static"`. A chunked
        layer gets a ring of `attention_chunk_size` slots, as a sliding layer of that window: a query sees at most the
        chunk's earlier keys, each within the last `attention_chunk_size` positions, and the mask hook evaluates the
        model's own chunked mask (its chunk boundaries, left padding included) at the ring's positions."""
        if kind in ("sliding_attention", "chunked_attention"):
            return "static_ring" if self.compiled else "ring"
        if self.full_layer_window is not None:
            return "sink_window"
        if self.full_layer_quantization is not None:
            return "static_quantized" if self.compiled else "quantized"
        return "static" if self.compiled else "growable"
