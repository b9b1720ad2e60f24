"""Fault injection for the fault-matrix tests (tests/test_faults.py), the way torchelastic's own
tests inject failures: HYBRIDPAR_FAULT="<where>:rank=<r>:step=<s>[:restart=<k>][:node=1]" makes
rank r kill itself with SIGKILL when it reaches <where> during step s (on torchrun restart attempt
k, default 0); with node=1 it kills its parent first, the torchrun agent: the whole node is lost,
as when a machine goes away. Points: forward, backward, handoff, halo, optimizer, checkpoint,
host. Unset, `at` costs a lookup.
"""

from __future__ import annotations

import os
import signal

__all__ = ["POINTS", "at", "set_step"]

POINTS = ("forward", "backward", "handoff", "halo", "optimizer", "checkpoint", "host")
_step = 0


def set_step(step: int) -> None:
    global _step
    _step = step


def _spec() -> dict | None:
    text = os.environ.get("HYBRIDPAR_FAULT")
    if not text:
        return None
    where, *rest = text.split(":")
    spec = {"where": where, "rank": 0, "step": 0, "restart": 0, "node": 0}
    spec.update({k: int(v) for k, v in (kv.split("=") for kv in rest)})
    return spec


def at(where: str) -> None:
    """SIGKILL this process if HYBRIDPAR_FAULT names this point, rank, step and restart."""
    spec = _spec()
    if (
        spec is not None
        and spec["where"] == where
        and spec["step"] == _step
        and spec["rank"] == int(os.environ.get("RANK", "0"))
        and spec["restart"] == int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    ):
        if spec["node"]:
            os.kill(os.getppid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)
