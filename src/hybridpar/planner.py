"""Planner: for (layers, P, B, cluster) evaluate the scenarios of Gholami et al. section 3 and a
per-layer search, and return the best plan with every candidate.

Scenarios (names are the CLI's and the JSON's):

| name      | layers                                                                           |
| --------- | -------------------------------------------------------------------------------- |
| batch     | every layer pure batch, grid 1 x P (Eq. 4)                                        |
| model     | every layer pure model, grid P x 1 (Eq. 3)                                        |
| same-grid | one Pr x Pc grid for every layer (Eq. 8, Fig. 6); the best grid is reported        |
| fc-grid   | conv layers pure batch, FC layers on a Pr x Pc grid (Fig. 7) + Eq. 6 hand-off       |
| domain    | one grid; each conv layer domain- or model-parallel, FC layers model (Eq. 9, Fig. 10) |
| per-layer | each layer its own strategy and grid, paying redistribution between them (DP)     |

Grids: Pr * Pc = P, Pc <= B and Pc divides B (every batch group gets B/Pc examples). A model split
needs Pr <= the layer's output channels/features (uneven shards are allowed); a domain split needs
Pr <= the output height. The per-layer search minimises communication time by dynamic
programming over layers (state: the strategy of the previous layer); with a memory limit it adds
lambda * bytes to the objective and raises lambda until the plan fits (Lagrangian relaxation).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

from hybridpar.cluster import Cluster
from hybridpar.cost.collectives import Comm
from hybridpar.cost.compute import ComputeModel, FlopsModel
from hybridpar.cost.layers import CostLayer, Strategy, Wire, layer_comms, redistribute
from hybridpar.errors import ConfigError
from hybridpar.wire import COMPRESSIBLE, payload_bytes

__all__ = ["SCENARIOS", "LayerPlan", "Plan", "PlanResult", "evaluate", "grids", "make_plan", "plan"]

SCENARIOS = ("batch", "model", "same-grid", "fc-grid", "domain", "per-layer")
OVERLAPPABLE = ("dw_allreduce",)  # Fig. 8: the weight all-reduce can hide behind back-propagation


@dataclass
class LayerPlan:
    layer: CostLayer
    strategy: Strategy
    terms: dict[str, Comm]
    forward_s: float
    backward_s: float
    memory_bytes: float

    @property
    def comm_s(self) -> float:
        return math.fsum(c.seconds for c in self.terms.values())

    @property
    def compute_s(self) -> float:
        return self.forward_s + self.backward_s

    def to_dict(self) -> dict:
        x, s = self.layer, self.strategy
        return {
            "name": x.name,
            "kind": x.kind,
            "params": x.params,
            "d_in": x.d_in,
            "d_out": x.d_out,
            "strategy": s.label,
            "pr": s.pr,
            "pc": s.pc,
            "comm_s": self.comm_s,
            "compute_s": self.compute_s,
            "terms": {k: c.seconds for k, c in self.terms.items()},
            "bytes": {k: c.bytes for k, c in self.terms.items()},
        }


@dataclass
class Plan:
    """One candidate: a strategy per layer and its predicted cost breakdown."""

    scenario: str
    grid: tuple[int, int] | None
    layers: list[LayerPlan] = field(default_factory=list)
    overlap: bool = False
    reason: str = ""  # why it is infeasible; empty when feasible

    @property
    def feasible(self) -> bool:
        return not self.reason

    @property
    def comm_s(self) -> float:
        return math.fsum(x.comm_s for x in self.layers) if self.feasible else math.inf

    @property
    def compute_s(self) -> float:
        return math.fsum(x.compute_s for x in self.layers) if self.feasible else math.inf

    @property
    def exposed_comm_s(self) -> float:
        """Communication not hidden behind compute: with overlap, the weight all-reduce runs during
        the backward pass (perfect overlap, as in Gholami et al. Fig. 8)."""
        if not self.overlap or not self.feasible:
            return self.comm_s
        hideable = math.fsum(
            x.terms[k].seconds for x in self.layers for k in OVERLAPPABLE if k in x.terms
        )
        backward = math.fsum(x.backward_s for x in self.layers)
        return self.comm_s - min(hideable, backward)

    @property
    def total_s(self) -> float:
        return self.compute_s + self.exposed_comm_s if self.feasible else math.inf

    @property
    def memory_bytes(self) -> float:
        return math.fsum(x.memory_bytes for x in self.layers)

    def bytes_by_term(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for x in self.layers:
            for k, c in x.terms.items():
                out[k] = out.get(k, 0.0) + c.bytes
        return out

    def to_dict(self) -> dict:
        if not self.feasible:
            return {
                "name": self.scenario,
                "grid": list(self.grid) if self.grid else None,
                "feasible": False,
                "reason": self.reason,
                "comm_s": None,
                "compute_s": None,
                "total_s": None,
                "layers": [],
            }
        return {
            "name": self.scenario,
            "grid": list(self.grid) if self.grid else None,
            "feasible": True,
            "comm_s": self.comm_s,
            "compute_s": self.compute_s,
            "total_s": self.total_s,
            "exposed_comm_s": self.exposed_comm_s,
            "memory_bytes": self.memory_bytes,
            "layers": [x.to_dict() for x in self.layers],
        }


@dataclass
class PlanResult:
    model: str
    procs: int
    batch: int
    cluster: Cluster
    scenarios: list[Plan]  # the best of each scenario, in SCENARIOS order
    candidates: dict[str, list[Plan]]  # every grid tried, per scenario
    elem_bytes: float
    codec: str | None = None
    compress: tuple[str, ...] = ()

    @property
    def best(self) -> Plan:
        feasible = [p for p in self.scenarios if p.feasible]
        if not feasible:
            reasons = "; ".join(f"{p.scenario}: {p.reason}" for p in self.scenarios)
            raise ConfigError(f"no plan fits P={self.procs}, B={self.batch} ({reasons})")
        return min(feasible, key=lambda p: (p.total_s, p.comm_s))

    def scenario(self, name: str) -> Plan | None:
        return next((p for p in self.scenarios if p.scenario == name), None)

    def speedup_vs_batch(self) -> dict[str, float] | None:
        batch = self.scenario("batch")
        if batch is None or not batch.feasible:
            return None
        best = self.best
        return {
            "comm": batch.comm_s / best.comm_s if best.comm_s > 0 else math.inf,
            "total": batch.total_s / best.total_s,
        }

    def to_dict(self) -> dict:
        return {
            "model": self.model,
            "procs": self.procs,
            "batch": self.batch,
            "cluster": self.cluster.to_dict(),
            "bytes_per_element": self.elem_bytes,
            "codec": self.codec or "none",
            "compress": list(self.compress) if self.codec not in (None, "none") else [],
            "scenarios": [p.to_dict() for p in self.scenarios],
            "best": self.best.to_dict(),
            "speedup_vs_batch": self.speedup_vs_batch(),
        }


def grids(P: int, B: int) -> list[tuple[int, int]]:
    """Every (Pr, Pc) with Pr * Pc = P, Pc <= B and Pc dividing B, Pr ascending."""
    return [(P // pc, pc) for pc in range(P, 0, -1) if P % pc == 0 and pc <= B and B % pc == 0]


class _Context:
    """Caches layer terms and redistributions for one (layers, P, B, cluster, codec)."""

    def __init__(
        self,
        layers: list[CostLayer],
        P: int,
        B: int,
        net: Cluster,
        compute: ComputeModel,
        e: float | Wire,
        overlap: bool,
    ) -> None:
        self.layers, self.P, self.B, self.net, self.e, self.overlap = layers, P, B, net, e, overlap
        self.compute = [compute.times(x, B / P) for x in layers]
        self._redist = lru_cache(maxsize=None)(self._redistribute)
        self._own: dict[tuple[int, Strategy], tuple[float, float]] = {}

    def why_not(self, i: int, s: Strategy) -> str:
        x = self.layers[i]
        if s.pr * s.pc != self.P or s.pc > self.B or self.B % s.pc:
            return (
                f"grid {s.pr}x{s.pc} needs Pc={s.pc} to divide B={self.B} (each batch group gets "
                f"B/Pc examples); change --batch or --procs"
            )
        if s.kind == "domain":
            if not x.spatial:
                return f"{x.name} ({x.kind}) cannot be split by height"
            if s.pr > min(x.x_shape[1], x.y_shape[1]):
                return f"{x.name}: Pr={s.pr} exceeds its height {x.y_shape[1]}"
        elif s.pr > x.out_units:
            return f"{x.name}: Pr={s.pr} exceeds its {x.out_units} output units"
        return ""

    def _redistribute(self, a: Strategy | None, b: Strategy, d: int) -> Comm | None:
        return redistribute(a, b, d, self.B, self.net, self.e)

    def memory(self, i: int, s: Strategy) -> float:
        x, w = self.layers[i], self.net.word_bytes
        shard = s.pr if s.kind == "model" else 1
        act = self.B / s.pc * x.d_out / (s.pr if s.kind == "domain" else 1)
        return 3 * x.params / shard * w + 2 * act * w  # weights, grads, momentum; Y and dY

    def own(self, i: int, s: Strategy) -> tuple[float, float]:
        """(communication seconds, memory bytes) of layer i under s, redistribution left out."""
        key = (i, s)
        if key not in self._own:
            terms = layer_comms(self.layers[i], i == 0, s, self.B, self.net, self.e)
            self._own[key] = (math.fsum(c.seconds for c in terms.values()), self.memory(i, s))
        return self._own[key]

    def layer_plan(self, i: int, s: Strategy, prev: Strategy | None) -> LayerPlan | str:
        why = self.why_not(i, s)
        if why:
            return why
        terms = dict(layer_comms(self.layers[i], i == 0, s, self.B, self.net, self.e))
        if i > 0:
            r = self._redist(prev, s, self.layers[i].d_in)
            if r is None:
                return (
                    f"no redistribution from {prev.label} to {s.label} before {self.layers[i].name}"
                )
            terms["redistribute"] = r
        fwd, bwd = self.compute[i]
        return LayerPlan(self.layers[i], s, terms, fwd, bwd, self.memory(i, s))

    def evaluate(
        self, scenario: str, grid: tuple[int, int] | None, strategies: list[Strategy]
    ) -> Plan:
        plan = Plan(scenario, grid, overlap=self.overlap)
        prev = None
        for i, s in enumerate(strategies):
            lp = self.layer_plan(i, s, prev)
            if isinstance(lp, str):
                return Plan(scenario, grid, overlap=self.overlap, reason=lp)
            plan.layers.append(lp)
            prev = s
        return plan

    def search(
        self,
        scenario: str,
        grid: tuple[int, int] | None,
        options: list[list[Strategy]],
        memory_limit: float | None,
    ) -> Plan:
        """Dynamic programming over layers: the cheapest chain of strategies, one per layer."""

        def run(lam: float) -> Plan:
            # best[s] = (cost so far, chain); cost of a layer = its comm + lambda * memory
            best: dict[Strategy, tuple[float, list[Strategy]]] = {}
            for i, opts in enumerate(options):
                nxt: dict[Strategy, tuple[float, list[Strategy]]] = {}
                for s in opts:
                    if self.why_not(i, s):
                        continue
                    comm, mem = self.own(i, s)
                    own = comm + lam * mem
                    if i == 0:
                        nxt[s] = (own, [s])
                        continue
                    cand = None
                    for p, (c, chain) in best.items():
                        r = self._redist(p, s, self.layers[i].d_in)
                        if r is not None and (cand is None or c + r.seconds < cand[0]):
                            cand = (c + r.seconds, chain)
                    if cand is not None:
                        nxt[s] = (cand[0] + own, [*cand[1], s])
                if not nxt:
                    return Plan(
                        scenario,
                        grid,
                        overlap=self.overlap,
                        reason=f"no strategy fits layer {self.layers[i].name}",
                    )
                best = nxt
            chain = min(best.values(), key=lambda v: v[0])[1]
            return self.evaluate(scenario, grid, chain)

        plan = run(0.0)
        if memory_limit is None or not plan.feasible or plan.memory_bytes <= memory_limit:
            return plan
        lam = plan.comm_s / plan.memory_bytes * 1e-3 or 1e-15
        for _ in range(60):
            plan = run(lam)
            if plan.feasible and plan.memory_bytes <= memory_limit:
                return plan
            lam *= 2
        return Plan(
            scenario,
            grid,
            overlap=self.overlap,
            reason=f"no per-layer plan fits the memory limit of {memory_limit / 2**30:.2f} GiB",
        )


def _fits_memory(plan: Plan, limit: float | None) -> Plan:
    if plan.feasible and limit is not None and plan.memory_bytes > limit:
        return Plan(
            plan.scenario,
            plan.grid,
            overlap=plan.overlap,
            reason=f"needs {plan.memory_bytes / 2**30:.2f} GiB per process, "
            f"over the limit of {limit / 2**30:.2f} GiB",
        )
    return plan


def _best(plans: list[Plan], scenario: str, empty_reason: str) -> Plan:
    feasible = [p for p in plans if p.feasible]
    if feasible:
        return min(feasible, key=lambda p: (p.total_s, p.comm_s))
    reason = plans[0].reason if plans else empty_reason
    return Plan(scenario, None, reason=reason)


def plan(
    layers: list[CostLayer],
    P: int,
    B: int,
    cluster: Cluster,
    *,
    model: str = "model",
    compute: ComputeModel | None = None,
    scenarios: tuple[str, ...] | list[str] = SCENARIOS,
    elem_bytes: float | None = None,
    memory_limit: float | None = None,
    overlap: bool = False,
    codec: str | None = None,
    compress: frozenset[str] | set[str] | tuple[str, ...] = COMPRESSIBLE,
) -> PlanResult:
    """Evaluate `scenarios` for `layers` on P processes with global batch B."""
    if not isinstance(P, int) or P < 1:
        raise ConfigError(f"the number of processes must be a positive integer, got {P!r}")
    if not isinstance(B, int) or B < 1:
        raise ConfigError(f"the global batch must be a positive integer, got {B!r}")
    unknown = [s for s in scenarios if s not in SCENARIOS]
    if unknown:
        raise ConfigError(
            f"unknown scenario(s) {unknown}; choose from {', '.join(SCENARIOS)} or all"
        )
    all_grids = grids(P, B)
    if not all_grids:
        raise ConfigError(f"no Pr x Pc grid fits P={P} with B={B}: Pc must divide B; change P or B")
    ctx = _Context(
        layers,
        P,
        B,
        cluster,
        compute or FlopsModel(cluster.flops),
        wire(cluster.word_bytes if elem_bytes is None else elem_bytes, codec, compress),
        overlap,
    )
    L = len(layers)
    conv = [x.kind == "conv" for x in layers]
    candidates: dict[str, list[Plan]] = {}

    def fixed(name: str, grid: tuple[int, int] | None, strategies: list[Strategy]) -> Plan:
        return _fits_memory(ctx.evaluate(name, grid, strategies), memory_limit)

    for name in scenarios:
        if name == "batch":
            candidates[name] = [fixed(name, (1, P), [Strategy.batch(P)] * L)]
        elif name == "model":
            candidates[name] = [fixed(name, (P, 1), [Strategy.model(P, 1)] * L)]
        elif name == "same-grid":
            candidates[name] = [fixed(name, g, [Strategy.model(*g)] * L) for g in all_grids]
        elif name == "fc-grid":
            candidates[name] = [
                fixed(name, g, [Strategy.batch(P) if c else Strategy.model(*g) for c in conv])
                for g in all_grids
            ]
        elif name == "domain":
            candidates[name] = [
                ctx.search(
                    name,
                    g,
                    [
                        [Strategy.domain(*g), Strategy.model(*g)] if c else [Strategy.model(*g)]
                        for c in conv
                    ],
                    memory_limit,
                )
                for g in all_grids
                if g[0] > 1
            ]
        elif name == "per-layer":
            options = [
                [Strategy.model(*g) for g in all_grids]
                + ([Strategy.domain(*g) for g in all_grids if g[0] > 1] if c else [])
                for c in conv
            ]
            candidates[name] = [ctx.search(name, None, options, memory_limit)]
    best = [_best(candidates[n], n, f"no grid with Pr > 1 fits P={P}, B={B}") for n in scenarios]
    base = cluster.word_bytes if elem_bytes is None else elem_bytes
    return PlanResult(model, P, B, cluster, best, candidates, base, codec, tuple(sorted(compress)))


def make_plan(
    model: str,
    P: int,
    B: int,
    cluster: Cluster,
    *,
    input_size: int | None = None,
    **kwargs: object,
) -> PlanResult:
    """`plan` for a zoo model by name (analysed on the meta device)."""
    from hybridpar.analysis_cache import zoo_cost_layers

    return plan(zoo_cost_layers(model, input_size), P, B, cluster, model=model, **kwargs)


def wire(elem_bytes: float, codec: str | None, compress=COMPRESSIBLE) -> float | Wire:
    """Bytes per element by kind of traffic: `elem_bytes` everywhere, or the codec's payload size
    for the traffic in `compress` (grads and/or activations)."""
    if codec is None or codec == "none":
        return elem_bytes
    b = payload_bytes(codec)
    g, a = "grads" in compress, "activations" in compress
    return Wire(b if g else elem_bytes, b if a else elem_bytes, g, a)


def evaluate(layers: list[CostLayer], P: int, B: int, cluster: Cluster, strategies: list[Strategy],
             *, elem_bytes: float | None = None, name: str = "custom", codec: str | None = None,
             compress=COMPRESSIBLE) -> Plan:  # fmt: skip
    """The predicted cost of one given chain of strategies (what the runtime is about to execute)."""
    e = wire(cluster.word_bytes if elem_bytes is None else elem_bytes, codec, compress)
    ctx = _Context(layers, P, B, cluster, FlopsModel(cluster.flops), e, False)
    return ctx.evaluate(name, None, strategies)
