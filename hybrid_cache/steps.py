"""Steps as transactions: what the step in progress has written, so that a forward that raised after some layers
stored it is undone before the cache is used again.

A model's forward stores one step (its `query_length` new tokens) layer by layer, in layer order, after building
its masks (`get_mask_sizes`, which arms the journal). `StepJournal` records which storing layers have stored the
open step. The step is complete when the last storing layer has stored
it. A forward that raised before that (an out-of-memory in a layer's MLP, a `KeyboardInterrupt`, an error in an
attention function) leaves the step open; so does one whose attention on codes reported a refusal after the write
(`fail`). Such a step is *dead*, and the next call that can only come from a new step or from the user (the first
`update` of a new step, mask creation, `crop`, `save`, ...) undoes it: every layer that stored it is cropped back by
`query_length` tokens, which is exact wherever the layer can undo that many tokens (always for one-token steps; for a
multi-token step on a wrapped ring only while past recording kept its window). Where it cannot, the cache refuses
every further use with `IncompleteStepError` until `reset`, `restore` or `load_into` replaces its state.

What the cache cannot see: a forward that raised after its last storing layer stored the step (in that layer's
attention or MLP, the final norm, the output layer) leaves a complete step, as it leaves one in `DynamicCache`;
`cache.crop(-query_length)` removes it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

from .errors import IncompleteStepError, RollbackError

__all__ = ["StepJournal"]


class StepJournal:
    """The storing layers that wrote the open step, and whether that step is known to have failed.

    Args:
        storing (`Sequence[int]`): the indices of the layers that store tokens, in the order a forward updates them.
    """

    written: list[int]  # the storing layers that stored the open step, in order
    broken: str | None  # why the cache cannot continue (a dead step it could not undo)

    def __init__(self, storing: Sequence[int]) -> None:
        self.storing = tuple(storing)
        self.forget()

    @property
    def open(self) -> bool:
        """Whether the last step is dead: some layers stored it and it did not complete, or it failed after that."""
        return bool(self.written) and (self.failed or not self.complete)

    def uncommitted(self, layer_idx: int) -> int:
        """Tokens of a dead step that layer `layer_idx` holds (0 when the last step is not dead or it did not store
        it)."""
        return self.query_length if self.open and layer_idx in self.written else 0

    def starts_step(self, layer_idx: int) -> bool:
        """Whether an update of `layer_idx` begins a new step (the last one completed, failed, or already reached
        this layer)."""
        return not self.written or self.complete or self.failed or layer_idx <= self.written[-1]

    def arm(self) -> None:
        """A model forward is building its masks (`get_mask_sizes`): the step it runs next is journaled. Steps that
        no mask creation announced (`update` called directly, layer by layer, as in tests of the cache itself, or a
        forward given prepared masks) are not: nothing tells them apart from a forward that died."""
        self.armed = True

    def begin(self, query_length: int) -> None:
        self.written, self.query_length, self.complete, self.failed = [], query_length, False, False
        self.tracking, self.armed = self.armed, False

    def stored(self, layer_idx: int) -> None:
        if self.tracking:
            self.written.append(layer_idx)
            self.complete = len(self.written) == len(self.storing)

    def fail(self) -> None:
        """The step was refused after some layers stored it (attention on codes): undo it at the next call."""
        if self.written:
            self.failed = True

    def forget(self) -> None:
        """The cache's state was replaced (`reset`, `restore`, `load_into`): nothing to undo, nothing broken."""
        self.written = []
        self.query_length, self.complete, self.failed = 0, False, False
        self.armed = self.tracking = False
        self.broken = None

    def abandon(self, layers: Sequence[Any]) -> None:
        """A refusal was raised during the step (by a check or a layer): undo what it stored now, so the refusal
        leaves the cache as it was; where that cannot be done exactly, the next use raises `IncompleteStepError`."""
        if self.written and not self.complete:
            self.failed = True
            with contextlib.suppress(IncompleteStepError):
                self.settle(layers)

    def settle(self, layers: Sequence[Any]) -> None:
        """Undo a dead step in `layers` (the cache's), or raise `IncompleteStepError` when it cannot be undone."""
        if self.broken is not None:
            raise IncompleteStepError(self.broken)
        if not self.open:
            return
        written, count = list(self.written), self.query_length
        try:
            for index in written:
                layers[index].check_crop(-count)
        except RollbackError as error:
            self.broken = (
                f"A forward failed after layers {written} of {list(self.storing)} stored its {count} tokens, and "
                f"they cannot be taken back exactly ({error}). The cache cannot continue this sequence: call "
                f"`cache.reset()` to start over, `cache.restore(checkpoint)` to go back to a checkpoint, or load a "
                f"saved cache (`HybridRingCache.load`)."
            )
            raise IncompleteStepError(self.broken) from None
        for index in written:
            layers[index].crop(-count)
        self.written, self.failed = [], False
