"""The per-rank training loop: the Trainer, and `train_worker`, the function every rank runs."""

from __future__ import annotations

import os
import time
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from hybridpar.comm.codecs import get_codec
from hybridpar.comm.collectives import all_reduce, even_split
from hybridpar.comm.grid import ProcessGrid
from hybridpar.comm.hooks import ReducerState, allreduce_hook, compressed_hook, host_hook
from hybridpar.comm.host import HostReducer, HostState
from hybridpar.comm.ledger import Ledger
from hybridpar.parallel.batchnorm import BNSwitch, LossPlateau, convert_global_batchnorm
from hybridpar.parallel.wrap import HybridParallel, parallelize
from hybridpar.train.config import TrainConfig
from hybridpar.train.data import Dataset, epoch_steps, load_data
from hybridpar.train.optim import KrizhevskySGD, lr_factor
from hybridpar.wire import parse_compress

__all__ = ["Trainer", "layer_map", "train_worker"]

BLOCKING_TERMS = ("allgather", "dx_allreduce", "redistribute")


def layer_map(model: nn.Module, input_shape: tuple[int, ...]) -> tuple[dict[str, str], list]:
    """{leaf module name: cost-model layer name} and the cost layers, from a meta-device analysis."""
    import copy

    from hybridpar.analysis import analyze
    from hybridpar.cost.layers import cost_layers

    meta = copy.deepcopy(model).to("meta")
    layers = cost_layers(analyze(meta, input_shape))
    return {m: x.name for x in layers for m in x.members}, layers


