"""`hybridpar simulate --handoffs N`: Krizhevsky's communication-to-computation argument for the
hand-off schemes (section 4), priced for K = the swept process counts.

"One weird trick" says scheme (c)'s communication-to-computation ratio is constant in K, while
(a)'s and (b)'s grow in proportion to K, "because schemes (a) and (b) are always bottlenecked by
the outbound bandwidth of the worker that has to send data at a given step, while scheme (c) is
able to utilize many workers for this task". The sweep keeps the paper's setting:
- weak scaling: each of K workers holds N examples (128 in the paper), so B = N K;
- the convolutional layers batch-parallel over K, the layers after the hand-off model-parallel
  over K (the fc-grid plan on grid K x 1);
- each worker's compute per iteration stays about the same as K grows (N examples through the
  trunk, N K examples through 1/K of the head).

For each K and scheme it gives the **exposed** hand-off (the part the head's compute of a round
cannot hide, `core.handoff.exposed`) over the worker's compute per iteration, in two link
models:
- **the paper's links**: every worker has one link, which carries one copy of the data per
  receiver and takes alpha per message. (a): every worker sends its N rows to each of the K - 1
  others at once; nothing hides. (b): round j's sender alone sends N rows to K - 1 workers, and
  in backward the owner's link takes K - 1 partial gradients. (c): every worker sends N / K rows
  to each other worker per round, all links busy at once. Then (a)'s and (b)'s exposed hand-off
  grows as K - 1 and (c)'s as (K - 1) / K, which levels off: the paper's claim, which holds as
  long as a round's head compute hides a round's transfer (beyond that, (c) grows too).
- **hybridpar's collectives**: the cost model's own prices of the same plans (ring all-gather
  and reduce-scatter, tree broadcast, on this cluster), which is what `hybridpar train` runs.
  A tree broadcast does not send one copy per receiver from one link, so (b) loses most of its
  disadvantage against (c) there.

The raw ratio (all hand-off traffic over compute, nothing hidden) grows as K - 1 for all three
schemes: (c) sends the same bytes as (a), in K pieces. The paper's "constant" is about what
(c) leaves exposed. Torch-free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from hybridpar.commands.papers import write_rows
from hybridpar.core.cluster import Cluster
from hybridpar.core.errors import ConfigError
from hybridpar.core.handoff import exposed, head
from hybridpar.core.terms import Term
from hybridpar.planning.candidates import LayerPlan, Plan

__all__ = ["HandoffPoint", "paper_exposed", "plot_handoffs", "sweep_handoffs", "write_handoffs"]


@dataclass(frozen=True)
class HandoffPoint:
    workers: int  # K
    scheme: str  # a, b or c
    rounds: int
    compute_s: float  # one worker's compute per iteration (the plan's)
    exposed_s: float  # the hand-off's exposed seconds, hybridpar's cost model
    paper_s: float  # the same under the paper's links (`paper_exposed`)
    raw_s: float  # every byte of the hand-off on the paper's links, nothing hidden
    hides: bool = True  # on the paper's links, a round's head compute covers a round's transfer

    @property
    def ratio(self) -> float:
        return self.exposed_s / self.compute_s

    @property
    def paper_ratio(self) -> float:
        return self.paper_s / self.compute_s

    @property
    def raw_ratio(self) -> float:
        return self.raw_s / self.compute_s


def paper_exposed(
    scheme: str, K: int, rows_bytes: float, alpha: float, beta: float, f: float, b: float
) -> tuple[float, float, bool]:
    """(exposed, raw, hides) of a hand-off of K workers, each holding `rows_bytes` of
    activations, on the paper's links (module docstring): one link per worker, one copy per
    receiver, `alpha` per message and `beta` per byte. `f` and `b`: the head's forward and
    backward of one round on a worker. `raw` hides nothing; `hides`: a round's compute covers
    the next round's transfer both ways (always for (a), which has one round)."""
    if K < 2:
        return 0.0, 0.0, True
    if scheme == "a":
        g = (K - 1) * (alpha + rows_bytes * beta)  # each worker's rows to each other worker
        return 2 * g, 2 * g, True  # the gradients return the same way
    if scheme == "b":  # one sender per round; its rows to K - 1 workers over its one link
        g = (K - 1) * (alpha + rows_bytes * beta)  # and backward, K - 1 partials into the owner
    elif scheme == "c":  # every worker sends rows / K to each other worker per round, all at once
        g = (K - 1) * (alpha + rows_bytes / K * beta)
    else:
        raise ValueError(f"unknown hand-off scheme {scheme!r}")
    return exposed(g, g, f, b, K), 2 * K * g, g <= min(f, b)


def _handoff(plan: Plan) -> tuple[int, LayerPlan] | None:
    for i, lp in enumerate(plan.layers):
        if lp.handoff is not None:
            return i, lp
    return None


def _head(plan: Plan, i: int) -> list[LayerPlan]:
    """The hand-off's head as the cost model takes it (core.handoff.head)."""
    layers = [x.layer for x in plan.layers]
    return [plan.layers[j] for j in head(layers, [x.style.layout for x in plan.layers], i)]


