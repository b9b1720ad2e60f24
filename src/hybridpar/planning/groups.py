"""Which ranks form each group of a plan, and which hosts a group spans: one torch-free answer
for the runtime (comm.grid builds its process groups from these lists) and the cost model (it
prices a collective by the hosts its group spans and by how many groups share a host's link).

A grid Pr x Pc puts rank c * Pr + r at model position r of batch group c, so a model group is Pr
consecutive ranks and a batch group is the Pc ranks with the same r. Launchers number ranks host
by host (torchrun: node_rank * nproc_per_node + local_rank), so model groups of at most a host's
ranks stay within a host and batch groups cross hosts: the placement Krizhevsky and Gholami et
al. assume (the activation traffic on the fast links, the gradient sums over the network).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "Span",
    "batch_groups",
    "hosts_by_rank",
    "model_groups",
    "regroup_groups",
    "span",
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
