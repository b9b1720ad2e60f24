"""Small all-reduces through host shared memory: batch-norm statistics and their gradients, the
training metrics, the adaptive-BN decision.

A gloo all-reduce of a few hundred bytes is all latency: a millisecond or more on CPU ranks,
more where ranks outnumber the cores. Global BN makes two of them per BN layer per step (38 for
resnet20), and the gradient buckets make the queue longer. Through shared memory a small sum is
a copy, a flag and a wait: each rank writes its tensor into its slot and raises its flag. When all
flags are up, every rank adds up all the slots in rank order, so every rank gets the same bits.
It is the host reducer's mechanism (comm.host): one segment per group, double-buffered by call
parity, waits that give the core away and time out naming the missing rank.

The same holds for the activations of model-parallel layers: the all-gathers of a layer's input
and output pieces and the all-reduces of dX (Gholami et al.'s 1.5D scheme, Krizhevsky's hand-off)
are hundreds of kilobytes, a few per layer and step, and gloo's latency dominates each. Through shared memory an all-gather is one copy in and one
concatenation out of the peers' slots.

A group gets one when it is built (comm.grid.new_group with shared memory asked for, where every
rank of the group is on this host: comm.group.Group.shm); `comm.collectives.all_reduce` and
`all_gather_uneven` on that group then take this path for synchronous CPU calls of up to
`MAX_BYTES` per rank; the segment grows (collectively: every rank makes the same call, so every
rank decides alike) to the largest call seen. Across hosts, for CUDA tensors, for async calls,
and for larger tensors (the gradient buckets: the host reducer's job) it stays on
torch.distributed.

Why this is safe: a rank writes its slot of parity q at call k only after it has seen every
rank's flag for call k - 1. So every rank has finished reading call k - 2, which used parity q.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from hybridpar.core.cluster import SHM_MAX_BYTES, SHM_MIN_BYTES
from hybridpar.runtime.comm.group import Group
from hybridpar.runtime.comm.host import HostReducer, sum_in_order

__all__ = ["SmallReducer", "shared_memory"]

CAPACITY = SHM_MIN_BYTES  # bytes per rank and call to start with
MAX_BYTES = SHM_MAX_BYTES  # per rank and call: larger tensors stay on torch.distributed


class SmallReducer(HostReducer):
    """All-reduce of small CPU tensors over a group whose ranks share this host."""

    def __init__(self, group: Group | dist.ProcessGroup, capacity: int = CAPACITY) -> None:
        super().__init__(group, make_leaders=False, stage_bytes=0)
        if self.topo.hosts != 1:
            raise ValueError("SmallReducer needs every rank of its group on this host")
        self._everyone = list(range(self.topo.local_size))
        self.calls = 0
        self._map(capacity)

    def _map(self, capacity: int) -> None:
        """A segment of `capacity` bytes per rank and parity (collective over the group)."""
        self.capacity = capacity
        seg = self._segment("small", capacity // 4)
        # each rank's slot as bytes, per parity, made once per segment
        self._bytes = [
            [seg.slot(q, i).view(torch.uint8) for i in range(self.topo.local_size)] for q in (0, 1)
        ]

    def _room(self, nbytes: int) -> None:
        """Grow the segment to hold `nbytes` per rank. Every rank of the group makes the same call
        with the same size, so all grow at the same call, together (the new segment's creation
        is collective); the old one is released once no view of it is left."""
        if nbytes > self.capacity:
            self._map(max(2 * self.capacity, 1 << (nbytes - 1).bit_length()))

    def close(self) -> None:
        self._bytes = []  # views of the segment go before it is unmapped
        super().close()

    def fits(self, t: torch.Tensor, nbytes: int | None = None) -> bool:
        """Whether a synchronous collective of t (`nbytes` per rank: t's own by default) takes
        this path."""
        nbytes = t.numel() * t.element_size() if nbytes is None else nbytes
        return t.device.type == "cpu" and nbytes <= MAX_BYTES

    def _post(self, flat: torch.Tensor, what: str, need: int) -> list[torch.Tensor]:
        """Write flat into this rank's slot, raise its flag, wait for every rank's; the slots of
        this call, as bytes (valid until this rank's call after next). `need`: the largest
        rank's bytes, the same number on every rank."""
        self._room(need)
        seg = self.segments["small"]
        step = self.steps["small"] = self.steps["small"] + 1
        parity, me = step % 2, self.topo.local_rank
        slots = self._bytes[parity]
        nbytes = flat.numel() * flat.element_size()
        slots[me][:nbytes].view(flat.dtype).copy_(flat)
        seg.flags[parity, me, 0] = step
        self._wait(seg, parity, 0, step, self._everyone, what, "small")
        self.calls += 1
        return slots

    def begin(self, pieces: list[torch.Tensor], need: int) -> tuple[int, int]:
        """The split-phase form of a call: write `pieces` one after the other into this rank's
        slot and raise its flag, without waiting; `finish` waits for every rank's. Every rank of
        the group calls both, with the same `need` (the largest rank's bytes), and nothing else
        on the group in between (a halo exchange computes its interior rows there)."""
        self._room(need)
        seg = self.segments["small"]
        step = self.steps["small"] = self.steps["small"] + 1
        parity, me = step % 2, self.topo.local_rank
        slot, off = self._bytes[parity][me], 0
        for t in pieces:
            n = t.numel() * t.element_size()
            slot[off : off + n].view(t.dtype).view(t.shape).copy_(t)
            off += n
        seg.flags[parity, me, 0] = step
        return step, parity

    def finish(self, posted: tuple[int, int], what: str) -> list[torch.Tensor]:
        """Wait for every rank's `begin`; their slots as bytes (valid until this rank's call after
        next)."""
        step, parity = posted
        self._wait(self.segments["small"], parity, 0, step, self._everyone, what, "small")
        self.calls += 1
        return self._bytes[parity]

    def small_all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` in place over the group. Every rank adds the slots in rank order, so every rank
        gets the same bits."""
        flat = t.reshape(-1) if t.is_contiguous() else t.contiguous().view(-1)
        nbytes = flat.numel() * flat.element_size()
        posted = self._post(flat, "join an all-reduce on", nbytes)
        sum_in_order(flat, [b[:nbytes].view(flat.dtype) for b in posted])
        if flat.data_ptr() != t.data_ptr():
            t.copy_(flat.view(t.shape))
        return t

    def all_gather(self, t: torch.Tensor, sizes: list[int], dim: int) -> torch.Tensor:
        """The pieces of every rank concatenated along `dim`; rank i's has sizes[i] along dim (the
        other dimensions as t's)."""
        t = t.contiguous()
        inner = math.prod(n for i, n in enumerate(t.shape) if i != dim % t.dim())
        slots = self._post(
            t.view(-1), "join an all-gather on", max(sizes) * inner * t.element_size()
        )
        return torch.cat(self.pieces(slots, t, sizes, dim), dim=dim)

    def pieces(self, slots: list[torch.Tensor], like: torch.Tensor, sizes: list[int], dim: int):
        """Each rank's piece of a posted all-gather, as views of its slot (valid until this
        rank's call after next): rank i's has sizes[i] along dim, the other dimensions as
        `like`'s."""
        inner = math.prod(n for i, n in enumerate(like.shape) if i != dim % like.dim())
        out = []
        for b, n in zip(slots, sizes, strict=True):
            shape = list(like.shape)
            shape[dim] = n
            out.append(b[: n * inner * like.element_size()].view(like.dtype).view(shape))
        return out

    def my_sum(self, slots: list[torch.Tensor], t: torch.Tensor, sizes: list[int], dim: int):
        """This rank's piece (sizes[me] along dim, from sum(sizes[:me])) of the sum of every
        rank's posted `t`-shaped tensor, added in rank order: the reduce-scatter's answer."""
        me = self.topo.local_rank
        nbytes = t.numel() * t.element_size()
        start = sum(sizes[:me])
        parts = [
            b[:nbytes].view(t.dtype).view(t.shape).narrow(dim, start, sizes[me]) for b in slots
        ]
        out = torch.empty_like(parts[0], memory_format=torch.contiguous_format)
        sum_in_order(out, parts)
        return out

    def reduce_scatter(self, t: torch.Tensor, sizes: list[int], dim: int) -> torch.Tensor:
        """Sum `t` over the group and keep this rank's piece along `dim` (rank i's has sizes[i]);
        every rank adds the slots in rank order, as small_all_reduce does."""
        t = t.contiguous()
        slots = self._post(t.view(-1), "join a reduce-scatter on", t.numel() * t.element_size())
        return self.my_sum(slots, t, sizes, dim)


def shared_memory(group: Group | dist.ProcessGroup) -> SmallReducer | None:
    """A shared-memory reducer for `group` (collective over it), or None where every rank of the
    group is not on this host, or the group has one rank."""
    if dist.get_world_size(group.pg if isinstance(group, Group) else group) == 1:
        return None
    try:
        return SmallReducer(group)
    except ValueError:  # several hosts: every rank of the group saw the same host names
        return None
