"""Watching the processes of a `hybridpar train` run from a test: its ranks, their CPU time, that
none is left behind, and what /dev/shm holds."""

from __future__ import annotations

import os
import sys
import time

TRAIN = [sys.executable, "-m", "hybridpar", "train", "--quiet", "--no-progress"]


def read(path: str) -> str:
    with open(path) as f:
        return f.read()


def ranks_of(parent: int) -> list[int]:
    """The spawned ranks of a launcher process (not multiprocessing's resource tracker)."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            stat = read(f"/proc/{pid}/stat")
            cmd = read(f"/proc/{pid}/cmdline")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == parent and "multiprocessing.spawn" in cmd and "resource_tracker" not in cmd:
            out.append(int(pid))
    return out


def cpu_ticks(pid: int) -> int:
    fields = read(f"/proc/{pid}/stat").rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def wait_for_ranks(proc, n: int, cpu_s: float = 0.0, deadline_s: float = 120) -> list[int]:
    """The n ranks of `proc` once each has used `cpu_s` seconds of CPU (imports done: training)."""
    deadline = time.monotonic() + deadline_s
    while len(ranks_of(proc.pid)) < n and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
    ranks = ranks_of(proc.pid)
    assert len(ranks) == n, f"{len(ranks)} of {n} ranks started"
    while time.monotonic() < deadline:
        try:
            if min(cpu_ticks(r) for r in ranks) >= cpu_s * 100:
                break
        except OSError:
            break
        time.sleep(0.2)
    return ranks


def assert_all_gone(pids, within_s: float = 10) -> None:
    def alive(w):
        try:
            return "Z" not in read(f"/proc/{w}/stat").rsplit(")", 1)[1].split()[0]
        except OSError:
            return False

    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and any(alive(w) for w in pids):
        time.sleep(0.1)
    left = [w for w in pids if alive(w)]
    assert not left, f"orphans left: {left}"


def shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
