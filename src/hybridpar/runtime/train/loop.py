"""The per-rank training loop: the Trainer, the plan every rank agrees on, and `train_worker`, the
function every rank runs."""

from __future__ import annotations

import inspect
import json
import math
import os
import sys
import threading
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from hybridpar.errors import ConfigError
from hybridpar.plan import ParallelPlan, Term
from hybridpar.runtime import faults
from hybridpar.runtime.comm import small
from hybridpar.runtime.comm.codecs import get_codec
from hybridpar.runtime.comm.collectives import all_reduce
from hybridpar.runtime.comm.grid import group_timeout, new_group
from hybridpar.runtime.comm.hooks import (
    PIECE_STRIDE,
    ReducerState,
    allreduce_hook,
    compressed_hook,
    host_hook,
)
from hybridpar.runtime.comm.host import HostReducer, HostState
from hybridpar.runtime.comm.ledger import Ledger
from hybridpar.runtime.comm.worker import CommWorker
from hybridpar.runtime.parallel.api import HybridParallel, parallelize
from hybridpar.runtime.parallel.batchnorm import BNSwitch, LossPlateau, convert_global_batchnorm
from hybridpar.runtime.parallel.layout import resolve
from hybridpar.runtime.train import checkpoint
from hybridpar.runtime.train.checkpoint import Position
from hybridpar.runtime.train.config import TrainConfig
from hybridpar.runtime.train.data import Dataset, epoch_steps, load_data, rows_of
from hybridpar.runtime.train.optim import KrizhevskySGD, lr_factor, scale_hparams
from hybridpar.runtime.train.run import Job

__all__ = ["Progress", "Trainer", "agreed_plan", "fit", "strict", "train_worker"]

BLOCKING_TERMS = (Term.ALLGATHER, Term.DX_ALLREDUCE, Term.REDISTRIBUTE)


