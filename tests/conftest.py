"""Fixtures many test files share: a cache of calibrations and profiles of each test's own (every
test has one: none reads or writes the user's ~/.cache/hybridpar, so a test that leans on a
warm cache fails on a new machine too, in CI as anywhere), and a calibration of this machine
written with fixed numbers (plans and predictions that repeat, nothing measured). The helpers
that run code in ranks and the small models stay in dist_helpers.py and nets.py, which tests
import by name."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

# what the cache holds that no measurement of this machine decides (the compiled kernels, the
# zoo models' traced layers): built once per session, in a folder the session starts empty
_BUILT = ("kernels", "analysis")
_SESSION: list[Path] = []


def pytest_configure(config: pytest.Config) -> None:
    """The session's own cache, from before the first fixture: what a fixture wider than one
    test (a module's run) calibrates or profiles is the session's, never the user's."""
    path = Path(tempfile.mkdtemp(prefix="hybridpar-tests-"))
    for name in _BUILT:
        (path / name).mkdir()
    os.environ["HYBRIDPAR_CACHE"] = str(path)
    _SESSION.append(path)


def pytest_unconfigure(config: pytest.Config) -> None:
    for path in _SESSION:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def _built() -> Path:
    return _SESSION[0]


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, _built: Path) -> Path:
    """An empty HYBRIDPAR_CACHE for this test and every process it starts: no calibration and
    no compute profile but its own; the session's build products linked in."""
    path = tmp_path / "cache"
    path.mkdir()
    for name in _BUILT:
        (path / name).symlink_to(_built / name)
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
