"""The Pr x Pc process grid on a torch DeviceMesh.

The mesh has shape (Pc, Pr) with dims ("batch", "model"), so rank = c * Pr + r: a model group is Pr
consecutive ranks (they hold the same examples and split a layer's weights) and a batch group is
the Pc ranks with the same r (they hold the same weight shard and split the examples). With this
numbering the examples of batch group c are exactly the pure-batch blocks of ranks c*Pr .. c*Pr+Pr-1,
which is what makes the batch -> model hand-off one all-gather within the model group.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from hybridpar.errors import ConfigError

__all__ = ["ProcessGrid", "check_grid"]


def check_grid(pr: int, pc: int, world: int, batch: int | None = None) -> None:
    """Raise a one-line ConfigError when the grid cannot run on `world` ranks with `batch`."""
    if pr < 1 or pc < 1:
        raise ConfigError(f"grid {pr}x{pc}: both sides must be at least 1")
    if pr * pc != world:
        raise ConfigError(
            f"grid {pr}x{pc} has {pr * pc} ranks but the job has {world}; use Pr*Pc = {world}"
        )
    if batch is not None and batch % world:
        raise ConfigError(
            f"global batch {batch} does not split evenly over {world} ranks; use a multiple of {world}"
        )


@dataclass
class ProcessGrid:
    """Pr x Pc grid over the default process group. Create after init_process_group."""

    pr: int
    pc: int
    device: str = "cpu"

    def __post_init__(self) -> None:
        if not dist.is_initialized():
            raise RuntimeError("ProcessGrid needs torch.distributed to be initialised first")
        check_grid(self.pr, self.pc, dist.get_world_size())
        self.rank = dist.get_rank()
        self.mesh: DeviceMesh = self._mesh()
        self.r = self.rank % self.pr  # position in the model group (which weight shard)
        self.c = self.rank // self.pr  # position in the batch group (which examples)

    def _mesh(self) -> DeviceMesh:
        """init_device_mesh creates its sub-groups with torch's default 30-minute timeout, so a dead
        rank would hang the others that long; we create them with the job's collective timeout
        (HYBRIDPAR_TIMEOUT_S, set by the launcher) and build the same mesh from them."""
        timeout = datetime.timedelta(seconds=float(os.environ.get("HYBRIDPAR_TIMEOUT_S", "300")))
        ranks = torch.arange(self.pr * self.pc).reshape(self.pc, self.pr)
        mine = {}
        for name, rows in (("model", ranks.tolist()), ("batch", ranks.t().tolist())):
            for members in rows:  # every rank creates every group, in the same order
                g = dist.new_group(members, timeout=timeout, group_desc=f"hybridpar_{name}")
                if self.rank in members:
                    mine[name] = g
        return DeviceMesh.from_group(
            [mine["batch"], mine["model"]],
            self.device,
            mesh=ranks,
            mesh_dim_names=("batch", "model"),
        )

    @property
    def world_size(self) -> int:
        return self.pr * self.pc

    @property
    def model_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group("model")

    @property
    def batch_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group("batch")

    @property
    def world(self) -> dist.ProcessGroup:
        return dist.group.WORLD
