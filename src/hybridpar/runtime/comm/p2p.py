"""Point-to-point sends and receives that work on every backend and device.

gloo's `send`/`recv` hand the tensor's data pointer to a TCP socket: host memory only (a CUDA
tensor there fails with "writev ... Bad address"), while its collectives stage CUDA tensors
through pinned memory themselves. So where gloo carries a tensor's device on the group (ranks
sharing one GPU; CPU ranks), a send goes from a host copy and a receive lands in a host buffer
that `wait()` copies into place; pinned where the tensor is on a GPU, so the copies are DMA. On
the CPU the copy costs a memcpy of a few halo rows before a TCP send. Where NCCL carries it
(a GPU per rank), the tensor itself goes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["carrier", "irecv", "isend"]


def carrier(pg: dist.ProcessGroup, device: torch.device) -> str:
    """The backend that carries tensors of `device` on `pg`: 'gloo', 'nccl', ..."""
    name = str(dist.get_backend(pg))
    if ":" not in name:  # one backend for every device
        return name
    pairs = dict(part.split(":") for part in name.split(","))  # 'cpu:gloo,cuda:nccl'
    return pairs.get(device.type, name)


def _host_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)


class _Landed:
    """A receive into a host buffer; wait() completes it and copies the rows into place."""

    def __init__(self, work: dist.Work, host: torch.Tensor, out: torch.Tensor) -> None:
        self.work, self.host, self.out = work, host, out

    def wait(self) -> bool:
        self.work.wait()
        self.out.copy_(self.host, non_blocking=self.out.is_cuda)
        return True


def isend(t: torch.Tensor, peer: int, pg: dist.ProcessGroup) -> dist.Work:
    """Start sending `t` to global rank `peer`."""
    t = t.contiguous()
    if carrier(pg, t.device) == "gloo":
        t = _host_like(t).copy_(t)  # the work keeps this copy alive until it is sent
    return dist.isend(t, peer, group=pg)


def irecv(out: torch.Tensor, peer: int, pg: dist.ProcessGroup) -> dist.Work | _Landed:
    """Start receiving into `out` (contiguous) from global rank `peer`; wait() on the answer."""
    if carrier(pg, out.device) != "gloo":
        return dist.irecv(out, peer, group=pg)
    host = _host_like(out)
    return _Landed(dist.irecv(host, peer, group=pg), host, out)
