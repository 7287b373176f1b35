"""ExecuTorch: a `RunnerProgram` exported to one `.pte` that ExecuTorch's stock LLM runner (`TextLLMRunner`) drives:
one method `forward(tokens [1, n], start_pos [1])`, `n` dynamic from 1 to `max_cache_len`, the metadata methods the
runner reads, XNNPACK for the model's dense ops and ExecuTorch's LLM custom ops for the cache (`runner.py`). The same
file runs under this package's runner (`ExecuTorchBackend`, `load_program`), which adds rollback and step admission.

What a user imports to run it elsewhere: `executorch.extension.llm.custom_ops.custom_ops` (the `llama::` ops) and, for
a quantized program, `executorch.kernels.quantized` (8-bit embeddings), before building the runner.

How it is lowered, and why (each a trap met on ExecuTorch 1.5.1, docs/export.md): the buffers' names are emitted so
the runner can read their shapes; the re-inplace pass runs, without which an in-place write copies its whole buffer;
the buffers start uninitialized and nothing zero-fills them (the stock runner calls no reset): the program never reads
a slot it did not write; the metadata is a constant method (`metadata.METADATA_KEY`) next to the runner's own.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..errors import ProgramFormatError
from .metadata import METADATA_KEY, ProgramMetadata
from .quantize import without_padding_idx
from .runner import RunnerProgram, runner_metadata_methods
from .step import exporter_quiet, state_names

__all__ = ["ExecuTorchBackend", "export_pte", "load_llm_ops"]


def load_llm_ops() -> None:
    """Load ExecuTorch's LLM custom ops (`llama::custom_sdpa`, `llama::update_cache`, ...) and quantized kernels into
    this process: what a runner program's methods call."""
    import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401
    import executorch.kernels.quantized  # noqa: F401


def export_pte(program: RunnerProgram, path: Path, metadata: ProgramMetadata, progress: Callable[[str], None]) -> None:
    """Export `program`'s `forward`, lower it to XNNPACK and write the `.pte` at `path`."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import EdgeCompileConfig, ExecutorchBackendConfig, to_edge_transform_and_lower
    from torch.export import Dim, export

    load_llm_ops()
    tokens = torch.ones(1, 2, dtype=torch.long)
    start = torch.zeros(1, dtype=torch.long)
    methods: dict[str, Any] = runner_metadata_methods(program, metadata.eos_token_ids, metadata.vocab_size)
    methods[METADATA_KEY] = torch.tensor(list(metadata.to_json().encode()), dtype=torch.uint8)
    with exporter_quiet(), torch.no_grad(), program.attention(), without_padding_idx(program.model):
        progress("export: torch.export of forward(tokens, start_pos)")
        exported = export(
            program,
            (tokens, start),
            dynamic_shapes=({1: Dim("tokens", min=1, max=program.max_cache_len)}, None),
            strict=False,
        )
        progress("lowering: ExecuTorch edge dialect, XNNPACK delegate")
        edge = to_edge_transform_and_lower(
            {"forward": exported},
            partitioner=[XnnpackPartitioner()],
            compile_config=EdgeCompileConfig(_check_ir_validity=False),
            constant_methods=methods,
        )
        config = ExecutorchBackendConfig(
            emit_mutable_buffer_names=True,
            run_reinplace_pass=True,
            do_quant_fusion_and_const_prop=True,  # a dequantized embedding becomes `embedding_byte`
            extract_delegate_segments=True,
        )
        executorch_program = edge.to_executorch(config)
    progress(f"writing: {path}")
    with open(path, "wb") as file:
        executorch_program.write_to_file(file)


class ExecuTorchBackend:
    """A `.pte` written by `export_pte`, loaded into ExecuTorch's runtime (a `program.Backend`)."""

    def __init__(self, path: Path) -> None:
        with open(path, "rb") as file:
            head = file.read(8)
        if head[4:6] != b"ET":  # a flatbuffer whose file identifier (bytes 4-8) is ExecuTorch's, "ET12"
            raise ProgramFormatError(f"{path} is not an ExecuTorch program (.pte): it does not start as one.")
        load_llm_ops()
        from executorch.runtime import Runtime

        try:
            program = Runtime.get().load_program(os.fspath(path))
        except RuntimeError as error:
            raise ProgramFormatError(f"{path} is not a readable ExecuTorch program ({error}).") from None
        if METADATA_KEY not in program.method_names:
            raise ProgramFormatError(f"{path} is an ExecuTorch program but not one exported by hybrid_cache.")
        raw = program.load_method(METADATA_KEY).execute([])[0]
        self.metadata = ProgramMetadata.from_json(bytes(raw.tolist()).decode(errors="replace"), str(path))
        if "forward" not in program.method_names:
            raise ProgramFormatError(f"{path}: a hybrid_cache program without its forward method.")
        self._forward = program.load_method("forward")
        self._names = [name for layer in self.metadata.layers if layer.stores for name in state_names(layer.index)]

    def step(self, input_ids: torch.Tensor, start: int, oldest: int) -> torch.Tensor:
        """`oldest` is the program's own (its state): the runner's, kept for rollback admission, is the same."""
        logits = self._forward.execute([input_ids.contiguous(), torch.tensor([start], dtype=torch.long)])[0]
        return logits

    def zero_state(self) -> None:
        """Nothing to zero: the program starts a new conversation at `start_pos == 0` and never reads a slot it did
        not write."""

    @property
    def state(self) -> dict[str, torch.Tensor]:
        """The program's state buffers by name (ExecuTorch's `get_attribute` of the mutable buffers' names), in
        ExecuTorch's layout `[batch, slots, heads, head_dim]`: views of the program's memory, not copies."""
        return {name: torch.as_tensor(self._forward._method.get_attribute(name)) for name in self._names}

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        """The state's shapes in the layout of `step.ProgramModule`'s, `[batch, heads, slots, head_dim]`."""
        return {name: (s[0], s[2], s[1], s[3]) for name, s in ((n, t.shape) for n, t in self.state.items())}
