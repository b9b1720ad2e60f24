"""Fixtures many test files share: a cache of calibrations and profiles of the test's own, and a
calibration of this machine written with fixed numbers (plans and predictions that repeat,
nothing measured). The helpers that run code in ranks and the small models stay in
dist_helpers.py and nets.py, which tests import by name."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty HYBRIDPAR_CACHE for this test and every process it starts."""
    path = tmp_path / "cache"
    path.mkdir()
    monkeypatch.setenv("HYBRIDPAR_CACHE", str(path))
    return path


@pytest.fixture
def localhost(cache: Path) -> Callable[..., dict[str, str]]:
    """`localhost(alpha=, beta=, flops=, cores=, device=, ...)`: a calibrated `localhost` in
    `cache`, not measured; returns the environment for a subprocess."""

    def write(alpha: float = 1e-5, beta: float = 1e-9, flops: float = 1e10, **more):
        data = {"name": "localhost", "alpha": alpha, "beta": beta, "flops": flops, **more}
        (cache / "localhost.json").write_text(json.dumps(data))
        return dict(os.environ)

    return write
