"""The device matrix (issue 38): every style and plan-wide choice, run through the public API
(`ParallelPlan` + `HybridTrainer`) on P ranks on one device, against one process on the same
device. tests/test_device_matrix.py runs it on the CPU under CUDA's device rules
(tests/device_rules.py); benchmarks/gpu_check.py runs it on a GPU (ranks sharing it over gloo).

The model is a small residual CNN with batch norm and a two-layer FC head (not a flat
Sequential). Each cell's plan is priced and exported by the planner (`evaluate`, `export`), so
a refusal is the planner's rule, the same one the runtime applies. The checks, by kind:

| kind     | reference (one process, same device)                          | tolerance            |
| -------- | ------------------------------------------------------------- | -------------------- |
| exact    | SGD on the whole batch, float64                               | rtol 1e-7, atol 1e-10 |
| chunks   | local BN: each rank's examples normalised alone; parameters    | rtol 1e-7, atol 1e-10 |
| lossy    | 8-bit codecs: the update (parameters - initial) of one process | 20 % of its norm     |
| bf16     | bf16 autocast in one process, float32 weights: the update      | 25 % of its norm     |
| dropout  | one process drawing the same counter-based masks              | rtol 1e-7, atol 1e-10 |
| variable | Krizhevsky 4.2 in one process: the head steps every round      | rtol 1e-7, atol 1e-10 |
| resume   | saved on this device after 2 steps, resumed on the CPU (and    | rtol 1e-7, atol 1e-10 |
|          | the reverse) for the third, against 3 steps straight          |                      |
| refused  | the planner must refuse the plan with a reason                |                      |
"""

from __future__ import annotations

import fnmatch
import math
import os
import tempfile
import time
import traceback
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from nets import variable_batch_step
from torch import nn
from torch.nn import functional as F

from hybridpar.core.analysis import analyze
from hybridpar.core.choices import Choices
from hybridpar.core.cluster import Cluster
from hybridpar.core.handoff import Handoff
from hybridpar.core.layers import cost_layers
from hybridpar.core.optim import KrizhevskySGD
from hybridpar.core.plan import Style
from hybridpar.planning.request import PlanRequest
from hybridpar.planning.search import evaluate, export
from hybridpar.runtime.options import RuntimeOptions
from hybridpar.runtime.parallel.dropout import counter_dropout
from hybridpar.runtime.parallel.trainer import HybridTrainer

SHAPE, B, STEPS, CLASSES, SEED = (1, 8, 8), 12, 3, 5, 7
NET = Cluster("test-net", alpha=1e-6, beta=1e-9, flops=1e12)
# the update's error allowed for the lossy kinds (update_error). A gradient summed over half the
# batch is off by 127 % (tests/test_device_matrix.py checks it); bf16 autocast alone moves this
# model's update by 13 % from float32 in one process, and the split run's bf16 sums round in
# another order (11 % from one process's bf16 run on the CPU).
TOLERANCE = {"lossy": 0.20, "bf16": 0.25}
TRUNK = ("conv", "bn", "block.*")
HEAD = ("head.*",)


class Block(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))) + x)


class ResHead(nn.Module):
    """conv-BN-ReLU, a residual block, a 1x1 convolution, max pool, flatten in forward, then a
    head Linear-ReLU-Dropout-Linear."""

    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.block = Block(4)
        self.mix, self.pool = nn.Conv2d(4, 4, 1), nn.MaxPool2d(2)
        self.head = nn.Sequential(
            nn.Linear(4 * 4 * 4, 12), nn.ReLU(), nn.Dropout(p), nn.Linear(12, CLASSES)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.mix(self.block(torch.relu(self.bn(self.conv(x))))))
        return self.head(torch.flatten(x, 1))


@dataclass(frozen=True)
class Cell:
    name: str
    styles: dict[str, str] = field(default_factory=dict)  # layer pattern -> style ("2x1" grids)
    choices: dict = field(default_factory=dict)
    options: dict = field(default_factory=dict)
    handoff: tuple[str, int] | None = None  # the scheme and rounds into fc1
    kind: str = "exact"
    dropout: float = 0.0
    hosts: bool = False  # each rank on a host of its own (emulated by name: HYBRIDPAR_HOST)
    engine: str = "hybridpar"  # or torch DDP (the `ddp` preset)


