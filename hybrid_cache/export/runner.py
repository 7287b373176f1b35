"""`RunnerProgram`: a model and its cache as the one `forward(tokens, start_pos)` ExecuTorch's stock LLM runner calls.

ExecuTorch's `TextLLMRunner` (`extension/llm/runner`) drives a `.pte` through one method, `forward(tokens [1, n],
start_pos [1])` with a dynamic `n` (the whole prompt in one call, then one token per call), reads the metadata methods
(`get_max_seq_len`, `get_eos_ids`, ...) and nothing else: it calls no reset, zero-fills nothing and keeps no counter
but its position. So everything a step needs is in the program:

- **Counters in the program's state**: buffers `length` and `oldest` (the oldest position the rings still hold).
  `start_pos == 0` starts a new conversation (the runner's `reset()`); `start_pos < length` continues from an
  earlier position (a rollback: exact under the rule of every `crop`, `slots.window_reaches`); any other step
  (`start_pos > length`, a rollback the rings cannot make exact, a step past `max_cache_len`) fails at the program's
  first operation, before anything is written (an index out of range: ExecuTorch returns an error, the runner says
  "Generation failed", and the program continues exactly once given a valid step).
- **Storage in ExecuTorch's layout** `[1, slots, kv_heads, head_dim]`, written by ExecuTorch's `llama::update_cache`
  (full layers, at `start_pos`) and `llama::update_cache_with_indices` (rings: the step's newest `min(n, slots)`
  rows at slots `(start_pos + row) % slots`, `slots.floor_mod`), read by `llama::custom_sdpa` (`PROGRAM_ATTENTION`,
  the attention function this module registers): a full layer attends mask-free and causally over keys
  `[0, start_pos + n)`, so an unwritten slot is never read.
- **Both ring paths in one graph** by symbolic sizes (`many = min(n - 1, 1)`; no branch, no `torch.cond`): a
  multi-token step attends on `[the ring as it was, unwritten slots zeroed ; its own keys]` with the mask the model's
  own mask function gives at those positions (the mask hook, `slots.slot_positions`), before the write; a one-token
  step writes, then attends mask-free over ring slots `[0, min(start_pos, W - 1)]` (with exactly `W` slots they hold
  the window). The unused path is empty (0 ring rows, or 1 key). With a `rollback_margin` the rings hold more than
  the window and every step takes the masked path.

What it refuses at export (`ValueError`): attention the fused kernel cannot compute exactly (sinks, logit
softcapping, non-causal layers), chunked layers (their mask is not a window's).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.utils import is_torchdynamo_compiling

from ..cache import HybridRingCache
from ..compat import cache_kwargs
from ..full import StaticFullLayer
from ..mask_hook import PROGRAM_ATTENTION, RingLayout, install_mask_hook
from ..ring import StaticRingSlidingLayer
from ..slots import advance_oldest, floor_mod, slot_positions, window_reaches
from ..specs import CHUNKED, FULL, SLIDING
from .step import model_parameter, state_names

__all__ = ["RunnerEagerBackend", "RunnerProgram", "program_attention", "runner_metadata_methods"]


class _Step:
    """What the layers and the attention function of one traced `forward` share: the step's start (`[1]` tensor and
    its value as a symbolic int), length, the oldest position the rings hold, and whether the step takes the rings'
    masked path (`many`: 1, or 0 for a one-token step on rings of exactly the window)."""

    def __init__(self, start: torch.Tensor, length: int, oldest: torch.Tensor, exact_rings: bool) -> None:
        self.start = start.view(())
        self.start_int = start[0].item()
        torch._check(self.start_int >= 0)
        self.length = length
        self.oldest = oldest.view(())
        self.many = torch.sym_min(length - 1, 1) if exact_rings else 1

    def ring_rows(self, slots: int) -> Any:
        """Ring rows the masked path reads: all, or none for a one-token step on rings of exactly the window. Run
        eagerly (tests, the reference), every step reads all: the eager mask hook checks the masked path's window,
        which the empty path of a one-token step would fail; its output is not taken either way."""
        return self.many * slots if is_torchdynamo_compiling() else slots


_ACTIVE: list[_Step] = []


def _active() -> _Step:
    if not _ACTIVE:
        raise RuntimeError(
            "A hybrid_cache runner-program layer was called outside `RunnerProgram.forward`: it is the program's "
            "storage, not a cache for eager use. Use `HybridRingCache` for eager steps."
        )
    return _ACTIVE[-1]


def _bshd(states: torch.Tensor) -> torch.Tensor:
    """`[batch, heads, n, head_dim]` (transformers' layout) as ExecuTorch's ops take it, `[batch, n, heads, head_dim]`."""
    return states.transpose(1, 2).contiguous()


class RunnerRingLayer(StaticRingSlidingLayer):
    """A sliding layer's ring of `sliding_window (+ rollback_margin)` slots in the runner program (see the module
    docstring); `k_cache` / `v_cache` `[1, slots, heads, head_dim]` are the program's buffers, bound at every call."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    tensor_steps = True

    def _held(self, step: _Step) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions of the ring's first `many * slots` slots before the step (`-1` where unwritten or no longer
        held), and whether each is held."""
        positions = slot_positions(step.start, self.max_slots, count=step.ring_rows(self.max_slots))
        held = (positions >= step.oldest) & (positions >= 0)
        return torch.where(held, positions, -1), held

    def returned_key_count(self, query_length: int) -> int:
        return int(_active().ring_rows(self.max_slots) + query_length)

    def get_mask_sizes(self, query_length: int) -> tuple[int, RingLayout]:  # type: ignore[override]
        step = _active()
        held, _ = self._held(step)
        positions = torch.cat([held, step.start + torch.arange(query_length)])
        return step.ring_rows(self.max_slots) + query_length, RingLayout(positions, end=step.start + query_length)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns the masked path's keys `[ring as it was, zeroed where not held ; the step's]` (transformers' layout),
        then writes the step's newest `min(n, slots)` rows; the one-token path reads the ring itself
        (`program_attention`)."""
        step, slots = _active(), self.max_slots
        _, held = self._held(step)
        returned = []
        rows = torch.arange(torch.sym_min(step.length, slots)) + (step.length - torch.sym_min(step.length, slots))
        indices = floor_mod(step.start + rows, slots).view(1, -1)
        for states, storage in ((key_states, self.k_cache), (value_states, self.v_cache)):
            new = _bshd(states)
            old = torch.where(held.view(1, -1, 1, 1), storage[:, : step.ring_rows(slots)], 0.0)
            returned.append(torch.cat([old, new], 1).transpose(1, 2))
            torch.ops.llama.update_cache_with_indices(new.index_select(1, rows), storage, 0, indices)
        return returned[0], returned[1]


