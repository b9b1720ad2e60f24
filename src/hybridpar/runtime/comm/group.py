"""A process group and the transport of its synchronous collectives, fixed when it is built.

`hybridpar.runtime.comm.grid.new_group` builds every group hybridpar uses. Where the caller asks
for it and every member shares this host, the group carries a shared-memory reducer (comm.small):
its synchronous CPU all-reduces and all-gathers of up to SHM_MAX_BYTES per rank go through host
memory instead of gloo. Nothing else decides the transport: a collective reads it from the group
it is given. A plain `torch.distributed.ProcessGroup` (what a DDP user passes to a hook) always
goes through torch.distributed.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["DEFAULT_TIMEOUT_S", "Group", "group_rank", "group_size", "group_timeout", "pg_of"]

DEFAULT_TIMEOUT_S = 300.0


@dataclass(eq=False)
class Group:
    """`pg` with its transport: `shm`, the shared-memory reducer its synchronous small collectives
    take (None: torch.distributed for everything), and the collective `timeout` it was built
    with (the host reducer's and the shared-memory waits use it too)."""

    pg: Any  # dist.ProcessGroup, or GroupMember.NON_GROUP_MEMBER on a rank outside it
    timeout: datetime.timedelta
    shm: Any = None  # a comm.small.SmallReducer (this module sits below it)

    @property
    def size(self) -> int:
        return dist.get_world_size(self.pg)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.pg)

    @property
    def timeout_s(self) -> float:
        return self.timeout.total_seconds()


def pg_of(group: Group | dist.ProcessGroup | None) -> dist.ProcessGroup:
    """The torch.distributed group (the default one for None)."""
    if isinstance(group, Group):
        return group.pg
    return group if group is not None else dist.group.WORLD


def group_size(group: Group | dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(pg_of(group))


def group_rank(group: Group | dist.ProcessGroup | None) -> int:
    return dist.get_rank(pg_of(group))


def group_timeout(group: Group | dist.ProcessGroup | None = None) -> datetime.timedelta:
    """The collective timeout a group was created with (the default group's: init_process_group's
    `timeout`)."""
    if isinstance(group, Group):
        return group.timeout
    pg = pg_of(group)
    for device in ("cpu", "cuda"):
        try:
            return pg._get_backend(torch.device(device)).options._timeout
        except (AttributeError, RuntimeError):
            continue
    return datetime.timedelta(seconds=DEFAULT_TIMEOUT_S)
