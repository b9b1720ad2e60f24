"""The baseline a user writes: torch DDP in a plain training loop with torch.optim.SGD (momentum
and weight decay; torch picks its foreach path), sharing only the model and the data with
hybridpar. Nothing of hybridpar's runtime, ledger or optimizer is in the loop.

    python benchmarks/plain_ddp.py --nproc 2                       # local processes
    torchrun --nnodes 2 ... benchmarks/plain_ddp.py                # one process per torchrun rank

Prints one JSON line on rank 0: median seconds per iteration (after one warm-up) and the gradient
bytes DDP all-reduces per iteration per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path


def _loop(args: argparse.Namespace) -> dict:
    import torch
    import torch.distributed as dist
    from torch import nn

    from hybridpar.core.models import MODELS, build_model, input_shape
    from hybridpar.runtime.train.data import load_data, signature

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, args.local_world or world)))
    # the model and data hybridpar's trainer builds for the same flags
    shape, classes = signature(
        args.data, input_shape(args.model, args.input_size), MODELS[args.model].num_classes
    )
    data = load_data(args.data, shape, classes, seed=0)
    torch.manual_seed(0)
    model = build_model(
        args.model, input_size=args.input_size, num_classes=classes, in_channels=shape[0]
    )
    net = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
    per = args.batch // world
    times = []
    n = len(data.x_train)
    for step in range(args.steps):
        lo = (step * args.batch + rank * per) % max(1, n - per)
        x, y = data.x_train[lo : lo + per], data.y_train[lo : lo + per]
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {
        "time_s": statistics.median(times[1:]),
        "grad_bytes": grad_bytes,
        "ring_bytes_per_rank": 2 * (world - 1) / world * grad_bytes,
    }


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    try:
        r = _loop(args)
        if rank == 0:
            Path(out).write_text(json.dumps(r))
    finally:
        dist.destroy_process_group()


def run_local(
    nproc: int,
    model: str = "alexnet-owt",
    input_size: int | None = 64,
    batch: int = 32,
    steps: int = 6,
    data: str = "synthetic:512",
    lr: float = 0.01,
) -> dict:
    """The plain loop on `nproc` local processes (gloo); rank 0's result."""
    import torch.multiprocessing as mp

    args = argparse.Namespace(
        model=model,
        input_size=input_size,
        batch=batch,
        steps=steps,
        data=data,
        lr=lr,
        local_world=nproc,
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "r.json")
        mp.start_processes(_worker, (nproc, port, args, out), nprocs=nproc, start_method="spawn")
        return json.loads(Path(out).read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=None, help="local processes (not under torchrun)")
    ap.add_argument("--model", default="alexnet-owt")
    ap.add_argument("--input-size", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--data", default="synthetic:512")
    ap.add_argument("--lr", type=float, default=0.01)
    args = ap.parse_args()
    if "LOCAL_RANK" in os.environ:  # under torchrun
        import torch.distributed as dist

        dist.init_process_group("gloo", timeout=timedelta(seconds=120))
        args.local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        r = _loop(args)
        if dist.get_rank() == 0:
            print(json.dumps(r), flush=True)
        dist.destroy_process_group()
        return
    if not args.nproc:
        sys.exit("give --nproc N, or run under torchrun")
    print(json.dumps(run_local(args.nproc, args.model, args.input_size, args.batch, args.steps)))


if __name__ == "__main__":
    main()