def sweep_handoffs(
    model: str,
    procs: list[int],
    per_worker: int,
    cluster: Cluster,
    **kwargs: object,
) -> list[HandoffPoint]:
    """Schemes (a), (b) and (c) (K rounds) of the fc-grid plan on grid K x 1 with `per_worker`
    examples per worker, for each K of `procs` (K >= 2), as `make_plan` prices them; a
    ConfigError where the model has no batch -> model hand-off there or a scheme is refused."""
    from hybridpar.planning.search import make_plan

    kwargs = {k: v for k, v in kwargs.items() if k not in ("handoff", "rounds")}
    out: list[HandoffPoint] = []
    for K in sorted({p for p in procs if p >= 2}):
        for scheme in ("a", "b", "c"):
            rounds = 1 if scheme == "a" else K
            result = make_plan(
                model,
                K,
                per_worker * K,
                cluster,
                scenarios=("fc-grid",),
                handoff=scheme,
                rounds=rounds if scheme == "c" else None,
                **kwargs,
            )
            plan, i, lp = _swept(result, f"--handoffs: {model} at K = {K}", K, scheme, rounds)
            net, c = result.cluster.priced(K), result.cluster
            alpha, beta = (c.net_alpha, c.net_beta) if c.two_level else (net.alpha, net.beta)
            head = _head(plan, i)
            f = math.fsum(x.forward_s for x in head) / rounds
            b = math.fsum(x.backward_s for x in head) / rounds
            d = lp.layer.entry_elements or lp.layer.d_in
            paper, raw, hides = paper_exposed(
                scheme, K, per_worker * d * result.elem_bytes, alpha or 0.0, beta or net.beta, f, b
            )
            out.append(
                HandoffPoint(
                    K,
                    scheme,
                    rounds,
                    plan.compute_s,
                    lp.terms[Term.REDISTRIBUTE].seconds,
                    paper,
                    raw,
                    hides,
                )
            )
    if not out:
        raise ConfigError("--handoffs needs a process count of 2 or more in --procs")
    return out


def _swept(result, where: str, K: int, scheme: str, rounds: int) -> tuple:
    """(the fc-grid plan on grid K x 1, the index and plan of its hand-off's layer), or a
    ConfigError saying why the sweep cannot price it."""
    plan = next((p for p in result.candidates.get("fc-grid", []) if p.grid == (K, 1)), None)
    if plan is None or not plan.feasible:
        why = plan.reason if plan is not None else "no grid K x 1"
        raise ConfigError(f"{where}: the fc-grid plan on grid {K}x1 is infeasible ({why})")
    found = _handoff(plan)
    if found is None:
        raise ConfigError(
            f"{where}: no batch -> model hand-off in its fc-grid plan; the sweep needs "
            "convolutional layers before model-parallel ones (e.g. alexnet-owt)"
        )
    i, lp = found
    if (lp.handoff.scheme, lp.handoff.rounds) != (scheme, rounds):  # type: ignore[union-attr]
        raise ConfigError(
            f"{where}: scheme ({scheme}) in {rounds} rounds is refused for the hand-off "
            f"into {lp.layer.name} (`hybridpar plan --handoff {scheme}` says why)"
        )
    return plan, i, lp


def write_handoffs(points: list[HandoffPoint], path: Path) -> None:
    rows = []
    for p in points:
        row = {"workers": p.workers, "scheme": p.scheme, "rounds": p.rounds}
        seconds = (
            ("compute_s", p.compute_s),
            ("exposed_s", p.exposed_s),
            ("paper_exposed_s", p.paper_s),
        )
        row.update({k: f"{v:.9g}" for k, v in (*seconds, ("raw_s", p.raw_s))})
        rows.append({**row, "paper_rounds_hide": p.hides})
    write_rows(path, rows)


def plot_handoffs(points: list[HandoffPoint], path: Path, title: str) -> Path:
    """Two panels, exposed hand-off over compute against K: the paper's links and hybridpar's
    collectives; the raw ratio (nothing hidden) dotted in the first, and hollow markers there
    where a round's compute no longer hides a round's transfer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"a": "#c44e52", "b": "#dd8452", "c": "#4c72b0"}
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=False)
    for ax, attr, name in (
        (axes[0], "paper_ratio", "the paper's links (one copy per receiver)"),
        (axes[1], "ratio", "hybridpar's collectives (the cost model)"),
    ):
        for scheme in ("a", "b", "c"):
            ps = [p for p in points if p.scheme == scheme]
            ks = [p.workers for p in ps]
            ys = [getattr(p, attr) for p in ps]
            ax.plot(ks, ys, "o-", color=colors[scheme], label=scheme)
            if attr == "paper_ratio":  # where a round's compute no longer covers a transfer
                late = [(k, y) for k, y, p in zip(ks, ys, ps, strict=True) if not p.hides]
                if late:
                    ax.plot(*zip(*late, strict=True), "o", color="white", markersize=4)
            if attr == "paper_ratio" and scheme == "c":
                ax.plot(
                    ks,
                    [p.raw_ratio for p in ps],
                    ":",
                    color="#777777",
                    label="(c), nothing hidden",
                )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ks = sorted({p.workers for p in points})
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.set_xlabel("workers K (examples per worker fixed)", fontsize=8)
        ax.set_ylabel("exposed hand-off / compute per iteration", fontsize=8)
        ax.set_title(
            name + (", hollow: rounds no longer hide" if attr == "paper_ratio" else ""), fontsize=9
        )
        ax.legend(fontsize=7, loc="upper left")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
