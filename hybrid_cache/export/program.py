"""`Program`: an exported program and the runner around it, whatever the runtime (`backends.py`).

The program holds the state (`step.ProgramModule`); the runner holds the counters and the conversation's token ids,
and admits every step before it calls the program, with the rules of the eager cache (`hybrid_cache.steps`,
`hybrid_cache.ring`): a step that would pass `max_cache_len` raises `CacheCapacityError`, a prompt that does not
continue the held conversation `ConversationMismatchError`, a rollback the rings cannot make exact `RollbackError`,
all before anything is written, so the program then continues exactly. The token ids are checked first
(`check_input_ids`): a runtime would not refuse a bad one cleanly (ONNX `Gather` takes a negative id as an index from
the end, a cast takes a float for an id, an id past the vocabulary fails inside the runtime mid-prompt).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from ..errors import ConversationMismatchError, RollbackError
from ..slots import advance_oldest, window_reaches
from ..steps import check_capacity, refuse_empty_step
from .metadata import ProgramMetadata
from .step import state_names

__all__ = ["Backend", "Program", "check_input_ids"]


class Backend(Protocol):
    """What a runtime gives the runner: the program's steps on its own state, and that state's shapes."""

    def step(self, input_ids: torch.Tensor, start: int, oldest: int) -> torch.Tensor:
        """Run one step of `input_ids` `[1, n]` (`n <= chunk_size`) from `start`; the last token's logits `[1, V]`."""
        ...

    def zero_state(self) -> None:
        """Zero every state tensor."""
        ...

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        """The shape of every state tensor, by name, read from the program's own buffers or inputs."""
        ...


class Program:
    """An exported hybrid_cache program, loaded (`hybrid_cache.export.load_program`): greedy generation on a cache of
    `sliding_window` slots per sliding layer, held in the program's own state.

    One program holds one conversation at a time, as one `HybridRingCache` does: `generate` continues the
    conversation it holds when the prompt starts with it (multi-turn), refuses one that does not, and `reset()`
    starts a new one.

    Example:

    ```python
    >>> program = load_program("gemma3.pte")
    >>> ids = program.generate(input_ids, max_new_tokens=128)  # [1, prompt + new]
    >>> program.cache_slots()  # {layer: slots held}
    ```
    """

    def __init__(self, backend: Backend, metadata: ProgramMetadata) -> None:
        self.backend = backend
        self.metadata = metadata
        self.tokens = torch.zeros(1, 0, dtype=torch.long)  # the conversation held: every token the program stored
        self.oldest = 0
        self.reset()

    @property
    def length(self) -> int:
        """Tokens held."""
        return self.tokens.shape[1]

    def reset(self) -> None:
        """Start a new conversation on the same loaded program (the state is zeroed)."""
        self.backend.zero_state()
        self.tokens = self.tokens[:, :0]
        self.oldest = 0

    def cache_slots(self) -> dict[int, int]:
        """Slots each decoder layer holds (0 for KV-shared layers), read from the program's own state tensors."""
        shapes = self.backend.state_shapes()
        return {
            layer.index: shapes[state_names(layer.index)[0]][2] if layer.stores else 0
            for layer in self.metadata.layers
        }

    # --- steps ----------------------------------------------------------------------------------------------------
    def _store(self, ids: torch.Tensor) -> torch.Tensor:
        """Feed `ids` `[1, n]` (already admitted) in chunks of at most `chunk_size`; the last token's logits."""
        logits = None
        for first in range(0, ids.shape[1], self.metadata.chunk_size):
            chunk = ids[:, first : first + self.metadata.chunk_size]
            logits = self.backend.step(chunk, self.length, self.oldest)
            self.tokens = torch.cat([self.tokens, chunk], 1)
            self.oldest = advance_oldest(self.oldest, self.length, self.metadata.ring_slots)
        assert logits is not None
        return logits

    def _new_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The tokens of `input_ids` (checked by `check_input_ids`) after the conversation held, or
        `ConversationMismatchError`."""
        held = self.length
        if held and not torch.equal(input_ids[:, :held], self.tokens):
            raise ConversationMismatchError(
                f"The prompt does not start with the {held} tokens this program holds: a program holds one "
                f"conversation. To continue it, pass the whole conversation (the held tokens, then the new ones); "
                f"to start another, call `program.reset()` first. Nothing was written."
            )
        if input_ids.shape[1] <= held:
            refuse_empty_step(held, holder="the program")
        return input_ids[:, held:]

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Feed the tokens of `input_ids` `[1, tokens]` after the conversation held (the whole conversation, when
        the program holds its start) and return the last one's logits `[1, vocab]`: a forward of the new tokens.
        Refused, before anything is written, as `generate` refuses."""
        input_ids = check_input_ids(input_ids, self.metadata.vocab_size)
        new = self._new_tokens(input_ids)
        check_capacity(self.length, new.shape[1], self.metadata.max_cache_len)
        return self._store(new)

    def generate(
        self, input_ids: torch.Tensor, max_new_tokens: int = 20, eos_token_id: int | Sequence[int] | None = None
    ) -> torch.Tensor:
        """Greedy generation: `input_ids` `[1, prompt]` (the whole conversation, when the program holds its start),
        then up to `max_new_tokens` tokens, stopping after an end-of-sequence token (`eos_token_id`, default the
        model's). Returns `[1, prompt + new]`.

        Raises (before anything is written, so the program then continues exactly): `TypeError` / `ValueError` for
        ids that are not a `[1, tokens]` tensor of integers in `[0, vocab_size)` (`check_input_ids`);
        `CacheCapacityError` when the prompt and `max_new_tokens` would pass `max_cache_len`;
        `ConversationMismatchError` for a prompt that does not continue the held conversation.
        """
        input_ids = check_input_ids(input_ids, self.metadata.vocab_size)
        new = self._new_tokens(input_ids)
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}.")
        # The last generated token is returned, not stored: a step of max_new_tokens - 1 decode tokens at most.
        check_capacity(self.length, new.shape[1] + max_new_tokens - 1, self.metadata.max_cache_len)
        stops = _stop_ids(self.metadata.eos_token_ids if eos_token_id is None else eos_token_id)
        logits = self._store(new)
        generated: list[int] = []
        while True:
            token = int(logits.argmax(-1))
            generated.append(token)
            if len(generated) == max_new_tokens or token in stops:
                break
            logits = self._store(torch.tensor([[token]]))
        return torch.cat([input_ids, torch.tensor([generated])], 1)

    def rollback(self, tokens: int) -> None:
        """Take back the last `tokens` tokens held (speculative decoding on device): exact within the rings'
        `rollback_margin + 1` tokens (any number while no ring has wrapped), else `RollbackError`, changing nothing.
        The rule of the eager cache's `crop` (`slots.window_reaches`)."""
        if tokens < 0 or tokens > self.length:
            raise ValueError(f"rollback({tokens}): between 0 and the {self.length} tokens held.")
        new_length = self.length - tokens
        window = self.metadata.window
        if window is not None and not window_reaches(new_length, self.oldest, window):
            margin = self.metadata.ring_slots - window
            raise RollbackError(
                f"Cannot roll back to {new_length} tokens exactly: the program's rings ({self.metadata.ring_slots} "
                f"slots = window {window} + margin {margin}) already overwrote tokens the next query needs (at most "
                f"{margin + 1} tokens after the wrap). Export the program with rollback_margin >= {tokens - 1}, or "
                f"`reset()` and feed the conversation again. Nothing was changed."
            )
        self.tokens = self.tokens[:, :new_length]