class Trainer:
    """One rank's view of a run: the model executing the plan (hybridpar's runtime, or torch DDP
    for a plan with engine ddp), the optimiser and the step."""

    def __init__(
        self,
        cfg: TrainConfig,
        model: nn.Module,
        plan: ParallelPlan,
        *,
        input_shape: tuple[int, ...],
        ledger: Ledger | None = None,
    ) -> None:
        self.cfg, self.plan, self.ledger = cfg, plan, ledger or Ledger()
        self.P, self.rank = dist.get_world_size(), dist.get_rank()
        small.enable(dist.group.WORLD)  # metrics, the BN switch, DDP's global BN: shared memory
        self.device = next(model.parameters()).device
        self.bn_switch = None
        if plan.bn == "adaptive":
            self.bn_switch = BNSwitch(
                cfg.bn_max_batch, LossPlateau(cfg.bn_window, cfg.bn_threshold), ledger=self.ledger
            )
            self.bn_switch.device = self.device.type
            self.bn_switch.start(plan.batch)  # BZ: the global batch (Liu et al. section 5)
        if plan.engine == "ddp":
            self.net: nn.Module = self._ddp(model, input_shape)
        else:
            self.net = parallelize(
                model,
                plan,
                ledger=self.ledger,
                input_shape=input_shape,
                bucket_bytes=int(cfg.bucket_mb * 2**20),
                seed=cfg.seed,
                bn_switch=self.bn_switch,
                device=self.device.type,
                codec_block=cfg.codec_block or None,
                error_feedback=cfg.error_feedback,
            )
        k = plan.batch / cfg.base_batch if cfg.base_batch else 1.0
        self.lr, wd = scale_hparams(cfg.lr, cfg.weight_decay, k, cfg.scale_rule)
        self.opt = KrizhevskySGD(
            self.net.parameters(), lr=self.lr, momentum=cfg.momentum, weight_decay=wd
        )
        self.step_no = 0
        self.resharded = False  # set by a checkpoint load onto another plan or P
        self.last = {"wait_s": 0.0, "blocking_s": 0.0, "time_s": 0.0}

    def _ddp(self, model: nn.Module, input_shape: tuple[int, ...]) -> nn.Module:
        """The baseline: torch DDP, its buckets reduced through a logged comm hook."""
        plan, cfg = self.plan, self.cfg
        layer_of = resolve(model, plan, input_shape, self.P).layer_of
        if plan.bn != "local":
            model = convert_global_batchnorm(
                model,
                dist.group.WORLD,
                ledger=self.ledger,
                switch=self.bn_switch,
                layer_of=layer_of,
            )
        # global statistics keep the running buffers equal on every rank; local BN keeps DDP's
        # default of sending rank 0's before each forward (the keyword was renamed in torch 2.13)
        params = inspect.signature(nn.parallel.DistributedDataParallel).parameters
        sync = "forward_sync_buffers" if "forward_sync_buffers" in params else "broadcast_buffers"
        net = nn.parallel.DistributedDataParallel(
            model, bucket_cap_mb=cfg.bucket_mb, **{sync: plan.bn == "local"}
        )
        if plan.reducer == "host":
            net.register_comm_hook(
                HostState(HostReducer(None, self.ledger), ledger=self.ledger), host_hook
            )
        else:
            codec = get_codec(plan.codec, cfg.codec_block or None) if plan.codec != "none" else None
            compressed = codec is not None and "grads" in plan.compress
            state = ReducerState(
                group=None,
                average=True,
                ledger=self.ledger,
                codec=codec,
                error_feedback=cfg.error_feedback,
            )
            if compressed:  # on its own thread and group, overlapping backward (comm.worker)
                members = list(range(self.P))
                state.group = new_group(members, group_timeout(), "hybridpar_grads", tag="grads")
                state.worker = CommWorker()
            net.register_comm_hook(state, compressed_hook if compressed else allreduce_hook)
            self.reducer_state = state
        return net

    def autocast(self):
        """bf16 autocast of the forward pass and the loss with --amp bf16 (weights, gradients and
        the optimizer stay float32)."""
        return torch.autocast(
            self.device.type, dtype=torch.bfloat16, enabled=self.cfg.amp == "bf16"
        )

    def _reducer_states(self) -> dict[int, ReducerState]:
        """Gradient bucket index -> the reducer state that holds its error-feedback residuals."""
        if self.hybrid is not None:
            return {b.index(): st for st, b in self.hybrid.sync.buckets}
        return {} if self.reducer_state is None else {-1: self.reducer_state}

    def residuals(self) -> dict[int, list]:
        """Codec error-feedback residuals per gradient bucket (for checkpoints); bucket indices
        are unique across reducer states."""
        out: dict[int, list] = {}
        for st in {id(st): st for st in self._reducer_states().values()}.values():
            out.update(getattr(st, "residuals", {}))  # the host reducer keeps none
        return out

    def residual_slot(self, bucket: int, j: int, size: tuple[int, ...]) -> None:
        """Make room for a residual a checkpoint holds, so that it can be loaded in place."""
        states = self._reducer_states()
        st = states.get(bucket % PIECE_STRIDE, states.get(-1))  # a split bucket's pieces too
        slot = st.residuals.setdefault(bucket, [None, None])
        slot[j] = torch.zeros(size)

    def restore_step(self, step: int) -> None:
        """Go on counting from `step` after a checkpoint (dropout seeds and the ledger use it)."""
        self.step_no = step
        if self.hybrid is not None and self.hybrid.random is not None:
            self.hybrid.random.step = step

    @property
    def hybrid(self) -> HybridParallel | None:
        return self.net if isinstance(self.net, HybridParallel) else None

    def rows(self, n: int) -> tuple[slice, slice]:
        """(rows this rank feeds in, rows its outputs belong to) of a global batch of n."""
        if self.hybrid is not None:
            return self.hybrid.input_rows(n), self.hybrid.output_rows(n)
        mine = rows_of(n, self.P, self.rank)
        return mine, mine

    @property
    def counts_outputs(self) -> bool:
        return self.hybrid is None or self.hybrid.counts_outputs

    def set_lr(self, progress: float) -> None:
        for g in self.opt.param_groups:
            g["lr"] = self.lr * lr_factor(self.cfg.schedule, progress)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, int, int]:
        """One SGD step on the global batch (x, y), identical on every rank. Returns this rank's
        (loss sum, correct, examples) over the outputs it counts."""
        t0 = time.perf_counter()
        self.ledger.step = self.step_no
        faults.set_step(self.step_no)
        first_entry = len(self.ledger.entries)
        n = len(x)
        rows_in, rows_out = self.rows(n)
        self.net.train()
        if self.hybrid is not None:
            self.hybrid.set_batch(n)
        faults.at("forward")
        with self.autocast():
            out = self.net(x[rows_in])
            target = y[rows_out]
            loss_sum = F.cross_entropy(out, target, reduction="sum")
        value = float(loss_sum.detach())
        if not math.isfinite(value) and not self.cfg.allow_nonfinite:
            raise FloatingPointError(
                f"the loss is {value} at step {self.step_no}: lower --lr or check the data "
                "(or pass --allow-nonfinite)"
            )
        # hybrid: every gradient is a sum over ranks, so scale by the global batch once;
        # DDP averages over ranks, so it takes the local mean
        loss = loss_sum / n if self.hybrid is not None else loss_sum / max(1, len(target))
        if out.requires_grad:
            out.register_hook(lambda g: faults.at("backward"))
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        wait = self.hybrid.finish_backward() if self.hybrid is not None else 0.0
        faults.at("optimizer")
        self.opt.step()
        self.step_no += 1
        blocking = sum(
            e.seconds for e in self.ledger.entries[first_entry:] if e.term in BLOCKING_TERMS
        )
        self.last = {"wait_s": wait, "blocking_s": blocking, "time_s": time.perf_counter() - t0}
        result = (0.0, 0, 0)
        if self.counts_outputs:
            result = value, int((out.argmax(1) == target).sum()), len(target)
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
                self.hybrid.set_batch(len(xb))
            with self.autocast():
                out = self.net(xb[rows_in])
            if self.counts_outputs:
                correct += int((out.argmax(1) == yb[rows_out]).sum())
                total += len(yb[rows_out])
        return correct, total

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        if self.hybrid is not None:
            return self.hybrid.full_state_dict()
        return {k: v.clone() for k, v in self.net.module.state_dict().items()}


