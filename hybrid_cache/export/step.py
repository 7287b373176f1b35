"""`ProgramModule`: a model and its `HybridRingCache` as one exported program runs them, every step tensor arithmetic.

The cache is the package's own fixed mode (`max_cache_len`: `ring.StaticRingSlidingLayer`, `full.StaticFullLayer`,
`DummyLayer` for KV-shared layers) with `tensor_steps` set on its layers: a step of any length is tensor arithmetic
of its counters (the slot arithmetic of `slots.slot_positions`, the ring-layout mask of the mask hook), so one traced
program serves every step. What the program holds and takes:

- state, per storing layer, its keys and values: `sliding_window + rollback_margin` slots for a sliding layer (exactly
  `sliding_window` by default), `max_cache_len` for a full one. For ExecuTorch they are buffers of this module,
  written in place (`index_copy_` along the slot axis, the one in-place form its kernels take); for ONNX
  (`functional=True`) they are graph inputs and outputs, written by `FunctionalWrites`.
- inputs `input_ids` `[1, n]`, `start` `[1]` (the position of the step's first token, i.e. the tokens held) and
  `oldest` `[1]` (the oldest position the rings still hold: `max(0, start - slots)` unless a rollback kept older
  slots out). The runner (`program.Program`) keeps the counters, checks every rule a step must pass before the
  call (`hybrid_cache.steps`), and advances them after it.
- output: the logits of the step's last token `[1, vocab]` (and, for ONNX, the state).

Layers read their storage from the module at every traced call (`bind`): a tensor a layer only refers to would be
traced as a constant and its writes lost.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from ..cache import HybridRingCache
from ..compat import cache_kwargs
from ..storage import SlotWrites

__all__ = [
    "EagerBackend",
    "FunctionalWrites",
    "ProgramModule",
    "example_counters",
    "exporter_quiet",
    "model_parameter",
    "state_names",
]


def state_names(layer_idx: int) -> tuple[str, str]:
    """The names of layer `layer_idx`'s keys and values in the program (buffers, or ONNX inputs / outputs)."""
    return f"keys_{layer_idx}", f"values_{layer_idx}"


def model_parameter(model: Any) -> torch.Tensor:
    """A floating-point parameter of `model`: its dtype and device are the model's (a quantized model's first
    parameters may be integer codes)."""
    return next(p for p in model.parameters() if p.is_floating_point())


def example_counters() -> tuple[torch.Tensor, torch.Tensor]:
    """Example `start` and `oldest` inputs `[1]` of a step, to trace a program with."""
    return torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long)


@contextlib.contextmanager
def exporter_quiet() -> Iterator[None]:
    """The exporters' warnings about their own internals (ExecuTorch's and torch.export's deprecations, unused torchao
    kernels, the ONNX exporter's notes) are not the user's to act on: silenced while a program is traced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


class FunctionalWrites(SlotWrites):
    """Slot writes for a program whose state is graph inputs and outputs (ONNX): each write rebinds the layer's
    tensor to a new one. Writes at indices are one `ScatterND` on the input (`index_put` with one index per axis:
    `index_copy` would export as transpose, scatter, transpose, two copies of the whole buffer). A ring's write of a
    multi-token step (`replace`) is deferred until the logits exist and made to depend on them (`finish`): the step's
    attention reads the ring as it was, and ONNX Runtime, which runs nodes in any order the data allows, must not
    write the ring first when the output is bound to the input's memory."""

    def __init__(self) -> None:
        self.pending: list[tuple[Any, str, torch.Tensor, torch.Tensor]] = []

    def index(self, layer: Any, name: str, index: torch.Tensor, rows: torch.Tensor) -> None:
        tensor = getattr(layer, name)
        batch = torch.zeros(1, 1, 1, dtype=torch.long, device=tensor.device)
        heads = torch.arange(tensor.shape[1], device=tensor.device).view(1, -1, 1)
        setattr(layer, name, torch.ops.aten.index_put(tensor, [batch, heads, index.view(1, 1, -1)], rows))

    def replace(self, layer: Any, name: str, take: torch.Tensor, rows: torch.Tensor) -> None:
        self.pending.append((layer, name, take, rows))

    def finish(self, logits: torch.Tensor) -> None:
        after = logits.reshape(-1)[:1] > float("inf")  # always False: a data dependency on the logits
        for layer, name, take, rows in self.pending:
            tensor = getattr(layer, name)
            setattr(layer, name, torch.where((take | after).view(1, 1, -1, 1), rows, tensor))
        self.pending = []


