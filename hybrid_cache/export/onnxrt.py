"""ONNX: a `ProgramModule` (`functional=True`) exported to one `.onnx` with torch's ONNX exporter, and run with ONNX
Runtime on the CPU execution provider, the state bound in place.

ONNX has no mutable state, so the state is the graph's inputs (`keys_<i>`, `values_<i>`) and outputs
(`keys_<i>_out`, ...). The runner owns the state tensors and binds each output to its input's memory (I/O binding):
a step then copies nothing it need not, since ONNX Runtime's `ScatterND` skips its copy when input and output are
the same buffer, and a ring's multi-token write (an elementwise `Where`) runs after every reader of the old ring
(`step.FunctionalWrites`). `check_in_place` proves this on the exported graph before it is kept. One graph serves
every step: its step length is dynamic (1 to `chunk_size`), so one-token steps run it too (the weights are stored
once; two graphs would each embed them).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ..errors import ProgramFormatError
from .metadata import METADATA_KEY, ProgramMetadata
from .step import ProgramModule, example_counters, exporter_quiet

__all__ = ["OnnxBackend", "check_in_place", "export_onnx"]

# Nodes that may write an output bound to their input's memory: the input is the data they update in place.
_IN_PLACE_WRITERS = ("ScatterND", "Where")
_STEP_INPUTS = ("input_ids", "start", "oldest")


class _Step(torch.nn.Module):
    def __init__(self, program: ProgramModule) -> None:
        super().__init__()
        self.program = program

    def forward(self, input_ids: torch.Tensor, start: torch.Tensor, oldest: torch.Tensor, *state: torch.Tensor) -> Any:
        return self.program.step(input_ids, start, oldest, *state)


def export_onnx(module: ProgramModule, path: Path, metadata: ProgramMetadata, progress: Callable[[str], None]) -> None:
    """Export `module`'s step as one graph, check that its state can be bound in place, and write it to `path`."""
    import onnx
    from torch.export import Dim

    names = [name for name, _ in module.state()]
    state = tuple(tensor.clone() for _, tensor in module.state())
    counters = example_counters()
    example = torch.ones(1, min(metadata.chunk_size, 3), dtype=torch.long)
    progress("export: torch.export of the step (ONNX exporter, dynamic step length)")
    with exporter_quiet(), torch.no_grad():
        exported = torch.onnx.export(
            _Step(module),
            (example, *counters, *state),
            dynamo=True,
            input_names=[*_STEP_INPUTS, *names],
            output_names=["logits", *[f"{name}_out" for name in names]],
            dynamic_shapes=({1: Dim.DYNAMIC(min=2, max=metadata.chunk_size)}, None, None, (None,) * len(state)),
            verbose=False,
        )
    assert exported is not None
    model = exported.model_proto
    problems = check_in_place(model, [(name, f"{name}_out") for name in names])
    if problems:
        raise RuntimeError(
            "hybrid_cache internal error: the exported ONNX graph cannot bind its state in place: "
            + "; ".join(problems[:3])
        )
    entry = model.metadata_props.add()
    entry.key, entry.value = METADATA_KEY, metadata.to_json()
    progress(f"writing: {path}")
    onnx.save_model(model, os.fspath(path))


def check_in_place(model: Any, pairs: Sequence[tuple[str, str]]) -> list[str]:
    """What prevents binding each output to its input's memory (empty: nothing). Safe when the node producing the
    output updates that input in place (`ScatterND` data, an elementwise `Where`) and every other node reading the
    input is among that node's ancestors, so that any order ONNX Runtime picks runs it before the write."""
    graph = model.graph
    producer = {output: node for node in graph.node for output in node.output}
    readers: dict[str, list[Any]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)

    def ancestors(node: Any) -> set[int]:
        seen: set[int] = set()
        stack = [node]
        while stack:
            for name in stack.pop().input:
                parent = producer.get(name)
                if parent is not None and id(parent) not in seen:
                    seen.add(id(parent))
                    stack.append(parent)
        return seen

    problems = []
    for source, target in pairs:
        writer = producer.get(target)
        if writer is None or writer.op_type not in _IN_PLACE_WRITERS or source not in writer.input:
            problems.append(f"{target} is not an in-place update of {source}")
            continue
        before = ancestors(writer)
        late = [node.op_type for node in readers.get(source, []) if node is not writer and id(node) not in before]
        if late:
            problems.append(f"{source} is read by {late} after it may be overwritten")
    return problems


class OnnxBackend:
    """An `.onnx` written by `export_onnx`, run by ONNX Runtime (CPU), its state owned here and bound in place (a
    `program.Backend`). `threads`: ONNX Runtime's intra-op threads (default: its own choice)."""

    def __init__(self, path: Path, threads: int | None = None) -> None:
        import onnxruntime

        options = onnxruntime.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
        try:
            session = onnxruntime.InferenceSession(os.fspath(path), options, providers=["CPUExecutionProvider"])
        except Exception as error:  # noqa: BLE001 - ONNX Runtime's own exception types; named in the message
            first = (str(error).strip().splitlines() or [type(error).__name__])[0]
            raise ProgramFormatError(f"{path} is not a readable ONNX program ({first}).") from None
        text = session.get_modelmeta().custom_metadata_map.get(METADATA_KEY)
        if text is None:
            raise ProgramFormatError(f"{path} is an ONNX model but not one exported by hybrid_cache.")
        self.metadata = ProgramMetadata.from_json(text, str(path))
        self.session = session
        dtype = getattr(torch, self.metadata.dtype)
        self.state = {
            spec.name: torch.zeros(spec.shape, dtype=dtype)
            for spec in session.get_inputs()
            if spec.name not in _STEP_INPUTS
        }
        self._numpy = {torch.float32: "float32", torch.float16: "float16"}
        self._logits = torch.empty(1, self.metadata.vocab_size, dtype=dtype)

    def step(self, input_ids: torch.Tensor, start: int, oldest: int) -> torch.Tensor:
        import numpy as np

        inputs = {
            "input_ids": input_ids.contiguous(),
            "start": torch.tensor([start], dtype=torch.long),
            "oldest": torch.tensor([oldest], dtype=torch.long),
        }
        binding = self.session.io_binding()
        for name, tensor in inputs.items():  # `inputs` keeps them alive until the run returns
            binding.bind_input(name, "cpu", 0, np.int64, list(tensor.shape), tensor.data_ptr())
        element = np.dtype(self._numpy[self._logits.dtype])
        binding.bind_output("logits", "cpu", 0, element, list(self._logits.shape), self._logits.data_ptr())
        for name, tensor in self.state.items():
            binding.bind_input(name, "cpu", 0, element, list(tensor.shape), tensor.data_ptr())
            binding.bind_output(f"{name}_out", "cpu", 0, element, list(tensor.shape), tensor.data_ptr())
        self.session.run_with_iobinding(binding)
        return self._logits.clone()

    def zero_state(self) -> None:
        for tensor in self.state.values():
            tensor.zero_()

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        """Read from the program's own state inputs."""
        return {spec.name: tuple(spec.shape) for spec in self.session.get_inputs() if spec.name in self.state}