def _broadcast(value: object) -> object:
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def agreed_plan(job: Job) -> ParallelPlan:
    """The plan every rank runs. A searched preset is decided by rank 0 alone (after a collective
    calibration of `localhost` if there is none yet) and broadcast (DESIGN.md invariant 3)."""
    from hybridpar.commands.calibration import calibrate_in_job
    from hybridpar.planning.cluster import localhost_path
    from hybridpar.runtime.train.run import build_plan, meta_model, model_layers, pricing_cluster

    if job.plan is not None:
        return job.plan
    cfg, rank = job.cfg, dist.get_rank()
    # one process has nothing to calibrate (no all-reduce to time) and one plan: it is priced on
    # whatever `localhost` holds, bytes only when it was never calibrated
    searched = job.procs > 1
    missing = (
        searched and cfg.cluster == "localhost" and not (rank == 0 and localhost_path().exists())
    )
    if _broadcast(missing):
        if rank == 0:
            print(
                f"calibrating this machine for --preset {cfg.preset} (once; "
                "`hybridpar calibrate` redoes it) ...",
                flush=True,
            )
        calibrate_in_job(device=cfg.device)
    answer: object = None
    if rank == 0:
        try:
            layers = model_layers(
                meta_model(cfg.model, job.input_shape, job.num_classes), job.input_shape
            )
            cluster = pricing_cluster(cfg.cluster, searched)
            plan = build_plan(cfg, job.procs, layers, job.input_shape, cluster)
            answer = ("plan", plan.with_choices(device=cfg.device).to_json())
        except ConfigError as exc:
            answer = ("error", str(exc))
    kind, text = _broadcast(answer)
    if kind == "error":
        raise ConfigError(text)
    return ParallelPlan.from_dict(json.loads(text))


