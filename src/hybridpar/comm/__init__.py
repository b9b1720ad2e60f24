"""Communication: the process grids, the ledger and every collective hybridpar runs."""

import torch.distributed as dist

from hybridpar.comm.grid import GridSet, ProcessGrid, check_grid
from hybridpar.comm.ledger import Ledger

__all__ = ["GridSet", "Ledger", "ProcessGrid", "check_grid", "shutdown"]


def shutdown() -> None:
    """End torch.distributed cleanly: a barrier, then destroy_process_group. A rank that tears down
    right after its last collective can close connections a slower peer is still reading, and gloo
    then aborts that peer ("terminate called without an active exception")."""
    if dist.is_initialized():
        from hybridpar.comm import small

        dist.barrier()
        small.disable_all()
        dist.destroy_process_group()