class RunnerFullLayer(StaticFullLayer):
    """A full layer of `max_cache_len` slots in the runner program: `llama::update_cache` at `start_pos` (which
    refuses a write past the end before writing); the attention reads `[0, start_pos + n)` of the buffers."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    tensor_steps = True

    def returned_key_count(self, query_length: int) -> int:
        return query_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0  # the mask is not read (`program_attention`): the smallest one transformers builds

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        start = _active().start_int
        torch.ops.llama.update_cache(_bshd(key_states), self.k_cache, start)
        torch.ops.llama.update_cache(_bshd(value_states), self.v_cache, start)
        return key_states, value_states


def _source_layer(cache: HybridRingCache, layer_idx: int) -> Any:
    """The layer whose storage layer `layer_idx` reads: itself, or for a KV-shared layer the one it reuses."""
    spec = cache.specs[layer_idx]
    if spec.stores:
        return cache.layers[layer_idx]
    if spec.shares_from is not None:
        return cache.layers[spec.shares_from]
    for earlier in reversed(cache.specs[:layer_idx]):  # the last storing layer of its type (transformers' "reuse")
        if earlier.stores and earlier.layer_type == spec.layer_type:
            return cache.layers[earlier.index]
    raise ValueError(f"Layer {layer_idx} is KV-shared but no earlier layer of its type stores keys and values.")


_PROGRAMS: list[RunnerProgram] = []


def program_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The attention of a runner program's layer (registered as `PROGRAM_ATTENTION`), on ExecuTorch's
    `llama::custom_sdpa`: see the module docstring. Returns `[batch, n, heads, head_dim]`, as transformers' sdpa."""
    if not _PROGRAMS:
        raise RuntimeError(
            f"attn_implementation={PROGRAM_ATTENTION!r} runs only inside a hybrid_cache runner program."
        )
    step, program = _active(), _PROGRAMS[-1]
    layer = _source_layer(program.cache, module.layer_idx)  # type: ignore[arg-type]
    scale = float(scaling) if scaling is not None else None
    q = _bshd(query)
    if isinstance(layer, RunnerFullLayer):
        # Queries are the step's last `q.shape[1]` (a model may compute only those, e.g. Gemma 4's KV-shared layers).
        first = step.start_int + (step.length - q.shape[1])
        return torch.ops.llama.custom_sdpa(q, layer.k_cache, layer.v_cache, first, None, 0.0, True, scale), None
    if attention_mask is None or attention_mask.dim() != 4:
        raise RuntimeError("A runner program's ring layer got no 4D mask: the mask hook did not build it.")
    mask = attention_mask[0, 0]
    if mask.dtype == torch.bool:
        mask = torch.where(mask, 0.0, float("-inf")).to(q.dtype)
    chunk = torch.ops.llama.custom_sdpa(q, _bshd(key), _bshd(value), 0, mask, 0.0, False, scale)
    last = q.index_select(1, torch.arange(1) + (q.shape[1] - 1))
    # Ring slots = the window whenever this path is taken (`many` is 0 only for rings of exactly the window).
    bound = (1 - step.many) * torch.sym_min(step.start_int, layer.max_slots - 1)
    decode = torch.ops.llama.custom_sdpa(last, layer.k_cache, layer.v_cache, bound, None, 0.0, False, scale)
    return torch.where(torch.full((1, 1, 1, 1), step.many) > 0, chunk, decode), None


