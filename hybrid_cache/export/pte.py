"""ExecuTorch: a `ProgramModule` exported to one `.pte` (methods `decode`, `chunk`, `reset` sharing the state
buffers; XNNPACK for the model's dense ops) and run with ExecuTorch's runtime (its Python bindings).

How it is lowered, and why (each a trap met on ExecuTorch 1.5.1, docs/export.md): the methods share their mutable
buffers (`share_mutable_buffers`), whose names are emitted so the runner can read their shapes; the re-inplace pass
runs, without which every `index_copy_` copies the whole buffer (12-23 ms a step on a 32 MiB cache, against 0.1 ms);
the buffers start uninitialized, so the runner calls `reset` (a zero fill) before the first step; the metadata is a
constant method (`metadata.METADATA_KEY`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..errors import ProgramFormatError
from .metadata import METADATA_KEY, ProgramMetadata
from .step import ProgramModule, example_counters, exporter_quiet, state_names

__all__ = ["ExecuTorchBackend", "export_pte"]


class _Step(torch.nn.Module):
    """The `decode` / `chunk` method, a module over the `ProgramModule` (every method sees the same buffer names,
    which ExecuTorch shares between methods)."""

    def __init__(self, program: ProgramModule) -> None:
        super().__init__()
        self.program = program

    def forward(self, input_ids: torch.Tensor, start: torch.Tensor, oldest: torch.Tensor) -> Any:
        return self.program.step(input_ids, start, oldest)


class _Reset(torch.nn.Module):
    """The `reset` method: zero every state buffer."""

    def __init__(self, program: ProgramModule) -> None:
        super().__init__()
        self.program = program

    def forward(self) -> torch.Tensor:
        return self.program.reset()


def export_pte(module: ProgramModule, path: Path, metadata: ProgramMetadata, progress: Callable[[str], None]) -> None:
    """Export `module`'s three methods, lower them to XNNPACK and write the `.pte` at `path`."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import EdgeCompileConfig, ExecutorchBackendConfig, to_edge_transform_and_lower
    from executorch.exir.passes import MemoryPlanningPass
    from torch.export import Dim, export

    one = torch.ones(1, dtype=torch.long)
    counters = example_counters()
    chunk_ids = one.repeat(1, min(metadata.chunk_size, 3))
    with exporter_quiet(), torch.no_grad():
        progress("export: torch.export of the decode, chunk and reset steps")
        programs = {
            "decode": export(_Step(module), (one.view(1, 1), *counters), strict=False),
            "chunk": export(
                _Step(module),
                (chunk_ids, *counters),
                dynamic_shapes=({1: Dim.DYNAMIC(min=2, max=metadata.chunk_size)}, None, None),
                strict=False,
            ),
            "reset": export(_Reset(module), (), strict=False),
        }
        progress("lowering: ExecuTorch edge dialect, XNNPACK delegate")
        edge = to_edge_transform_and_lower(
            programs,
            partitioner=[XnnpackPartitioner()],
            compile_config=EdgeCompileConfig(_check_ir_validity=False),
            constant_methods={METADATA_KEY: torch.tensor(list(metadata.to_json().encode()), dtype=torch.uint8)},
        )
        config = ExecutorchBackendConfig(
            memory_planning_pass=MemoryPlanningPass(share_mutable_buffers=True),
            emit_mutable_buffer_names=True,
            run_reinplace_pass=True,
        )
        program = edge.to_executorch(config)
    progress(f"writing: {path}")
    with open(path, "wb") as file:
        program.write_to_file(file)


class ExecuTorchBackend:
    """A `.pte` written by `export_pte`, loaded into ExecuTorch's runtime (a `program.Backend`)."""

    def __init__(self, path: Path) -> None:
        with open(path, "rb") as file:
            head = file.read(8)
        if head[4:6] != b"ET":  # a flatbuffer whose file identifier (bytes 4-8) is ExecuTorch's, "ET12"
            raise ProgramFormatError(f"{path} is not an ExecuTorch program (.pte): it does not start as one.")
        from executorch.runtime import Runtime

        try:
            program = Runtime.get().load_program(os.fspath(path))
        except RuntimeError as error:
            raise ProgramFormatError(f"{path} is not a readable ExecuTorch program ({error}).") from None
        if METADATA_KEY not in program.method_names:
            raise ProgramFormatError(f"{path} is an ExecuTorch program but not one exported by hybrid_cache.")
        raw = program.load_method(METADATA_KEY).execute([])[0]
        self.metadata = ProgramMetadata.from_json(bytes(raw.tolist()).decode(errors="replace"), str(path))
        missing = {"decode", "chunk", "reset"} - set(program.method_names)
        if missing:
            raise ProgramFormatError(f"{path}: a hybrid_cache program without its {sorted(missing)} method(s).")
        self._methods = {name: program.load_method(name) for name in ("decode", "chunk", "reset")}
        self._names = [name for layer in self.metadata.layers if layer.stores for name in state_names(layer.index)]

    def step(self, input_ids: torch.Tensor, start: int, oldest: int) -> torch.Tensor:
        method = self._methods["decode" if input_ids.shape[1] == 1 else "chunk"]
        counters = (torch.tensor([start], dtype=torch.long), torch.tensor([oldest], dtype=torch.long))
        return method.execute([input_ids.contiguous(), *counters])[0]

    def zero_state(self) -> None:
        self._methods["reset"].execute([])

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        """Read from the program's own buffers (ExecuTorch's `get_attribute` of the mutable buffers' names)."""
        method = self._methods["decode"]
        return {name: tuple(method._method.get_attribute(f"program.{name}").shape) for name in self._names}
