"""docs/fidelity.md is pinned by tests: every test it names exists, and every row it marks
"reproduced" names one (directly or through "same", the row above's)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "fidelity.md"
NAMED = re.compile(r"`(?:tests/)?(test_\w+\.py)(?:::([\w*]+))?")  # `f.py::test_x`, a * glob


def _defined(file: str, name: str | None) -> bool:
    path = ROOT / "tests" / file
    if not path.exists():
        return False
    pattern = re.escape(name or "").replace(r"\*", r"\w*")
    return name is None or re.search(rf"^def {pattern}\(", path.read_text(), re.M) is not None


def _rows():
    """(line number, status, test cell) of every table row with a status column."""
    head = None
    for i, line in enumerate(DOC.read_text().splitlines(), 1):
        if not line.startswith("|"):
            head = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if head is None:
            head = [c.lower() for c in cells]
            continue
        if set(line) <= set("|- :"):
            continue
        if "status" in head and len(cells) == len(head):
            test = (
                cells[head.index(next(h for h in head if h.startswith("test")))]
                if any(h.startswith("test") for h in head)
                else ""
            )
            yield i, cells[head.index("status")], test


def test_every_test_the_fidelity_table_names_exists():
    missing = [
        f"{f}::{n}" if n else f
        for f, n in NAMED.findall(DOC.read_text())
        if not _defined(f, n or None)
    ]
    assert not missing, f"docs/fidelity.md names tests that do not exist: {missing}"


def test_every_reproduced_row_names_a_test():
    bad, previous = [], ""
    for line, status, test in _rows():
        cell = previous if test.lower().startswith("same") else test
        if test.lower().startswith("same") and NAMED.search(test):
            cell = previous + " " + test
        previous = cell
        if status.lower().startswith("reproduced") and not NAMED.search(cell):
            bad.append(line)
    assert not bad, f"docs/fidelity.md lines {bad}: 'reproduced' without a test that checks it"


def test_the_checks_catch_what_they_are_for(tmp_path, monkeypatch):
    """A made-up table: a missing test and a reproduced row without one are both found."""
    doc = tmp_path / "fidelity.md"
    doc.write_text(
        "| what | paper | ours | status | test |\n| --- | --- | --- | --- | --- |\n"
        "| a | 1 | 1 | reproduced | `test_codecs.py::no_such_test` |\n"
        "| b | 1 | 1 | reproduced | - |\n"
    )
    monkeypatch.setattr(__import__(__name__), "DOC", doc)
    try:
        test_every_test_the_fidelity_table_names_exists()
        raise AssertionError("a missing test was not found")
    except AssertionError as e:
        assert "no_such_test" in str(e)
    try:
        test_every_reproduced_row_names_a_test()
        raise AssertionError("a reproduced row without a test was not found")
    except AssertionError as e:
        assert "lines [4]" in str(e)
