"""The host reducer (Sekiyama et al., Algorithms 5-7): gradients summed in host shared memory.

The ranks on one host share one memory segment per bucket. Each rank copies its bucket into its
own slot and raises its arrival flag; once every slot has arrived, rank i sums slice i of all
slots (Algorithm 7's parallel loop, split over the ranks instead of threads) into the shared sum
and raises its done flag; when all slices are done every rank reads the whole sum. Buffers and
flags are double-buffered by step parity, so a rank that runs ahead into the next step cannot
overwrite what a slower one is still reading.

Several hosts (discovered from the host names, not configured): after the intra-host sum, one rank
per host (the leader) all-reduces the host sums over torch.distributed, writes the result back
into the segment and raises a final flag that the other ranks of its host wait for.

Robustness: every wait has the job's collective timeout (HYBRIDPAR_TIMEOUT_S) and names the rank
that did not arrive. A segment is a file in /dev/shm that is unlinked as soon as every rank of the
host has mapped it, so nothing is left behind even when a rank is killed.

Ordering relies on the processor keeping stores in order (x86-64's TSO): the data is written
before the flag that announces it. On CUDA, a bucket is copied to pinned host memory on a side
stream and the sum back on another (Algorithm 6); that path needs a GPU to test.
"""

from __future__ import annotations

import mmap
import os
import secrets
import socket
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from hybridpar import faults
from hybridpar.comm.ledger import Ledger
from hybridpar.comm.worker import CommWorker
from hybridpar.plan import Term

__all__ = ["HostReducer", "HostState", "discover"]

_FLAGS = 4  # per rank and parity: arrived, done, final (+1 spare, keeps 32-byte rows)


# How long a wait yields the core (sched_yield) before it sleeps. Timer slack makes a Python sleep
# last 60 us or more, and ranks in lockstep (global BN's small all-reduces) typically wait tens of
# microseconds, so waking from a sleep would cost more than the wait itself.
_YIELD_S = 500e-6


def _timeout() -> float:
    return float(os.environ.get("HYBRIDPAR_TIMEOUT_S", "300"))


class _Segment:
    """One bucket's shared memory: 2 parities x (P slots + 1 sum) x n floats, then the flags."""

    def __init__(self, path: str, local: int, nlocal: int, n: int, create: bool) -> None:
        self.n, self.nlocal = n, nlocal
        data = 2 * (nlocal + 1) * n * 4
        self.flag_off = (data + 63) // 64 * 64
        size = self.flag_off + 2 * nlocal * _FLAGS * 8
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self.mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        whole = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.floats = whole[:data].view(torch.float32).view(2, nlocal + 1, n)
        # flags through numpy: polling one is a plain memory read, ~20x cheaper than indexing a
        # tensor (the small all-reduces poll them in a loop)
        self.flags = np.frombuffer(
            self.mm, dtype=np.int64, count=2 * nlocal * _FLAGS, offset=self.flag_off
        ).reshape(2, nlocal, _FLAGS)

    def slot(self, parity: int, i: int) -> torch.Tensor:
        return self.floats[parity, i]

    def total(self, parity: int) -> torch.Tensor:
        return self.floats[parity, self.nlocal]


@dataclass
class _Topology:
    local_rank: int
    local_size: int
    local_ranks: list[int]  # global ranks on this host, in order
    leader: bool
    leaders: dist.ProcessGroup | None  # one rank per host; None on a single host
    hosts: int


def discover(
    group: dist.ProcessGroup | None = None, host: str | None = None, make_leaders: bool = True
) -> _Topology:
    """Which ranks of `group` share this host (by host name; `host` overrides it, for tests that
    emulate several hosts on one machine). Collective: every rank of the group calls it. With
    several hosts and `make_leaders`, it also creates the group of one rank per host, which every rank
    of the default group must join (new_group's rule): only for `group` = the whole world."""
    group = group or dist.group.WORLD
    me = dist.get_rank()
    name = host or os.environ.get("HYBRIDPAR_HOST") or socket.gethostname()
    names: list[object] = [None] * dist.get_world_size(group)
    dist.all_gather_object(names, (name, me), group=group)
    hosts = sorted({n for n, _ in names})
    mine = [r for n, r in names if n == name]
    leaders_ranks = [min(r for n, r in names if n == h) for h in hosts]
    leaders = None
    if len(hosts) > 1 and make_leaders:  # every rank creates the group, in the same order
        import datetime

        leaders = dist.new_group(leaders_ranks, timeout=datetime.timedelta(seconds=_timeout()))
    return _Topology(mine.index(me), len(mine), mine, me == mine[0], leaders, len(hosts))


