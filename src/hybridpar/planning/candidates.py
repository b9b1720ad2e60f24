"""The planner's candidates: a style per layer with its predicted terms (LayerPlan, Plan), the
result of a planning run (PlanResult), and `export`, which turns one candidate into the
ParallelPlan that `hybridpar train` executes."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hybridpar.core.choices import Choices
from hybridpar.core.cluster import BYTES_ONLY, Cluster
from hybridpar.core.errors import ConfigError
from hybridpar.core.handoff import Handoff
from hybridpar.core.layers import CostLayer
from hybridpar.core.plan import ParallelPlan, Prediction, Redistribution, Style
from hybridpar.core.rules import EXECUTED, why_not_choices
from hybridpar.core.terms import Term
from hybridpar.planning.cost.collectives import Comm
from hybridpar.planning.cost.sync import Sync, calls

__all__ = ["OVERLAPPABLE", "LayerPlan", "Plan", "PlanResult", "best_of", "export"]

OVERLAPPABLE = (
    Term.DW_ALLREDUCE,
)  # Fig. 8: the weight all-reduce can hide behind back-propagation


@dataclass
class LayerPlan:
    layer: CostLayer
    style: Style
    terms: dict[str, Comm]
    forward_s: float
    backward_s: float
    memory_bytes: float
    update_s: float = 0.0  # the optimizer's step on this layer's parameters of one rank
    handoff: Handoff | None = None  # the scheme of the batch -> model hand-off into this layer
    peak_bytes: float = 0.0  # held beyond memory_bytes at the layer's worst moment (the plan's
    # peak: its layers' memory_bytes and the largest of these)

    @property
    def comm_s(self) -> float:
        return math.fsum(c.seconds for c in self.terms.values())

    @property
    def compute_s(self) -> float:
        return self.forward_s + self.backward_s + self.update_s

    def to_dict(self) -> dict:
        x, s = self.layer, self.style
        return {
            "name": x.name,
            "kind": x.kind,
            "params": x.params,
            "d_in": x.d_in,
            "d_out": x.d_out,
            "style": s.label,
            "pr": s.pr,
            "pc": s.pc,
            "comm_s": self.comm_s,
            "compute_s": self.compute_s,
            "terms": {str(k): c.seconds for k, c in self.terms.items()},
            "bytes": {str(k): c.bytes for k, c in self.terms.items()},
        }


@dataclass
class Plan:
    """One candidate: a style per layer and its predicted cost breakdown."""

    scenario: str
    grid: tuple[int, int] | None
    layers: list[LayerPlan] = field(default_factory=list)
    overlap: bool = False
    reason: str = ""  # why it is infeasible; empty when feasible
    placement: tuple[int, int] | None = None  # how its positions sit on ranks (core.groups)
    sync: Sync = field(default_factory=Sync)  # where the ranks meet (planning.cost.sync)
    shared_bytes: float = 0.0  # of the host shared segments a rank writes (cost.memory.segment)
    sharded: bool = False  # its states sharded (Choices.shard_states), a memory limit's choice

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
        """Compute, exposed communication, and what the ranks lose where they meet beyond both
        (the sync term's excess; its wait moves time between the two and adds nothing)."""
        if not self.feasible:
            return math.inf
        return self.compute_s + self.exposed_comm_s + self.sync.excess_s

    def split(self) -> dict[str, float]:
        """The iteration as the report measures it: compute (each rank's time outside the
        collectives: the compute model's, plus the sync excess, less the time the ranks wait at
        meetings), comm (the exposed communication and those waits) and of it `waiting_s`, the
        wait for the slowest rank at the blocking collectives; `total_s` their sum."""
        waits = self.sync.wait_s + self.sync.grad_wait_s
        return {
            "comm_s": self.exposed_comm_s + waits,
            "compute_s": self.compute_s + self.sync.excess_s - waits,
            "total_s": self.total_s,
            "waiting_s": self.sync.wait_s,
            # of compute_s: the optimizer's step (the profile's update_s per element)
            "update_s": math.fsum(x.update_s for x in self.layers),
        }

    @property
    def held_bytes(self) -> float:
        """Bytes the busiest rank holds throughout a step: states and what backward keeps."""
        return math.fsum(x.memory_bytes for x in self.layers)

    @property
    def memory_bytes(self) -> float:
        """The busiest rank's predicted peak: `held_bytes`, the largest layer's worst moment
        beyond it (gradients in flight; in evaluation, the activations alive) and the shared
        segments it writes."""
        worst = max((x.peak_bytes for x in self.layers), default=0.0)
        return self.held_bytes + worst + self.shared_bytes

    def bytes_by_term(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for x in self.layers:
            for k, c in x.terms.items():
                out[k] = out.get(k, 0.0) + c.bytes
        return out

    def to_dict(self) -> dict:
        d = {
            "name": self.scenario,
            "grid": list(self.grid) if self.grid else None,
            "feasible": self.feasible,
        }
        if not self.feasible:
            return {
                **d,
                "reason": self.reason,
                "comm_s": None,
                "compute_s": None,
                "total_s": None,
                "layers": [],
            }
        return {
            **d,
            "comm_s": self.comm_s,
            "compute_s": self.compute_s,
            "total_s": self.total_s,
            "exposed_comm_s": self.exposed_comm_s,
            "sync": {
                "excess_s": self.sync.excess_s,
                "wait_s": self.sync.wait_s,
                "grad_wait_s": self.sync.grad_wait_s,
                "meetings": self.sync.meetings,
            },
            "memory_bytes": self.memory_bytes,
            "layers": [x.to_dict() for x in self.layers],
        }


def best_of(plans) -> Plan | None:
    """The best feasible plan: the least predicted time per iteration, then the least
    communication (the one rule every caller uses); None when none is feasible."""
    feasible = [p for p in plans if p.feasible]
    return min(feasible, key=lambda p: (p.total_s, p.comm_s)) if feasible else None


@dataclass
class PlanResult:
    model: str
    procs: int
    batch: int
    cluster: Cluster
    scenarios: list[Plan]  # the best of each scenario, in SCENARIOS order
    candidates: dict[str, list[Plan]]  # every grid tried, per scenario
    elem_bytes: float
    choices: Choices = field(default_factory=Choices)
    input_shape: tuple[int, ...] | None = None

    @property
    def best(self) -> Plan:
        chosen = best_of(self.scenarios)
        if chosen is None:
            reasons = "; ".join(f"{p.scenario}: {p.reason}" for p in self.scenarios)
            raise ConfigError(f"no plan fits P={self.procs}, B={self.batch} ({reasons})")
        return chosen

    def scenario(self, name: str) -> Plan | None:
        return next((p for p in self.scenarios if p.scenario == name), None)

    def speedup_vs_batch(self, best: Plan | None = None) -> dict[str, float] | None:
        batch = self.scenario("batch")
        if batch is None or not batch.feasible:
            return None
        best = best or self.best
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
            **self.choices.to_dict(),
            "scenarios": [p.to_dict() for p in self.scenarios],
            "best": self.best.to_dict(),
            "speedup_vs_batch": self.speedup_vs_batch(),
        }

    def export(self, chosen: Plan | None = None, *, engine: str = "hybridpar") -> ParallelPlan:
        """The ParallelPlan of `chosen` (default: the best), with this result's choices (its
        states sharded where the planner sharded them)."""
        chosen = chosen or self.best
        return export(
            chosen,
            procs=self.procs,
            batch=self.batch,
            model=self.model,
            input_shape=self.input_shape,
            cluster=self.cluster.name,
            choices=self.choices.with_(shard_states=True) if chosen.sharded else self.choices,
            engine=engine,
        )


def export(
    chosen: Plan,
    *,
    procs: int,
    batch: int,
    choices: Choices,
    model: str = "",
    input_shape: tuple[int, ...] | None = None,
    cluster: str = "",
    engine: str = "hybridpar",
) -> ParallelPlan:
    """The ParallelPlan of one evaluated candidate: a style per weighted layer, the redistributions
    where the layout changes, and the predicted bytes and seconds per (layer, term)."""
    if not chosen.feasible:
        raise ConfigError(f"scenario {chosen.scenario} is infeasible: {chosen.reason}")
    unrun = sorted({x.style.kind for x in chosen.layers} - EXECUTED)
    if unrun:
        raise ConfigError(f"style {unrun[0]} is not executed by the runtime; re-plan without it")
    why = why_not_choices(
        choices, [x.style for x in chosen.layers], [x.layer for x in chosen.layers], whole=True
    )
    if why:
        raise ConfigError(why)
    redistributions, prev = [], None
    for x in chosen.layers:
        if prev is not None and x.style.layout != prev.layout:
            at, d = x.layer.entry or x.layer.name, x.layer.entry_elements or x.layer.d_in
            h = x.handoff or Handoff()
            redistributions.append(
                Redistribution(at, x.layer.name, prev, x.style, d, h.scheme, h.rounds)
            )
        prev = x.style
    return ParallelPlan(
        procs=procs,
        batch=batch,
        styles={x.layer.name: x.style for x in chosen.layers},
        model=model,
        input_shape=input_shape,
        scenario=chosen.scenario,
        engine=engine,  # type: ignore[arg-type]
        choices=choices,
        redistributions=redistributions,
        predicted=[
            Prediction(x.layer.name, str(k), c.bytes, c.seconds, sum(calls(k, c)))
            for x in chosen.layers
            for k, c in x.terms.items()
        ],
        cluster=cluster,
        placement=chosen.placement if engine == "hybridpar" else None,
        memory_bytes=chosen.memory_bytes,
        held_bytes=chosen.held_bytes,
        totals={} if cluster == BYTES_ONLY.name else priced_totals(chosen, cluster),
    )


# an iteration predicted outside these seconds is not a time but a broken calibration
PLAUSIBLE_S = (1e-9, 1e6)


def priced_totals(chosen: Plan, cluster: str) -> dict[str, float]:
    """The iteration's predicted split, or a one-line error where it is not a plausible time
    (a GPU job once printed 6.4e-289 s, priced without a calibration of its device)."""
    split = chosen.split()
    t = split["total_s"]
    lo, hi = PLAUSIBLE_S
    if not all(math.isfinite(v) for v in split.values()) or not lo <= t <= hi:
        raise ConfigError(
            f"the {chosen.scenario} plan is predicted at {t:.3g} s per iteration on cluster "
            f"{cluster!r}: not a plausible time, so its numbers are off; calibrate it again "
            "(`hybridpar calibrate`) or fix the cluster file"
        )
    return split
