"""Run a function on N ranks: spawned local processes, or the ranks torchrun started.

`launch(fn, nprocs, *args)` spawns nprocs processes (gloo on CPU; NCCL with one GPU per process
when CUDA is present), initialises torch.distributed in each with a collective timeout, runs
fn(*args) and returns every rank's result in rank order. It watches the ranks: when one dies (a
signal, a non-zero exit) or raises, the others are stopped and a RankFailure names it; a rank
that hangs makes the others time out in their next collective, and the still-running one is named
as the culprit. Children die with the parent (PR_SET_PDEATHSIG), so no orphans are left behind.

Under torchrun (WORLD_SIZE is set) it initialises from the environment and runs fn in-process.
"""

from __future__ import annotations

import ctypes
import datetime
import faulthandler
import multiprocessing as mp
import os
import signal
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["RankFailure", "free_port", "launch", "under_torchrun"]


class RankFailure(RuntimeError):
    """A rank died, raised, or hung. The message is one line naming it; `details` holds the
    failing rank's traceback when there is one."""

    def __init__(self, message: str, details: str = "") -> None:
        super().__init__(message)
        self.details = details


def under_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ and "MASTER_ADDR" in os.environ


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _backend() -> str:
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(timeout_s: float, backend: str | None = None) -> None:
    import torch
    import torch.distributed as dist

    backend = backend or _backend()
    os.environ["HYBRIDPAR_TIMEOUT_S"] = str(timeout_s)  # sub-groups (ProcessGrid) use it too
    if backend == "nccl":
        torch.cuda.set_device(
            int(os.environ.get("LOCAL_RANK", os.environ["RANK"])) % torch.cuda.device_count()
        )
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _child(
    rank: int,
    world: int,
    port: int,
    timeout_s: float,
    backend: str | None,
    fn: Callable,
    args: tuple,
    queue: mp.Queue,
) -> None:
    _die_with_parent()
    faulthandler.register(
        signal.SIGUSR1, all_threads=True
    )  # `kill -USR1 <pid>` prints where a rank is
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    import torch

    from hybridpar.comm import shutdown

    # the ranks share this machine's cores: more threads than cores make OpenMP spin-wait
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    try:
        init_distributed(timeout_s, backend)
        result = fn(*args)
        queue.put((rank, "ok", result))
        shutdown()  # nobody tears down the group while another rank still uses it
    except BaseException as exc:  # report everything, including KeyboardInterrupt
        last = (
            f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        )
        queue.put((rank, "error", (last, traceback.format_exc())))
        raise SystemExit(1) from None


def _describe(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def launch(
    fn: Callable,
    nprocs: int,
    *args: Any,
    timeout_s: float = 300.0,
    backend: str | None = None,
    grace_s: float = 3.0,
) -> list[Any]:
    """fn(*args) on nprocs ranks; returns their results in rank order."""
    if under_torchrun():
        from hybridpar.comm import shutdown

        init_distributed(timeout_s, backend)
        result = fn(*args)
        shutdown()
        return [result]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_child, args=(r, nprocs, port, timeout_s, backend, fn, args, queue), daemon=True
        )
        for r in range(nprocs)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, tuple[str, str]] = {}
    deadline = (
        time.monotonic() + timeout_s * 4 + 600
    )  # a backstop; collectives time out much sooner

    def drain(wait: float = 0.0) -> None:
        end = time.monotonic() + wait
        while True:
            try:
                rank, status, payload = queue.get(
                    timeout=max(0.0, min(0.05, end - time.monotonic()))
                )
            except Exception:  # queue.Empty
                if time.monotonic() >= end:
                    return
                continue
            (results if status == "ok" else errors)[rank] = payload

    try:
        while True:
            drain(0.05)
            codes = [p.exitcode for p in procs]
            failed = [r for r, c in enumerate(codes) if (c is not None and c != 0) or r in errors]
            if failed:
                break
            if all(c == 0 for c in codes) or (
                len(results) == nprocs and all(c is not None for c in codes)
            ):
                drain(0.2)
                return [results.get(r) for r in range(nprocs)]
            if time.monotonic() > deadline:
                raise RankFailure(
                    f"job exceeded its {deadline:.0f} s backstop; ranks {sorted(set(range(nprocs)) - set(results))} never finished"
                )
        # something failed: give the others a moment to report, then name the culprit
        t_fail = time.monotonic()
        while time.monotonic() - t_fail < grace_s and any(p.exitcode is None for p in procs):
            drain(0.1)
        drain(0.1)
        raise RankFailure(*_blame(procs, errors))
    finally:
        _stop(procs)
        queue.close()


def _blame(procs: list, errors: dict[int, tuple[str, str]]) -> tuple[str, str]:
    codes = [p.exitcode for p in procs]
    killed = [r for r, c in enumerate(codes) if c is not None and c < 0]
    if killed:
        r = killed[0]
        return f"rank {r} {_describe(codes[r])}; the job was stopped", ""
    raised = [
        r
        for r in errors
        if "timed out" not in errors[r][0].lower()
        and "timeout" not in errors[r][0].lower()
        and "connection" not in errors[r][0].lower()
    ]
    if raised:
        r = min(raised)
        return f"rank {r} failed: {errors[r][0]}", errors[r][1]
    hung = [r for r, c in enumerate(codes) if c is None]
    if hung and errors:
        return (
            f"rank {hung[0]} did not respond (hung?); ranks {sorted(errors)} timed out waiting for it "
            "in a collective; the job was stopped"
        ), ""
    crashed = [r for r, c in enumerate(codes) if c not in (None, 0) and r not in errors]
    if crashed:
        return (
            f"rank {crashed[0]} {_describe(codes[crashed[0]])} without a message; the job was stopped",
            "",
        )
    r = min(errors)
    return f"rank {r} failed: {errors[r][0]}", errors[r][1]


def _stop(procs: list) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    t = time.monotonic()
    for p in procs:
        p.join(max(0.0, 2.0 - (time.monotonic() - t)))
        if p.is_alive():
            p.kill()
            p.join(1.0)
