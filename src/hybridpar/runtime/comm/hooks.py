"""Reducers as DDP communication hooks: `hook(state, bucket) -> Future[Tensor]`.

The same functions serve torch's DistributedDataParallel (`ddp.register_comm_hook(state, hook)`,
where `bucket` is a torch GradBucket) and hybridpar's own gradient synchroniser (where `bucket` is
a `hybridpar.runtime.parallel.sync.Bucket` with the same `buffer()`, `index()`, `is_last()` and
`parameters()`). Either way the collective goes through `hybridpar.runtime.comm` and the ledger sees it.
"""

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hybridpar.core.terms import Term
from hybridpar.runtime.comm.codecs import Codec, get_codec
from hybridpar.runtime.comm.collectives import (
    CompressedPipeline,
    Via,
    all_reduce,
    compressed_all_reduce,
)
from hybridpar.runtime.comm.group import Group, group_size
from hybridpar.runtime.comm.host import HostReducer, HostState
from hybridpar.runtime.comm.ledger import Ledger
from hybridpar.runtime.comm.worker import CommWorker

__all__ = [
    "PIECE_STRIDE",
    "HostReducer",
    "HostState",
    "ReducerState",
    "allreduce_hook",
    "compressed_hook",
    "dynamic8",
    "host_hook",
    "linear8",
    "piece_key",
]


@dataclass
class ReducerState:
    """What a hook needs: the group, whether to average (DDP expects the mean; hybridpar's loss is
    already scaled by 1/B, so it sums), the ledger, and for each bucket the layers it carries."""

    group: Group | dist.ProcessGroup | None = None
    average: bool = True
    ledger: Ledger | None = None
    term: str = Term.DW_ALLREDUCE
    bucket_layers: dict[int, dict[str, float]] = field(default_factory=dict)
    codec: Codec | None = None
    """compressed_hook's codec (None: dynamic-tree, 4096-element blocks)"""
    error_feedback: bool = False
    """keep what the encoding lost per bucket and add it back at the next step"""
    residuals: dict = field(default_factory=dict)
    worker: CommWorker | None = None
    """compressed_hook runs on this thread (overlapping backward) instead of inside the hook; the
    group must then be one that only this thread uses (GridSet.grad_group)"""
    split_elements: int = 1 << 22
    """with a worker: a bucket larger than this is reduced as several jobs of at most this many
    elements, so its first pieces are summed while the rest of the queue waits"""
    buckets_per_step: int = 0
    """with a worker: how many buckets this state reduces per step (hybridpar's GradSync sets it;
    0: the bucket's is_last() says, as torch DDP's buckets, launched in order, do)"""
    launched: int = 0
    pipeline: CompressedPipeline | None = None
    """with a worker: the compressed pipeline, created on the worker thread at first use"""
    in_flight: dict = field(default_factory=dict)
    """with a worker: the futures of buckets not yet summed (an error fails them all)"""


def allreduce_hook(state: ReducerState, bucket) -> torch.futures.Future[torch.Tensor]:
    """Plain fp32 all-reduce of the bucket, logged; averaged when state.average."""
    buf = bucket.buffer()
    p = group_size(state.group) if state.group is not None else dist.get_world_size()
    group = state.group if state.group is not None else dist.group.WORLD
    layers = state.bucket_layers.get(bucket.index())
    pending = all_reduce(buf, Via(group, state.ledger, state.term, layers), async_op=True)
    if pending.work is None:  # one rank
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(buf)
        return fut

    def done(_f: torch.futures.Future) -> torch.Tensor:
        pending.finished()
        return buf.div_(p) if state.average else buf

    return pending.work.get_future().then(done)


