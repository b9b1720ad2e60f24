"""Which ranks form each group of a plan, and which hosts a group spans: one torch-free answer
for the runtime (comm.grid builds its process groups from these lists) and the cost model (it
prices a collective by the hosts its group spans and by how many groups share a host's link).

A grid Pr x Pc puts rank c * Pr + r at model position r of batch group c, so a model group is Pr
consecutive ranks and a batch group is the Pc ranks with the same r. Launchers number ranks host
by host (torchrun: node_rank * nproc_per_node + local_rank), so model groups of at most a host's
ranks stay within a host and batch groups cross hosts: the placement Krizhevsky and Gholami et
al. assume (the activation traffic on the fast links, the gradient sums over the network).

Placement. The lists above number *positions*: the position of a rank decides its place in every
grid and the examples it holds. A plan's `placement` (Pr, Pc) puts position c * Pr + r on rank
r * Pc + c instead: grid Pr x Pc's batch groups become consecutive ranks (within a host) and its
model groups stride across hosts, for plans whose gradient sums outweigh their activations.
None keeps position = rank. torch.distributed orders a group's members by rank, so a group
whose pieces are ordered (a model group's all-gather, a regroup's, a domain band's neighbours)
must hold its positions in increasing rank order; the transpose keeps that along both axes of its
own grid, not always for other grids of the plan (`why_not_placement`, the one rule the planner
and the runtime both apply). Batch groups only sum, in any order.

Hosts. The positions above assume ranks numbered host by host. A launcher may deal them otherwise
(SLURM's cyclic distribution deals rank k to node k mod H); the runtime then follows the hosts:
`host_order(names)` lists the ranks host by host, and a position's rank is that list's entry at
the rank the placement gives, so the groups sit on the hosts the plan was priced for. The same
order rule applies (`why_not_placement` with `order`): where following the hosts would put an
ordered group's positions out of rank order, the runtime keeps the ranks' own numbering and says
why.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "Span",
    "batch_groups",
    "check_placement",
    "host_order",
    "hosts_by_rank",
    "model_groups",
    "placed",
    "position_of",
    "rank_of",
    "regroup_groups",
    "span",
    "why_not_placement",
]


def model_groups(pr: int, pc: int) -> list[list[int]]:
    """The Pc model groups of grid Pr x Pc: Pr consecutive ranks each."""
    return [[c * pr + r for r in range(pr)] for c in range(pc)]


def batch_groups(pr: int, pc: int) -> list[list[int]]:
    """The Pr batch groups of grid Pr x Pc: the Pc ranks holding weight shard r each."""
    return [[c * pr + r for c in range(pc)] for r in range(pr)]


def regroup_groups(P: int, fine: int, coarse: int) -> list[list[int]]:
    """The groups that move an activation between layouts of `fine` and `coarse` batch groups
    (coarse dividing fine): the m = fine / coarse ranks whose fine batch groups make up one
    coarse batch group, at the same place within their model groups."""
    pr_f, pr_c, m = P // fine, P // coarse, fine // coarse
    return [[c * pr_c + j * pr_f + r for j in range(m)] for c in range(coarse) for r in range(pr_f)]


def rank_of(
    position: int, placement: tuple[int, int] | None, order: Sequence[int] | None = None
) -> int:
    """The rank at `position` under `placement`, on ranks listed host by host in `order`
    (`host_order`; None: the ranks are numbered host by host)."""
    if placement is not None:
        pr, pc = placement
        c, r = divmod(position, pr)
        position = r * pc + c
    return order[position] if order is not None else position


def position_of(
    rank: int, placement: tuple[int, int] | None, order: Sequence[int] | None = None
) -> int:
    """The position of `rank` under `placement` and `order` (rank_of's inverse)."""
    if order is not None:
        rank = list(order).index(rank)
    if placement is None:
        return rank
    pr, pc = placement
    r, c = divmod(rank, pc)
    return c * pr + r


def placed(
    groups: list[list[int]],
    placement: tuple[int, int] | None,
    order: Sequence[int] | None = None,
) -> list[list[int]]:
    """`groups` of positions as the ranks that hold them."""
    if placement is None and order is None:
        return groups
    return [[rank_of(k, placement, order) for k in g] for g in groups]


def host_order(names: Sequence[str]) -> list[int] | None:
    """The ranks host by host, given each rank's host in rank order: hosts in the order their
    first rank comes, a host's ranks in increasing order. None where the ranks are numbered so
    already (torchrun numbers them node by node)."""
    hosts = list(dict.fromkeys(names))
    order = [k for h in hosts for k, n in enumerate(names) if n == h]
    return None if order == list(range(len(names))) else order


def check_placement(placement: object, P: int) -> str:
    """Why `placement` cannot place P ranks ('' when it can)."""
    if placement is None:
        return ""
    ok = (
        isinstance(placement, tuple | list)
        and len(placement) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) and v > 1 for v in placement)
    )
    if not ok or placement[0] * placement[1] != P:  # type: ignore[index]
        return (
            f"placement {placement!r} must be a grid Pr x Pc with Pr, Pc > 1 and Pr * Pc = {P} "
            "(batch groups of that grid on consecutive ranks)"
        )
    return ""