def _every(patterns: tuple[str, ...], style: str) -> dict[str, str]:
    return {p: style for p in patterns}


MODEL_HEAD = _every(HEAD, "model(2x1)")
DOMAIN = _every(TRUNK, "domain(2x1)")
CELLS = [
    Cell("all batch, global BN"),
    Cell("torch DDP engine, global BN", engine="ddp"),
    Cell("FC model(2x1), hand-off (a)", MODEL_HEAD),
    Cell("model(2x1) everywhere", _every((*TRUNK, *HEAD), "model(2x1)")),
    Cell("domain(2x1) trunk", DOMAIN),
    Cell("domain trunk + model head", {**DOMAIN, **MODEL_HEAD}),
    Cell("domain trunk, states sharded (FSDP2)", DOMAIN, {"shard_states": True}),
    Cell("1x2 tiles trunk + model head", {**_every(TRUNK, "domain(1x2x1)"), **MODEL_HEAD}),
    Cell("all batch, host reducer", choices={"reducer": "host"}),
    Cell("FC hand-off (b)", MODEL_HEAD, handoff=("b", 2)),
    Cell("FC hand-off (c), 2 rounds", MODEL_HEAD, handoff=("c", 2)),
    Cell("variable batch, (c) 2 rounds", MODEL_HEAD, handoff=("c", 2), kind="variable"),
    Cell("all batch, local BN", choices={"bn": "local"}, kind="chunks"),
    Cell("dropout 0.5, model head", MODEL_HEAD, kind="dropout", dropout=0.5),
    Cell("bf16 autocast, model head", MODEL_HEAD, choices={"amp": "bf16"}, kind="bf16"),
    Cell("8-bit grads", choices={"codec": "dynamic-tree", "compress": "grads"}, kind="lossy"),
    Cell(
        "8-bit activations, model head",
        MODEL_HEAD,
        choices={"codec": "dynamic-tree", "compress": "activations"},
        kind="lossy",
    ),
    Cell(
        "domain trunk, 8-bit grads",
        DOMAIN,
        {"codec": "dynamic-tree", "compress": "grads"},
        kind="lossy",
    ),
    Cell(
        "host reducer, 2 hosts, 8-bit leaders",
        choices={"codec": "dynamic-tree", "compress": "grads", "reducer": "host"},
        kind="lossy",
        hosts=True,
    ),
    Cell(
        "adaptive BN, checkpoint",
        MODEL_HEAD,
        choices={"bn": "adaptive"},
        options={"bn_window": 1, "bn_threshold": 10.0},
        kind="resume",
    ),
    Cell("domain trunk, 8-bit activations", DOMAIN, {"codec": "dynamic-tree"}, kind="refused"),
]


