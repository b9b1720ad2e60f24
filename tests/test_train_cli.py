"""`hybridpar train` as a user meets it: a real run, bad input caught before spawning, and a rank
that dies or hangs ending the job with a message naming it, leaving no processes behind."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from hybridpar.errors import ConfigError
from hybridpar.train.config import TrainConfig
from hybridpar.train.run import prepare

CMD = [sys.executable, "-m", "hybridpar", "train", "--no-progress"]


def test_train_digits_reports_prediction_and_measurement(tmp_path):
    report = tmp_path / "r.json"
    r = subprocess.run(CMD + ["--nproc", "2", "--strategy", "owt", "--epochs", "3", "--report", str(report)],
                       capture_output=True, text=True, timeout=240)  # fmt: skip
    assert r.returncode == 0, r.stderr
    d = json.loads(report.read_text())
    assert d["procs"] == 2 and d["grid"] == [2, 1] and len(d["epochs"]) == 3
    assert {"epoch", "loss", "train_acc", "test_acc", "time_s"} <= set(d["epochs"][0])
    assert d["final"]["test_acc"] > 0.5  # 3 epochs; the accuracy promise is the next test's
    assert {"time_s", "compute_s", "comm_wait_s"} <= set(d["iteration"])
    meas, pred = d["bytes"]["measured"], d["bytes"]["predicted"]
    for k, v in pred.items():
        assert meas[k] == pytest.approx(v, rel=1e-9), k
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"


def test_default_run_is_the_demo_and_reaches_95_percent(tmp_path):
    """`make demo` runs `hybridpar train` with its defaults: digits-cnn on digits, 4 ranks, auto."""
    env = {**os.environ, "HYBRIDPAR_CACHE": str(tmp_path)}  # auto calibrates this machine first
    t0 = time.monotonic()
    r = subprocess.run(CMD + ["--report", str(tmp_path / "demo.json")], capture_output=True, text=True,
                       timeout=300, env=env)  # fmt: skip
    assert r.returncode == 0, r.stderr
    d = json.loads((tmp_path / "demo.json").read_text())
    assert d["procs"] == 4 and d["config"]["strategy"] == "auto"
    assert d["final"]["test_acc"] >= 0.95, d["final"]
    assert time.monotonic() - t0 < 180
    assert (tmp_path / "localhost.json").exists()


@pytest.mark.parametrize(
    "changes, needle",
    [
        ({"strategy": "grid:3x2", "nproc": 4}, "has 6 ranks"),
        ({"strategy": "grid:2x2", "nproc": 4, "batch": 30}, "does not split evenly"),
        ({"strategy": "owt", "nproc": 16, "model": "resnet20", "batch": 64}, "narrowest FC layer"),
        ({"data": "/nonexistent/data.npz"}, "does not exist"),
        ({"strategy": "pipeline"}, "unknown strategy"),
        ({"model": "gpt5"}, "unknown model"),
        ({"schedule": "warp"}, "unknown schedule"),
        ({"codec": "int4"}, "unknown codec"),
        ({"compress": "weights"}, "--compress takes"),
        ({"bn": "sync"}, "unknown --bn"),
    ],
)
def test_bad_config_is_caught_before_spawning(changes, needle):
    with pytest.raises(ConfigError, match=needle):
        prepare(TrainConfig(**{"nproc": 4, "strategy": "grid:2x2", **changes}))


def test_malformed_npz_via_cli(tmp_path):
    bad = tmp_path / "bad.npz"
    np.savez(bad, inputs=np.zeros((4, 1, 8, 8)), labels=np.zeros(4))
    t0 = time.monotonic()
    r = subprocess.run(CMD + ["--data", str(bad)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "needs arrays named x and y" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and time.monotonic() - t0 < 30
    garbage = tmp_path / "garbage.npz"
    garbage.write_bytes(b"not a zip")
    r = subprocess.run(CMD + ["--data", str(garbage)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "not a readable .npz" in r.stderr


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _workers(parent: int) -> list[int]:
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            stat = _read(f"/proc/{pid}/stat")
            cmd = _read(f"/proc/{pid}/cmdline")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == parent and "multiprocessing.spawn" in cmd and "resource_tracker" not in cmd:
            out.append(int(pid))
    return out


def _start_and_wait_for_training(extra):
    p = subprocess.Popen(CMD + ["--nproc", "4", "--strategy", "grid:2x2", "--epochs", "500", *extra],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    deadline = time.monotonic() + 120
    while len(_workers(p.pid)) < 4 and time.monotonic() < deadline:
        p.wait(timeout=0.2) if p.poll() is not None else time.sleep(0.2)
    workers = _workers(p.pid)
    assert len(workers) == 4, "workers did not start"
    # wait until they are training: their CPU time grows past start-up
    while time.monotonic() < deadline:
        ticks = [int(_read(f"/proc/{w}/stat").rsplit(")", 1)[1].split()[11]) for w in workers]
        if min(ticks) > 300:  # 3 s of CPU each: imports done, steps running
            break
        time.sleep(0.5)
    return p, workers


def _assert_all_gone(pids):
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(
        os.path.exists(f"/proc/{w}") and "Z" not in _read(f"/proc/{w}/stat").split()[2]
        for w in pids
        if os.path.exists(f"/proc/{w}")
    ):
        time.sleep(0.1)
    alive = [w for w in pids if os.path.exists(f"/proc/{w}")]
    assert not alive, f"orphans left: {alive}"


def _shm():
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def test_killed_rank_ends_the_job_with_its_name():
    before = _shm()
    p, workers = _start_and_wait_for_training(["--timeout", "30"])
    victim = workers[2]
    os.kill(victim, signal.SIGKILL)
    _, err = p.communicate(timeout=90)
    assert p.returncode == 1
    m = re.search(r"rank (\d) was killed by SIGKILL", err)
    assert m, err
    _assert_all_gone(workers)
    assert _shm() - before == set()  # no semaphores or segments left behind


def test_hung_rank_ends_the_job_within_the_timeout():
    p, workers = _start_and_wait_for_training(["--timeout", "5"])
    victim = workers[1]
    os.kill(victim, signal.SIGSTOP)
    t0 = time.monotonic()
    _, err = p.communicate(timeout=90)
    elapsed = time.monotonic() - t0
    assert p.returncode == 1
    assert re.search(r"rank \d did not respond", err), err
    assert elapsed < 5 + 30, elapsed
    _assert_all_gone(workers)


def test_eight_bit_training_matches_fp32_accuracy(tmp_path):
    """digits-cnn on a 2x2 grid, gradients and model-parallel activations in the 8-bit dynamic
    tree: the final test accuracy is within 1 point of float32 training from the same seed."""
    acc = {}
    for codec in ("none", "dynamic-tree"):
        report = tmp_path / f"{codec}.json"
        r = subprocess.run(CMD + ["--strategy", "grid:2x2", "--codec", codec, "--epochs", "10",
                                  "--report", str(report)], capture_output=True, text=True, timeout=300)  # fmt: skip
        assert r.returncode == 0, r.stderr
        r = json.loads(report.read_text())
        acc[codec] = r["final"]["test_acc"]
        if codec != "none":  # the wire carried 1 byte per element, as predicted
            assert r["bytes"]["measured"]["dw_allreduce"] == r["bytes"]["predicted"]["dw_allreduce"]
    assert acc["none"] > 0.95
    assert abs(acc["dynamic-tree"] - acc["none"]) <= 0.01, acc