def why_not_placement(
    placement: tuple[int, int] | None,
    grids: list[tuple[int, int]],
    order: Sequence[int] | None = None,
) -> str:
    """Why a plan whose layers use `grids` (Pr, Pc) cannot be placed by `placement` on ranks
    listed host by host in `order` ('' when it can): some model group, or some group moving an
    activation between two of its layouts, would not hold its positions in rank order."""
    if placement is None and order is None:
        return ""
    P = len(order) if order is not None else placement[0] * placement[1]  # type: ignore[index]
    groups = [g for pr, pc in sorted(set(grids)) for g in model_groups(pr, pc)]
    pcs = sorted({pc for _, pc in grids})
    for i, a in enumerate(pcs):
        for b in pcs[i + 1 :]:
            if b % a == 0:
                groups += regroup_groups(P, b, a)
    for g, ranks in zip(groups, placed(groups, placement, order), strict=True):
        if ranks != sorted(ranks):
            if order is not None:
                return (
                    f"following the hosts puts positions {g} on ranks {ranks}, out of order for "
                    "a group whose pieces are ordered; number the ranks host by host (torchrun "
                    "--nnodes/--node-rank, SLURM --distribution=block)"
                )
            return (
                f"placement {placement[0]}x{placement[1]} puts positions {g} on ranks {ranks}, "  # type: ignore[index]
                "out of order for a group whose pieces are ordered; plan without a placement "
                "or with grids that nest in it"
            )
    return ""


def hosts_by_rank(P: int, ranks_per_host: int) -> list[int]:
    """Host index of each of P ranks numbered host by host."""
    return [k // ranks_per_host for k in range(P)]


class Span:
    """How a kind of group (all of its groups run their collective at once) meets the hosts:
    `hosts`, the most hosts one group spans; `flows`, the most groups spanning several hosts
    that have a member on one host (they share its link); `per_host`, the most members one
    group has on one host."""

    __slots__ = ("flows", "hosts", "per_host")

    def __init__(self, hosts: int, flows: int, per_host: int) -> None:
        self.hosts, self.flows, self.per_host = hosts, flows, per_host

    def __repr__(self) -> str:
        return f"Span(hosts={self.hosts}, flows={self.flows}, per_host={self.per_host})"


def span(groups: Sequence[Sequence[int]], host: Sequence[int]) -> Span:
    """The Span of `groups` (lists of ranks) given each rank's host index."""
    most, per_host = 1, 1
    crossing: dict[int, int] = {}
    for g in groups:
        counts: dict[int, int] = {}
        for k in g:
            counts[host[k]] = counts.get(host[k], 0) + 1
        most = max(most, len(counts))
        per_host = max(per_host, max(counts.values(), default=1))
        if len(counts) > 1:
            for h in counts:
                crossing[h] = crossing.get(h, 0) + 1
    return Span(most, max(crossing.values(), default=0), per_host)