class HostReducer:
    """Sums tensors over the ranks of `group` through host shared memory (one segment per key).

    Create it on every rank of the group (collective). `all_reduce(t, key)` sums t in place; `key`
    names the bucket (a segment is made for each key on first use, also collectively)."""

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        ledger: Ledger | None = None,
        host: str | None = None,
        make_leaders: bool = True,
    ) -> None:
        self.group = group or dist.group.WORLD
        self.ledger = ledger
        self.topo = discover(self.group, host, make_leaders)
        token = [secrets.token_hex(6) if dist.get_rank(self.group) == 0 else None]
        dist.broadcast_object_list(token, group_src=0, group=self.group)
        self.token = token[0]
        self.segments: dict[object, _Segment] = {}
        self.steps: dict[object, int] = {}
        self.wait_s = 0.0
        self._worker = CommWorker("hybridpar-host")  # started on first use

    def all_reduce_async(
        self,
        t: torch.Tensor,
        key: object = 0,
        term: str = Term.DW_ALLREDUCE,
        layers: dict[str, float] | None = None,
    ) -> torch.futures.Future:
        """`all_reduce` on this reducer's worker thread, so that the summing overlaps whatever the
        caller does next (the rest of the backward pass). Buckets are reduced in the order they
        are submitted, which is the same on every rank. The segment of a new key is made here,
        on the caller's thread, because making it is collective."""
        seg = self.segments.get(key)
        if seg is None or seg.n != t.numel():
            self._segment(key, t.numel())
        return self._worker.submit(lambda: self.all_reduce(t, key, term, layers))

    def slot(self, key: object, n: int) -> torch.Tensor:
        """This rank's slot for the next all-reduce of `key` (n floats; made on first use, which
        is collective). Write the tensor there and pass the slot to `all_reduce`: the copy into
        shared memory is skipped, and the result comes back as a view of the shared sum, which
        stays valid until this rank's next all-reduce of `key` but one."""
        seg = self._segment(key, n)
        return seg.slot((self.steps[key] + 1) % 2, self.topo.local_rank)

    def _segment(self, key: object, n: int) -> _Segment:
        seg = self.segments.get(key)
        if seg is not None and seg.n == n:
            return seg
        t = self.topo
        path = f"/dev/shm/hybridpar-{self.token}-{t.local_ranks[0]}-{len(self.segments)}-{n}"
        if t.leader:
            seg = _Segment(path, t.local_rank, t.local_size, n, create=True)
        dist.barrier(group=self.group)  # created before anyone opens it
        if not t.leader:
            seg = _Segment(path, t.local_rank, t.local_size, n, create=False)
        dist.barrier(group=self.group)  # everyone has it mapped: the name can go
        if t.leader:
            os.unlink(path)
        self.segments[key] = seg
        self.steps[key] = 0
        return seg

    def _wait(
        self,
        seg: _Segment,
        parity: int,
        col: int,
        step: int,
        who: list[int],
        what: str,
        key: object,
    ) -> None:
        flags = seg.flags[parity, :, col]
        start = limit = 0.0
        while True:
            if all(flags[i] >= step for i in who):
                return
            now = time.monotonic()
            if not start:
                start, limit = now, _timeout()
            waited = now - start
            if waited < _YIELD_S:
                # sched_yield: a runnable peer on this core (an oversubscribed machine) gets the
                # core at once; otherwise the wait ends within a microsecond of the flag
                os.sched_yield()
            else:  # a long wait (a slow peer, a large bucket): give the core away
                time.sleep(20e-6 if waited < 0.05 else 1e-3)
            if waited > limit:
                missing = [i for i in who if flags[i] < step]
                ranks = [self.topo.local_ranks[i] for i in missing]
                raise RuntimeError(
                    f"host reducer timed out: rank(s) {ranks} did not {what} bucket {key!r} "
                    f"within {limit:g} s (dead or hung?)"
                )

    def all_reduce(
        self,
        t: torch.Tensor,
        key: object = 0,
        term: str = Term.DW_ALLREDUCE,
        layers: dict[str, float] | None = None,
    ) -> torch.Tensor:
        faults.at("host")
        flat = t.view(-1)
        n = flat.numel()
        seg = self._segment(key, n)
        topo = self.topo
        step = self.steps[key] = self.steps[key] + 1
        parity, me, L = step % 2, topo.local_rank, topo.local_size
        everyone = list(range(L))
        t0 = time.perf_counter()
        mine = seg.slot(parity, me)
        in_slot = flat.data_ptr() == mine.data_ptr()  # written there already (`slot`)
        if not in_slot:
            _to_host(flat, mine)
        seg.flags[parity, me, 0] = step  # arrived
        self._wait(seg, parity, 0, step, everyone, "deliver", key)
        lo, hi = n * me // L, n * (me + 1) // L  # Algorithm 7: each rank sums its slice
        out = seg.total(parity)[lo:hi]
        torch.add(
            seg.floats[parity, 0, lo:hi], seg.floats[parity, 1, lo:hi], out=out
        ) if L > 1 else out.copy_(seg.floats[parity, 0, lo:hi])
        for i in range(2, L):
            out.add_(seg.floats[parity, i, lo:hi])
        seg.flags[parity, me, 1] = step  # my slice is summed
        self._wait(seg, parity, 1, step, everyone, "sum its slice of", key)
        total = seg.total(parity)
        if topo.leaders is not None:  # hierarchical: the host sums meet over the network
            if topo.leader:
                dist.all_reduce(total, group=topo.leaders)
                seg.flags[parity, me, 2] = step
            else:
                self._wait(seg, parity, 2, step, [0], "share the all-host sum of", key)
        if not in_slot:
            _from_host(total, flat)
        self.wait_s += time.perf_counter() - t0
        if self.ledger is not None:
            self.ledger.record("host_reduce", 1, 0.0, time.perf_counter() - t0, term, layers)
            if topo.leaders is not None and topo.leader:
                self.ledger.record("all_reduce", topo.hosts, n * 4, 0.0, term, layers)
        return total.view(t.shape) if in_slot else t

    def close(self) -> None:
        self._worker.close()
        for seg in self.segments.values():
            seg.floats = seg.flags = None
            seg.mm.close()
        self.segments.clear()


