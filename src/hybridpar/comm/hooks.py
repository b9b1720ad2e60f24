"""Reducers as DDP communication hooks: `hook(state, bucket) -> Future[Tensor]`.

The same functions serve torch's DistributedDataParallel (`ddp.register_comm_hook(state, hook)`,
where `bucket` is a torch GradBucket) and hybridpar's own gradient synchroniser (where `bucket` is
a `hybridpar.parallel.sync.Bucket` with the same `buffer()`, `index()`, `is_last()` and
`parameters()`). Either way the collective goes through `hybridpar.comm` and the ledger sees it.
"""

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hybridpar.comm.collectives import all_reduce, group_size
from hybridpar.comm.ledger import Ledger

__all__ = ["ReducerState", "allreduce_hook"]


@dataclass
class ReducerState:
    """What a hook needs: the group, whether to average (DDP expects the mean; hybridpar's loss is
    already scaled by 1/B, so it sums), the ledger, and for each bucket the layers it carries."""

    group: dist.ProcessGroup | None = None
    average: bool = True
    ledger: Ledger | None = None
    term: str = "dw_allreduce"
    bucket_layers: dict[int, dict[str, float]] = field(default_factory=dict)


def allreduce_hook(state: ReducerState, bucket) -> torch.futures.Future[torch.Tensor]:
    """Plain fp32 all-reduce of the bucket, logged; averaged when state.average."""
    buf = bucket.buffer()
    p = group_size(state.group) if state.group is not None else dist.get_world_size()
    group = state.group if state.group is not None else dist.group.WORLD
    pending = all_reduce(buf, group, state.ledger, state.term, state.bucket_layers.get(bucket.index()),
                         async_op=True)  # fmt: skip
    if pending.work is None:  # one rank
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(buf)
        return fut

    def done(_f: torch.futures.Future) -> torch.Tensor:
        pending.finished()
        return buf.div_(p) if state.average else buf

    return pending.work.get_future().then(done)
