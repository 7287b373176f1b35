"""Step admission: the one place where a step is admitted before it writes, journaled while it writes, and undone when
it fails.

A model's forward stores one step (its `query_length` new tokens) layer by layer, in layer order, after building its
masks. Three moments, and what this module does at each (`StepAdmission`, one per cache):

1. **Masks are built** (`get_mask_sizes`, before any layer writes): a dead step is undone first (below), the journal
   is armed, and a step with no new tokens is refused (`refuse_empty_step`). The mask hook checks, with what only the
   mask creation sees, that the 2D attention mask covers the held tokens (`check_mask_covers`) and that the model's
   window does not reach a key the ring no longer holds (`refuse_unheld_key`); the ring layouts it was announced
   are recorded (`IssuedLayouts`).
2. **A layer is about to write** (`StepAdmission.admit`, called by `HybridRingCache.update`): a 4D mask has the
   width of the keys the layer returns (`check_prepared_mask_width`); the first step after
   `activate_past_recording` on held tokens continues them (`check_assisted_start`); at the step's first layer,
   every layer can hold the step (`check_capacity`, through each layer's `check_fits`) and compressed codes meet an
   attention that reads them (`check_code_attention`); a wrapped ring's layout was served by the hook
   (`IssuedLayouts.check_served`). Every refusal comes before the first write, so a refused step changes nothing.
3. **A layer stored the step** (`StepJournal.stored`): the journal records which storing layers wrote the open step,
   with what each layer kept about its previous step (`step_bookkeeping`: the record that undoes it, what it
   returned), so that undoing the open step puts the layer back exactly.

A step is *dead* when a forward raised after some layers stored it (an out-of-memory in a layer's MLP, a
`KeyboardInterrupt`, attention on the codes refusing after the write: `fail`). The next call that can only come from
a new step or from the user (mask creation, the first `update` of a new step, `crop`, `save`, ...) undoes it: every
layer that stored it is cropped back by `query_length` tokens, which is exact because each layer that overwrites
slots in place keeps the slots its last step overwrote (`ring.SlotUndo`), and then given back its previous step's
bookkeeping. Where a layer cannot (a compiled step keeps no record), the cache refuses every further use with
`IncompleteStepError` until `reset`, `restore` or `load_into` replaces its state.

What the cache cannot see: a forward that raised after its last storing layer stored the step (in that layer's
attention or MLP, the final norm, the output layer) leaves a complete step, as it leaves one in `DynamicCache`;
`cache.crop(-query_length)` takes it back exactly, through the same records.

The rules are small functions of the cache's state (lengths, capacities, positions), so that a program whose state
is tensors can check the same arithmetic and raise the same errors. `StepAdmission.forget` is the one reset path:
`reset`, `restore` and `load_into` call it, and it clears everything above.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from .banded import BandedMask
from .code_attention import CODE_ATTENTION
from .compat import chunked_prefill_release_note, step_positions_note
from .errors import (
    CacheCapacityError,
    CodeAttentionError,
    ConversationMismatchError,
    IncompleteStepError,
    PreparedMaskError,
    RollbackError,
    WindowMismatchError,
)
from .state import StateHolder

__all__ = [
    "GRAPH_CAPACITY",
    "GRAPH_INCOMPLETE_STEP",
    "IssuedLayouts",
    "StepAdmission",
    "StepJournal",
    "behind_first_layer",
    "check_assisted_start",
    "check_capacity",
    "check_code_attention",
    "check_mask_covers",
    "check_prepared_mask_width",
    "held_lengths",
    "refuse_empty_step",
    "refuse_unheld_key",
]


# --- the rules ---------------------------------------------------------------------------------------------------
#: What a compiled step's in-graph checks raise (`StepAdmission.admit_in_graph`), as `RuntimeError`s.
GRAPH_CAPACITY = (
    "HybridRingCache: this compiled step does not fit: the full-attention layers were allocated for max_cache_len "
    "tokens, all held. Nothing was written. Create the cache with a larger `max_cache_len` (prompt + "
    "max_new_tokens)."
)
GRAPH_INCOMPLETE_STEP = (
    "HybridRingCache: its layers hold different numbers of tokens: a forward failed after some layers stored its "
    "step. Nothing was written by this one. Call `cache.reset()` to start over, `cache.restore(checkpoint)` to go "
    "back to a checkpoint, or run the next step without torch.compile, whose checks undo the failed step where "
    "they can."
)


def refuse_empty_step(cached_tokens: int, holder: str = "HybridRingCache") -> None:
    """Raise `ConversationMismatchError` for a step with no new tokens (`get_mask_sizes(0, ...)`; an exported
    program's runner, `holder="the program"`)."""
    fresh = (
        "a new `HybridRingCache(model.config)` or call `cache.reset()`"
        if holder == "HybridRingCache"
        else ("call `program.reset()`")
    )
    raise ConversationMismatchError(
        f"A step with no new tokens reached {holder}, which holds {cached_tokens} tokens: "
        f"`generate` slices the new tokens off the prompt by the cached length, so a prompt no longer than "
        f"the cached tokens leaves nothing (or the wrong tokens) to run. A cache holds one conversation: to "
        f"continue it, pass the whole conversation (the cached tokens, then the new ones); to start another, "
        f"{'pass ' if holder == 'HybridRingCache' else ''}{fresh} first."
    )


def check_capacity(length: int, query_length: int, max_cache_len: int) -> int:
    """The length after a step of `query_length` tokens on `length` held ones, or `CacheCapacityError` when it
    exceeds the fixed capacity `max_cache_len`."""
    end = length + query_length
    if end > max_cache_len:
        raise CacheCapacityError(
            f"The full-attention layers were allocated for max_cache_len={max_cache_len} tokens, but {end} are "
            f"needed. Nothing was written. Create the cache with a larger `max_cache_len` (prompt + max_new_tokens), "
            f"or leave it unset for storage that grows."
        )
    return end


def check_mask_covers(mask_columns: int, columns_needed: int) -> None:
    """Refuse a 2D attention mask of `mask_columns` columns for a step that needs `columns_needed` (the held tokens
    followed by the step's): a shorter one means inputs that do not continue the cached conversation."""
    if mask_columns < columns_needed:
        raise ConversationMismatchError(
            f"The attention mask has {mask_columns} columns, but HybridRingCache holds tokens before this step: it "
            f"needs {columns_needed} columns (the cached tokens followed by this step's). A cache holds one "
            f"conversation: to continue it, pass the whole conversation (the cached tokens, then the new ones) with "
            f"its attention mask; to start another, pass a new `HybridRingCache(model.config)` or call "
            f"`cache.reset()` first.{chunked_prefill_release_note()}"
        )


def check_assisted_start(cached_tokens: int, query_length: int, newest_position: int | None) -> None:
    """Refuse the first step of an assisted / prompt-lookup `generate` that feeds the held tokens again.

    transformers' `_assisted_decoding` runs its first target forward on the whole `input_ids` plus the draft, never
    cut by the cache length as `_prefill` cuts a plain `generate`'s prompt; its position ids come from the attention
    mask, so they start at 0. On a cache that holds the conversation's earlier turns, the step would append the whole
    conversation after it (every cache, `DynamicCache` included, then continues wrong). Seen from the cache: the
    step's newest position (`newest_position`, from the positions the attention passes) is below its own length.
    `None`: the release passes no positions (`compat.step_positions_note` says which; a multi-token step is refused
    there, since it cannot be told from one fed again).
    """
    if cached_tokens <= 0:
        return
    if newest_position is None:
        note = step_positions_note()
        if note and query_length > 1:
            raise ConversationMismatchError(
                f"This assisted / prompt-lookup step feeds {query_length} tokens to a cache that already holds "
                f"{cached_tokens} tokens. {note} so a conversation continued here cannot be told from one fed again "
                f"from its first token, which its assisted decoding does on the first step of a reused cache (every "
                f"cache, DynamicCache included, then continues wrong). Nothing was written. Generate this turn "
                f"without `assistant_model` / `prompt_lookup_num_tokens`, or start from a new cache (or "
                f"`cache.reset()`) with the whole conversation as the prompt, or upgrade transformers."
            )
        return
    if newest_position + 1 <= query_length:
        raise ConversationMismatchError(
            f"This step feeds {query_length} tokens at positions up to {newest_position} to a cache that already "
            f"holds {cached_tokens} tokens: it starts the conversation over instead of continuing it. transformers' "
            f"assisted / prompt-lookup decoding does this on its first step (it feeds the whole prompt plus the draft "
            f"again, not cut by the cache length as a plain `generate` is; every cache, DynamicCache included, would "
            f"then hold the earlier turns twice and continue wrong). Nothing was written. To continue a conversation "
            f"held in this cache, generate this turn without `assistant_model` / `prompt_lookup_num_tokens`; to use "
            f"them, start from a new cache (or `cache.reset()`) with the whole conversation as the prompt."
        )


def check_code_attention(code_attention_option: bool | None, attention: str | None) -> None:
    """Refuse `full_layer_code_attention=True` under an attention implementation that cannot read codes."""
    if code_attention_option and attention != CODE_ATTENTION:
        raise CodeAttentionError(
            f"full_layer_code_attention=True, but the model's attention implementation is {attention!r}, which "
            f"cannot read compressed codes. Select hybrid_cache's (`model.set_attn_implementation("
            f"{CODE_ATTENTION!r})` or `with hybrid_cache.use_code_attention(model):`), or build the cache with "
            f"full_layer_code_attention=None to follow the model."
        )


def refuse_unheld_key(missing: int, held_text: str, model_window: int | None) -> None:
    """Raise `WindowMismatchError`: the model's mask lets a real query see position `missing`, which the ring no
    longer holds (it holds `held_text`): the cache was built for a smaller window than the model's."""
    raise WindowMismatchError(
        f"The model's attention mask lets a query see the key at position {missing}, but HybridRingCache's "
        f"sliding-window ring holds only {held_text}: the model attends further back than the window the cache "
        f"was built for"
        + (f" (the model's sliding_window={model_window})" if model_window is not None else "")
        + ". Build the cache from the model's own config: `HybridRingCache(model.config)`."
    )


def check_prepared_mask_width(layer: Any, layer_idx: int, query_length: int) -> None:
    """Refuse a step whose prepared 4D attention mask does not have the width of the keys `layer` will return for it,
    before the layer writes anything (`PreparedMaskError`, naming both widths).

    transformers hands a prepared mask (a 4D tensor, or a dict of them per layer type, passed as `attention_mask`)
    straight to the attention: neither the mask creation nor the cache sees it, and a wrong width ends in a bare
    tensor-shape error inside attention, or, for a width of 1, in a silent broadcast. The attention module passes
    its mask to the attention function, not to `cache.update`, so it is read from the calling frame's local
    `attention_mask` (`_caller_of_cache`: the attention forward that called `update`); when the caller has no such
    local (a model that updates the cache elsewhere), nothing is checked. Masks the hook built are checked too: a model
    may hand a layer the mask built for another layer type. Only a tensor `[..., kv_length]` or a `BandedMask` (its
    `kv_length`) is compared (flex attention's `BlockMask` is not), against `returned_key_count` (no layout built).
    """
    caller = _caller_of_cache()
    mask = caller.f_locals.get("attention_mask") if caller is not None else None
    if isinstance(mask, BandedMask):
        width = mask.kv_length
    elif isinstance(mask, torch.Tensor) and mask.ndim == 4:
        width = mask.shape[-1]
    else:
        return
    kv_length = layer.returned_key_count(query_length)
    if width != kv_length:
        raise PreparedMaskError(
            f"Layer {layer_idx} was given a prepared attention mask {width} keys wide, but HybridRingCache "
            f"returns {kv_length} keys for this step of {query_length} token(s) (a sliding-window ring returns "
            f"at most its window, in its own slot order once wrapped; a mask prepared for another cache, for this "
            f"one before a crop / reset / restore, or by a model whose own code sizes sliding masks for the whole "
            f"conversation (transformers 5.14's Gemma 3 / 4 given token types, where DynamicCache fails too) does not "
            f"fit). Nothing was written by this layer. Pass a 2D attention mask (or none) so the model builds the "
            f"masks for this cache, or build the prepared masks from this cache right before the step "
            f"(`create_masks_for_generate(..., cache=cache)`)."
        )


def _caller_of_cache() -> Any:
    """The innermost frame outside this package and torch's compiler wrappers (`torch.compiler.disable` runs a cache
    step outside a compiled graph through them): the model code that called the cache, or None."""
    frame: Any = sys._getframe(1)
    while frame is not None and (
        frame.f_globals.get("__name__", "").startswith(("hybrid_cache.", "torch._dynamo", "torch.compiler"))
    ):
        frame = frame.f_back
    return frame


def _newest_position(update_kwargs: Mapping[str, Any]) -> int | None:
    """The newest position of the step, from the position ids the attention passes to `Cache.update`
    (`kwargs={"position_ids": ...}` from transformers 5.24), or `None` when there are none."""
    inner = update_kwargs.get("kwargs")
    position_ids = inner.get("position_ids") if isinstance(inner, Mapping) else update_kwargs.get("position_ids")
    if not isinstance(position_ids, torch.Tensor) or position_ids.numel() == 0:
        return None
    return int(position_ids[..., -1].max())


# --- the layouts announced to the masks of a step -----------------------------------------------------------------
class IssuedLayouts:
    """The ring layouts a cache announced to the mask creation of the current step, and whether the hook served them.

    A wrapped ring's one-token step is only exact if this step's mask was built by the hook from the layout
    `get_mask_sizes` announced: `issue` records each announced layout (the latest per layer: model code may size
    something from one request, Gemma's image-block padding, and build the mask from the next; the hook sets
    `layout.served`), `check_served` is called before the step's first write. A step is `(cache length, query
    length)`; after a crop, reset or restore the same step can come again, so the cache calls `forget`.
    """

    def __init__(self) -> None:
        self.forget()

    def forget(self) -> None:
        self._layouts: dict[int, Any] = {}
        self._step: tuple[int, int] | None = None
        self.verified: tuple[int, int] | None = None  # the step whose served layouts were checked
        # `(cache length, query length)` of the last step whose ring layouts a compiled graph built (its hook, traced,
        # served them; the length a 0-d tensor of that graph's): see `served_in_graph`.
        self._in_graph: tuple[Any, int] | None = None

    def served_in_graph(self, length: torch.Tensor, query_length: int) -> None:
        """A compiled graph built the masks of the step `(length, query_length)`: nothing is issued while tracing, so
        a layer of that step run eagerly (a frame Dynamo did not compile) takes the graph's masks as served."""
        self._in_graph = (length, query_length)

    def issue(self, layer_idx: int, step: tuple[int, int], layout: Any) -> None:
        if step != self._step:
            self._layouts, self._step = {}, step
        self._layouts[layer_idx] = layout

    def check_served(self, step: tuple[int, int]) -> None:
        """Raise unless the layouts announced for `step` were all served by the hook (checked once per step)."""
        if self.verified == step:
            return  # a later layer of the step whose layouts the first one verified
        graph_step, self._in_graph = self._in_graph, None
        if graph_step is not None and (int(graph_step[0]), graph_step[1]) == step:
            self.verified = step  # masks built inside a compiled graph, by the traced hook
            return
        layouts, self._layouts = self._layouts, {}  # checked once; do not keep their tensors alive
        if not layouts or not all(layout.served for layout in layouts.values()) or self._step != step:
            raise PreparedMaskError(
                "HybridRingCache's sliding-window ring has wrapped, but no attention mask was built for its slot "
                "layout in this forward pass (the model was given a prepared 4D attention mask, or its attention "
                "does not use transformers' mask functions). Pass a 2D attention mask (or none) so the model builds "
                "its masks itself, or use `DynamicCache` for this model."
            )
        self.verified = step


# --- the journal -------------------------------------------------------------------------------------------------
def held_lengths(layers: Sequence[Any], storing: Sequence[int]) -> dict[int, int]:
    """The tokens each storing layer holds, by index."""
    return {index: int(layers[index].get_seq_length()) for index in storing}


def behind_first_layer(layers: Sequence[Any], storing: Sequence[int], layer_idx: int) -> bool:
    """Whether layer `layer_idx` holds fewer tokens than the first storing layer: it is catching up with a step that
    the layers before it stored already (inside a compiled graph, when the journal did not see them)."""
    first = storing[0] if storing else layer_idx
    return layer_idx != first and int(layers[layer_idx].get_seq_length()) < int(layers[first].get_seq_length())


class StepJournal:
    """The storing layers that wrote the open step (with their previous step's bookkeeping), and whether that step is
    known to have failed.

    Args:
        storing (`Sequence[int]`): the indices of the layers that store tokens, in the order a forward updates them.
    """

    written: list[int]  # the storing layers that stored the open step, in order
    broken: str | None  # why the cache cannot continue (a dead step it could not undo)
    complete: bool  # every storing layer stored the open step
    graph_steps: bool  # a step ran inside a compiled graph since the layers were last seen holding the same tokens
    failed: bool  # the open step was refused after some layers stored it
    _previous: dict[int, Any]  # each journaled layer's step bookkeeping from before the open step

    def __init__(self, storing: Sequence[int]) -> None:
        self.storing = tuple(storing)
        self.forget()

    def is_open(self, layers: Sequence[Any]) -> bool:
        """Whether the last step is dead: some layers stored it and it did not complete, or it failed after that.

        A step the journal saw only part of is not dead when every storing layer of `layers` holds it: the other
        layers stored it inside a compiled graph (`HybridRingCache`'s one-token steps with a fixed capacity), where
        nothing is journaled; the step is then complete."""
        if not self.written or (self.complete and not self.failed):
            return False
        if not self.failed and len(set(held_lengths(layers, self.storing).values())) == 1:
            self.complete, self._previous = True, {}
            return False
        return True

    def uncommitted(self, layer_idx: int, layers: Sequence[Any]) -> int:
        """Tokens of a dead step that layer `layer_idx` holds (0 when the last step is not dead or it did not store
        it)."""
        return self.query_length if layer_idx in self.written and self.is_open(layers) else 0

    def untrack(self) -> None:
        """The open step reached a layer behind the first storing one: its earlier layers stored it inside a compiled
        graph (nothing journaled), so it is not journaled either; it is complete once every layer stored it."""
        self.written, self.complete, self.failed, self.tracking, self._previous = [], False, False, False, {}

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
        self._previous = {}

    @property
    def journaling(self) -> bool:
        """Whether the open step's writes are recorded (it was announced by mask creation)."""
        return self.tracking

    def stored(self, layer_idx: int, previous: Any = None) -> None:
        """Layer `layer_idx` stored the open step; `previous` is its `step_bookkeeping()` from before the write."""
        if self.tracking:
            self.written.append(layer_idx)
            self._previous[layer_idx] = previous
            self.complete = len(self.written) == len(self.storing)
            if self.complete:
                self._previous = {}  # a complete step is kept: nothing to put back

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
        self._previous = {}
        self.graph_steps = False

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
        written, count = list(self.written), self.query_length
        # No journaled step is open: a step that failed inside a compiled graph shows in the lengths alone (once steps
        # ran in a graph: layers updated one by one, as tests of the cache do, are no step).
        unjournaled = not written or (self.complete and not self.failed)
        if (unjournaled and not self.graph_steps) or (not unjournaled and not self.is_open(layers)):
            return
        lengths = held_lengths(layers, self.storing)
        floor = min(lengths.values(), default=0)
        if unjournaled:
            if floor == max(lengths.values(), default=0):
                self.graph_steps = False
                return
            written, count = [], max(lengths.values()) - floor
        unseen = [index for index, length in lengths.items() if length > floor and index not in written]
        try:
            if unseen:  # stored inside a compiled graph, which keeps nothing to undo a step with
                raise RollbackError(f"layers {unseen} stored it inside a compiled graph, which keeps no undo record")
            for index in written:
                layers[index].check_crop(-count)
        except RollbackError as error:
            self.broken = (
                f"A forward failed after layers {sorted(written + unseen)} of {list(self.storing)} stored its {count} "
                f"tokens, and they cannot be taken back exactly ({error}). The cache cannot continue this sequence: "
                f"call `cache.reset()` to start over, `cache.restore(checkpoint)` to go back to a checkpoint, or load "
                f"a saved cache (`HybridRingCache.load`)."
            )
            raise IncompleteStepError(self.broken) from None
        for index in written:
            layers[index].crop(-count)
            if self._previous.get(index) is not None:
                layers[index].restore_step_bookkeeping(self._previous[index])
        self.written, self.failed, self._previous = [], False, {}


# --- admission ---------------------------------------------------------------------------------------------------
class StepAdmission:
    """Everything a cache keeps about the step in progress: the journal, the layouts announced to its masks, and the
    assisted-start check pending after `activate_past_recording`; and the checks a step passes before it writes.

    Args:
        storing (`Sequence[int]`): the indices of the storing layers, in update order.
        first_ring (`int | None`): the first layer whose keys may come out of time order (`ring_ordered`).
    """

    def __init__(self, storing: Sequence[int], first_ring: int | None) -> None:
        self.journal = StepJournal(storing)
        self.layouts = IssuedLayouts()
        self.first_ring = first_ring
        self.assisted_start = 0  # tokens held at `activate_past_recording`: the next step must continue them

    def forget(self, held_tokens: Callable[[], int] | None = None) -> None:
        """The one reset path: the cache's state was replaced (`reset`, `restore`, `load_into`). Nothing to undo, no
        layout served, and a pending assisted-start check applies to the tokens now held (`held_tokens()`; none
        after a reset)."""
        self.journal.forget()
        self.layouts.forget()
        self.assisted_start = held_tokens() if self.assisted_start and held_tokens is not None else 0

    def masks_requested(self, layers: Sequence[Any], query_length: int, held_tokens: Any) -> None:
        """Mask creation for a step of `query_length` tokens (`get_mask_sizes`), before any layer writes: a dead step
        is undone, the step is journaled, and an empty step refused. `held_tokens`: a callable giving the length."""
        self.journal.settle(layers)
        self.journal.arm()
        if query_length == 0:
            refuse_empty_step(held_tokens())

    def admit(
        self,
        cache: StateHolder,
        layer_idx: int,
        query_length: int,
        update_kwargs: Mapping[str, Any],
        attention_supported: Callable[[str | None], None],
    ) -> None:
        """Every check before layer `layer_idx` of `cache` stores a step of `query_length` tokens; a new step first
        undoes a dead one. `update_kwargs`: `Cache.update`'s keyword arguments; `attention_supported`: raises for an
        attention that cannot mask a wrapped ring (`mask_hook.check_ring_attention_supported`), asked before a ring
        layout is checked."""
        layers, journal = cache.layers, self.journal
        attention = getattr(cache.config, "_attn_implementation", None)
        code_attention_option = cache.options.full_layer_code_attention
        # At every layer, masks the hook built included: a model may give a layer a mask built for another layer
        # type (transformers 5.14's Gemma 3 / 4 given token types size sliding masks for the whole conversation).
        check_prepared_mask_width(layers[layer_idx], layer_idx, query_length)
        starts = journal.starts_step(layer_idx)
        if self.assisted_start:  # the first step of an assisted generate on held tokens
            check_assisted_start(self.assisted_start, query_length, _newest_position(update_kwargs))
            self.assisted_start = 0
        if starts and journal.graph_steps and behind_first_layer(layers, journal.storing, layer_idx):
            journal.untrack()  # the step's earlier layers stored it inside a compiled graph: it was admitted there
            starts = False
        if starts:
            journal.settle(layers)
            for layer in layers:  # fixed capacity (`max_cache_len`): refused here, not after the rings wrote
                if hasattr(layer, "check_fits"):
                    layer.check_fits(query_length)
            check_code_attention(code_attention_option, attention)
        self._check_ring_mask_was_built(layers, layer_idx, query_length, attention, attention_supported)
        if starts:
            journal.begin(query_length)

    def admit_in_graph(
        self,
        layers: Sequence[Any],
        layer_idx: int,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        max_cache_len: int | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The checks of a step that runs inside a compiled graph (`HybridRingCache`'s fixed-mode one-token steps), as
        graph ops at its first storing layer: every storing layer holds the same tokens (a forward that failed
        partway inside a graph left a step that no record can undo) and the step fits `max_cache_len`. Returns the
        layer's new keys and values, which a failed check makes unreadable (an index out of range), so that no write
        of the step can come before the check: with the `eager` backend the check raises `RuntimeError` with one of
        the messages above first (fixed when the graph is built: no counts); inductor reports the index. Nothing is
        written either way."""
        storing = self.journal.storing
        if not storing or layer_idx != storing[0]:
            return key_states, value_states
        self.journal.graph_steps = True  # a Python side effect, which Dynamo applies once the graph has run
        lengths = torch.stack([torch.as_tensor(layers[index].get_seq_length()) for index in storing])
        consistent = (lengths == lengths[0]).all()
        torch._assert_async(consistent, GRAPH_INCOMPLETE_STEP)
        admitted = consistent
        if max_cache_len is not None:
            fits = lengths[0] + key_states.shape[-2] <= max_cache_len
            torch._assert_async(fits, GRAPH_CAPACITY)
            admitted = admitted & fits
        rows = torch.arange(key_states.shape[-2], device=key_states.device) + (~admitted).long() * key_states.shape[-2]
        return key_states.index_select(-2, rows), value_states.index_select(-2, rows)

    def _check_ring_mask_was_built(
        self,
        layers: Sequence[Any],
        layer_idx: int,
        query_length: int,
        attention: str | None,
        attention_supported: Callable[[str | None], None],
    ) -> None:
        """Checked before any layer of a step is written (also at a full layer that comes before the first ring),
        so a refused step leaves the cache as it was (see `IssuedLayouts`)."""
        first_ring = self.first_ring
        if first_ring is None or layer_idx > first_ring and not getattr(layers[layer_idx], "ring_ordered", False):
            return  # time-ordered layers after the first ring: the first ring already checked this step
        ring = layers[max(layer_idx, first_ring)]
        if getattr(ring, "ring_ordered", False) and ring.needs_ring_layout(query_length):
            step = (ring.cumulative_length, query_length)
            if self.layouts.verified != step:
                attention_supported(attention)
            self.layouts.check_served(step)
