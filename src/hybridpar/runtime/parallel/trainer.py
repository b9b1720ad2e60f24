"""HybridTrainer: the one training step, for `hybridpar train` and for users' own loops.

An engine (HybridParallel or DDPEngine: hybridpar.runtime.parallel.engine) asks for four things
each step, in order: the global batch size (`set_batch`), this rank's rows in (`input_rows`) and
out (`output_rows`), a loss summed over the rows and divided by the global batch (every gradient
is then a plain sum over ranks), and the wait for the gradient sums (`finish_backward`) before the
optimizer step. `HybridTrainer.step(x, y)` does exactly that, so none of it can be forgotten or
done in the wrong order; `train_step` is the same step without the loss's all-reduce (the epoch
loop sums its metrics once per epoch). `save(dir)` and `load(dir)` checkpoint the engine and the
optimizer through torch.distributed.checkpoint, resharding onto another plan or P.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from hybridpar.core import faults
from hybridpar.core.errors import ConfigError
from hybridpar.core.plan import ParallelPlan
from hybridpar.core.terms import Term
from hybridpar.runtime.comm.collectives import Via, all_gather_uneven, all_reduce
from hybridpar.runtime.comm.ledger import Ledger
from hybridpar.runtime.options import RuntimeOptions
from hybridpar.runtime.parallel import checkpoint, losses, memory, rounds
from hybridpar.runtime.parallel.api import parallelize
from hybridpar.runtime.parallel.engine import Engine
from hybridpar.runtime.parallel.layout import Layout, resolve
from hybridpar.runtime.parallel.mappings import joined, summed
from hybridpar.runtime.parallel.verify import Checked, check_plan

__all__ = ["HybridTrainer", "StepResult", "own_outputs"]

# the collectives a rank waits in during its forward and backward (the time split's "comm"): the
# activations' and the hand-offs', and the global batch norms' and the halos' (they block too:
# left out, resnet20's batch-norm sums across two hosts were counted as compute, docs/cluster.md)
BLOCKING_TERMS = (
    Term.ALLGATHER,
    Term.DX_ALLREDUCE,
    Term.DX_ALLGATHER,
    Term.REDISTRIBUTE,
    Term.BN_STATS,
    Term.BN_GRAD,
    Term.HALO_FWD,
    Term.HALO_BWD,
)


@dataclass(frozen=True)
class StepResult:
    """One step on this rank: the loss summed over the outputs it counts (model-group replicas
    count theirs once), how many of them its argmax got right (for class labels), how many it
    counts, and where the step's time went."""

    loss_sum: float
    correct: int
    count: int
    time_s: float
    wait_s: float  # waiting for gradient sums after the backward pass
    blocking_s: float  # inside the forward/backward's synchronous activation collectives


