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

Stages (issue 12, item 4): a bucket is summed in stages of `stage_bytes` (1 MB by default;
RuntimeOptions.host_stage_mb sets it, 0 means one stage), each with its own arrival and done flags. A
rank raises a stage's arrival flag as soon as that stage of its slot is written, and the ranks sum
stage c while stage c + 1 is still being written: the gradient synchroniser packs a bucket
straight into the slot on the autograd thread (`start`) while the reducer's thread sums. What that
saves in training is the last bucket's sum after its pack (docs/host-reducer.md, measured). A
tensor the reducer copies in (DDP's hook) is summed as one stage: staged, it was slower.

Robustness: every wait has the group's collective timeout (the one it was built with) and names
the rank that did not arrive. A segment is a file in /dev/shm that is unlinked as soon as every rank of the
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

from hybridpar.core import faults
from hybridpar.core.terms import Term
from hybridpar.runtime.comm.codecs import Codec
from hybridpar.runtime.comm.collectives import Via, compressed_all_reduce
from hybridpar.runtime.comm.group import Group, group_timeout, pg_of
from hybridpar.runtime.comm.ledger import Ledger
from hybridpar.runtime.comm.worker import CommWorker

__all__ = [
    "HostReducer",
    "HostState",
    "StagedReduce",
    "discover",
    "host_name",
    "host_names",
    "leader_groups",
]

_FLAGS = 4  # per rank, parity and stage: arrived, done, final (+1 spare, keeps 32-byte rows)
ARRIVED, DONE, FINAL = 0, 1, 2
STAGE_BYTES = 1 << 20  # a bucket's stage unless the caller says otherwise


# How long a wait yields the core (sched_yield) before it sleeps. Timer slack makes a Python sleep
# last 60 us or more, and ranks in lockstep (global BN's small all-reduces) typically wait tens of
# microseconds, so waking from a sleep would cost more than the wait itself.
_YIELD_S = 500e-6


def sum_in_order(out: torch.Tensor, parts: list[torch.Tensor]) -> None:
    """out = parts[0] + parts[1] + ..., added in that (rank) order, so that every rank that sums
    the same parts gets the same bits."""
    if len(parts) == 1:
        out.copy_(parts[0])
        return
    torch.add(parts[0], parts[1], out=out)
    for part in parts[2:]:
        out.add_(part)


class _Segment:
    """One bucket's shared memory: 2 parities x (P slots + 1 sum) x n values of `dtype` (the
    gradients': a float64 model sums in float64), then the flags: 2 parities x P ranks x
    (stages x _FLAGS); stage c covers values bounds[c]:bounds[c + 1]."""

    def __init__(
        self,
        path: str,
        local: int,
        nlocal: int,
        n: int,
        create: bool,
        stages: int = 1,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.n, self.nlocal, self.stages, self.dtype = n, nlocal, stages, dtype
        self.bounds = [n * c // stages for c in range(stages + 1)]
        data = 2 * (nlocal + 1) * n * dtype.itemsize
        self.flag_off = (data + 63) // 64 * 64
        size = self.flag_off + 2 * nlocal * stages * _FLAGS * 8
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self.mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        whole = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.floats = whole[:data].view(dtype).view(2, nlocal + 1, n)
        # flags through numpy: polling one is a plain memory read, ~20x cheaper than indexing a
        # tensor (the small all-reduces poll them in a loop)
        self.flags = np.frombuffer(
            self.mm, dtype=np.int64, count=2 * nlocal * stages * _FLAGS, offset=self.flag_off
        ).reshape(2, nlocal, stages * _FLAGS)

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


def host_name(host: str | None = None) -> str:
    """This rank's host: `host`, else HYBRIDPAR_HOST (tests and emulated clusters name hosts so:
    one name, or a comma-separated name per rank, `h0,h0,h1,h1`, for ranks one launcher starts),
    else the machine's name."""
    given = host or os.environ.get("HYBRIDPAR_HOST")
    if not given:
        return socket.gethostname()
    names = given.split(",")
    return names[dist.get_rank() % len(names)] if len(names) > 1 else given


def host_names(host: str | None = None) -> list[str]:
    """Every rank's host (`host_name`), in rank order. Collective over the whole world."""
    names: list = [None] * dist.get_world_size()
    dist.all_gather_object(names, host_name(host))
    return [str(n) for n in names]


def discover(
    group: Group | dist.ProcessGroup | None = None,
    host: str | None = None,
    make_leaders: bool = True,
    leaders: dist.ProcessGroup | None = None,
) -> _Topology:
    """Which ranks of `group` share this host (by host name: `host_name`). Collective: every rank
    of the group calls it. With several hosts it needs the group of one rank per host: `leaders`
    where the caller made it (`leader_groups`, for groups that are not the whole world), else,
    with `make_leaders`, it creates it here, which every rank of the default group must join
    (new_group's rule): only for `group` = the whole world."""
    pg = pg_of(group)
    me = dist.get_rank()
    name = host_name(host)
    names: list[object] = [None] * dist.get_world_size(pg)
    dist.all_gather_object(names, (name, me), group=pg)
    hosts = sorted({n for n, _ in names})
    mine = [r for n, r in names if n == name]
    leaders_ranks = [min(r for n, r in names if n == h) for h in hosts]
    if leaders is None and len(hosts) > 1 and make_leaders:  # every rank, in the same order
        leaders = dist.new_group(leaders_ranks, timeout=group_timeout(group))
    if len(hosts) == 1:
        leaders = None
    return _Topology(mine.index(me), len(mine), mine, me == mine[0], leaders, len(hosts))


def leader_groups(
    members: list[list[int]], timeout, host: str | None = None
) -> dict[tuple[int, ...], dist.ProcessGroup | None]:
    """For each group of `members` (global ranks), the group of its first rank on every host it
    spans (None where it spans one host). Collective over the whole world: every rank makes every
    leaders' group, in the order given, as torch.distributed.new_group requires, so sibling groups
    (the batch groups of a grid with Pr > 1, each its own host reducer) get theirs without a
    rank ever waiting on a group it is not in."""
    names = host_names(host)
    out: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
    for ranks in members:
        key = tuple(ranks)
        if key in out:
            continue
        hosts = sorted({names[r] for r in ranks})
        leaders = [min(r for r in ranks if names[r] == h) for h in hosts]
        out[key] = dist.new_group(leaders, timeout=timeout) if len(hosts) > 1 else None
    return out


class StagedReduce:
    """An all-reduce started before its input is written (`HostReducer.start`).

    Write the input into `buffer` (this rank's slot) from the front and call `deliver(upto)` once
    its first `upto` floats are there: each stage that is complete is announced to the other
    ranks, and the reducer's thread sums it while the rest is written. `stage` is a stage's length
    in floats, the piece a writer should deliver at a time. `future` completes with the sum, a view
    of shared memory valid until this rank's all-reduce of the same key after next. Every stage
    must be delivered (`deliver(n)` at the end), or the ranks wait for it until the timeout."""

    def __init__(self, seg: _Segment, parity: int, me: int, step: int) -> None:
        self.buffer = seg.slot(parity, me)
        self.stage = max(1, seg.bounds[1] - seg.bounds[0])
        self.future: torch.futures.Future | None = None
        self._flags = seg.flags[parity, me]
        self._bounds = seg.bounds
        self._step = step
        self._next = 0  # the first stage not delivered yet

    def deliver(self, upto: int) -> None:
        stages = len(self._bounds) - 1
        while self._next < stages and self._bounds[self._next + 1] <= upto:
            self._flags[self._next * _FLAGS + ARRIVED] = self._step
            self._next += 1


class HostReducer:
    """Sums tensors over the ranks of `group` through host shared memory (one segment per key).

    Create it on every rank of the group (collective). `all_reduce(t, key)` sums t in place; `key`
    names the bucket (a segment is made for each key on first use, also collectively).
    `stage_bytes`: the size of a bucket's stages (module docstring; 0 sums a bucket in one stage).
    Every wait times out after the group's collective timeout."""

    def __init__(
        self,
        group: Group | dist.ProcessGroup | None = None,
        ledger: Ledger | None = None,
        host: str | None = None,
        make_leaders: bool = True,
        stage_bytes: int = STAGE_BYTES,
        leaders: dist.ProcessGroup | None = None,
        codec: Codec | None = None,
    ) -> None:
        self.codec = codec if codec is not None and codec.name != "none" else None
        """the leaders' step across hosts, encoded (Dettmers over the network, Sekiyama within
        the host: the shared-memory sums keep the gradients' dtype)"""
        self.group = pg_of(group)
        self.timeout_s = group_timeout(group).total_seconds()
        self.ledger = ledger
        self.stage_bytes = stage_bytes
        self.topo = discover(group, host, make_leaders, leaders)
        # the launcher's job first (it removes what a stopped rank left): HYBRIDPAR_JOB
        job = os.environ.get("HYBRIDPAR_JOB")
        mine = f"{job}-{secrets.token_hex(6)}" if job else secrets.token_hex(6)
        token = [mine if dist.get_rank(self.group) == 0 else None]
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
        seg, step = self._next_step(key, t.numel(), t.dtype)
        return self._worker.submit(lambda: self._reduce(t, seg, key, step, term, layers, False))

    def start(
        self,
        key: object,
        n: int,
        term: str = Term.DW_ALLREDUCE,
        layers: dict[str, float] | None = None,
    ) -> StagedReduce:
        """An all-reduce of n floats on the worker thread that sums each stage of this rank's slot
        as soon as every rank has delivered it: the caller writes the slot and delivers as it
        goes (StagedReduce). Collective like `all_reduce_async`, in the same order. Start a key's
        next all-reduce only once its previous one has completed (its future is done), as the
        gradient synchroniser does: the slot is double-buffered, not queued."""
        seg, step = self._next_step(key, n)
        run = StagedReduce(seg, step % 2, self.topo.local_rank, step)
        buf = run.buffer
        run.future = self._worker.submit(
            lambda: self._reduce(buf, seg, key, step, term, layers, True)
        )
        return run

    def slot(self, key: object, n: int) -> torch.Tensor:
        """This rank's slot for the next all-reduce of `key` (n floats; made on first use, which
        is collective). Write the tensor there and pass the slot to `all_reduce`: the copy into
        shared memory is skipped, and the result comes back as a view of the shared sum, which
        stays valid until this rank's next all-reduce of `key` but one."""
        seg = self._segment(key, n)
        return seg.slot((self.steps[key] + 1) % 2, self.topo.local_rank)

    def _next_step(
        self, key: object, n: int, dtype: torch.dtype = torch.float32
    ) -> tuple[_Segment, int]:
        """The segment and number of the next all-reduce of `key`, counted on the caller's
        thread (the order every rank shares), so that `slot` and `start` agree with the worker."""
        seg = self._segment(key, n, dtype)
        step = self.steps[key] = self.steps[key] + 1
        return seg, step

    def _segment(self, key: object, n: int, dtype: torch.dtype = torch.float32) -> _Segment:
        seg = self.segments.get(key)
        if seg is not None and seg.n == n and seg.dtype == dtype:
            return seg
        t = self.topo
        path = f"/dev/shm/hybridpar-{self.token}-{t.local_ranks[0]}-{len(self.segments)}-{n}"
        size = n * dtype.itemsize
        stages = max(1, min(n, -(-size // self.stage_bytes))) if self.stage_bytes else 1
        if t.leader:
            seg = _Segment(path, t.local_rank, t.local_size, n, True, stages, dtype)
        dist.barrier(group=self.group)  # created before anyone opens it
        if not t.leader:
            seg = _Segment(path, t.local_rank, t.local_size, n, False, stages, dtype)
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
                start, limit = now, self.timeout_s
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
        seg, step = self._next_step(key, t.numel(), t.dtype)
        return self._reduce(t, seg, key, step, term, layers, False)

    def _reduce(
        self,
        t: torch.Tensor,
        seg: _Segment,
        key: object,
        step: int,
        term: str,
        layers: dict[str, float] | None,
        delivered: bool,
    ) -> torch.Tensor:
        """All-reduce number `step` of `key`. `delivered`: the caller raises the arrival flags
        stage by stage as it writes the slot (`start`), and each stage is summed as soon as every
        rank has delivered it. Otherwise the whole tensor is in the slot (copied in here, or
        written there before: `slot`) and is summed as one stage: a tensor copied in and out stage
        by stage, with a wait per stage, is slower than one copy and one sum
        (docs/host-reducer.md)."""
        faults.at("host")
        flat = t.view(-1)
        topo = self.topo
        parity, me, L = step % 2, topo.local_rank, topo.local_size
        everyone = list(range(L))
        flags = seg.flags[parity, me]
        t0 = time.perf_counter()
        mine = seg.slot(parity, me)
        in_slot = flat.data_ptr() == mine.data_ptr()  # written there already (`slot`, `start`)
        if not in_slot:
            _to_host(flat, mine)
        if delivered:
            parts = [(c, seg.bounds[c], seg.bounds[c + 1]) for c in range(seg.stages)]
        else:  # one part; the flags go up in stage order, so the last stage's stands for all
            flags[ARRIVED::_FLAGS] = step
            parts = [(seg.stages - 1, 0, seg.n)]
        total, slots = seg.total(parity), seg.floats[parity]
        for c, a, b in parts:
            self._wait(seg, parity, c * _FLAGS + ARRIVED, step, everyone, "deliver", key)
            lo, hi = a + (b - a) * me // L, a + (b - a) * (me + 1) // L  # Algorithm 7's slice
            sum_in_order(total[lo:hi], list(slots[:L, lo:hi]))
            if delivered:
                flags[c * _FLAGS + DONE] = step  # my slice of stage c is summed
            else:
                flags[DONE::_FLAGS] = step
        hosts = topo.leaders is not None
        for c, _, _ in parts:
            self._wait(seg, parity, c * _FLAGS + DONE, step, everyone, "sum its slice of", key)
        if hosts:  # hierarchical: the host sums meet over the network
            self._across_hosts(seg, parity, total, (key, step, term, layers))
        if not in_slot:
            _from_host(total, flat)
        self.wait_s += time.perf_counter() - t0
        if self.ledger is not None:
            self.ledger.record("host_reduce", 1, 0.0, time.perf_counter() - t0, term, layers)
            if hosts and topo.leader and self.codec is None:
                nbytes = seg.n * seg.dtype.itemsize
                self.ledger.record("all_reduce", topo.hosts, nbytes, 0.0, term, layers)
        return total.view(t.shape) if in_slot else t

    def _across_hosts(self, seg: _Segment, parity: int, total, call: tuple) -> None:
        """The host's sum in `total` summed over the hosts: the leader all-reduces it over the
        leaders' group (encoded with a codec), the others wait for it. `call`: (key, step, term,
        layers) of the reduction."""
        key, step, term, layers = call
        topo = self.topo
        if not topo.leader:
            self._wait(seg, parity, FINAL, step, [0], "share the all-host sum of", key)
            return
        if self.codec is not None:  # books its payload and overhead itself
            compressed_all_reduce(total, Via(topo.leaders, self.ledger, term, layers, self.codec))
        else:
            dist.all_reduce(total, group=topo.leaders)
        seg.flags[parity, topo.local_rank][FINAL] = step

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

    def start_bucket(
        self, index: int, numel: int, device: torch.device, dtype: torch.dtype
    ) -> StagedReduce | None:
        """For hybridpar's gradient synchroniser: the all-reduce of bucket `index`, started before
        the bucket is packed. The bucket is packed straight into this rank's slot in shared memory
        (CPU float32), so it is never copied in or out, and its stages are summed as the pack
        delivers them. None: pack it in its own buffer and call `host_hook`."""
        r = self.reducer
        if not self.zero_copy or device.type != "cpu" or dtype != torch.float32:
            return None
        if r.topo.local_size == 1:
            return None
        run = r.start(index, numel, self.term, self.bucket_layers.get(index))
        run.future = self.averaged(run.future)
        return run

    def averaged(self, fut: torch.futures.Future) -> torch.futures.Future:
        """The sum as DDP expects it: divided by the ranks when `average`. A result in shared
        memory (zero-copy) is every rank's, so a copy is divided, never the sum itself."""
        if not self.average:
            return fut
        p = dist.get_world_size(self.reducer.group)
        return fut.then(lambda f: f.value() / p)
