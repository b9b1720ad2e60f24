"""DDPEngine: a plan with engine `ddp` runs under torch's DistributedDataParallel, the baseline,
with hybridpar's reducers as its communication hooks (the same factory as HybridParallel's:
reducers.py), so its buckets are logged and can be 8-bit or summed in host memory.

The hooks sum, they do not average (`average=False`), so DDP keeps hybridpar's per-step contract:
the loss is summed over this rank's examples and divided by the global batch, and every gradient
is the global batch's. Every layer is batch-parallel; batch norms are global over all ranks unless
the plan says local.
"""

from __future__ import annotations

import datetime
import inspect

import torch.distributed as dist
from torch import nn

from hybridpar.runtime.comm.collectives import even_split
from hybridpar.runtime.comm.grid import new_group
from hybridpar.runtime.parallel.batchnorm import BNSwitch, convert_global_batchnorm
from hybridpar.runtime.parallel.dropout import Where, replace_dropouts
from hybridpar.runtime.parallel.engine import Engine
from hybridpar.runtime.parallel.reducers import make_reducer

__all__ = ["DDPEngine"]


class DDPEngine(Engine):
    kind = "ddp"

    def build(self, model: nn.Module) -> None:
        plan, options, ledger = self.plan, self.options, self.ledger
        layout, device = self.layout, self.device
        self.P, self.rank = dist.get_world_size(), dist.get_rank()
        self.rows: list[int] | None = None
        timeout = datetime.timedelta(seconds=options.timeout_s) if options.timeout_s else None
        everyone = list(range(self.P))
        shm = options.shared_memory and device.type == "cpu"
        self.world = new_group(everyone, timeout, "hybridpar_world", "world", shm)
        self.bn_switch = BNSwitch.of(plan, options, self.world, ledger, device)
        if plan.choices.bn != "local":
            model = convert_global_batchnorm(
                model, self.world, ledger=ledger, switch=self.bn_switch, layer_of=layout.layer_of
            )
        # counter-based dropout: this rank's masks are its examples' slice of one process's
        replace_dropouts(
            model, options.seed, lambda name: Where(lambda: self.step, self._first_example)
        )
        self.ddp = nn.parallel.DistributedDataParallel(
            model, bucket_cap_mb=options.bucket_mb, **{_sync_buffers(): plan.choices.bn == "local"}
        )
        self.module = model
        self.reducer = make_reducer(plan.choices, options)
        group = self.world
        if self.reducer.own_groups:  # on its own thread and group, overlapping backward
            group = new_group(everyone, timeout, "hybridpar_grads", tag="grads")
        self.reducer_state = self.reducer.state(group=group, average=False, ledger=ledger)
        self.ddp.register_comm_hook(self.reducer_state, self.reducer.hook)

    def split(self, sizes: list[int]) -> None:
        self.rows = sizes

    def _first_example(self) -> int:
        return sum(self.rows[: self.rank]) if self.rows else 0

    def input_rows(self, n: int) -> slice:
        sizes = even_split(n, self.P)
        lo = sum(sizes[: self.rank])
        return slice(lo, lo + sizes[self.rank])

    output_rows = input_rows

    def forward(self, x, *args, **kwargs):
        if self.rows is None:
            raise RuntimeError("call set_batch(n) with the global batch size before each forward")
        return self.ddp(x, *args, **kwargs)

    def reducer_states(self) -> dict[int, object]:
        return {-1: self.reducer_state}


def _sync_buffers() -> str:
    """DDP's keyword for sending rank 0's buffers before each forward (renamed in torch 2.13).
    Global statistics keep the running buffers equal on every rank; local BN keeps DDP's
    default of sending them."""
    params = inspect.signature(nn.parallel.DistributedDataParallel).parameters
    return "forward_sync_buffers" if "forward_sync_buffers" in params else "broadcast_buffers"