class HybridTrainer:
    """Train `model` with `plan`: every rank calls `step(x, y)` with the same global batch.

    optimizer: a function of the parameters, e.g. `lambda ps: torch.optim.SGD(ps, lr=0.01)`
    (the model's parameters are this rank's shards, known only after parallelize).
    loss: a torch loss, as a module (nn.CrossEntropyLoss(label_smoothing=0.1), nn.MSELoss(), ...)
    or a function that takes `reduction="sum"` (F.cross_entropy, a functools.partial of it),
    whose sum is divided as torch's `reduction="mean"` divides it on the whole batch (per pixel
    for a dense prediction, whose targets y are (B, H, W) or (B, C, H, W)), by 1 where the loss
    sums; a loss of the whole batch's sums (losses.Dice, losses.DiceCE); or any other callable
    (a lambda that returns a mean, another library's Dice), run on the whole batch's outputs
    joined on every rank (runtime/parallel/losses.py).
    options: how the runtime runs (hybridpar.runtime.options.RuntimeOptions).
    layout: the plan already resolved against this model (`hybridpar train` resolves it once).
    head_optimizer: with `options.variable_batch`, the optimizer of the layers after the hand-off
    sent in rounds (default: `optimizer`); `self.optimizer` is then a rounds.VariableBatch.
    verify: before anything else, check the plan on a small float64 copy of the model against
    one process (runtime/parallel/verify.py; `self.checked` says what it found); a plan that
    computes something else stops here, naming the first module that differs."""

    def __init__(
        self,
        model: nn.Module,
        plan: ParallelPlan,
        optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
        loss: Callable[..., torch.Tensor] = F.cross_entropy,
        options: RuntimeOptions | None = None,
        *,
        ledger: Ledger | None = None,
        layout: Layout | None = None,
        input_shape: tuple[int, ...] | None = None,
        head_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None,
        verify: bool = True,
    ) -> None:
        if not callable(optimizer) or isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                "optimizer: pass a function of the parameters, e.g. "
                "lambda params: torch.optim.SGD(params, lr=0.01)"
            )
        loss = losses.as_function(loss)
        self.options = options or RuntimeOptions()
        self.ledger = ledger if ledger is not None else Ledger()
        self.checked: Checked | None = None
        """what the plan's check before the first step ran and found (verify.py); None: off"""
        if verify:
            if layout is None:
                layout = resolve(model, plan, input_shape, dist.get_world_size())
            self.checked = check_plan(model, plan, layout, loss, self.options, type(self))
        self.model: Engine = parallelize(
            model, plan, self.options, ledger=self.ledger, layout=layout, input_shape=input_shape
        )
        self.optimizer = rounds.optimizer_for(self, optimizer, head_optimizer)
        self.target: torch.Tensor | None = None
        """this step's targets of this rank's output rows"""
        self.loss = loss
        self.counted: dict[str, int] = {}
        """what the last step run with `count` held: bytes by kind (memory.py)"""
        self.divisor = torch.ones((), dtype=torch.float64)
        """what the last step's loss sum was divided by (losses.divisor)"""
        self.places: dict[int, list[tuple]] = {}
        """per batch size, where every rank's outputs lie in the whole batch's (a joined loss)"""
        self.resharded = False
        self.last: StepResult | None = None

    @property
    def plan(self) -> ParallelPlan:
        return self.model.plan

    @property
    def steps(self) -> int:
        """Optimizer steps taken (the engine's one step counter)."""
        return self.model.step

    @property
    def device(self) -> torch.device:
        p = next(self.model.parameters(), None)
        return p.device if p is not None else torch.device("cpu")

    def autocast(self):
        """bf16 autocast of the forward pass and the loss under amp bf16 (weights, gradients and
        the optimizer stay float32)."""
        enabled = self.plan.choices.amp == "bf16"
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=enabled)

    def train_step(self, x: torch.Tensor, y: torch.Tensor, count: bool = False) -> StepResult:
        """One optimizer step on the global batch (x, y), identical on every rank; this rank's
        share of the metrics, no collective beyond the step's own. `count`: also count what the
        step holds (`self.counted`: memory.state_bytes and what the forward kept)."""
        n = len(x)
        if len(y) != n:
            raise ValueError(f"x has {n} examples but y has {len(y)}")
        t0, m, step = time.perf_counter(), self.model, self.model.step
        self.ledger.step = step
        faults.set_step(step)
        first_entry = len(self.ledger.entries)
        if not m.training:  # after `evaluate` only: train() walks every module
            m.train()
        m.set_batch(n)
        faults.at("forward")
        self.target = target = _mine(y, m)
        with self.autocast(), memory.Kept(m) if count else contextlib.nullcontext() as kept:
            out = m(_take(x, m.input_rows(n), m.input_band(), _dims(m.layout.trace.in_shape)))
            if isinstance(self.loss, losses.Joined):
                loss_sum, objective = self._joined(out, y, target)
            else:
                if losses.by_sums(self.loss):
                    loss_sum, self.divisor = self._whole_batch(out, target)
                else:
                    loss_sum = self.loss(out, target, reduction="sum")
                    self.divisor = self._divisor(y, target)
                objective = loss_sum / self.divisor.to(loss_sum)
        if out.requires_grad:
            out.register_hook(lambda g: faults.at("backward"))
        self.optimizer.zero_grad(set_to_none=True)
        objective.backward()
        wait = m.finish_backward()
        # the step's one read of the device, once its backward is queued (on a GPU a read waits
        # for the work before it: read after the forward, it kept the backward from being
        # queued meanwhile), and before the parameters change
        numbers = [loss_sum.detach().double(), _correct(out, target)]
        numbers.append(losses.counted(self.loss, target).to(numbers[0].device))
        value, correct, count = torch.stack(numbers).tolist()
        if not math.isfinite(value) and not self.options.allow_nonfinite:
            raise FloatingPointError(
                f"the loss is {value} at step {step}: lower --lr or check the data "
                "(or pass --allow-nonfinite)"
            )
        faults.at("optimizer")
        self.optimizer.step()
        if kept is not None:
            self.counted = {**memory.state_bytes(m, self.optimizer), "kept": kept.bytes}
        entries = self.ledger.entries[first_entry:]
        blocking = sum(e.seconds for e in entries if e.term in BLOCKING_TERMS)
        counted = (value, int(correct), int(count)) if m.counts_outputs else (0.0, 0, 0)
        self.last = StepResult(*counted, time.perf_counter() - t0, wait, blocking)
        if m.bn_switch is not None:
            m.bn_switch.observe(counted[0], counted[2], counted[1])
        return self.last

    def _divisor(self, y, target: torch.Tensor) -> torch.Tensor:
        """What the summed loss is divided by (losses.divisor) over the global batch's targets
        `y`; of targets not read whole (`take_rows`: memory-mapped), from their shape, or where the
        labels decide it (ignored ones, class weights) from the ranks' own targets, summed."""
        if not hasattr(y, "take_rows"):
            return losses.divisor(self.loss, y)
        by_shape = losses.divisor_by_shape(self.loss, tuple(y.shape), y.dtype.is_floating_point)
        if by_shape is not None:
            return torch.tensor(by_shape, dtype=torch.float64)
        m = self.model
        mine = losses.divisor(self.loss, target) if m.counts_outputs else target.new_zeros(())
        total = mine.double().reshape(1).clone()
        all_reduce(total, Via(m.world, self.ledger, Term.METRICS))
        return total[0]

    def _whole_batch(self, out: torch.Tensor, target: torch.Tensor):
        """(the loss times this rank's labels, those labels) of a loss over the whole batch's
        sums (losses.by_sums: Dice): every rank holds other pixels or examples, its sums and
        labels are all-reduced (one call, forward only) and every rank computes the loss of the
        total."""
        m = self.model
        if not m.counts_outputs or (self.plan.engine == "hybridpar" and m.styles[-1].replicated):
            raise ConfigError(
                f"the {type(self.loss).__name__} loss needs every rank to hold other outputs: end "
                "the plan with a batch "
                "or domain layer, not a model-parallel one"
            )
        mine = losses.counted(self.loss, target).to(out.device)
        sums = self.loss.sums(out, target)
        both = torch.cat([sums.flatten(), mine.to(sums.dtype).view(1)])
        total = summed(both, Via(m.world, self.ledger, Term.METRICS))
        value = self.loss.value(total[:-1].view(sums.shape))
        # reported as a sum over this rank's labels (the epoch's mean weighs steps by them), and
        # divided by them again: every rank back-propagates the whole value into its own sums
        return value * mine.to(out.dtype), mine.clamp_min(1)

    def _joined(self, out: torch.Tensor, y, target: torch.Tensor):
        """(the loss times this rank's labels, the loss) of a loss that does not split
        (losses.Joined): every rank's outputs joined into the whole batch's on every rank (booked
        as loss_join), the loss of those and the whole targets; backward each rank takes the
        gradient of its own outputs (a replica's too: it holds the same)."""
        m, n = self.model, len(y)
        via = Via(m.world, self.ledger, Term.LOSS_JOIN, m.layout.layers[-1].name)
        places = self._places(n, Via(m.world, self.ledger, Term.METRICS))
        whole = joined(out, places, (n, *m.layout.trace.out_shape), via)
        ys = y.take_rows(slice(None)) if hasattr(y, "take_rows") else y
        value = self.loss(whole, ys.to(whole.device))
        mine = losses.counted(self.loss, target).to(out.device)
        mine = mine if m.counts_outputs else mine * 0
        self.divisor = mine.clamp_min(1)
        return value.detach() * mine.to(value.dtype), value

    def _places(self, n: int, via: Via) -> list[tuple]:
        """Where every rank's outputs lie in the whole batch's (its examples, band or tile):
        gathered once per batch size."""
        if n not in self.places:
            m = self.model
            t = torch.tensor(_where(m, n), dtype=torch.int64, device=self.device)
            every = all_gather_uneven(t, [6] * m.world.size, 0, via).view(-1, 6).tolist()
            self.places[n] = [_place(v) for v in every]
        return self.places[n]

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """One optimizer step on the global batch (x, y); returns its mean loss (one small
        all-reduce of the loss sums over the ranks)."""
        r = self.train_step(x, y)
        total = torch.tensor([r.loss_sum, r.count], dtype=torch.float64, device=self.device)
        all_reduce(total, Via(self.model.world, self.ledger, Term.METRICS))
        if losses.by_sums(self.loss) or isinstance(self.loss, losses.Joined):  # times the labels
            return float(total[0] / total[1])
        return float(total[0]) / float(self.divisor)

    @torch.no_grad()
    def evaluate(
        self, x: torch.Tensor, y: torch.Tensor, batch: int, classes: int = 0
    ) -> tuple[int, int, torch.Tensor]:
        """(correct, counted, overlaps) of this rank's counted outputs over (x, y) in batches of
        `batch`, in evaluation mode: right class labels, labels counted (examples, or pixels of
        a dense prediction), and with `classes` > 0 each class's pixels predicted and labelled
        both and either (losses.overlaps; float64, 2 x classes); sum each over the ranks for
        the accuracy and the mean IoU (losses.mean_iou)."""
        m = self.model
        m.eval()
        self.ledger.step = -1  # evaluation traffic is not part of any training iteration
        correct = total = 0
        overlaps = torch.zeros((2, classes), dtype=torch.float64)
        for i in range(0, len(x), batch):
            xb, yb = x[i : i + batch], y[i : i + batch]
            n = len(xb)
            m.set_batch(n)
            with self.autocast():
                out = m(_take(xb, m.input_rows(n), m.input_band(), _dims(m.layout.trace.in_shape)))
            if m.counts_outputs:
                target = _mine(yb, m)
                correct += int(_correct(out, target))
                total += int(losses.counted(self.loss, target))
                if classes:
                    overlaps += losses.overlaps(out, target, classes, self.loss).cpu()
        return correct, total, overlaps

    @torch.no_grad()
    def predict(self, x: torch.Tensor, out=None) -> torch.Tensor | None:
        """The model's outputs for the global batch x (evaluation mode). Without `out` they are
        joined whole on every rank: for small outputs only (each rank then holds all of them).
        With `out` nothing is joined: each rank puts the outputs it computed (its examples, its
        band or tile) in their place of the whole outputs, `out[index] = part` into an array of
        their shape every rank has open (`np.lib.format.open_memmap(path, mode="r+")`), or
        `out(index, part)` with a function; a model-group replica writes nothing. Returns None
        then."""
        part, index = own_outputs(self.model, x, self.autocast())
        if out is None:
            return self.model.gather_output(part)
        if index is None:
            return None
        if callable(out):
            out(index, part)
        else:  # a tensor takes the part, an array (numpy's memmap) its values
            out[index] = part if isinstance(out, torch.Tensor) else part.cpu().numpy()
        return None

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The original model's state_dict, shards gathered (every rank calls it)."""
        return self.model.full_state_dict()

    def save(self, directory: str | Path, meta: dict | None = None, keep: int = 2) -> Path:
        """Checkpoint the model and the optimizer into `directory` (collective; atomic): a folder
        `step-N` per checkpoint, the newest `keep` kept, `latest` pointing at the last."""
        return checkpoint.save(self.model, self.optimizer, directory, meta, keep)

    def load(self, path: str | Path) -> dict:
        """Go on from a checkpoint (a folder `save` wrote into, or one `step-N` in it), on this or
        another plan and P; returns its metadata. On the same plan and P training continues bit
        for bit (random streams and codec residuals included); elsewhere `resharded` is set."""
        meta, same = checkpoint.load(self.model, self.optimizer, path)
        self.resharded = not same
        return meta


