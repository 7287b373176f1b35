"""`ProgramMetadata`: what an exported program says about itself, written into the file (an ExecuTorch constant
method, an ONNX metadata entry) and checked when it is loaded, so that a file that is not a hybrid_cache program, or
one written by an incompatible version, is refused with one line."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from ..errors import ProgramFormatError
from ..specs import SLIDING
from ..version import __version__

__all__ = ["FORMAT", "FORMAT_VERSION", "METADATA_KEY", "LayerInfo", "ProgramMetadata"]

FORMAT = "hybrid_cache.program"
#: The layout of the programs' inputs, outputs and state; a program of another version is refused at load. 2: the
#: `.pte` is one `forward(tokens, start_pos)` with its counters in its state, for ExecuTorch's stock runner.
FORMAT_VERSION = 2
#: The ExecuTorch constant method / ONNX metadata key that holds the metadata (JSON).
METADATA_KEY = "hybrid_cache_metadata"


@dataclasses.dataclass(frozen=True)
class LayerInfo:
    """One decoder layer of the program: its kind (`specs` kinds) and whether it holds state of its own."""

    index: int
    kind: str
    stores: bool


@dataclasses.dataclass(frozen=True)
class ProgramMetadata:
    """The program's geometry and settings.

    Attributes:
        runtime: `"executorch"` or `"onnx"`.
        max_cache_len: slots of every full layer (prompt + generated tokens).
        chunk_size: longest step the program takes (longer prompts are fed in chunks).
        window: the sliding layers' window (`None`: a model without sliding layers, a plain static cache).
        ring_slots: slots of each sliding layer (`sliding_window + rollback_margin`; `max_cache_len` without rings).
        layers: every decoder layer.
        eos_token_ids: where `generate` stops by default.
        vocab_size: the model's; the runner refuses a token id outside `[0, vocab_size)` before any step.
        dtype, model_type: the model's.
        quantization: how the weights were quantized (`quantize.QUANTIZATIONS`), or None.
    """

    runtime: str
    max_cache_len: int
    chunk_size: int
    window: int | None
    ring_slots: int
    layers: tuple[LayerInfo, ...]
    eos_token_ids: tuple[int, ...]
    vocab_size: int
    dtype: str
    model_type: str
    quantization: str | None = None
    hybrid_cache: str = __version__
    format: str = FORMAT
    format_version: int = FORMAT_VERSION

    @classmethod
    def describe(
        cls,
        model: Any,
        module: Any,
        runtime: str,
        max_cache_len: int,
        chunk_size: int,
        quantization: str | None = None,
    ) -> ProgramMetadata:
        """The metadata of `model` exported as `module` (a `step.ProgramModule`) for `runtime`."""
        specs = module.cache.specs
        windows = {spec.window for spec in specs if spec.kind == SLIDING}
        if len(windows) > 1:
            raise ValueError(
                f"export_program: sliding layers of several windows ({sorted(windows)}) are not supported."
            )
        slots = module.slots()
        ring = next((slots[spec.index] for spec in specs if spec.kind == SLIDING), max_cache_len)
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        eos = getattr(module.cache.config, "eos_token_id", None) if eos is None else eos
        eos_ids = () if eos is None else ((eos,) if isinstance(eos, int) else tuple(int(e) for e in eos))
        return cls(
            runtime=runtime,
            max_cache_len=max_cache_len,
            chunk_size=chunk_size,
            window=next(iter(windows), None),
            ring_slots=ring,
            layers=tuple(LayerInfo(spec.index, spec.kind, spec.stores) for spec in specs),
            eos_token_ids=eos_ids,
            vocab_size=int(module.cache.config.vocab_size),
            dtype=str(next(p for p in model.parameters() if p.is_floating_point()).dtype).removeprefix("torch."),
            model_type=str(getattr(module.cache.config, "model_type", "")),
            quantization=quantization,
        )

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str, source: str) -> ProgramMetadata:
        """Parse and check the metadata read from `source` (a path, for the error), or raise `ProgramFormatError`."""
        try:
            fields: dict[str, Any] = json.loads(text)
        except (ValueError, TypeError):
            raise ProgramFormatError(f"{source} is not a hybrid_cache program: its metadata is not JSON.") from None
        if not isinstance(fields, dict) or fields.get("format") != FORMAT:
            raise ProgramFormatError(f"{source} is not a hybrid_cache program (no {FORMAT!r} metadata).")
        if fields.get("format_version") != FORMAT_VERSION:
            raise ProgramFormatError(
                f"{source} was exported by hybrid_cache {fields.get('hybrid_cache', '?')} in program format "
                f"{fields.get('format_version')!r}; this hybrid_cache {__version__} runs format {FORMAT_VERSION}. "
                f"Export it again with `hybrid-cache-export`."
            )
        try:
            layers = tuple(LayerInfo(**layer) for layer in fields.pop("layers"))
            fields["eos_token_ids"] = tuple(fields["eos_token_ids"])
            metadata = cls(layers=layers, **fields)
        except (KeyError, TypeError):
            raise ProgramFormatError(f"{source}: its hybrid_cache metadata is incomplete or damaged.") from None
        vocab = metadata.vocab_size
        if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
            # The runner checks every token id against it before a step (`program.check_input_ids`).
            raise ProgramFormatError(
                f"{source}: its hybrid_cache metadata has no valid vocab_size ({vocab!r}), which the runner checks "
                f"token ids against. Export it again with `hybrid-cache-export`."
            )
        return metadata
