"""Progress of the slow steps (synth, the expert pool's load and pin, conversions, bench runs).

On a terminal a tqdm bar redraws itself in place; when the stream is a file or a pipe (CI
logs, `2> log`) carriage returns would turn into one unreadable line, so a few plain lines
are printed instead: the start, about every tenth of the way or after a quiet stretch of
`interval_s`, and the end with the elapsed time. Never both, and nothing when `quiet`.

    with Progress("synth", total=len(tensors), unit="tensor") as progress:
        for t in tensors:
            ...
            progress.advance(1, t.name)
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

PLAIN_STEPS = 10  # plain lines mark every tenth of the total
PLAIN_INTERVAL_S = 10.0  # and never go quieter than this while something advances


def _is_terminal(stream: Any) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False


def _bytes_scale(total: float) -> tuple[float, str]:
    return (1e9, "GB") if total >= 1e9 else (1e6, "MB")


def _amount(value: float, unit: str) -> str:
    if unit == "B":
        scale, name = _bytes_scale(value)
        return f"{value / scale:.2f} {name}"
    return f"{value:g} {unit}".rstrip()


def _fraction(done: float, total: float, unit: str) -> str:
    if unit == "B":
        scale, name = _bytes_scale(total)
        return f"{done / scale:.2f}/{total / scale:.2f} {name}"
    return f"{done:g}/{total:g} {unit}".rstrip()


class Progress:
    """A bar on a terminal, plain lines elsewhere, silence when quiet. `total` counts `unit`s
    (`"B"` shows bytes as GB); `advance` adds to the count and sets the note shown beside it."""

    def __init__(self, label: str, total: float, *, unit: str = "", quiet: bool = False,
                 stream: TextIO | None = None, interval_s: float = PLAIN_INTERVAL_S) -> None:
        if total < 0:
            raise ValueError(f"progress {label!r}: total must be >= 0, got {total}")
        self.label = label
        self.total = total
        self.unit = unit
        self.quiet = quiet
        self.stream = sys.stderr if stream is None else stream
        self.interval_s = interval_s
        self.done = 0.0
        self.note = ""
        self._bar = None
        self._start = 0.0
        self._last_line = 0.0
        self._next_step = 1

    def __enter__(self) -> Progress:
        self._start = self._last_line = time.monotonic()
        if self.quiet:
            return self
        if _is_terminal(self.stream):
            from tqdm import tqdm

            unit = self.unit or "it"
            self._bar = tqdm(total=self.total, desc=self.label, unit=unit, file=self.stream,
                             unit_scale=unit == "B", unit_divisor=1000, dynamic_ncols=True, leave=True)
        else:
            self._print(f"{self.label}: started, {_amount(self.total, self.unit)} to go")
        return self

    def advance(self, amount: float = 1, note: str = "") -> None:
        self.done += amount
        self.note = note or self.note
        if self.quiet:
            return
        if self._bar is not None:
            if note:
                self._bar.set_postfix_str(note, refresh=False)
            self._bar.update(amount)
            return
        now = time.monotonic()
        reached = self.total > 0 and self.done >= self._next_step * self.total / PLAIN_STEPS
        if reached or now - self._last_line >= self.interval_s:
            while self.total > 0 and self.done >= self._next_step * self.total / PLAIN_STEPS:
                self._next_step += 1
            if self.done < self.total:  # the last step is the done line's to report
                share = f" ({100 * self.done / self.total:.0f}%)" if self.total > 0 else ""
                note = f" {self.note}" if self.note else ""
                self._print(f"{self.label}: {_fraction(self.done, self.total, self.unit)}{share}{note}"
                            f" [{now - self._start:.1f} s]")
            self._last_line = now

    def write(self, line: str) -> None:
        """A line of the caller's own, printed above the bar rather than through it."""
        if self._bar is not None:
            self._bar.write(line, file=self.stream)
        else:
            print(line, file=self.stream, flush=True)

    def __exit__(self, exc_type, exc, tb) -> None:
        elapsed = time.monotonic() - self._start
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif not self.quiet:
            outcome = "done" if exc_type is None else f"stopped by {exc_type.__name__}"
            self._print(f"{self.label}: {outcome}, {_amount(self.done, self.unit)} in {elapsed:.1f} s")

    def _print(self, line: str) -> None:
        print(line, file=self.stream, flush=True)

