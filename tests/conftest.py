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


@pytest.fixture
def train_job() -> Callable[..., object]:
    """`train_job(model=, procs=, batch=, device=, **flags)`: the Job `hybridpar train` hands its
    ranks before a plan is chosen (the model traced on the meta device), said to run on `device`
    whether or not this machine has one; `flags` are TrainConfig's, by flag name."""
    from hybridpar.core.analysis import trace
    from hybridpar.core.config import build
    from hybridpar.core.layers import cost_layers
    from hybridpar.core.zoo import input_shape, zoo_entry
    from hybridpar.runtime.train.config import TrainConfig
    from hybridpar.runtime.train.job import Job
    from hybridpar.runtime.train.run import meta_model

    def make(model="digits-wide", procs=2, batch=16, device="cpu", **flags):
        cfg = build(TrainConfig, model=model, nproc=procs, batch=batch, **flags)
        shape, classes = input_shape(model, None), zoo_entry(model).num_classes
        traced = trace(meta_model(model, shape, classes), shape)
        choices = cfg.choices.with_(device=device, backend="gloo")
        layers = cost_layers(traced.specs)
        return Job(cfg, model, procs, batch, choices, "w.pt", shape, classes, traced, layers, None)

    return make