def register_program_attention() -> None:
    """Register `program_attention` and sdpa's mask function under `PROGRAM_ATTENTION` (idempotent; the mask hook
    then wraps the mask function, so rings get their layout's masks)."""
    if AttentionInterface._global_mapping.get(PROGRAM_ATTENTION) is not program_attention:
        AttentionInterface.register(PROGRAM_ATTENTION, program_attention)
    if PROGRAM_ATTENTION not in AttentionMaskInterface._global_mapping:
        AttentionMaskInterface.register(PROGRAM_ATTENTION, sdpa_mask)
    install_mask_hook()


def _refuse_unsupported(model: Any, cache: HybridRingCache) -> None:
    config = cache.config
    if any(spec.kind == CHUNKED for spec in cache.specs):
        raise ValueError(
            "A runner program (.pte for ExecuTorch's TextLLMRunner) does not take chunked-attention layers (Llama 4): "
            "their mask is not a window's. Export to ONNX (.onnx) instead."
        )
    for name in ("attn_logit_softcapping", "final_attn_logit_softcapping"):
        if name == "attn_logit_softcapping" and getattr(config, name, None):
            raise ValueError(
                f"A runner program attends with ExecuTorch's llama::custom_sdpa, which has no logit softcapping "
                f"({name}={getattr(config, name)}). Export to ONNX (.onnx) instead."
            )
    for module in model.modules():
        if hasattr(module, "layer_idx") and hasattr(module, "is_causal"):
            if getattr(module, "sinks", None) is not None or module.is_causal is False:
                raise ValueError(
                    f"A runner program attends with ExecuTorch's llama::custom_sdpa, which has no attention sinks and "
                    f"is causal: {type(module).__name__} (layer {module.layer_idx}) is not. Export to ONNX instead."
                )


