"""`MemoryReport`: the bytes a `HybridRingCache` holds, per layer type, against a full cache of every layer."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["MemoryReport", "memory_report"]


@dataclass
class MemoryReport:
    """KV bytes held by a `HybridRingCache`, per layer type, against a full cache of every layer.

    Attributes:
        tokens: tokens seen so far (cache length).
        total_bytes: bytes of every tensor the cache keeps alive: key/value storage, plus `extra_bytes`.
        full_cache_bytes: bytes a full (non-sliding) cache of every storing layer would hold for `tokens` tokens.
        kv_bytes: bytes of key/value storage actually allocated (every layer).
        extra_bytes: everything else the cache keeps alive: the window kept to undo the last speculative step (while
            past recording is on, see `HybridRingCache.deactivate_past_recording`), the fixed mode's counters, and
            `workspace_bytes`.
        bytes_by_type: allocated key/value bytes per layer type (`sliding_attention`, `full_attention`, `shared`).
        layers_by_type: number of layers of each type.
        slots_by_type: allocated token slots per layer of each type (capacity).
        per_layer: `(layer_type, bytes)` for every layer.
        workspace_bytes: model-dtype buffers that compressed full layers dequantize their history into (shared by
            those layers, one layer's keys and values; part of `extra_bytes` and `total_bytes`; 0 without
            compression).
    """

    tokens: int
    total_bytes: int
    full_cache_bytes: int
    kv_bytes: int = 0
    extra_bytes: int = 0
    bytes_by_type: dict[str, int] = field(default_factory=dict)
    layers_by_type: dict[str, int] = field(default_factory=dict)
    slots_by_type: dict[str, list[int]] = field(default_factory=dict)
    per_layer: list[tuple[str, int]] = field(default_factory=list)
    workspace_bytes: int = 0

    @property
    def saving(self) -> float:
        """Fraction of the full cache's bytes not held (0 when nothing is saved)."""
        return 1.0 - self.total_bytes / self.full_cache_bytes if self.full_cache_bytes else 0.0

    def __str__(self) -> str:
        lines = [
            f"KV cache after {self.tokens} tokens",
            f"  {'layer type':<18}{'layers':>7}{'slots/layer':>13}{'MiB':>11}",
        ]
        for layer_type, count in self.layers_by_type.items():
            slots = sorted(set(self.slots_by_type.get(layer_type, []))) or [0]
            slot_text = "/".join(str(s) for s in slots)
            lines.append(f"  {layer_type:<18}{count:>7}{slot_text:>13}{self.bytes_by_type[layer_type] / 2**20:>11.3f}")
        if self.workspace_bytes:
            lines.append(f"  {'dequant. workspace':<18}{'':>7}{'':>13}{self.workspace_bytes / 2**20:>11.3f}")
        if self.extra_bytes - self.workspace_bytes:
            other = self.extra_bytes - self.workspace_bytes
            lines.append(f"  {'rollback, counters':<18}{'':>7}{'':>13}{other / 2**20:>11.3f}")
        lines.append(f"  {'total':<18}{sum(self.layers_by_type.values()):>7}{'':>13}{self.total_bytes / 2**20:>11.3f}")
        lines.append(
            f"  full cache of every storing layer: {self.full_cache_bytes / 2**20:.3f} MiB "
            f"(held: {100 * (1 - self.saving):.1f}%, saved: {100 * self.saving:.1f}%)"
        )
        return "\n".join(lines)


def memory_report(
    tokens: int, layer_kinds: Sequence[str], layers: Sequence[Any], workspace_bytes: int
) -> MemoryReport:
    """The report of a cache holding `tokens` tokens in `layers` (one kind each), plus a shared dequantization
    workspace of `workspace_bytes`: every tensor it keeps alive, against a full cache of every storing layer."""
    report = MemoryReport(
        tokens=tokens,
        total_bytes=workspace_bytes,
        full_cache_bytes=0,
        extra_bytes=workspace_bytes,
        workspace_bytes=workspace_bytes,
    )
    for kind, layer in zip(layer_kinds, layers):
        held = layer.nbytes() if hasattr(layer, "nbytes") else 0
        extra = layer.extra_nbytes() if hasattr(layer, "extra_nbytes") else 0
        report.per_layer.append((kind, held))
        report.kv_bytes += held
        report.extra_bytes += extra
        report.total_bytes += held + extra
        report.bytes_by_type[kind] = report.bytes_by_type.get(kind, 0) + held
        report.layers_by_type[kind] = report.layers_by_type.get(kind, 0) + 1
        report.slots_by_type.setdefault(kind, []).append(getattr(layer, "capacity", 0))
        if getattr(layer, "is_initialized", False) and hasattr(layer, "uncompressed_bytes_per_token"):
            report.full_cache_bytes += layer.uncompressed_bytes_per_token() * tokens
    return report