class ProgramModule(torch.nn.Module):
    """The model and its tensor-state cache (see the module docstring): the `.onnx` program (`functional=True`, its
    state the graph's inputs and outputs). With `functional=False` the state stays in buffers and `reset` zero-fills
    them: the eager reference of the same arithmetic that tests run; no runtime exports it since the `.pte` became
    `runner.RunnerProgram`.

    Args:
        model: a causal LM (`Gemma3ForCausalLM`, `Gemma4ForCausalLM`, ...) in eval mode, batch 1.
        max_cache_len (`int`): slots of every full layer (prompt + generated tokens).
        rollback_margin (`int`): extra ring slots, so that the runner can roll back `rollback_margin + 1` tokens.
        functional (`bool`): the state is inputs and outputs (ONNX) instead of buffers (the eager reference).
    """

    def __init__(self, model: Any, max_cache_len: int, rollback_margin: int = 0, functional: bool = False) -> None:
        super().__init__()
        attention = getattr(model.config, "_attn_implementation", None)
        if attention not in (None, "sdpa", "eager"):
            raise ValueError(
                f"An exported program builds its masks with the mask hook's sdpa or eager masks; the model uses "
                f"attn_implementation={attention!r}. Call `model.set_attn_implementation('sdpa')` before exporting."
            )
        self.model = model
        self.cache = HybridRingCache(model.config, max_cache_len=max_cache_len, rollback_margin=rollback_margin)
        parameter = model_parameter(model)
        specs = self.cache.specs  # the config, as the cache reads it: KV heads and head size of every layer
        heads = [spec.declared_kv_heads if spec.stores else None for spec in specs]
        sizes = [spec.declared_head_dim or (spec.hidden_size or 0) // (spec.query_heads or 1) for spec in specs]
        self.cache.early_initialization(1, heads, sizes, parameter.dtype, parameter.device)  # type: ignore[arg-type]
        self.functional = functional
        self.writes = FunctionalWrites() if functional else None
        self.storing = [i for i, spec in enumerate(self.cache.specs) if spec.stores]
        for index in self.storing:
            layer = self.cache.layers[index]
            layer.tensor_steps = True
            if self.writes is not None:
                layer.slot_writes = self.writes
            for name, tensor in zip(state_names(index), (layer.keys, layer.values)):
                self.register_buffer(name, tensor, persistent=False)

    def state(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every state tensor by name, in the order of the program's state inputs and outputs."""
        for index in self.storing:
            for name in state_names(index):
                yield name, getattr(self, name)

    def slots(self) -> dict[int, int]:
        """Slots each layer holds (0: KV-shared), by decoder layer."""
        return {
            i: (getattr(self, state_names(i)[0]).shape[2] if i in self.storing else 0)
            for i in range(len(self.cache.layers))
        }

    def bind(self, start: torch.Tensor, oldest: torch.Tensor, state: tuple[torch.Tensor, ...] = ()) -> None:
        """Point every layer at this call's storage (the buffers, or the ONNX state inputs) and counters."""
        tensors = iter(state) if state else None
        for index in self.storing:
            layer = self.cache.layers[index]
            names = state_names(index)
            layer.keys, layer.values = (next(tensors), next(tensors)) if tensors else (getattr(self, n) for n in names)
            layer.length_tensor = start.view(())
            if hasattr(layer, "oldest_tensor"):
                layer.oldest_tensor = oldest.view(())

    def step(self, input_ids: torch.Tensor, start: torch.Tensor, oldest: torch.Tensor, *state: torch.Tensor) -> Any:
        """One step of `input_ids` (`[1, n]`) from position `start`: the last token's logits, and for ONNX the state
        after the step."""
        self.bind(start, oldest, state)
        positions = (start + torch.arange(input_ids.shape[1], device=input_ids.device)).view(1, -1)
        output = self.model(
            input_ids=input_ids, position_ids=positions, use_cache=True, logits_to_keep=1, **cache_kwargs(self.cache)
        )
        logits = output.logits[:, -1]
        if self.writes is None:
            return logits
        self.writes.finish(logits)
        layers = [self.cache.layers[i] for i in self.storing]
        return (logits, *[tensor for layer in layers for tensor in (layer.keys, layer.values)])

    def reset(self) -> torch.Tensor:
        """Zero every state buffer (a NaN in an unwritten slot would reach every output through a zero attention
        weight)."""
        for _, tensor in self.state():
            tensor.zero_()
        return torch.zeros(1)


class EagerBackend:
    """A `ProgramModule` run as it is, in PyTorch (a `program.Backend`): the exported programs' arithmetic without a
    runtime, for tests and as their reference. `functional` modules get their state passed in and taken back, as
    ONNX Runtime's runner does."""

    def __init__(self, module: ProgramModule) -> None:
        self.module = module

    @torch.no_grad()
    def step(self, input_ids: torch.Tensor, start: int, oldest: int) -> torch.Tensor:
        counters = (torch.tensor([start]), torch.tensor([oldest]))
        if not self.module.functional:
            return self.module.step(input_ids, *counters)
        logits, *state = self.module.step(input_ids, *counters, *[tensor for _, tensor in self.module.state()])
        for (_, tensor), new in zip(self.module.state(), state):
            tensor.copy_(new)
        return logits

    def zero_state(self) -> None:
        self.module.reset()

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(tensor.shape) for name, tensor in self.module.state()}
