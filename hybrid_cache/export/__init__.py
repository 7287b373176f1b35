"""`hybrid_cache.export`: one exported program that decodes forever in `sliding_window` slots, for ExecuTorch (`.pte`,
run by ExecuTorch's own `TextLLMRunner` or by this package's runner) and ONNX Runtime (`.onnx`).

```python
from hybrid_cache.export import export_program, load_program

export_program(model, "gemma3.pte", max_cache_len=2048, quantize="8da4w")   # format from the suffix: .pte, .onnx
program = load_program("gemma3.pte")
ids = program.generate(input_ids, max_new_tokens=128)   # greedy; LongTensor [1, prompt + new]
program.rollback(1)        # exact within rollback_margin + 1 tokens after the wrap
program.cache_slots()      # {layer index: slots held}, read from the program's own buffers / inputs
program.reset()            # a new conversation on the same loaded program
```

Both programs are the package's own cache in its fixed mode, the same slot arithmetic and ring-layout mask as the
eager cache. The `.pte` (`runner.RunnerProgram`) is one `forward(tokens, start_pos)` with its counters in its state
and ExecuTorch's fused cache and attention ops, the interface of ExecuTorch's LLM runner; the `.onnx`
(`step.ProgramModule`) takes its counters as inputs. This package's runner (`program.Program`) admits every step with
the eager cache's rules. Needs the `export` extra (ExecuTorch, ONNX, ONNX Runtime). docs/export.md says how it is
built, what it measures and what it leaves out.
"""

from __future__ import annotations

import contextlib
import copy
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..code_attention import CODE_ATTENTION
from ..errors import ProgramFormatError
from .metadata import ProgramMetadata
from .program import Program
from .step import ProgramModule

__all__ = ["ExportReport", "Program", "ProgramFormatError", "export_program", "load_program"]

RUNTIMES = {".pte": "executorch", ".onnx": "onnx"}


@dataclass(frozen=True)
class ExportReport:
    """What `export_program` wrote: the file, its size, the seconds it took and the slots of every layer."""

    path: Path
    runtime: str
    nbytes: int
    seconds: float
    slots: dict[int, int]
    note: str | None  # e.g. that a model without sliding layers got a plain static cache


def _runtime(path: Path) -> str:
    runtime = RUNTIMES.get(path.suffix)
    if runtime is None:
        raise ValueError(f"{path}: the format comes from the suffix, .pte (ExecuTorch) or .onnx (ONNX Runtime).")
    return runtime


def export_program(
    model: Any,
    path: str | os.PathLike,
    max_cache_len: int,
    chunk_size: int = 64,
    rollback_margin: int = 0,
    progress: Callable[[str], None] | None = None,
    quantize: str | None = None,
) -> ExportReport:
    """Export `model` (a causal LM whose config may declare `sliding_attention` layers, in eval mode, on the CPU) to
    one program at `path`: `.pte` (torch.export, lowered to XNNPACK, for ExecuTorch's runtime) or `.onnx` (torch's
    ONNX exporter, for ONNX Runtime). Sliding layers hold exactly `sliding_window` slots (`+ rollback_margin`), full
    layers `max_cache_len`, KV-shared layers nothing. Prompts are fed in steps of at most `chunk_size` tokens.
    `progress` is told each stage (export, lowering, writing). `quantize="8da4w"` (`.pte` only): 4-bit weights and
    8-bit embeddings (`quantize.py`), on a copy of the model (the model given is left as it is).

    The program's masks are sdpa's (or eager's, for a model on `"eager"`). A model on `"hybrid_cache_sdpa"` (what
    `hybrid_cache.tools.models.load_model` gives; its results are sdpa's) is switched to `"sdpa"` for the export and
    switched back afterwards, also when the export fails; any other attention implementation is refused
    (`ValueError`)."""
    path = Path(os.fspath(path))
    runtime = _runtime(path)
    if chunk_size < 2 or max_cache_len < 1 or rollback_margin < 0:
        raise ValueError(
            f"export_program needs chunk_size >= 2, max_cache_len >= 1 and rollback_margin >= 0; got {chunk_size}, "
            f"{max_cache_len}, {rollback_margin}."
        )
    if quantize is not None and runtime != "executorch":
        raise ValueError(f"quantize={quantize!r} is for ExecuTorch programs (.pte); {path.suffix} programs are fp32.")
    tell = progress or (lambda message: None)
    began = time.perf_counter()
    if quantize is not None:
        from .quantize import quantize_model

        tell(f"quantizing: {quantize} (torchao)")
        model = quantize_model(copy.deepcopy(model), quantize)
    with _sdpa_masks(model):
        module: Any
        if runtime == "executorch":  # ExecuTorch's stock runner feeds a whole prompt in one call
            from .runner import RunnerProgram

            module, chunk_size = RunnerProgram(model.eval(), max_cache_len, rollback_margin), max_cache_len
        else:
            module = ProgramModule(model.eval(), max_cache_len, rollback_margin, functional=True)
        metadata = ProgramMetadata.describe(model, module, runtime, max_cache_len, chunk_size, quantize)
        note = None
        if metadata.window is None:
            note = "no sliding_attention layers: every layer keeps max_cache_len slots (a plain static cache)"
            tell(note)
        path.parent.mkdir(parents=True, exist_ok=True)
        if runtime == "executorch":
            from .pte import export_pte

            export_pte(module, path, metadata, tell)
        else:
            from .onnxrt import export_onnx

            export_onnx(module, path, metadata, tell)
    return ExportReport(path, runtime, path.stat().st_size, time.perf_counter() - began, module.slots(), note)


@contextlib.contextmanager
def _sdpa_masks(model: Any) -> Iterator[None]:
    """Within the block, a model on hybrid_cache's attention (`CODE_ATTENTION`, `load_model`'s default) runs `"sdpa"`:
    the same results, and the masks the program is built with (`step.ProgramModule` takes sdpa's or eager's). Its own
    attention comes back on exit, also after an exception; any other model is left as it is."""
    previous = getattr(model.config, "_attn_implementation", None)
    if previous != CODE_ATTENTION:
        yield
        return
    model.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


def load_program(path: str | os.PathLike, threads: int | None = None) -> Program:
    """Load a program written by `export_program` into its runtime (from the suffix), ready to `generate`.
    `threads`: ONNX Runtime's intra-op threads. Raises `ProgramFormatError` (one line naming the file) for a file
    that is not a hybrid_cache program, or was exported in a program format this version does not run."""
    path = Path(os.fspath(path))
    runtime = _runtime(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such program file.")
    if runtime == "executorch":
        from .pte import ExecuTorchBackend

        backend: Any = ExecuTorchBackend(path)
    else:
        from .onnxrt import OnnxBackend

        backend = OnnxBackend(path, threads)
    if backend.metadata.runtime != runtime:
        raise ProgramFormatError(f"{path}: a {backend.metadata.runtime} program with a {path.suffix} suffix.")
    return Program(backend, backend.metadata)
