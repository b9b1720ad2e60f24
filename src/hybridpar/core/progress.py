"""Long work says what it is doing, on standard error, as lines: a terminal, a pipe and a log all
read them as they come (a bar drawn with carriage returns shows nothing in a pipe until the end).

    with Phase("compute profile of resnet20", total=9, estimate_s=45) as p:
        for item in work:
            ...
            p.tick()

prints `hybridpar: compute profile of resnet20 (9 parts, about 45 s) ...`, a line with the parts
done and the seconds left at most every `every_s`, and `hybridpar: compute profile of resnet20:
done in 41.2 s`. HYBRIDPAR_QUIET=1 silences it (the tests that read one-line errors set nothing:
an error raised before any long work prints no progress line).
"""

from __future__ import annotations

import os
import sys
import time
from typing import TextIO

__all__ = ["Phase"]


class Phase:
    """One phase of long work, announced when it starts, ticked per part, closed when done."""

    def __init__(
        self,
        what: str,
        total: int | None = None,
        estimate_s: float | None = None,
        every_s: float = 5.0,
        out: TextIO | None = None,
        shown: bool = True,
    ) -> None:
        self.what, self.total, self.estimate_s, self.every_s = what, total, estimate_s, every_s
        self.out = out
        self.shown = shown and not os.environ.get("HYBRIDPAR_QUIET")
        self.done, self.t0, self.last = 0, 0.0, 0.0

    def _say(self, text: str) -> None:
        if self.shown:
            print(f"hybridpar: {text}", file=self.out or sys.stderr, flush=True)

    def __enter__(self) -> Phase:
        self.t0 = self.last = time.perf_counter()
        parts = [f"{self.total} parts"] if self.total else []
        if self.estimate_s:
            parts.append(f"about {self.estimate_s:.0f} s")
        detail = f" ({', '.join(parts)})" if parts else ""
        self._say(f"{self.what}{detail} ...")
        return self

    def tick(self, n: int = 1) -> None:
        """`n` more parts done."""
        self.done += n
        now = time.perf_counter()
        if now - self.last < self.every_s or not self.total or self.done >= self.total:
            return
        self.last = now
        left = (now - self.t0) / self.done * (self.total - self.done)
        self._say(f"{self.what}: {self.done}/{self.total}, about {left:.0f} s left")

    def __exit__(self, kind, exc, tb) -> None:
        if kind is None:
            self._say(f"{self.what}: done in {time.perf_counter() - self.t0:.1f} s")
