"""The epoch loop of `hybridpar train` over a HybridTrainer (the library's one step), and
`train_worker`, the function every rank runs: data, the model, the trainer, checkpoints, the
live log and the report. No step of its own: every optimizer step is `HybridTrainer.train_step`."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.distributed as dist

from hybridpar.core.cluster import rank_threads
from hybridpar.core.errors import ConfigError
from hybridpar.core.models import build_any, user_factory
from hybridpar.core.optim import KrizhevskySGD, lr_factor, scale_hparams
from hybridpar.core.plan import ParallelPlan
from hybridpar.core.progress import Phase
from hybridpar.core.terms import Term
from hybridpar.runtime.comm.collectives import Via, all_reduce
from hybridpar.runtime.comm.devices import local_gpu
from hybridpar.runtime.comm.host import host_name
from hybridpar.runtime.launcher import under_torchrun
from hybridpar.runtime.parallel import losses
from hybridpar.runtime.parallel.checkpoint import save_weights
from hybridpar.runtime.parallel.layout import Layout, resolve
from hybridpar.runtime.parallel.trainer import BLOCKING_TERMS, HybridTrainer
from hybridpar.runtime.train.config import TrainConfig
from hybridpar.runtime.train.data import Dataset, epoch_steps, load_data
from hybridpar.runtime.train.job import Job
from hybridpar.runtime.train.plans import agreed_plan
from hybridpar.runtime.train.report import (
    host_layout,
    measured,
    report,
    strict,
    waiting,
    write_report,
)

__all__ = ["Position", "Progress", "fit", "train_worker"]


@dataclass
class Position:
    """Where training stands: the next step is step `index` of epoch `epoch`; `sums` are the
    epoch's loss, correct and count so far over every rank (one rank carries them after a
    resume), `history` the epoch records before it."""

    epoch: int = 0
    index: int = 0
    sums: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    history: list[dict] = field(default_factory=list)

    @staticmethod
    def of(meta: dict | None) -> Position:
        if not meta:
            return Position()
        p = dict(meta["position"])
        p.pop("step", None)  # the step is the engine's (checkpoint metadata "step")
        pos = Position(**p)
        if dist.get_rank() != 0:
            pos.sums = [0.0, 0.0, 0.0]
        return pos


class Progress:
    """Rank 0's live account of the run: the plan and one line per epoch on stdout (unless quiet),
    the same records as JSON lines next to the report, as they happen."""

    def __init__(self, cfg: TrainConfig, plan: ParallelPlan) -> None:
        self.quiet = cfg.quiet
        self.log = Path(cfg.report).with_suffix(".jsonl") if cfg.report else None
        if self.log is not None:
            self.log.parent.mkdir(parents=True, exist_ok=True)
            self.log.write_text("")
        self.board = None  # TensorBoard's writer, with --tensorboard
        if cfg.tensorboard is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.board = SummaryWriter(cfg.tensorboard)
            self.board.add_text("plan", plan.describe())
        self.predicted_s = plan.totals.get("total_s")
        self.steps = 0
        self.write({"event": "plan", "plan": plan.to_dict()}, plan.describe())

    def write(self, record: dict, line: str) -> None:
        if not self.quiet:
            print(line, flush=True)
        if self.log is not None:
            with self.log.open("a") as f:
                f.write(json.dumps(strict(record), allow_nan=False) + "\n")

    def close(self, report: dict) -> None:
        """The run's measured iteration and bytes per term next to their predictions."""
        if self.board is None:
            return
        it, k = report["iteration"], self.steps
        pairs = {
            "total": ("time_s", "predicted_s"),
            "compute": ("compute_s", "predicted_compute_s"),
            "comm": ("comm_wait_s", "predicted_comm_s"),
        }
        for name, keys in pairs.items():
            for source, key in zip(("measured", "predicted"), keys, strict=True):
                if it.get(key) is not None:
                    self.board.add_scalar(f"iteration/{name} ms {source}", it[key] * 1e3, k)
        for source in ("measured", "predicted"):
            for term, v in report["bytes"][source].items():
                self.board.add_scalar(f"bytes per rank/{term} {source}", v, k)
        self.board.close()

    def step(self, record: dict) -> None:
        """A training step's record (the JSON lines leave them out: the report has them)."""
        self.steps = record["step"]
        if self.board is not None:
            k = record["step"]
            self.board.add_scalar("step/loss (rank 0's examples)", record["loss"], k)
            self.board.add_scalar("step/learning rate", record["lr"], k)
            self.board.add_scalar("step/iteration ms", record["time_s"] * 1e3, k)
            if self.predicted_s is not None:
                self.board.add_scalar("step/predicted iteration ms", self.predicted_s * 1e3, k)

    def epoch(self, e: dict) -> None:
        if self.board is not None:
            for key in ("loss", "train_acc", "test_acc", "time_s"):
                self.board.add_scalar(f"epoch/{key}", e[key], e["epoch"])
        miou = ""
        if "test_miou" in e:
            miou = f"  mean IoU {e['test_miou']:.4f}  mean Dice {e['test_mean_dice']:.4f}"
        self.write(
            {"event": "epoch", **e},
            f"  epoch {e['epoch']:3d}  loss {e['loss']:.4f}  "
            f"train {e['train_acc']:.4f}  test {e['test_acc']:.4f}{miou}  {e['time_s']:.2f} s",
        )


