"""Progress of the tuner's long passes: a bar where the stream is a terminal, plain lines elsewhere.

Written to a file or a pipe, a bar's every redraw lands on one line full of carriage returns; so
there each pass prints whole lines only: the pass's start and a few milestones when asked for
(`milestones`), and one line when it ends, with its summary. Messages (`write`) print either way,
and are all that prints with progress off (--no-progress)."""
from __future__ import annotations

import sys
from typing import TextIO


def is_terminal(stream) -> bool:
    """Whether `stream` is a terminal (a closed or stream-less object is not)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def progress(total: int, desc: str, *, unit: str, stream: TextIO | None = None, enabled: bool = True,
             milestones: int = 0) -> "Bar | Lines":
    """The progress of `total` units of `desc` on `stream` (stderr by default): a bar on a terminal,
    else Lines (a start line and `milestones` evenly spaced lines when milestones > 0, and a line at
    the end); with enabled False, only what `write` is given."""
    stream = sys.stderr if stream is None else stream
    if enabled and is_terminal(stream):
        return Bar(total, desc, unit=unit, stream=stream)
    return Lines(total, desc, unit=unit, stream=stream, quiet=not enabled, milestones=milestones)


class Bar:
    """A tqdm bar; its status shows beside it and stays with it once closed."""

    def __init__(self, total: int, desc: str, *, unit: str, stream: TextIO):
        from tqdm import tqdm

        self.stream = stream
        self.bar = tqdm(total=total, desc=desc, unit=unit, file=stream, leave=True)

    def update_to(self, done: int) -> None:
        self.bar.n = min(done, self.bar.total)
        self.bar.refresh()

    def status(self, text: str) -> None:
        self.bar.set_postfix_str(text)

    def write(self, line: str) -> None:
        self.bar.write(line, file=self.stream)

    def close(self, summary: str | None = None) -> None:
        if summary:
            self.bar.set_postfix_str(summary, refresh=False)
        self.bar.close()


class Lines:
    """Whole lines, one per milestone reached and one at the end, each "<desc>: <done>/<total> <unit>"
    (and the summary at the end)."""

    def __init__(self, total: int, desc: str, *, unit: str, stream: TextIO, quiet: bool = False,
                 milestones: int = 0):
        self.total, self.desc, self.unit, self.stream, self.quiet = total, desc, unit, stream, quiet
        self.done, self.steps, self.said = 0, milestones, 0
        if self.steps:
            self._say()

    def update_to(self, done: int) -> None:
        self.done = min(done, self.total)
        reached = self.done * (self.steps + 1) // max(self.total, 1) if self.steps else 0
        if self.said < reached <= self.steps:
            self.said = reached
            self._say()

    def status(self, text: str) -> None:
        """Shown on a terminal only: a plain stream gets the summary at the end instead."""

    def write(self, line: str) -> None:
        print(line, file=self.stream, flush=True)

    def close(self, summary: str | None = None) -> None:
        self._say(summary)

    def _say(self, summary: str | None = None) -> None:
        if not self.quiet:
            tail = f"; {summary}" if summary else ""
            self.write(f"{self.desc}: {self.done}/{self.total} {self.unit}{tail}")
