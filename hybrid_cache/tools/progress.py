"""Progress of long passes (a perplexity run, a generation, one no-cache forward) that reads well everywhere.

On a terminal it is a tqdm bar that disappears when the pass ends; in a log, a pipe or CI (no terminal) a bar's
carriage returns would glue its updates and the next printed line together, so it prints whole lines instead: one
when the pass starts, one per quarter done, one at the end. Either way the pass ends with one summary line
(``ring: <n> tok in <seconds> s (<rate> tok/s)``). Lines go to stderr after flushing stdout, so they never interleave
with a half-written line of results.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from typing import Any, TextIO

import torch

__all__ = ["Progress", "layer_progress"]


class Progress:
    """Progress of one pass of `total` units.

    Args:
        total: units the pass will do (tokens, layers, ...).
        desc: what the pass is, shown first on every line.
        unit: the unit's name.
        enabled: False for no output at all.
        stream: where to write (default stderr).
        bar: True for a tqdm bar, False for whole lines; default: a bar when `stream` is a terminal.
        rate: end with the rate (units per second).
    """

    def __init__(
        self,
        total: int,
        desc: str,
        unit: str = "tok",
        *,
        enabled: bool = True,
        stream: TextIO | None = None,
        bar: bool | None = None,
        rate: bool = True,
    ) -> None:
        self.total, self.desc, self.unit, self.enabled, self.rate = total, desc, unit, enabled, rate
        self.stream = stream or sys.stderr
        self.done = 0
        self._start = time.perf_counter()
        self._next_line = 0.25
        self._bar: Any = None
        use_bar = bar if bar is not None else bool(getattr(self.stream, "isatty", lambda: False)())
        if not enabled:
            return
        if use_bar:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, desc=desc, unit=unit, leave=False, file=self.stream)
        else:
            self._line(f"{desc}: {total} {unit} ...")

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self._start

    def _line(self, text: str) -> None:
        sys.stdout.flush()
        print(text, file=self.stream, flush=True)

    def update(self, n: int = 1) -> None:
        self.done += n
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(n)
        elif self.total and self.done / self.total >= self._next_line and self.done < self.total:
            self._line(f"{self.desc}: {self.done}/{self.total} {self.unit} ({self.seconds:.0f} s)")
            while self._next_line <= self.done / self.total:
                self._next_line += 0.25

    def close(self) -> None:
        """End the pass with its summary line (once)."""
        if not self.enabled:
            return
        self.enabled = False
        if self._bar is not None:
            self._bar.close()
        rate = f", {self.done / self.seconds:.1f} {self.unit}/s" if self.rate and self.seconds > 0 else ""
        self._line(f"{self.desc}: {self.done} {self.unit} in {self.seconds:.1f} s{rate}")

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def layer_progress(model: torch.nn.Module, progress: Progress) -> Iterator[None]:
    """Advance `progress` by one each time a decoder layer of `model` finishes a forward (for one long forward, such as
    a no-cache pass over a whole text, whose only visible steps are its layers)."""
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None) or getattr(getattr(base, "language_model", None), "layers", None) or []
    handles = [layer.register_forward_hook(lambda *_: progress.update(1)) for layer in layers]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