@torch.no_grad()
def own_outputs(m: Engine, x, autocast=None) -> tuple[torch.Tensor, tuple | None]:
    """(this rank's outputs of the global batch x in evaluation mode, their index in the whole
    outputs: its examples and of them its band or tile; None for a model-group replica, whose
    outputs another rank holds). Of x a rank reads only its own examples, rows and columns."""
    m.eval()
    n = len(x)
    m.set_batch(n)
    with autocast or contextlib.nullcontext():
        out = m(_take(x, m.input_rows(n), m.input_band(), _dims(m.layout.trace.in_shape)))
    return out, _place(_where(m, n)) if m.counts_outputs else None


def _where(m: Engine, n: int) -> list[int]:
    """Where this rank's outputs of a batch of n lie in the whole batch's, as six integers
    (`_place` reads them)."""
    rows, band = m.output_rows(n), m.output_band()
    spans = [] if band is None else list(band if isinstance(band[0], tuple) else (band,))
    mine = [rows.start, rows.stop] + [v for s in spans for v in s]
    return mine + [-1] * (6 - len(mine))


def _place(v: list[int]) -> tuple:
    """An index of the whole outputs from (first example, last + 1, then per split dim from
    2 on its first and last + 1; -1 where none)."""
    spans = [slice(v[i], v[i + 1]) for i in (2, 4) if v[i] >= 0]
    return (slice(v[0], v[1]), *([slice(None)] + spans if spans else []))


