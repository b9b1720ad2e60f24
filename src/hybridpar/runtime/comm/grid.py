"""Process grids on torch DeviceMeshes: one per distinct grid a plan uses.

A grid Pr x Pc has a mesh of shape (Pc, Pr) with dims ("batch", "model"), so rank = c * Pr + r: a
model group is Pr consecutive ranks (they hold the same examples and split a layer's weights) and
a batch group is the Pc ranks with the same r (they hold the same weight shard and split the
examples).

Layouts. An activation in the layout of grid (Pr, Pc) is split by examples over the Pc batch
groups and replicated within each model group. Examples are numbered the same way for every grid:
a step's n examples split over all P ranks in rank order (`even_split(n, P)`), and batch group c of
any grid holds the blocks of its model group's ranks c*Pr .. c*Pr + Pr - 1. So when Pc' divides Pc
the coarser layout's batch group is the union of m = Pc / Pc' finer ones, and moving between the
two is one all-gather (or a slice) among the m ranks that hold the pieces: `GridSet.regroup`.

Transport. Every group is built by `new_group`, which fixes how its synchronous collectives
travel (comm.group): the groups that carry activations (model, batch, regroup, the batch norms'
twins, the job's world group) take host shared memory where all their ranks share a host, unless
the engine is told not to (RuntimeOptions.shared_memory); the gradient reducer's own groups stay
on torch.distributed.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from hybridpar.core.errors import ConfigError
from hybridpar.core.groups import (
    batch_groups,
    host_order,
    model_groups,
    placed,
    position_of,
    regroup_groups,
    why_not_placement,
)
from hybridpar.runtime.comm.group import Group, group_timeout
from hybridpar.runtime.comm.host import host_names
from hybridpar.runtime.comm.small import shared_memory

__all__ = ["GridSet", "ProcessGrid", "check_grid", "close_groups", "new_group", "rows_of_group"]


def check_grid(pr: int, pc: int, world: int) -> None:
    """Raise a one-line ConfigError when the grid cannot run on `world` ranks with `batch`."""
    if pr < 1 or pc < 1:
        raise ConfigError(f"grid {pr}x{pc}: both sides must be at least 1")
    if pr * pc != world:
        raise ConfigError(
            f"grid {pr}x{pc} has {pr * pc} ranks but the job has {world}; use Pr*Pc = {world}"
        )


_GROUPS: dict[tuple, tuple[object, Group]] = {}


def new_group(
    members: list[int],
    timeout: datetime.timedelta | None,
    desc: str,
    tag: str = "",
    shm: bool = False,
) -> Group:
    """A group of `members` with the collective `timeout` (the default group's when None) and,
    with `shm`, host shared memory for its synchronous small collectives where every member
    shares this host (collective over the members: set up right here, once).

    Built once per (members, timeout, tag, shm) for the life of the default group: a job that
    parallelizes several models (tests, benchmarks) reuses its groups instead of opening new
    connections each time. Every rank calls it for every group in the same order, as
    dist.new_group requires, so every rank hits or misses the cache alike. A `tag` gives the
    same members a second, separate group (the gradient reducer's own, see GridSet.grad_group)."""
    world = dist.group.WORLD
    timeout = timeout or group_timeout()
    key = (id(world), tuple(members), timeout, tag, shm)
    if key not in _GROUPS:  # the value keeps `world` alive, so its id is not reused
        pg = dist.new_group(members, timeout=timeout, group_desc=desc)
        group = Group(pg, timeout)
        if shm and dist.get_rank() in members:
            group.shm = shared_memory(group)
        _GROUPS[key] = (world, group)
    return _GROUPS[key][1]


def close_groups() -> None:
    """Release the shared memory of every group (comm.shutdown calls it before the process
    groups are destroyed)."""
    for _, group in _GROUPS.values():
        if group.shm is not None:
            group.shm.close()
            group.shm = None
    _GROUPS.clear()


def rows_of_group(sizes: list[int], pr: int, c: int) -> int:
    """Examples held by batch group c of a grid with model groups of pr ranks, given the examples
    of every rank in the finest (1 x P) layout."""
    return sum(sizes[c * pr : (c + 1) * pr])


@dataclass
class ProcessGrid:
    """Pr x Pc grid over the default process group. Create after init_process_group, on every
    rank in the same order (it creates process groups)."""

    pr: int
    pc: int
    device: str = "cpu"
    timeout: datetime.timedelta | None = None
    """collective timeout of the grid's groups (default: the default group's)"""
    shm: bool = False
    """the model and batch groups through host shared memory where they share a host"""
    placement: tuple[int, int] | None = None
    """how positions sit on ranks (hybridpar.core.groups); None: position = rank"""
    order: list[int] | None = None
    """the ranks host by host (core.groups.host_order); None: numbered host by host"""
    mesh: DeviceMesh = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not dist.is_initialized():
            raise RuntimeError("ProcessGrid needs torch.distributed to be initialised first")
        check_grid(self.pr, self.pc, dist.get_world_size())
        self.timeout = self.timeout or group_timeout()
        self.rank = dist.get_rank()
        self.position = position_of(self.rank, self.placement, self.order)
        self.r = self.position % self.pr  # place in the model group (which weight shard)
        self.c = self.position // self.pr  # place in the batch group (which examples)
        self.groups: dict[str, Group] = {}
        self.mesh = self._mesh()

    def _mesh(self) -> DeviceMesh:
        """init_device_mesh creates its sub-groups with torch's default 30-minute timeout, so a dead
        rank would hang the others that long; we create them with the job's timeout and build the
        same mesh from them."""
        # (Pc, Pr): the rank at position c * Pr + r
        at = self.placement, self.order
        ranks = torch.tensor(placed(model_groups(self.pr, self.pc), *at))
        for name, rows in (
            ("model", placed(model_groups(self.pr, self.pc), *at)),
            ("batch", placed(batch_groups(self.pr, self.pc), *at)),
        ):
            for members in rows:  # every rank creates every group, in the same order
                g = new_group(members, self.timeout, f"hybridpar_{name}", shm=self.shm)
                if self.rank in members:
                    self.groups[name] = g
        return DeviceMesh.from_group(
            [self.groups["batch"].pg, self.groups["model"].pg],
            self.device,
            mesh=ranks,
            mesh_dim_names=("batch", "model"),
        )

    @property
    def world_size(self) -> int:
        return self.pr * self.pc

    @property
    def model_group(self) -> Group:
        return self.groups["model"]

    @property
    def batch_group(self) -> Group:
        return self.groups["batch"]

    def rows(self, sizes: list[int]) -> slice:
        """The examples of this rank's batch group within a step, given every rank's share of the
        finest layout (`even_split(n, P)`)."""
        lo = sum(sizes[: self.c * self.pr])
        return slice(lo, lo + rows_of_group(sizes, self.pr, self.c))


def _follow_hosts(
    names: list[str], placement: tuple[int, int] | None, grids: list[tuple[int, int]]
) -> tuple[list[int] | None, str]:
    """The order that puts positions on ranks host by host (None: the ranks' own numbering),
    and, where the hosts cannot be followed, why."""
    order = host_order(names)
    why = why_not_placement(placement, grids, order) if order is not None else ""
    return (None, why) if why else (order, "")


class GridSet:
    """The grids of one plan, keyed by Pc (a layout is its number of batch groups), the groups
    that move an activation between two of their layouts, and the job's world group; every group
    with `timeout`, created in the same order on every rank. `shm`: the groups that carry
    activations and small sums go through host shared memory where their ranks share a host."""

    def __init__(
        self,
        pcs: Iterable[int],
        moves: Iterable[tuple[int, int]] = (),
        device: str = "cpu",
        timeout: datetime.timedelta | None = None,
        shm: bool = True,
        placement: tuple[int, int] | None = None,
    ) -> None:
        self.world_size = dist.get_world_size()
        self.placement = placement
        pcs = sorted(set(pcs))
        self.order, self.why_not_hosts = _follow_hosts(
            host_names(), placement, [(self.world_size // pc, pc) for pc in pcs]
        )
        self.position = position_of(dist.get_rank(), placement, self.order)
        self.timeout = timeout or group_timeout()
        self.device = device
        self.shm = shm and device == "cpu"
        everyone = list(range(self.world_size))
        self.world = new_group(everyone, self.timeout, "hybridpar_world", "world", self.shm)
        self.grids = {
            pc: ProcessGrid(
                self.world_size // pc, pc, device, self.timeout, self.shm, placement, self.order
            )
            for pc in pcs
        }
        self._moves: dict[tuple[int, int], Group] = {}
        for a, b in sorted({(max(a, b), min(a, b)) for a, b in moves if a != b}):
            self._moves[(a, b)] = self._regroup(a, b)

    def grid(self, pc: int) -> ProcessGrid:
        return self.grids[pc]

    def _regroup(self, fine: int, coarse: int, tag: str = "") -> Group:
        """Ranks {k : k // pr_coarse and k % pr_fine as for this rank}: the m = fine / coarse ranks
        whose batch groups of the fine layout make up one batch group of the coarse layout."""
        if fine % coarse:
            raise ConfigError(
                f"layouts with {fine} and {coarse} batch groups do not nest: no redistribution "
                "between them; use grids whose Pc divide one another"
            )
        rank, mine = dist.get_rank(), None
        for members in placed(
            regroup_groups(self.world_size, fine, coarse), self.placement, self.order
        ):
            g = new_group(members, self.timeout, f"hybridpar_regroup{tag}", tag, self.shm)
            if rank in members:
                mine = g
        return mine

    def regroup(self, a: int, b: int) -> Group:
        return self._moves[(max(a, b), min(a, b))]

    def handoff_group(self, a: int, b: int, tag: str = "handoff") -> Group:
        """A twin of `regroup(a, b)` for a hand-off sent in rounds (runtime/parallel/rounds.py):
        its split-phase collectives stay in flight while the layers after it run theirs, so it
        must not share a group (or its shared memory) with them. Collective: every rank asks for
        the same pairs in the same order."""
        return self._regroup(max(a, b), min(a, b), tag)

    def twin_group(self, pc: int, tag: str, shm: bool = False) -> Group:
        """Another group with the members of this rank's batch group of grid `pc`, so that one kind
        of traffic never queues behind another on one group: "grads" for the gradient reducer's
        thread (comm.worker), "bn" for batch-norm statistics. Collective: every rank calls it for
        the same (pc, tag) in the same order; it creates the twin of every batch group of that
        grid."""
        g = self.grid(pc)
        mine = None
        for members in placed(batch_groups(g.pr, g.pc), self.placement, self.order):
            grp = new_group(
                members, self.timeout, f"hybridpar_{tag}", tag=tag, shm=shm and self.shm
            )
            if dist.get_rank() in members:
                mine = grp
        return mine

    def grad_group(self, pc: int) -> Group:
        """The gradient reducer's own twin of grid `pc`'s batch group (torch.distributed: the
        reducer's thread runs asynchronous collectives)."""
        return self.twin_group(pc, "grads")