class RunnerProgram(torch.nn.Module):
    """The model and its storage as one `forward(tokens [1, n], start_pos [1]) -> logits [1, vocab]` (see the module
    docstring). `max_cache_len`: slots of every full layer, the longest conversation; `rollback_margin`: extra ring
    slots (the masked path then serves every step). The model must be on `"sdpa"` or `"eager"` attention; it is
    switched to `PROGRAM_ATTENTION` while the program runs or is traced (`attention`)."""

    length: torch.Tensor  # buffers: tokens held, the oldest position the rings hold, the admission guard's index
    oldest: torch.Tensor
    admission: torch.Tensor

    def __init__(self, model: Any, max_cache_len: int, rollback_margin: int = 0) -> None:
        super().__init__()
        self.model: Any = model
        self.max_cache_len = max_cache_len
        self.cache = HybridRingCache(model.config, max_cache_len=max_cache_len, rollback_margin=rollback_margin)
        _refuse_unsupported(model, self.cache)
        parameter = model_parameter(model)
        specs = self.cache.specs
        heads = [spec.declared_kv_heads if spec.stores else None for spec in specs]
        sizes = [spec.declared_head_dim or (spec.hidden_size or 0) // (spec.query_heads or 1) for spec in specs]
        self.cache.early_initialization(1, heads, sizes, parameter.dtype, parameter.device)  # type: ignore[arg-type]
        self.storing = [spec.index for spec in specs if spec.stores]
        windows = {spec.window for spec in specs if spec.kind == SLIDING}
        self.window = next(iter(windows), None)
        for index in self.storing:
            # The fixed mode's layers, in their runner form (the same state; storage in ExecuTorch's layout).
            layer = self.cache.layers[index]
            layer.__class__ = RunnerFullLayer if specs[index].kind == FULL else RunnerRingLayer
            for name, tensor in zip(state_names(index), (layer.keys, layer.values)):
                batch, heads, slots, size = tensor.shape  # fresh storage: standard strides (ExecuTorch's dim order)
                self.register_buffer(name, tensor.new_zeros(batch, slots, heads, size), persistent=False)
            self._bind(index)
        self.ring_slots = next(
            (self.cache.layers[i].max_slots for i in self.storing if specs[i].kind == SLIDING), max_cache_len
        )
        self.exact_rings = self.window is not None and self.ring_slots == self.window
        self.register_buffer("length", torch.zeros(1, dtype=torch.long), persistent=False)
        self.register_buffer("oldest", torch.zeros(1, dtype=torch.long), persistent=False)
        self.register_buffer("admission", torch.zeros(1, dtype=torch.long), persistent=False)

    def _bind(self, index: int) -> Any:
        """Point layer `index` at this module's buffers (read at every traced call: a tensor a layer only refers to
        would be traced as a constant and its writes lost); `keys` / `values` are their views in transformers'
        layout, for whatever reads them."""
        layer = self.cache.layers[index]
        layer.k_cache, layer.v_cache = (getattr(self, name) for name in state_names(index))
        layer.keys, layer.values = layer.k_cache.transpose(1, 2), layer.v_cache.transpose(1, 2)
        return layer

    def slots(self) -> dict[int, int]:
        """Slots each layer holds (0: KV-shared), by decoder layer."""
        return {
            i: (getattr(self, state_names(i)[0]).shape[1] if i in self.storing else 0)
            for i in range(len(self.cache.layers))
        }

    @contextlib.contextmanager
    def attention(self) -> Iterator[None]:
        """Within the block the model attends through `program_attention` (its previous attention comes back)."""
        register_program_attention()
        previous = self.model.config._attn_implementation
        self.model.set_attn_implementation(PROGRAM_ATTENTION)
        _PROGRAMS.append(self)
        try:
            yield
        finally:
            _PROGRAMS.pop()
            self.model.set_attn_implementation(previous)

    def forward(self, tokens: torch.Tensor, start_pos: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        fresh = start_pos == 0
        held = torch.where(fresh, 0, self.length)
        oldest = torch.where(fresh, 0, self.oldest)
        admitted = (start_pos <= held) & (start_pos + length <= self.max_cache_len)
        if self.window is not None:
            admitted &= window_reaches(start_pos, oldest, self.window)
        # Refused before anything is written: an index out of range in the op every later one depends on.
        tokens = tokens + self.admission.index_select(0, torch.where(admitted, 0, 1))
        step = _Step(start_pos, length, oldest, self.exact_rings)
        torch._check(step.start_int + length <= self.max_cache_len)
        for index in self.storing:
            layer = self._bind(index)
            layer.length_tensor = step.start
            if hasattr(layer, "oldest_tensor"):
                layer.oldest_tensor = step.oldest
        positions = (start_pos + torch.arange(length)).view(1, -1)
        _ACTIVE.append(step)
        try:
            output = self.model(
                input_ids=tokens, position_ids=positions, use_cache=True, logits_to_keep=1, **cache_kwargs(self.cache)
            )
        finally:
            _ACTIVE.pop()
        self.length.copy_(start_pos + length)
        self.oldest.copy_(advance_oldest(oldest, start_pos + length, self.ring_slots))
        return output.logits[:, -1]


def runner_metadata_methods(program: RunnerProgram, eos_token_ids: tuple[int, ...], vocab_size: int) -> dict:
    """The constant methods ExecuTorch's LLM runner reads (`llm_runner_helper.cpp`): the longest step and context
    (`max_cache_len`: the runner then refuses a longer prompt before any call), KV cache, dynamic `n`, end ids."""
    return {
        "get_max_seq_len": program.max_cache_len,
        "get_max_context_len": program.max_cache_len,
        "use_kv_cache": True,
        "enable_dynamic_shape": True,
        "use_sdpa_with_kv_cache": True,
        "get_eos_ids": list(eos_token_ids),
        "get_vocab_size": vocab_size,
    }


class RunnerEagerBackend:
    """A `RunnerProgram` run as it is, in PyTorch (a `program.Backend`): the ExecuTorch program's arithmetic without
    the runtime, for tests and as its reference."""

    def __init__(self, program: RunnerProgram) -> None:
        self.program = program

    @torch.no_grad()
    def step(self, input_ids: torch.Tensor, start: int, oldest: int) -> torch.Tensor:
        with self.program.attention():
            return self.program(input_ids, torch.tensor([start]))

    def zero_state(self) -> None:
        """Nothing to zero (see `pte.ExecuTorchBackend.zero_state`)."""

    @property
    def state(self) -> dict[str, torch.Tensor]:
        """The state buffers by name, `[batch, slots, heads, head_dim]`, and the counters."""
        names = [name for index in self.program.storing for name in state_names(index)]
        return {name: getattr(self.program, name) for name in (*names, "length", "oldest")}

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        buffers = [(name, tensor.shape) for name, tensor in self.state.items() if tensor.dim() == 4]
        return {name: (shape[0], shape[2], shape[1], shape[3]) for name, shape in buffers}
