"""The ring's slot arithmetic: which slot holds which position, which positions a ring still holds, and whether it
can continue at a given length. One implementation for every path that writes or reads a ring: the eager and
compiled layers (`ring.py`, `streaming.py`) and the exported program's graph and runner (`hybrid_cache.export`).

A ring of `capacity` slots keeps position `p` in slot `p % capacity` (`(p - first) % capacity` for a ring that keeps
its first `first` positions apart, a bounded layer's sinks). The functions take Python integers or 0-d integer tensors
where a compiled step or an exported program passes its counters as tensors.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "SlotRuns",
    "advance_oldest",
    "floor_mod",
    "ring_runs",
    "ring_slots",
    "slot_positions",
    "window_reaches",
]

#: Where a step keeps its newest tokens: `(first slot, count, first source token)` runs (`_newest_runs`).
SlotRuns = list[tuple[int, int, int]]


def ring_slots(length: int, oldest: int, max_slots: int) -> int:
    """Slots of a ring worth keeping: `[0, length)` while in time order (`oldest == 0`, `length <= max_slots`), else
    every slot (in slot order, not time order)."""
    return length if oldest == 0 and length <= max_slots else max_slots


def floor_mod(value: torch.Tensor, modulus: int) -> torch.Tensor:
    """`value mod modulus` in `[0, modulus)` for integer tensors, negative values too (Python's `%`), written with a
    floor division: ExecuTorch's portable `remainder` kernel truncates negative int64 (`remainder(-1, 8) == -1`)."""
    return value - torch.div(value, modulus, rounding_mode="floor") * modulus


def slot_positions(
    length: int | torch.Tensor,
    capacity: int,
    first: int = 0,
    device: torch.device | None = None,
    count: Any = None,
) -> torch.Tensor:
    """The newest position `p < length` held by each slot of a ring of `capacity` slots that keeps positions `p >=
    first` in slot `(p - first) % capacity` (`[capacity]`, or its first `count` slots; below `first` where no such
    position was written yet). The one formula of the ring's layout: eager, compiled and exported steps all read slot
    positions from it; `length` may be a 0-d tensor (a compiled step's counter, an exported program's input)."""
    slot_ids = torch.arange(capacity if count is None else count, device=device)
    return (length - 1) - floor_mod((length - 1 - first) - slot_ids, capacity)


def advance_oldest(oldest: int | torch.Tensor, length: int | torch.Tensor, capacity: int) -> Any:
    """The oldest position a ring of `capacity` slots still holds once `length` tokens were written (positions below
    `oldest` were already overwritten, or rolled back): an int for Python counters, a tensor for tensor counters (a
    compiled step's)."""
    if isinstance(oldest, torch.Tensor) or isinstance(length, torch.Tensor):
        return torch.maximum(torch.as_tensor(oldest), torch.as_tensor(length) - capacity)
    return max(oldest, length - capacity)


def window_reaches(new_length: Any, oldest: Any, window: int, first: int = 0) -> Any:
    """Whether a ring holding every position from `oldest` on can continue at `new_length` exactly: the next query
    sees `new_length - window + 1 .. new_length - 1` (positions below `first`, a bounded layer's sinks, are kept
    apart). The rule of every `crop`, in the eager cache, in an exported program's runner and, on tensors (a bool
    tensor), inside a runner program."""
    if isinstance(oldest, torch.Tensor) or isinstance(new_length, torch.Tensor):
        return torch.as_tensor(oldest) <= torch.clamp(torch.as_tensor(new_length) - window + 1, min=first)
    return oldest <= max(first, new_length - window + 1)


def ring_runs(first_position: int, count: int, capacity: int) -> list[tuple[int, int, int]]:
    """The slots holding positions `[first_position, first_position + count)` of a ring of `capacity` slots
    (position `p` in slot `p % capacity`, `count <= capacity`), as `(first slot, count, offset)` runs: one, or two
    across the end of the ring; `offset` is the run's first position minus `first_position`."""
    start = first_position % capacity
    head = min(count, capacity - start)
    return [(start, head, 0)] + ([(0, count - head, head)] if count > head else [])