def _done(result: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(result)
    return fut


PIECE_STRIDE = 1 << 20


def piece_key(bucket: int, piece: int) -> int:
    """The error-feedback key of piece `piece` of a split bucket: an int (checkpoints name
    residuals by it), the bucket's own index for the first piece; `key % PIECE_STRIDE` gives the
    bucket back."""
    return bucket + piece * PIECE_STRIDE


def compressed_hook(state: ReducerState, bucket) -> torch.futures.Future[torch.Tensor]:
    """The bucket summed by `compressed_all_reduce` with state.codec: 8-bit chunks to their owners
    by all-to-all, float32 sums, 8-bit sums back (Krizhevsky 4.1 + Dettmers).

    Without `state.worker` it runs synchronously inside the hook: the two collectives depend on
    each other, and starting the second from a completion callback could order collectives
    differently on different ranks. With a worker (`CommWorker`) the hook queues the bucket, cut
    into pieces of at most `state.split_elements`, and returns at once: the thread pushes the
    pieces in order through a `CompressedPipeline` on `state.group`, which only the worker may
    use, while backward goes on. The all-to-alls of consecutive pieces are in flight together
    while the thread encodes, sums and decodes; the pipeline is flushed after the step's last
    bucket, and a bucket's future completes once its last piece is summed.
    """
    group = state.group if state.group is not None else dist.group.WORLD
    p = group_size(group)
    buf = bucket.buffer()
    if p == 1:
        return _done(buf)
    codec = state.codec or get_codec("dynamic-tree")
    if codec.name == "none":
        return allreduce_hook(state, bucket)
    index, layers = bucket.index(), state.bucket_layers.get(bucket.index())
    residuals = state.residuals if state.error_feedback else None

    if state.worker is None:
        via = Via(group, state.ledger, state.term, layers, codec)
        compressed_all_reduce(buf, via, residuals, index)
        return _done(buf.div_(p) if state.average else buf)
    return _queued(state, bucket, group, codec, residuals)


def _queued(state: ReducerState, bucket, group, codec: Codec, residuals) -> torch.futures.Future:
    """compressed_hook with a worker: the bucket's pieces queued on the worker's thread, pushed
    through the state's pipeline; the future completes once the last piece is summed."""
    buf, p = bucket.buffer(), group_size(group)
    index, layers = bucket.index(), state.bucket_layers.get(bucket.index())
    if state.buckets_per_step:  # the same count on every rank: the step's last launch flushes
        state.launched = (state.launched + 1) % state.buckets_per_step
        last = state.launched == 0
    else:
        last = bucket.is_last()
    step = max(1, state.split_elements)
    done: torch.futures.Future = torch.futures.Future()
    state.in_flight[id(done)] = done
    starts = range(0, buf.numel(), step) or range(1)  # an empty bucket is one empty piece

    def finished() -> None:
        state.in_flight.pop(id(done), None)
        done.set_result(buf.div_(p) if state.average else buf)

    def push(k: int, lo: int) -> None:
        try:
            if state.pipeline is None:
                state.pipeline = CompressedPipeline(
                    group, codec, state.ledger, state.term, residuals
                )
            tail = k == len(starts) - 1
            # a piece's bytes are booked over the bucket's layers pro rata, like the bucket's
            state.pipeline.push(
                buf[lo : lo + step], layers, piece_key(index, k), finished if tail else None
            )
            if tail and last:
                state.pipeline.flush()
        except BaseException as exc:  # the waiting rank raises it: a timeout names the peer
            state.pipeline = None  # nothing half-sent carries over
            for f in list(state.in_flight.values()):
                if not f.done():
                    f.set_exception(exc)
            state.in_flight.clear()

    for k, lo in enumerate(starts):
        state.worker.submit(lambda k=k, lo=lo: push(k, lo))
    return done


def dynamic8(state: ReducerState, bucket) -> torch.futures.Future[torch.Tensor]:
    """compressed_hook with the 8-bit dynamic tree (whatever state.codec says)."""
    if state.codec is None or state.codec.name != "dynamic-tree":
        state.codec = get_codec("dynamic-tree")
    return compressed_hook(state, bucket)


def linear8(state: ReducerState, bucket) -> torch.futures.Future[torch.Tensor]:
    """compressed_hook with 8-bit linear (absmax) quantisation."""
    if state.codec is None or state.codec.name != "linear":
        state.codec = get_codec("linear")
    return compressed_hook(state, bucket)


def host_hook(state, bucket) -> torch.futures.Future[torch.Tensor]:
    """The bucket summed through host shared memory by state.reducer (a HostReducer: hybridpar.runtime.comm.host,
    Sekiyama et al.) on the reducer's worker thread, overlapped with the rest of the backward pass;
    over several hosts, the host sums are all-reduced by one rank per host."""
    buf = bucket.buffer()
    reducer = state.reducer
    if dist.get_world_size(reducer.group) == 1:
        return _done(buf)
    fut = reducer.all_reduce_async(
        buf, key=bucket.index(), term=state.term, layers=state.bucket_layers.get(bucket.index())
    )
    return state.averaged(fut)