def check_input_ids(input_ids: Any, vocab_size: int) -> torch.Tensor:
    """`input_ids` as the runner feeds it (int64, on the CPU), after checking that it is a tensor `[1, tokens]`
    (batch 1, at least one token) of integer token ids in `[0, vocab_size)` (the program's metadata); any integer
    dtype is taken (int32, uint8, ...). Raises `TypeError` (not a tensor, not integers) or `ValueError` (another
    shape, empty, an id outside the vocabulary), naming the problem and the fix; the runner calls it before anything
    is written."""
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(
            f"input_ids must be a torch.Tensor of token ids [1, tokens], got {type(input_ids).__name__}: pass the "
            f"tokenizer's `input_ids` (`tokenizer(text, return_tensors='pt').input_ids`) or `torch.tensor([ids])`. "
            f"Nothing was written."
        )
    dtype = input_ids.dtype
    if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        raise TypeError(
            f"input_ids must hold integer token ids, got dtype {dtype}: floats and booleans are not token ids (a "
            f"program would cast them to ids silently). Pass the tokenizer's ids as an integer tensor (torch.long). "
            f"Nothing was written."
        )
    shape = tuple(input_ids.shape)
    if input_ids.ndim != 2 or shape[0] != 1:
        fix = {
            1: "add the batch axis: `input_ids.unsqueeze(0)`",
            2: "run one program per sequence (docs/export.md says what batch > 1 needs)",
        }.get(input_ids.ndim, "pass one sequence as [1, tokens]")
        raise ValueError(
            f"input_ids must be [1, tokens] (an exported program runs batch 1), got shape {shape}: {fix}. Nothing "
            f"was written."
        )
    if shape[1] == 0:
        raise ValueError(
            "input_ids is empty ([1, 0]): a step needs at least one token. Pass the prompt's token ids (to continue "
            "the conversation held, the whole conversation followed by the new tokens). Nothing was written."
        )
    ids = input_ids.detach().cpu().to(torch.long)
    outside = ((ids < 0) | (ids >= vocab_size)).nonzero()
    if len(outside):
        position = int(outside[0, 1])
        raise ValueError(
            f"input_ids[0, {position}] = {int(ids[0, position])} is not a token id of this program: ids run from 0 "
            f"to vocab_size - 1 = {vocab_size - 1} ({len(outside)} of the {shape[1]} ids outside that range). Pass ids "
            f"of the model's own tokenizer, without padding or ignore values such as -1 or -100. Nothing was written."
        )
    return ids


def _stop_ids(value: Any) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value}