class Trainer:
    """One rank's view of a run: the parallel model, the optimiser and the step."""

    def __init__(self, cfg: TrainConfig, model: nn.Sequential, grid: ProcessGrid, ledger: Ledger,
                 kind: str, layer_of: dict[str, str] | None = None, tail: int | None = None) -> None:  # fmt: skip
        self.cfg, self.grid, self.ledger, self.kind = cfg, grid, ledger, kind
        self.P, self.rank = grid.world_size, grid.rank
        self.compress = parse_compress(cfg.compress)
        self.codec = get_codec(cfg.codec, cfg.codec_block or None) if cfg.codec != "none" else None
        self.bn_switch = (
            BNSwitch(cfg.bn_max_batch, LossPlateau(cfg.bn_window, cfg.bn_threshold), ledger=ledger)
            if cfg.bn == "adaptive"
            else None
        )
        if self.bn_switch is not None:
            self.bn_switch.start(-(-cfg.batch // self.P))  # the nominal per-rank batch
        if kind == "ddp":
            if cfg.bn != "local":
                model = convert_global_batchnorm(model, grid.world, ledger=ledger,
                                                 switch=self.bn_switch, layer_of=layer_of)  # fmt: skip
            # global statistics keep the running buffers equal on every rank; local BN keeps
            # DDP's default of broadcasting rank 0's
            self.net = nn.parallel.DistributedDataParallel(
                model, bucket_cap_mb=cfg.bucket_mb, broadcast_buffers=cfg.bn == "local"
            )
            compressed = self.codec is not None and "grads" in self.compress
            if cfg.reducer == "host":
                self.net.register_comm_hook(
                    HostState(HostReducer(None, ledger), ledger=ledger), host_hook
                )
            else:
                self.net.register_comm_hook(
                    ReducerState(group=None, average=True, ledger=ledger, codec=self.codec,
                                 error_feedback=cfg.error_feedback),
                    compressed_hook if compressed else allreduce_hook,
                )  # fmt: skip
        else:
            self.net = parallelize(model, grid, ledger, tail=tail, layer_of=layer_of,
                                   bucket_bytes=int(cfg.bucket_mb * 2**20), seed=cfg.seed,
                                   bn=cfg.bn, bn_switch=self.bn_switch, codec=self.codec,
                                   compress=self.compress, error_feedback=cfg.error_feedback,
                                   reducer=cfg.reducer)  # fmt: skip
        self.opt = KrizhevskySGD(
            self.net.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay
        )
        self.step_no = 0
        self.last = {"wait_s": 0.0, "blocking_s": 0.0, "time_s": 0.0}

    @property
    def hybrid(self) -> HybridParallel | None:
        return self.net if isinstance(self.net, HybridParallel) else None

    def rows(self, n: int) -> tuple[slice, slice]:
        """(rows this rank feeds in, rows its outputs belong to) of a global batch of n."""
        h = self.hybrid
        if h is not None and h.input_replicated:
            sizes = even_split(n, self.grid.pc)
            lo = sum(sizes[: self.grid.c])
            s = slice(lo, lo + sizes[self.grid.c])
            return s, s
        sizes = even_split(n, self.P)
        mine = slice(sum(sizes[: self.rank]), sum(sizes[: self.rank + 1]))
        if h is None or h.tail >= len(h.model):
            return mine, mine
        g = self.grid  # after the hand-off: the blocks of the whole model group
        return mine, slice(sum(sizes[: g.c * g.pr]), sum(sizes[: (g.c + 1) * g.pr]))

    @property
    def counts_outputs(self) -> bool:
        """Model-group replicas hold the same outputs: only r = 0 counts them in the metrics."""
        return self.hybrid is None or self.grid.r == 0 or self.hybrid.tail >= len(self.hybrid.model)

    def set_lr(self, progress: float) -> None:
        for g in self.opt.param_groups:
            g["lr"] = self.cfg.lr * lr_factor(self.cfg.schedule, progress)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, int, int]:
        """One SGD step on the global batch (x, y), identical on every rank. Returns this rank's
        (loss sum, correct, examples) over the outputs it counts."""
        t0 = time.perf_counter()
        self.ledger.step = self.step_no
        first_entry = len(self.ledger.entries)
        n = len(x)
        rows_in, rows_out = self.rows(n)
        self.net.train()
        if self.hybrid is not None:
            self.hybrid.set_batch(even_split(n, self.P))
        out = self.net(x[rows_in])
        target = y[rows_out]
        loss_sum = F.cross_entropy(out, target, reduction="sum")
        # hybrid: every gradient is a sum over ranks, so scale by the global batch once;
        # DDP averages over ranks, so it takes the local mean
        loss = loss_sum / n if self.hybrid is not None else loss_sum / max(1, len(target))
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        wait = self.hybrid.finish_backward() if self.hybrid is not None else 0.0
        self.opt.step()
        self.step_no += 1
        blocking = sum(
            e.seconds for e in self.ledger.entries[first_entry:] if e.term in BLOCKING_TERMS
        )
        self.last = {"wait_s": wait, "blocking_s": blocking, "time_s": time.perf_counter() - t0}
        if not self.counts_outputs:
            result = 0.0, 0, 0
        else:
            result = float(loss_sum.detach()), int((out.argmax(1) == target).sum()), len(target)
        if self.bn_switch is not None:
            self.bn_switch.observe(result[0], result[2])
        return result

    @torch.no_grad()
    def evaluate(self, x: torch.Tensor, y: torch.Tensor, batch: int) -> tuple[int, int]:
        self.net.eval()
        self.ledger.step = -1  # evaluation traffic is not part of any training iteration
        correct = total = 0
        for i in range(0, len(x), batch):
            xb, yb = x[i : i + batch], y[i : i + batch]
            rows_in, rows_out = self.rows(len(xb))
            if self.hybrid is not None:
                self.hybrid.set_batch(even_split(len(xb), self.P))
            out = self.net(xb[rows_in])
            if self.counts_outputs:
                correct += int((out.argmax(1) == yb[rows_out]).sum())
                total += len(yb[rows_out])
        return correct, total

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        if self.hybrid is not None:
            return self.hybrid.full_state_dict()
        return {k: v.clone() for k, v in self.net.module.state_dict().items()}


def _sum_over_world(values: list[float], ledger: Ledger) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    all_reduce(t, dist.group.WORLD, ledger, "metrics")
    return t.tolist()


def train_worker(cfg: TrainConfig, kind: str) -> dict | None:
    """What every rank runs. Rank 0 returns the report dict; the others return None."""
    import threading

    from tqdm import tqdm

    # tqdm's default lock is a multiprocessing RLock: a named semaphore in /dev/shm that a rank
    # killed by a signal would leave behind; a thread lock is all one rank needs
    tqdm.set_lock(threading.RLock())
    from hybridpar.models import build_model
    from hybridpar.train.report import predicted_bytes

    P, rank = dist.get_world_size(), dist.get_rank()
    # DDP warns once per run when a 1-channel conv's gradient has unusual strides: harmless
    warnings.filterwarnings("ignore", message="Grad strides do not match bucket view strides")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // P))
    torch.manual_seed(cfg.seed)
    data: Dataset = load_data(cfg.data, _model_input(cfg), seed=cfg.seed)
    c, s = data.input_shape[0], data.input_shape[-1]
    model = build_model(cfg.model, input_size=s, num_classes=data.num_classes, in_channels=c)
    pr, pc = cfg.grid or (1, P)
    grid = ProcessGrid(pr, pc)
    ledger = Ledger()
    layer_of, layers = layer_map(model, data.input_shape)
    trainer = Trainer(cfg, model, grid, ledger, kind, layer_of)
    n = len(data.x_train)
    steps_per_epoch = len(epoch_steps(n, cfg.batch, 0, cfg.seed))
    if cfg.max_steps:
        steps_per_epoch = min(steps_per_epoch, cfg.max_steps)
    total = cfg.epochs * steps_per_epoch
    bar = tqdm(total=total, desc=f"train {cfg.model} P={P} {kind} {pr}x{pc}", unit="step",
               disable=rank != 0 or not cfg.progress, leave=False)  # fmt: skip
    epochs, times = [], {"time_s": [], "wait_s": [], "blocking_s": []}
    full_steps: set[int] = set()
    for epoch in range(cfg.epochs):
        t0 = time.perf_counter()
        loss_sum = correct = count = 0.0
        for i, idx in enumerate(epoch_steps(n, cfg.batch, epoch, cfg.seed)[:steps_per_epoch]):
            trainer.set_lr((epoch * steps_per_epoch + i) / total)
            if len(idx) == cfg.batch:
                full_steps.add(trainer.step_no)
            ls, cr, ct = trainer.step(data.x_train[idx], data.y_train[idx])
            loss_sum, correct, count = loss_sum + ls, correct + cr, count + ct
            if epoch > 0 or i > 0:  # the first step pays one-off start-up costs
                for k in times:
                    times[k].append(trainer.last[k])
            bar.update(1)
        test_correct, test_total = trainer.evaluate(data.x_test, data.y_test, cfg.batch)
        loss_sum, correct, count, test_correct, test_total = _sum_over_world(
            [loss_sum, correct, count, test_correct, test_total], ledger)  # fmt: skip
        epochs.append({"epoch": epoch + 1, "loss": loss_sum / count, "train_acc": correct / count,
                       "test_acc": test_correct / test_total, "time_s": time.perf_counter() - t0})  # fmt: skip
        bar.set_postfix(loss=f"{epochs[-1]['loss']:.3f}", test=f"{epochs[-1]['test_acc']:.3f}")
    bar.close()
    # bytes per full iteration, averaged over ranks (uneven shards make ranks differ slightly)
    steps = max(1, len(full_steps))
    mine = {k: v / steps for k, v in ledger.bytes_by_term(full_steps).items()}
    gathered: list[dict] = [{} for _ in range(P)]
    dist.all_gather_object(gathered, mine)  # one small object, outside the measured steps
    measured: dict[str, float] = {}
    for d in gathered:
        for k, v in d.items():
            measured[k] = measured.get(k, 0.0) + v / P
    med = {k: float(torch.tensor(v).median()) if v else 0.0 for k, v in times.items()}
    predicted = predicted_bytes(layers, P, cfg.batch, kind, (pr, pc), layer_of, model, bn=cfg.bn,
                                codec=cfg.codec, compress=parse_compress(cfg.compress))  # fmt: skip
    if cfg.reducer == "host" and "dw_allreduce" in predicted:
        # shared memory within a host; across H hosts one leader each all-reduces: per rank on
        # average 2(H-1)/H n * H/P instead of 2(P-1)/P n
        hosts = len(set(_hostnames()))
        predicted["dw_allreduce"] *= ((hosts - 1) / P) / ((P - 1) / P)
    if rank != 0:
        return None
    comm = med["wait_s"] + med["blocking_s"]
    return {
        "procs": P,
        "grid": [pr, pc],
        "strategy": cfg.strategy if kind != "ddp" else "ddp",
        "model": cfg.model,
        "data": data.name,
        "config": cfg.to_dict(),
        "epochs": epochs,
        "final": {"test_acc": epochs[-1]["test_acc"], "loss": epochs[-1]["loss"]},
        "iteration": {
            "time_s": med["time_s"],
            "compute_s": max(0.0, med["time_s"] - comm),
            "comm_wait_s": comm,
        },
        "bytes": {
            "measured": measured,
            "predicted": predicted,
        },
        "reducer": cfg.reducer,
        "bn": {"requested": cfg.bn, **(trainer.bn_switch.record() if trainer.bn_switch else {})},
    }


def _hostnames() -> list[str]:
    import socket

    names: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(names, os.environ.get("HYBRIDPAR_HOST") or socket.gethostname())
    return [str(n) for n in names]


def _model_input(cfg: TrainConfig) -> tuple[int, ...] | None:
    from hybridpar.models import input_shape

    return input_shape(cfg.model, cfg.input_size) if cfg.data.startswith("synthetic") else None