def _dims(shape: tuple[int, ...]) -> int:
    """The spatial dimensions of a per-example shape (C, H, W) or (C, D, H, W): 2 or 3."""
    return max(len(shape) - 1, 1)


def _take(x, rows: slice, band: tuple | None, dims: int = 2) -> torch.Tensor:
    """Of a global batch `x`, the examples `rows` and of them the rows `band` (lo, hi) of the
    first of its `dims` spatial dimensions (the height; a volume's depth), or a tile's rows and
    columns ((lo, hi), (first, last + 1)); a batch not read yet (`take_rows`: memory-mapped)
    reads only those."""
    if hasattr(x, "take_rows"):
        return x.take_rows(rows, band, dims)
    x = x[rows]
    if band is None:
        return x
    for d, (lo, hi) in enumerate(band if isinstance(band[0], tuple) else (band,)):
        x = x.narrow(x.dim() - dims + d, lo, hi - lo)
    return x


def _mine(y, m: Engine) -> torch.Tensor:
    """This rank's targets of a global batch's `y`: its examples, and of a dense prediction split
    by height its band of rows (of a volume's, by depth)."""
    out, shape = m.layout.trace.out_shape, tuple(y.shape)
    dims = _dims(out)
    if len(out) in (3, 4) and len(shape) >= len(out) and shape[-dims:] != out[1:]:
        size = " x ".join(map(str, out[1:]))
        raise ValueError(
            f"targets of shape {shape} do not match the outputs' {size} pixels: give y as "
            f"(B, {', '.join(map(str, out[1:]))}) or (B, C, {', '.join(map(str, out[1:]))})"
        )
    return _take(y, m.output_rows(len(y)), m.output_band(), dims)


def _correct(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """How many rows' (or pixels') argmax over the classes is their class label (0 where the
    targets are not class labels), as a float64 tensor on the outputs' device (read with the
    loss, in one go)."""
    if out.dim() != target.dim() + 1 or out.dim() < 2 or target.is_floating_point():
        return torch.zeros((), dtype=torch.float64, device=out.device)
    return (out.argmax(1) == target).sum().double()