_streams: dict[str, tuple] = {}


def _to_host(src: torch.Tensor, dst: torch.Tensor) -> None:
    """Device -> host slot; on CUDA through pinned memory on a side stream (Algorithm 6)."""
    if src.device.type == "cpu":
        dst.copy_(src)
        return
    d2h, _ = _cuda_streams(src.device)
    pinned = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
    d2h.wait_stream(torch.cuda.current_stream(src.device))
    with torch.cuda.stream(d2h):
        pinned.copy_(src, non_blocking=True)
    d2h.synchronize()
    dst.copy_(pinned)


def _from_host(src: torch.Tensor, dst: torch.Tensor) -> None:
    if dst.device.type == "cpu":
        dst.copy_(src)
        return
    _, h2d = _cuda_streams(dst.device)
    pinned = src.pin_memory()
    with torch.cuda.stream(h2d):
        dst.copy_(pinned, non_blocking=True)
    torch.cuda.current_stream(dst.device).wait_stream(h2d)


def _cuda_streams(device: torch.device) -> tuple:
    key = str(device)
    if key not in _streams:
        _streams[key] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
    return _streams[key]


@dataclass
class HostState:
    """State of `host_hook`: the reducer (create it on every rank after init_process_group) and
    whether to average, as DDP expects."""

    reducer: HostReducer
    average: bool = True
    ledger: Ledger | None = None
    term: str = Term.DW_ALLREDUCE
    bucket_layers: dict[int, dict[str, float]] = field(default_factory=dict)
    zero_copy: bool = True

    def buffer_for(self, index: int, numel: int, device: torch.device) -> torch.Tensor | None:
        """Where hybridpar's gradient synchroniser should pack bucket `index`: this rank's slot in
        shared memory (CPU float32), so the bucket is never copied in or out; None: its own."""
        if not self.zero_copy or device.type != "cpu" or self.reducer.topo.local_size == 1:
            return None
        return self.reducer.slot(index, numel)
