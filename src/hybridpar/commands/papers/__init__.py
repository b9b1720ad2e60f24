"""The papers' own figures and models, reproduced for the commands that show them: Dettmers' speed-up
model (`plan --model-of dettmers`), Krizhevsky's hand-off sweep and `simulate`, and the codecs'
Table 2 (`codecs`). The planner and the runtime import nothing from here."""

from __future__ import annotations

import csv
from pathlib import Path


def write_rows(path: Path, rows: list[dict]) -> None:
    """A CSV of `rows`, one dict each; the first row's keys are the header."""
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else [])
        w.writeheader()
        w.writerows(rows)