def _sum_over_world(values: list[float], ledger: Ledger, device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    all_reduce(t, dist.group.WORLD, ledger, Term.METRICS)
    return t.tolist()


def _quiet_rank(P: int) -> None:
    from tqdm import tqdm

    # tqdm's default lock is a multiprocessing RLock: a named semaphore in /dev/shm that a rank
    # killed by a signal would leave behind; a thread lock is all one rank needs
    tqdm.set_lock(threading.RLock())
    # DDP warns once per run when a 1-channel conv's gradient has unusual strides: harmless
    warnings.filterwarnings("ignore", message="Grad strides do not match bucket view strides")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // P))


class Progress:
    """Rank 0's live account of the run: the plan and one line per epoch on stdout (unless quiet),
    the same records as JSON lines next to the report, as they happen."""

    def __init__(self, cfg: TrainConfig, plan: ParallelPlan) -> None:
        self.quiet = cfg.quiet
        self.log = Path(cfg.report).with_suffix(".jsonl") if cfg.report else None
        if self.log is not None:
            self.log.parent.mkdir(parents=True, exist_ok=True)
            self.log.write_text("")
        self.write({"event": "plan", "plan": plan.to_dict()}, plan.describe())

    def write(self, record: dict, line: str) -> None:
        if not self.quiet:
            print(line, flush=True)
        if self.log is not None:
            with self.log.open("a") as f:
                f.write(json.dumps(strict(record), allow_nan=False) + "\n")

    def epoch(self, e: dict) -> None:
        self.write(
            {"event": "epoch", **e},
            f"  epoch {e['epoch']:3d}  loss {e['loss']:.4f}  "
            f"train {e['train_acc']:.4f}  test {e['test_acc']:.4f}  {e['time_s']:.2f} s",
        )


def strict(x):
    """NaN and infinities as null: the report and the log are strict JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: strict(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [strict(v) for v in x]
    return x


def fit(
    trainer: Trainer, data: Dataset, cfg: TrainConfig, pos: Position, log: Progress | None
) -> tuple[list[dict], dict, set[int]]:
    """Train from `pos` to cfg.epochs, checkpointing every cfg.checkpoint_every steps; returns
    (epoch records, per-step timings, the steps with a full batch)."""
    from tqdm import tqdm

    n = len(data.x_train)
    per_epoch = len(epoch_steps(n, cfg.batch, 0, cfg.seed))
    per_epoch = min(per_epoch, cfg.max_steps) if cfg.max_steps else per_epoch
    total = cfg.epochs * per_epoch
    bar = tqdm(
        total=total,
        initial=pos.epoch * per_epoch + pos.index,
        unit="step",
        leave=False,
        desc=f"train {cfg.model} P={trainer.P} {trainer.plan.scenario}",
        disable=log is None or not cfg.progress or not sys.stderr.isatty(),
    )
    epochs, times = list(pos.history), {"time_s": [], "wait_s": [], "blocking_s": []}
    full_steps: set[int] = set()
    for epoch in range(pos.epoch, cfg.epochs):
        t0 = time.perf_counter()
        first = pos.index if epoch == pos.epoch else 0
        sums = list(pos.sums) if epoch == pos.epoch else [0.0, 0.0, 0.0]  # loss, correct, count
        for i, idx in enumerate(epoch_steps(n, cfg.batch, epoch, cfg.seed)[:per_epoch]):
            if i < first:
                continue
            trainer.set_lr((epoch * per_epoch + i) / total)
            if len(idx) == cfg.batch:
                full_steps.add(trainer.step_no)
            result = trainer.step(data.x_train[idx], data.y_train[idx])
            sums = [a + b for a, b in zip(sums, result, strict=True)]
            if i > first:  # the first step after a start pays one-off costs
                for k in times:
                    times[k].append(trainer.last[k])
            bar.update(1)
            if (
                cfg.checkpoint_dir
                and cfg.checkpoint_every
                and trainer.step_no % cfg.checkpoint_every == 0
            ):
                where = Position(epoch, i + 1, trainer.step_no, sums, epochs)
                checkpoint.save(trainer, cfg.checkpoint_dir, where, cfg.checkpoint_keep)
        test = trainer.evaluate(data.x_test, data.y_test, cfg.batch)
        loss, correct, count, tc, tt = _sum_over_world(
            [*sums, *test], trainer.ledger, trainer.device
        )
        epochs.append(
            {
                "epoch": epoch + 1,
                "loss": loss / count,
                "train_acc": correct / count,
                "test_acc": tc / tt,
                "time_s": time.perf_counter() - t0,
            }
        )
        if log is not None:
            log.epoch(epochs[-1])
        bar.set_postfix(loss=f"{epochs[-1]['loss']:.3f}", test=f"{epochs[-1]['test_acc']:.3f}")
    bar.close()
    return epochs, times, full_steps


def train_worker(job: Job) -> dict | None:
    """What every rank runs. Rank 0 writes the weights, the log and the report as it goes and
    returns the report; the others return None."""
    from hybridpar.planning.models import build_model
    from hybridpar.runtime.train.report import measured, report, write_report

    cfg, P, rank = job.cfg, dist.get_world_size(), dist.get_rank()
    _quiet_rank(P)
    plan = agreed_plan(job)
    log = Progress(cfg, plan) if rank == 0 else None
    torch.manual_seed(cfg.seed)
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if cfg.device == "cuda"
        else torch.device("cpu")
    )
    data = load_data(cfg.data, job.input_shape, job.num_classes, seed=cfg.seed).to(device)
    shape = job.input_shape
    model = build_model(
        cfg.model,
        input_size=shape[-1] if len(shape) == 3 else None,
        num_classes=job.num_classes,
        in_channels=shape[0],
    ).to(device)
    trainer = Trainer(cfg, model, plan, input_shape=shape)
    pos = checkpoint.load(trainer, job.resume) if job.resume else Position()
    if log is not None and job.resume:
        how = (
            "onto another plan or P (RNG streams and codec residuals start afresh)"
            if trainer.resharded
            else "bit-exact"
        )
        log.write(
            {"event": "resume", "from": str(job.resume), "step": pos.step},
            f"resumed from {job.resume} at step {pos.step}, {how}",
        )
    epochs, times, full_steps = fit(trainer, data, cfg, pos, log)
    weights = trainer.full_state_dict()  # collective: every rank
    if cfg.checkpoint_dir:
        final = Position(cfg.epochs, 0, trainer.step_no, [0.0, 0.0, 0.0], epochs)
        checkpoint.save(trainer, cfg.checkpoint_dir, final, cfg.checkpoint_keep)
    bytes_measured = measured(trainer.ledger, full_steps)
    hosts = len(set(_hostnames())) if plan.reducer == "host" else 1
    if rank != 0:
        return None
    checkpoint.save_weights(weights, cfg.save)
    out = report(job, plan, data.name, epochs, times, bytes_measured, hosts, trainer.bn_switch)
    # what the optimizer ran with: --lr and --weight-decay after --scale-rule
    out["hparams"] = {"lr": trainer.lr, "weight_decay": trainer.opt.param_groups[0]["weight_decay"]}
    out["written"] = [str(cfg.save)]
    if cfg.report:
        json_path, png = write_report(out, cfg.report)
        out["written"] += [str(json_path), str(log.log)] + ([str(png)] if png else [])
    return out


def _hostnames() -> list[str]:
    import socket

    names: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(names, os.environ.get("HYBRIDPAR_HOST") or socket.gethostname())
    return [str(n) for n in names]