def model(dtype: torch.dtype, device: torch.device, p: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    return ResHead(p).to(device=device, dtype=dtype)


def data(dtype: torch.dtype, device: torch.device, steps: int = STEPS) -> list:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        x = torch.randn(B, *SHAPE, generator=g, dtype=torch.float64).to(dtype)
        out.append((x.to(device), torch.randint(0, CLASSES, (B,), generator=g).to(device)))
    return out


def optimizer(params) -> KrizhevskySGD:
    return KrizhevskySGD(params, lr=0.1, momentum=0.9, weight_decay=5e-4)


def plan_of(cell: Cell, P: int, dtype: torch.dtype):
    """The cell's plan as the planner prices and exports it, or the planner's reason."""
    with torch.device("meta"):
        layers = cost_layers(analyze(ResHead(cell.dropout).to(dtype), SHAPE))

    def style(name: str) -> Style:
        for pattern, text in cell.styles.items():
            if fnmatch.fnmatchcase(name, pattern):
                return Style.parse(text, P)
        return Style.batch(P)

    choices = Choices(**cell.choices)
    handoffs = {"head.0": Handoff(*cell.handoff)} if cell.handoff else None
    e = torch.finfo(dtype).bits // 8
    priced = evaluate(
        layers,
        [style(x.name) for x in layers],
        PlanRequest(P, B, NET, choices=choices, elem_bytes=e),
        handoffs=handoffs,
    )
    if not priced.feasible:
        return priced.reason
    return export(priced, procs=P, batch=B, choices=choices, input_shape=SHAPE, engine=cell.engine)


# --- one process, on the same device ------------------------------------------------------------


def _steps(net: nn.Module, batches, forward=None, autocast: bool = False) -> dict:
    opt = optimizer(net.parameters())
    for x, y in batches:
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
            out = forward(net, x) if forward else net(x)
            loss = F.cross_entropy(out, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return net.state_dict()


def _chunks(P: int):
    """Local BN: each rank's rows through the model alone, the loss over all of them."""
    from hybridpar.core.splits import even_split

    def forward(net, x):
        sizes = even_split(len(x), P)
        return torch.cat([net(piece) for piece in torch.split(x, sizes)])

    return forward


def _variable_reference(dtype, device, batches, P: int, K: int) -> dict:
    """Krizhevsky 4.2 in one process: the trunk once on the whole batch, per round of scheme (c)
    the head's mean loss, backward and step; the trunk's gradient from the rounds' shares."""
    from hybridpar.core.handoff import round_rows
    from hybridpar.core.splits import even_split

    net = model(dtype, device)
    head = net.head
    ids = {id(p) for p in head.parameters()}
    trunk_opt = optimizer([p for p in net.parameters() if id(p) not in ids])
    head_opt = optimizer(head.parameters())
    rows = even_split(B, P)
    starts = [sum(rows[:i]) for i in range(P)]
    rounds = []
    for j in range(K):
        ex = []
        for i in range(P):
            per = round_rows(rows[i], "c", K, i)
            ex += range(starts[i] + sum(per[:j]), starts[i] + sum(per[: j + 1]))
        rounds.append(ex)
    for x, y in batches:
        h = torch.flatten(net.pool(net.mix(net.block(torch.relu(net.bn(net.conv(x)))))), 1)
        variable_batch_step(h, y, rounds, head, head_opt, trunk_opt)
    return net.state_dict()


# --- the cells on P ranks -----------------------------------------------------------------------


def _trainer(cell: Cell, plan, dtype, device, shm: bool) -> HybridTrainer:
    options = RuntimeOptions(
        seed=SEED, codec_block=16, host_stage_mb=0.0, shared_memory=shm, **cell.options
    )
    if cell.kind == "variable":
        options = options.with_(variable_batch=True)
    return HybridTrainer(model(dtype, device, cell.dropout), plan, optimizer, options=options)


def _trained(t: HybridTrainer, batches) -> dict:
    for x, y in batches:
        t.train_step(x, y)
    return t.full_state_dict()


def _close(got: dict, want: dict, keys, rtol: float, atol: float) -> str:
    for k in keys:
        a, b = got[k].double().cpu(), want[k].double().cpu()
        if not torch.allclose(a, b, rtol=rtol, atol=atol):
            return f"{k}: largest difference {(a - b).abs().max().item():.3g}"
    return ""


def update_error(got: dict, want: dict, start: dict) -> float:
    """How far the parameters' update (got - start) is from one process's (want - start): the
    norm of the difference over the norm of the update, all parameters together (one tensor's
    update can be about 0, e.g. a bias before batch norm)."""
    off = norm = 0.0
    for k, s in start.items():
        if s.is_floating_point() and "running" not in k:
            dw = want[k].double().cpu() - s.double().cpu()
            off += (got[k].double().cpu() - s.double().cpu() - dw).square().sum().item()
            norm += dw.square().sum().item()
    return math.sqrt(off / norm)


def _within(err: float, most: float) -> tuple[bool, str]:
    return err <= most, f"update off by {100 * err:.1f} % (at most {100 * most:g} %)"


def _resume(cell: Cell, plan, dtype, device, batches, folder: str, shm: bool) -> str:
    """Saved after 2 steps on one device, resumed on the other for the last: the run straight
    through on `device` against (device -> cpu) and (cpu -> device)."""
    cpu = torch.device("cpu")
    straight = _trained(_trainer(cell, plan, dtype, device, shm), batches)
    problems = []
    for first, then in ((device, cpu), (cpu, device)):
        t = _trainer(cell, plan, dtype, first, shm)
        _trained(t, [(x.to(first), y.to(first)) for x, y in batches[:2]])
        t.save(f"{folder}/{first.type}")
        again = _trainer(cell, plan, dtype, then, shm)
        again.load(f"{folder}/{first.type}")
        got = _trained(again, [(x.to(then), y.to(then)) for x, y in batches[2:]])
        why = _close(got, straight, straight, 1e-7, 1e-10)
        if why:
            problems.append(f"{first.type} -> {then.type}: {why}")
    switched = t.model.bn_switch.record()["switched_at_step"] if t.model.bn_switch else 0
    if cell.choices.get("bn") == "adaptive" and switched is None:
        problems.append("adaptive BN never turned global")
    return "; ".join(problems)


def run_cell(
    cell: Cell, device: torch.device, dtype: torch.dtype = torch.float64, shm: bool = True
) -> tuple:
    """(result, detail, seconds) of one cell on this rank: match, DIFFERS, refused or CRASH.
    Every rank of the world takes part; rank 0's answer is the cell's."""
    t0 = time.perf_counter()
    P = dist.get_world_size()
    if cell.kind == "bf16":
        dtype = torch.float32
    plan = plan_of(cell, P, dtype)
    if isinstance(plan, str):
        return ("refused" if cell.kind == "refused" else "CRASH", plan, time.perf_counter() - t0)
    if cell.kind == "refused":
        return ("DIFFERS", "the planner accepted a plan it must refuse", time.perf_counter() - t0)
    batches = data(dtype, device)
    if cell.hosts:
        os.environ["HYBRIDPAR_HOST"] = f"host{dist.get_rank()}"
    try:
        return _compared(cell, plan, dtype, device, batches, shm, t0)
    finally:
        os.environ.pop("HYBRIDPAR_HOST", None)


def _compared(cell: Cell, plan, dtype, device, batches, shm: bool, t0: float) -> tuple:
    P = dist.get_world_size()
    if cell.kind == "resume":
        with tempfile.TemporaryDirectory() as d:
            box = [d]
            dist.broadcast_object_list(box, src=0)
            why = _resume(cell, plan, dtype, device, batches, box[0], shm)
            dist.barrier()
        return ("DIFFERS" if why else "match", why, time.perf_counter() - t0)
    got = _trained(_trainer(cell, plan, dtype, device, shm), batches)
    start = model(dtype, device, cell.dropout).state_dict()
    if cell.kind == "variable":
        want = _variable_reference(dtype, device, batches, P, cell.handoff[1])
    elif cell.kind == "dropout":
        net = counter_dropout(model(dtype, device, cell.dropout), SEED)
        want = _steps(net, batches)
    else:
        forward = _chunks(P) if cell.kind == "chunks" else None
        want = _steps(model(dtype, device), batches, forward, autocast=cell.kind == "bf16")
    if cell.kind in TOLERANCE:
        ok, what = _within(update_error(got, want, start), TOLERANCE[cell.kind])
        return ("match" if ok else "DIFFERS", what, time.perf_counter() - t0)
    # local BN: the running statistics and their count are each rank's own
    keys = [k for k in want if "running" not in k and "tracked" not in k]
    why = _close(got, want, keys if cell.kind == "chunks" else want, 1e-7, 1e-10)
    return ("DIFFERS" if why else "match", why, time.perf_counter() - t0)


def run_cells(names: list[str], device: str, rules: bool = False, shm: bool = True) -> list[tuple]:
    """Each named cell on this rank's device (cuda: the GPU of rank mod the GPUs here), in turn;
    with `rules`, under CUDA's device rules (a breach is a CRASH, as it would be on a GPU), and
    without `shm` on the paths a GPU takes (no shared-memory fast path for small collectives and
    halo rows: those are for CPU tensors)."""
    from device_rules import DeviceRules

    where = torch.device(device)
    if where.type == "cuda":
        where = torch.device("cuda", dist.get_rank() % torch.cuda.device_count())
        torch.cuda.set_device(where)
    out = []
    for cell in (c for c in CELLS if c.name in names):
        checker = DeviceRules() if rules else None
        try:
            if checker:
                with checker:
                    result = run_cell(cell, where, shm=shm)
                checker.check()
            else:
                result = run_cell(cell, where, shm=shm)
        except Exception as exc:  # the table shows it; the other ranks fail alike or time out
            text = " | ".join(traceback.format_exception_only(exc)[-1].strip().splitlines())
            result = ("CRASH", text[:800], math.nan)
        out.append((cell.name, *result))
    return out
