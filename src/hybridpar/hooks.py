"""DDP communication hooks, for plain torch DistributedDataParallel:

    from hybridpar.hooks import ReducerState, dynamic8
    ddp.register_comm_hook(ReducerState(), dynamic8)

`allreduce_hook` is the logged float32 all-reduce; `compressed_hook` uses `state.codec`
(hybridpar.runtime.comm.codecs.get_codec(name, block)) and optional error feedback; `dynamic8` and
`linear8` fix the codec; `host_hook` sums through host shared memory (HostState(HostReducer())).
All average over the group, as DDP expects.
"""

from hybridpar.runtime.comm.hooks import (
    ReducerState,
    allreduce_hook,
    compressed_hook,
    dynamic8,
    host_hook,
    linear8,
)
from hybridpar.runtime.comm.host import HostReducer, HostState

__all__ = [
    "HostReducer",
    "HostState",
    "ReducerState",
    "allreduce_hook",
    "compressed_hook",
    "dynamic8",
    "host_hook",
    "linear8",
]