def _sum_over_world(trainer: HybridTrainer, values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=trainer.device)
    all_reduce(t, Via(trainer.model.world, trainer.ledger, Term.METRICS))
    return t.tolist()


def _checkpoint(trainer: HybridTrainer, job: Job, pos: Position) -> None:
    """A checkpoint at `pos`, with the epoch's sums taken over every rank (collective)."""
    sums = _sum_over_world(trainer, pos.sums)
    position = {**pos.__dict__, "sums": sums}
    meta = {"position": position, "config": job.config()}
    trainer.save(job.cfg.checkpoint_dir, meta, job.cfg.checkpoint_keep)


def _bar(trainer: HybridTrainer, job: Job, total: int, start: int, shown: bool):
    from tqdm import tqdm

    return tqdm(
        total=total,
        initial=start,
        unit="step",
        leave=False,
        desc=f"train {job.model} P={trainer.plan.procs} {trainer.plan.scenario}",
        disable=not shown or not job.cfg.progress or not sys.stderr.isatty(),
    )


def fit(
    trainer: HybridTrainer, data: Dataset, job: Job, pos: Position, log: Progress | None
) -> tuple[list[dict], dict, set[int]]:
    """Train from `pos` to cfg.epochs, checkpointing every cfg.checkpoint_every steps; returns
    (epoch records, per-step timings, the steps with a full batch, step records: the loss on
    this rank's examples, the learning rate and the time, for at most about 2000 steps)."""
    n, cfg, B = len(data.x_train), job.cfg, job.batch
    seed = cfg.runtime.seed
    per_epoch = len(epoch_steps(n, B, 0, seed))
    per_epoch = min(per_epoch, cfg.max_steps) if cfg.max_steps else per_epoch
    total = cfg.epochs * per_epoch
    groups = trainer.optimizer.param_groups  # --schedule scales each from its initial lr
    for g in groups:
        g.setdefault("initial_lr", g["lr"])
    bar = _bar(trainer, job, total, pos.epoch * per_epoch + pos.index, log is not None)
    epochs, times = list(pos.history), {"time_s": [], "wait_s": [], "blocking_s": []}
    full_steps: set[int] = set()
    steps, stride, started = [], max(1, -(-total // 2000)), False
    trace = _Trace(cfg, trainer.device)
    for epoch in range(pos.epoch, cfg.epochs):
        t0 = time.perf_counter()
        first = pos.index if epoch == pos.epoch else 0
        sums = list(pos.sums) if epoch == pos.epoch else [0.0, 0.0, 0.0]  # loss, correct, count
        for i, idx in enumerate(epoch_steps(n, B, epoch, seed)[:per_epoch]):
            if i < first:
                continue
            factor = lr_factor(cfg.schedule, (epoch * per_epoch + i) / total)
            for g in groups:
                g["lr"] = g["initial_lr"] * factor
            if len(idx) == B:
                full_steps.add(trainer.steps)
            trace.before_step()
            with _first(trainer, log) if not started else contextlib.nullcontext():
                # the second step counts what it holds (the first pays one-off costs)
                count = started and not trainer.counted
                r = trainer.train_step(data.x_train[idx], data.y_train[idx], count)
            started = True
            trace.after_step()
            sums = [sums[0] + r.loss_sum, sums[1] + r.correct, sums[2] + r.count]
            if trainer.steps % stride == 0 and r.count:
                lr = groups[0]["lr"]
                steps.append({"step": trainer.steps, "epoch": epoch + 1, "lr": lr})
                steps[-1].update(loss=r.loss_sum / r.count, time_s=r.time_s)
                if log is not None:
                    log.step(steps[-1])
            if i > first:  # the first step after a start pays one-off costs
                for k in times:
                    times[k].append(getattr(r, k))
            bar.update(1)
            every = cfg.checkpoint_every
            if cfg.checkpoint_dir and every and trainer.steps % every == 0:
                _checkpoint(trainer, job, Position(epoch, i + 1, sums, epochs))
        epochs.append(_epoch_record(trainer, data, B, sums, epoch, t0))
        if log is not None:
            log.epoch(epochs[-1])
        bar.set_postfix(loss=f"{epochs[-1]['loss']:.3f}", test=f"{epochs[-1]['test_acc']:.3f}")
    bar.close()
    trace.close()
    return epochs, times, full_steps, steps


def _first(trainer: HybridTrainer, log: Progress | None) -> Phase:
    """The run's first step, announced on rank 0: it pays one-off costs (the collectives'
    first connections, the allocator's first pages, and with --compile every part's compile)."""
    parts = len(trainer.model.compiled)
    what = f"first step (torch.compile compiles {parts} parts in it)" if parts else "first step"
    return Phase(what, estimate_s=10.0 * parts or None, shown=log is not None and not log.quiet)


def _epoch_record(trainer, data: Dataset, batch: int, sums: list, epoch: int, t0: float) -> dict:
    """The epoch's training loss and accuracy (`sums`: this rank's loss, correct, count) and its
    test accuracy (a dense prediction's per pixel, and its mean IoU), over every rank."""
    dense = len(trainer.model.layout.trace.out_shape) in (3, 4)
    classes = data.num_classes if dense else 0
    tc, tt, overlaps = trainer.evaluate(data.x_test, data.y_test, batch, classes)
    every = _sum_over_world(trainer, [*sums, tc, tt, *overlaps.flatten().tolist()])
    loss, correct, count, tc, tt = every[:5]
    record = {
        "epoch": epoch + 1,
        "loss": loss / count,
        "train_acc": correct / count,
        "test_acc": tc / tt,
        "time_s": time.perf_counter() - t0,
    }
    if dense:
        record["test_miou"] = losses.mean_iou(every[5:], classes)
        record["test_dice"] = losses.dice_scores(every[5:], classes)
        present = [d for d in record["test_dice"] if d == d]  # nan: a class absent
        record["test_mean_dice"] = sum(present) / len(present) if present else float("nan")
    return record


class _Trace:
    """--profile-trace: torch.profiler over 3 steps after this run's first (which pays one-off
    costs), written as a Chrome trace per rank; nothing without the option."""

    STEPS = 3

    def __init__(self, cfg: TrainConfig, device: torch.device) -> None:
        self.path = None
        if cfg.profile_trace is not None:
            self.path = Path(cfg.profile_trace) / f"rank{dist.get_rank()}.json"
        self.device, self.seen, self.prof = device, 0, None

    def before_step(self) -> None:
        if self.path is not None and self.seen == 1 and self.prof is None:
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU]
            if self.device.type == "cuda":
                acts.append(ProfilerActivity.CUDA)
            self.prof = profile(activities=acts)
            with _native_stderr_dropped():
                self.prof.start()

    def after_step(self) -> None:
        self.seen += 1
        if self.prof is not None and self.seen == 1 + self.STEPS:
            self.close()

    def close(self) -> None:
        if self.prof is not None:
            with _native_stderr_dropped():
                self.prof.stop()
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.prof.export_chrome_trace(str(self.path))
            self.prof, self.path = None, None


@contextlib.contextmanager
def _native_stderr_dropped():
    """torch.profiler's C++ side writes a line to the process's stderr as it starts and stops
    ("USDT: ... profiler_start"), which no setting turns off: what it writes meanwhile is
    dropped."""
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def _quiet_rank(P: int) -> None:
    from tqdm import tqdm

    # tqdm's default lock is a multiprocessing RLock: a named semaphore in /dev/shm that a rank
    # killed by a signal would leave behind; a thread lock is all one rank needs
    tqdm.set_lock(threading.RLock())
    # DDP warns once per run when a 1-channel conv's gradient has unusual strides: harmless
    warnings.filterwarnings("ignore", message="Grad strides do not match bucket view strides")
    # the ranks on this host share its cores (torchrun across nodes: LOCAL_WORLD_SIZE of them)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", P))
    torch.set_num_threads(rank_threads(os.cpu_count() or 1, min(P, local)))


def make_trainer(job: Job, plan: ParallelPlan) -> HybridTrainer:
    """The zoo model on this rank's device, with the KrizhevskySGD the config asks for (its lr
    and weight decay scaled from --base-batch by --scale-rule, Krizhevsky section 5)."""
    cfg, shape = job.cfg, job.input_shape
    torch.manual_seed(cfg.runtime.seed)
    device = torch.device("cpu")
    if job.choices.device == "cuda":  # NCCL: its own GPU; gloo: ranks may share one
        device = torch.device("cuda", local_gpu())
        torch.cuda.set_device(device)
    model = build_any(job.model, shape, job.num_classes).to(device)
    k = plan.batch / cfg.base_batch if cfg.base_batch else 1.0
    lr, wd = scale_hparams(cfg.lr, cfg.weight_decay, k, cfg.scale_rule)

    def optimizer(params):
        return KrizhevskySGD(params, lr=lr, momentum=cfg.momentum, weight_decay=wd)

    def head_optimizer(params):  # variable batch: the head sees B/K examples per step
        k_head = plan.batch / _rounds(plan) / cfg.base_batch if cfg.base_batch else 1.0
        lr_h, wd_h = scale_hparams(cfg.lr, cfg.weight_decay, k_head, cfg.scale_rule)
        return KrizhevskySGD(params, lr=lr_h, momentum=cfg.momentum, weight_decay=wd_h)

    return HybridTrainer(
        model,
        plan,
        optimizer,
        options=cfg.runtime,
        layout=_layout(job, model, plan),
        head_optimizer=head_optimizer,
        verify=job.cfg.verify,
        loss=make_loss(cfg.loss),
    )


def make_loss(spec: str):
    """--loss's loss (a user's factory called here, in each rank, as --model's is); a one-line
    ConfigError for one that cannot train."""
    factory = user_factory(spec, "--loss") if ":" in spec else None
    try:
        return losses.named(spec, factory)
    except ValueError as exc:
        raise ConfigError(f"--loss {spec!r}: {str(exc).removeprefix('loss: ')}") from None


def _rss_kb(field: str) -> int | None:
    try:
        status = Path("/proc/self/status").read_text()
        return int(next(x for x in status.splitlines() if x.startswith(field)).split()[1])
    except (OSError, StopIteration):
        return None


def _reset_peak(device: torch.device) -> float:
    """Start the peak memory's count afresh (the training steps', not the data's loading);
    returns the resident set now in MB (0: unknown)."""
    # Linux: VmHWM := the resident set now (elsewhere ru_maxrss: the peak since the start)
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    return (_rss_kb("VmRSS:") or 0) / 1024


def _peak(device: torch.device, base_mb: float) -> dict[str, float]:
    """This rank's peak resident memory in MB since `_reset_peak` (and the CUDA allocator's),
    and the resident set when it was reset."""
    kb = _rss_kb("VmHWM:") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = {"peak_rss_mb": kb / 1024, "base_rss_mb": base_mb}
    if device.type == "cuda":
        out["peak_cuda_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
    return out


def _rounds(plan: ParallelPlan) -> int:
    """K of the last hand-off sent in rounds (the one a variable batch steps per round)."""
    return next((r.rounds for r in reversed(plan.redistributions) if r.scheme != "a"), 1)


def _layout(job: Job, model: torch.nn.Module, plan: ParallelPlan) -> Layout:
    """The parent's layout where `plan` runs as the parent's does (under torchrun rank 0's
    plan differs from the others' in its predictions only: they priced bytes); else the plan
    rank 0 chose, resolved against the parent's trace (no second trace)."""
    mine = job.layout
    if mine is not None and _runs(mine.plan) == _runs(plan):
        return replace(mine, plan=plan)
    return resolve(model, plan, job.input_shape, job.procs, job.trace)


def _runs(plan: ParallelPlan) -> dict:
    """What of a plan a rank runs: all of it but its predictions."""
    return {k: v for k, v in plan.to_dict().items() if k not in ("predicted", "totals", "cluster")}


def train_worker(job: Job) -> dict | None:
    """What every rank runs. Rank 0 writes the weights, the log and the report as it goes and
    returns the report; the others return None."""
    cfg, P, rank = job.cfg, dist.get_world_size(), dist.get_rank()
    _quiet_rank(P)
    plan = job.plan if job.plan is not None and not under_torchrun() else agreed_plan(job)
    log = Progress(cfg, plan) if rank == 0 else None
    trainer = make_trainer(job, plan)
    if log is not None and trainer.checked is not None:
        c = trainer.checked
        record = {"event": "check", "seconds": c.seconds, "skipped": c.skipped}
        log.write({**record, "batch": c.batch, "shape": list(c.shape)}, str(c))
    data = load_data(cfg.data, job.input_shape, job.num_classes, seed=cfg.runtime.seed)
    data = data.to(trainer.device)
    pos = Position.of(trainer.load(job.resume) if job.resume else None)
    if log is not None and job.resume:
        how = "onto another plan or P (RNG streams and codec residuals start afresh)"
        log.write(
            {"event": "resume", "from": str(job.resume), "step": trainer.steps},
            f"resumed from {job.resume} at step {trainer.steps}, "
            + (how if trainer.resharded else "bit-exact"),
        )
    base = _reset_peak(trainer.device)
    begun = trainer.steps
    epochs, times, full_steps, steps = fit(trainer, data, job, pos, log)
    trained = trainer.steps - begun
    peak = _peak(trainer.device, base)
    if trainer.counted:  # what the second step held, counted (memory.py)
        peak["counted_mb"] = sum(trainer.counted.values()) / 2**20
    read, examples, whole = data.reads
    if examples:  # memory-mapped: per example read, the rank's band (and the example whole)
        peak["read_kib"], peak["whole_kib"] = read / examples / 2**10, whole / examples / 2**10
    weights = trainer.full_state_dict()  # collective: every rank
    if cfg.checkpoint_dir:
        _checkpoint(trainer, job, Position(cfg.epochs, 0, [0.0, 0.0, 0.0], epochs))
    bytes_measured = measured(trainer.ledger, full_steps)
    timed = full_steps - {min(full_steps, default=0)}  # as `times`: the first step is left out
    split = waiting(trainer.ledger, timed, BLOCKING_TERMS)
    split["handoff"] = waiting(trainer.ledger, timed, (Term.REDISTRIBUTE,))
    every: list = [None] * P  # each rank's host and peak memory, in rank order
    dist.all_gather_object(every, (host_name(), peak))
    names = [str(n) for n, _ in every]
    if rank != 0:
        return None
    save_weights(weights, job.save)
    engine = trainer.model
    hosts = names if plan.choices.reducer == "host" else None
    args = (epochs, times, bytes_measured, hosts, engine.bn_switch, split, engine.order)
    out = report(job, plan, data.name, *args)
    out["iteration"]["trained"] = trained  # the steps this run took (the first is not timed)
    _describe(out, trainer, plan, steps, names, [p for _, p in every])
    log.close(out)
    out["written"] = [job.save] + ([cfg.tensorboard] if cfg.tensorboard else [])
    if cfg.profile_trace and (Path(cfg.profile_trace) / "rank0.json").exists():  # 2 steps or more
        out["written"].append(str(Path(cfg.profile_trace) / f"rank{{0..{plan.procs - 1}}}.json"))
    if cfg.report:
        json_path, png = write_report(out, cfg.report)
        out["written"] += [str(json_path), str(log.log)] + ([str(png)] if png else [])
    return out


def _describe(out: dict, trainer, plan: ParallelPlan, steps, names, peaks) -> None:
    """What rank 0's report adds to `report`'s: the optimizer's settings, the variable batch's
    head, the per-step losses, what was compiled and recomputed, the memory, the hosts."""
    engine = trainer.model
    # what the optimizer ran with: --lr and --weight-decay after --scale-rule
    group = trainer.optimizer.param_groups[0]
    out["hparams"] = {"lr": trainer.optimizer.defaults["lr"], "weight_decay": group["weight_decay"]}
    head = getattr(trainer.optimizer, "head", None)
    if head is not None:  # Krizhevsky 4.2 (rounds.VariableBatch): the head's own step and batch
        out["variable_batch"] = {
            "rounds": _rounds(plan),
            "head_batch": plan.batch / _rounds(plan),
            "head_lr": head.defaults["lr"],
            "head_weight_decay": head.param_groups[0]["weight_decay"],
        }
    out["steps"] = steps  # rank 0's: the loss on its own examples
    # what --compile compiled and --activation-checkpointing recomputes, and the largest rank's
    # peak memory over the training steps (resident; on a GPU also what torch's allocator held)
    out["compute"] = {"compiled": engine.compiled, "checkpointed": engine.checkpointed}
    out["memory"] = {k: max(p[k] for p in peaks) for k in peaks[0]}
    out["hosts"] = host_layout(names)
    # ranks dealt to hosts otherwise than host by host: the groups follow the hosts (engine.order)
    # where the plan's ordered groups allow it, else the prices assume what did not happen
    out["hosts"]["followed"] = engine.order is not None
    if engine.why_not_hosts:
        print(
            "hybridpar: the ranks are not numbered host by host (e.g. dealt round-robin) and "
            f"the plan's groups cannot follow the hosts: {engine.why_not_hosts}",
            file=sys.stderr,
            flush=True,
        )
