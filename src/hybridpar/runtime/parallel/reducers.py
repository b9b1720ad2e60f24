"""One factory for the gradient reducer, for both engines: hybridpar's GradSync (a state per group
of ranks that replicate some parameters) and torch DDP (one state over all ranks). A reducer is a
DDP communication hook and a function building its state for a group (hybridpar.runtime.comm.hooks,
hybridpar.runtime.comm.host).

| plan's choices                      | hook              | where it runs                       |
| ----------------------------------- | ----------------- | ----------------------------------- |
| reducer process-group               | allreduce_hook    | the autograd thread, async gloo/NCCL |
| reducer process-group, codec on grads | compressed_hook | a thread of its own (`own_groups`)  |
| reducer host (codec on grads: across | host_hook         | the host reducer's thread            |
| hosts only, the leaders' step)      |                   |                                      |
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

from hybridpar.core.choices import Choices
from hybridpar.runtime.comm.codecs import get_codec
from hybridpar.runtime.comm.group import Group, pg_of
from hybridpar.runtime.comm.hooks import ReducerState, allreduce_hook, compressed_hook, host_hook
from hybridpar.runtime.comm.host import HostReducer, HostState
from hybridpar.runtime.comm.ledger import Ledger
from hybridpar.runtime.comm.worker import CommWorker
from hybridpar.runtime.options import RuntimeOptions

__all__ = ["Reducer", "make_reducer"]


@dataclass
class Reducer:
    hook: Callable
    state: Callable[..., object]
    """(group=, average=, ledger=) -> the hook's state for the buckets of that group"""
    own_groups: bool = False
    """the hook runs collectives on a thread of its own: give it groups nobody else uses"""
    worker: CommWorker | None = None
    host: bool = False
    """Sekiyama's reducer: parameters are broadcast once at the start (Algorithm 5)"""
    leaders: dict[tuple[int, ...], object] | None = None
    """the host reducer across hosts: each gradient group's leaders' group, made beforehand by
    every rank (comm.host.leader_groups); None: a reducer over the whole world makes its own"""


def make_reducer(choices: Choices, options: RuntimeOptions) -> Reducer:
    if choices.reducer == "host":
        out = Reducer(host_hook, None, host=True)  # type: ignore[arg-type]
        codec = get_codec(choices.codec, options.block) if choices.grads_encoded else None

        def host_state(group: Group, average: bool, ledger: Ledger | None) -> HostState:
            members = tuple(dist.get_process_group_ranks(pg_of(group)))
            known = out.leaders is not None and members in out.leaders
            reducer = HostReducer(
                group,
                ledger,
                stage_bytes=options.stage_bytes,
                make_leaders=not known,
                leaders=out.leaders[members] if known else None,
                codec=codec,
            )
            return HostState(reducer, average=average, ledger=ledger)

        out.state = host_state
        return out
    if choices.grads_encoded:
        worker = CommWorker()
        codec = get_codec(choices.codec, options.block)

        def compressed_state(group: Group, average: bool, ledger: Ledger | None) -> ReducerState:
            return ReducerState(
                group,
                average,
                ledger,
                codec=codec,
                error_feedback=options.error_feedback,
                worker=worker,
            )

        return Reducer(compressed_hook, compressed_state, own_groups=True, worker=worker)
    return Reducer(allreduce_hook, ReducerState)
