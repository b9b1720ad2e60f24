"""Fault injection for the fault-matrix tests (tests/test_faults.py), the way torchelastic's own
tests inject failures: HYBRIDPAR_FAULT="<where>:rank=<r>:step=<s>[:restart=<k>][:node=1]" makes
rank r kill itself with SIGKILL when it reaches <where> during step s (on torchrun restart attempt
k, default 0); with node=1 it kills its parent first, the torchrun agent: the whole node is lost,
as when a machine goes away. With hold=<seconds> it stops there that long instead, having
created the file HYBRIDPAR_FAULT_FLAG names (so that a test knows it is there and can kill the
launcher at that moment).

Points in a step: forward, backward, handoff, halo, optimizer, checkpoint, host. Points of a
launch's start-up (runtime.launcher): server (the fork server, before it imports torch: the
launcher's first fork waits for it), rank (a rank, before it sets its parent-death signal) and
unpickle (a rank, while it unpickles its job). Unset, `at` costs a lookup.
"""

from __future__ import annotations

import os
import signal
import time

__all__ = ["POINTS", "at", "set_step"]

POINTS = ("forward", "backward", "handoff", "halo", "optimizer", "checkpoint", "host")
POINTS += ("server", "rank", "unpickle")
_step = 0


def set_step(step: int) -> None:
    global _step
    _step = step


def _spec() -> dict | None:
    text = os.environ.get("HYBRIDPAR_FAULT")
    if not text:
        return None
    where, *rest = text.split(":")
    spec = {"where": where, "rank": 0, "step": 0, "restart": 0, "node": 0, "hold": 0}
    spec.update({k: float(v) if k == "hold" else int(v) for k, v in (kv.split("=") for kv in rest)})
    return spec


def at(where: str, rank: int | None = None) -> None:
    """SIGKILL this process (or hold it) if HYBRIDPAR_FAULT names this point, rank (RANK's,
    unless given), step and restart."""
    spec = _spec()
    if (
        spec is not None
        and spec["where"] == where
        and spec["step"] == _step
        and spec["rank"] == (int(os.environ.get("RANK", "0")) if rank is None else rank)
        and spec["restart"] == int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    ):
        if spec["hold"]:
            flag = os.environ.get("HYBRIDPAR_FAULT_FLAG")
            if flag:
                with open(flag, "w") as f:
                    f.write(str(os.getpid()))
            time.sleep(spec["hold"])
            return
        if spec["node"]:
            os.kill(os.getppid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)
