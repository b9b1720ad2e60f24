"""Small all-reduces through host shared memory: batch-norm statistics and their gradients, the
training metrics, the adaptive-BN decision.

A gloo all-reduce of a few hundred bytes costs 0.5-1.2 ms on 2 ranks of this machine and about
5 ms on 4, all of it latency. Global BN makes two of them per BN layer per step (38 for
resnet20), and the gradient buckets make the queue longer. Through shared memory a small sum is
a copy, a flag and a wait: each rank writes its tensor into its slot and raises its flag. When all
flags are up, every rank adds up all the slots in rank order, so every rank gets the same bits.
It is the host reducer's mechanism (comm.host): one segment per group, double-buffered by call
parity, waits that give the core away and time out naming the missing rank.

`enable(group)` (collective over the group) sets it up where every rank of the group is on this
host. After that, `comm.collectives.all_reduce` on that group takes this path for CPU tensors of
up to `capacity` bytes when called synchronously. Across hosts, or for CUDA tensors, it stays on
torch.distributed.

Why this is safe: a rank writes its slot of parity q at call k only after it has seen every
rank's flag for call k - 1. So every rank has finished reading call k - 2, which used parity q.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from hybridpar.comm.host import HostReducer

__all__ = ["SmallReducer", "enable", "reducer_for"]

CAPACITY = 1 << 16  # bytes per rank and call: 8192 float64 (BN of 4096 channels)
_REDUCERS: dict[int, tuple[dist.ProcessGroup, SmallReducer]] = {}


class SmallReducer(HostReducer):
    """All-reduce of small CPU tensors over a group whose ranks share this host."""

    def __init__(self, group: dist.ProcessGroup, capacity: int = CAPACITY) -> None:
        super().__init__(group, make_leaders=False)
        if self.topo.hosts != 1:
            raise ValueError("SmallReducer needs every rank of its group on this host")
        self.capacity = capacity
        seg = self._segment("small", capacity // 4)
        # each rank's slot as bytes, per parity, made once
        self._bytes = [
            [seg.slot(q, i).view(torch.uint8) for i in range(self.topo.local_size)] for q in (0, 1)
        ]
        self._everyone = list(range(self.topo.local_size))
        self.calls = 0

    def close(self) -> None:
        self._bytes = []  # views of the segment go before it is unmapped
        super().close()

    def fits(self, t: torch.Tensor) -> bool:
        return (
            t.device.type == "cpu"
            and t.is_contiguous()
            and t.numel() * t.element_size() <= self.capacity
        )

    def small_all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` in place over the group (same bits on every rank)."""
        seg = self.segments["small"]
        step = self.steps["small"] = self.steps["small"] + 1
        parity, me, L = step % 2, self.topo.local_rank, self.topo.local_size
        flat = t.view(-1)
        nbytes = flat.numel() * flat.element_size()
        slots = [b[:nbytes].view(flat.dtype) for b in self._bytes[parity]]
        slots[me].copy_(flat)
        seg.flags[parity, me, 0] = step
        self._wait(seg, parity, 0, step, self._everyone, "join a small all-reduce on", "small")
        torch.sum(torch.stack(slots), 0, out=flat) if L > 2 else torch.add(*slots, out=flat)
        self.calls += 1
        return t


def enable(group: dist.ProcessGroup | None = None) -> SmallReducer | None:
    """Route the group's small synchronous CPU all-reduces through shared memory when all its ranks
    share this host (collective over the group; idempotent). Returns the reducer, or None where
    it does not apply (one rank, several hosts, HYBRIDPAR_SMALL_SHM=0)."""
    group = group or dist.group.WORLD
    if id(group) in _REDUCERS:
        return _REDUCERS[id(group)][1]
    if dist.get_world_size(group) == 1 or os.environ.get("HYBRIDPAR_SMALL_SHM", "1") == "0":
        return None
    try:
        r = SmallReducer(group)
    except ValueError:  # several hosts: every rank of the group saw the same host names
        return None
    _REDUCERS[id(group)] = (group, r)  # the tuple keeps `group` alive, so its id is not reused
    return r


def reducer_for(group: dist.ProcessGroup) -> SmallReducer | None:
    hit = _REDUCERS.get(id(group))
    return hit[1] if hit is not None and hit[0] is group else None


def disable_all() -> None:
    """Drop every small reducer (comm.shutdown calls it with the process group's end)."""
    for _, r in _REDUCERS.values():
        r.close()
    _REDUCERS.clear()
