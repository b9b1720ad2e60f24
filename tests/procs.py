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


def _children() -> dict[int, list[tuple[int, str]]]:
    """Every process's children as (pid, command line), by parent pid."""
    out: dict[int, list[tuple[int, str]]] = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            stat = read(f"/proc/{pid}/stat")
            cmd = read(f"/proc/{pid}/cmdline")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        out.setdefault(ppid, []).append((int(pid), cmd))
    return out


def ranks_of(parent: int) -> list[int]:
    """The ranks of a launcher process: the children of its fork server (runtime.launcher), not
    the server itself nor multiprocessing's resource tracker."""
    children = _children()
    servers = [pid for pid, cmd in children.get(parent, []) if "forkserver" in cmd]
    return [pid for s in servers for pid, _ in children.get(s, [])]


def descendants(parent: int) -> list[int]:
    """Every process below `parent`: its children, theirs, and so on."""
    children, out, todo = _children(), [], [parent]
    while todo:
        kids = [pid for pid, _ in children.get(todo.pop(), [])]
        out += kids
        todo += kids
    return out


def python_prints(code: str, timeout_s: float = 120) -> list[str]:
    """The words a fresh interpreter prints running `code` (which must exit 0)."""
    import subprocess

    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout.split()


def fork_servers() -> set[int]:
    """Every multiprocessing fork server on this machine (a launcher's, runtime.launcher)."""
    return {pid for kids in _children().values() for pid, cmd in kids if "forkserver" in cmd}


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
