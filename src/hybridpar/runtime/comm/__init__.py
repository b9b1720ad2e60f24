"""Communication: the process grids, the ledger and every collective hybridpar runs."""

import os
import time

import torch.distributed as dist

from hybridpar.runtime.comm.grid import GridSet, ProcessGrid, check_grid, close_groups, new_group
from hybridpar.runtime.comm.group import Group
from hybridpar.runtime.comm.ledger import Ledger

__all__ = ["GridSet", "Group", "Ledger", "ProcessGrid", "check_grid", "new_group", "shutdown"]

_ENDS = 0


def shutdown(timeout_s: float = 60.0) -> None:
    """End torch.distributed cleanly. A rank that tears down right after its last collective can
    close connections a slower peer is still reading, and gloo then aborts that peer ("terminate
    called without an active exception"). So: stop the communication threads, a barrier, then
    every rank says through the store that it is out of the barrier and waits until all have said
    so; only then are the groups destroyed, when no rank is inside a gloo operation. Rank 0, whose
    process holds the store, then waits until every rank has left the store alone."""
    global _ENDS
    if not dist.is_initialized():
        return
    from hybridpar.runtime.comm import worker

    worker.close_all()  # no thread still holds a group when the groups are destroyed
    dist.barrier()
    close_groups()
    try:
        store = dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        store = None
    if store is not None:
        _ENDS += 1
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        key = f"hybridpar/shutdown/{restart}/{_ENDS}"
        world = dist.get_world_size()
        store.add(key, 1)
        deadline = time.monotonic() + timeout_s
        while store.add(key, 0) < world and time.monotonic() < deadline:
            time.sleep(0.001)
        # the store lives in rank 0's process (launch, init_process_group's env:// rendezvous):
        # rank 0 goes only after every rank has made its last call to it, or a rank still polling
        # above gets "Connection reset by peer"
        store.add(f"{key}/left", 1)
        if dist.get_rank() == 0:
            while store.add(f"{key}/left", 0) < world and time.monotonic() < deadline:
                time.sleep(0.001)
    dist.destroy_process_group()
