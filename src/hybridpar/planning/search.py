"""Planner: for (layers, P, B, cluster) evaluate the scenarios of Gholami et al. section 3 and a
per-layer search, and return the best plan with every candidate; `PlanResult.export` turns one
into the ParallelPlan that `hybridpar train` executes.

Scenarios (names are the CLI's and the JSON's):

| name      | layers                                                                           |
| --------- | -------------------------------------------------------------------------------- |
| batch     | every layer pure batch, grid 1 x P (Eq. 4)                                        |
| model     | every layer pure model, grid P x 1 (Eq. 3)                                        |
| same-grid | one Pr x Pc grid for every layer (Eq. 8, Fig. 6); the best grid is reported        |
| fc-grid   | conv layers pure batch, FC layers on a Pr x Pc grid (Fig. 7) + Eq. 6 hand-off       |
| domain    | one grid; conv layers domain or model, at least one domain; FC model (Fig. 10)  |
| per-layer | each layer its own style and grid, paying redistribution between them (DP)        |

Grids: Pr * Pc = P and Pc <= B (the batch groups' examples: core.splits.group_rows). Whether a
layer can take a style is `hybridpar.core.rules.why_not`, the function the runtime asks too:
a model split needs a Linear or Conv2d called once with Pr <= its output units (uneven shards are
allowed); a domain split needs Pr <= the output height. Whether the plan's choices can run with
its styles (the domain style's halos travel unencoded) is `rules.why_not_choices`. Layers of one segment (no point between them where the runtime can change
the layout, e.g. the two convolutions of a residual block: hybridpar.core.analysis) take one style;
the
redistribution into a segment moves the activation at its entry. The per-layer search minimises
the exposed communication time by dynamic programming over layers (state: the style of the previous
layer; inside a segment the only transition is to the same style; with overlap a Pareto front per
state, see `_Context.chain`), so it is never worse than a fixed scenario it contains; with a memory
limit it adds lambda * bytes to the objective and raises lambda until the plan fits (Lagrangian
relaxation).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
from functools import lru_cache

from hybridpar.core.choices import Choices, covered, payload_bytes
from hybridpar.core.cluster import SHM_MAX_BYTES, Cluster, Priced
from hybridpar.core.errors import ConfigError
from hybridpar.core.groups import why_not_placement
from hybridpar.core.handoff import Handoff, exposed, head, is_gather, why_not_handoff
from hybridpar.core.handoff import fused as handoff_fused
from hybridpar.core.layers import CostLayer, cost_layers
from hybridpar.core.plan import Style
from hybridpar.core.rules import why_not, why_not_choices, why_not_grid, why_not_move
from hybridpar.core.splits import buckets, even_split, slowest_batch
from hybridpar.core.terms import Term
from hybridpar.planning.analysis_cache import model_layers
from hybridpar.planning.candidates import (
    OVERLAPPABLE,
    LayerPlan,
    Plan,
    PlanResult,
    best_of,
    export,
)
from hybridpar.planning.cost.collectives import Comm, all_gather, broadcast, reduce_scatter
from hybridpar.planning.cost.compute import FlopsModel, style_times
from hybridpar.planning.cost.memory import at_worst, kept, segment
from hybridpar.planning.cost.sync import calls, sync_of
from hybridpar.planning.cost.terms import (
    Wire,
    codec_s,
    largest_halo,
    layer_comms,
    on_host,
    padded,
    plus,
    redistribute,
    sharded_elements,
    t_dw_allreduce,
    t_loss_join,
)
from hybridpar.planning.request import GRAD_BUCKET_BYTES, SCENARIOS, PlanRequest

__all__ = [
    "GRAD_BUCKET_BYTES",
    "SCENARIOS",
    "LayerPlan",
    "Plan",
    "PlanRequest",
    "PlanResult",
    "evaluate",
    "export",
    "grids",
    "make_plan",
    "plan_for",
    "plan_layers",
]


def grids(P: int, B: int) -> list[tuple[int, int]]:
    """Every (Pr, Pc) with Pr * Pc = P and Pc <= B, Pr ascending (the divisors of P found up to
    sqrt(P): a P of millions is answered at once)."""
    divisors = {d for k in range(1, math.isqrt(P) + 1) if P % k == 0 for d in (k, P // k)}
    return [(P // pc, pc) for pc in sorted(divisors, reverse=True) if pc <= B]


def slowest(price, batch: int, slow: int):
    """What `price(batch)` returns (a Comm, or terms by name), with the seconds `price(slow)`
    gives: the bytes a rank sends on average follow the true batch, the time the slowest
    group's (`_Context.slow`); the same where the groups are even."""
    mean = price(batch)
    if slow == batch or mean is None:
        return mean
    timed = price(slow)
    if isinstance(mean, Comm):
        return dataclasses.replace(mean, seconds=timed.seconds)
    return {t: dataclasses.replace(c, seconds=timed[t].seconds) for t, c in mean.items()}


def _shares_segment(layers: list[CostLayer], i: int) -> bool:
    """Layer i has no point before it where the layout can change: it takes layer i-1's style."""
    return i > 0 and layers[i].segment is not None and layers[i].segment == layers[i - 1].segment


class _Context:
    """Caches layer terms and redistributions for one (layers, request, placement)."""

    def __init__(
        self,
        layers: list[CostLayer],
        request: PlanRequest,
        net: Priced,
        fixed: dict[str, Handoff] | None = None,
    ) -> None:
        r = request
        P, B, choices = r.procs, r.batch, r.choices
        self.layers, self.P, self.B, self.net = layers, P, B, net
        self.e = wire(r.elem_bytes or net.word_bytes, choices, net)
        self.overlap, self.bucket = r.overlap, r.grad_bucket
        self.handoff, self.rounds, self.fixed = r.handoff, r.rounds, fixed
        self.fuse_handoff = r.fuse_handoff
        self.predict = r.mode == "predict"  # a forward in evaluation: no backward, no states
        self._moves: dict[tuple, tuple | None] = {}
        self._heads: dict[str, dict[str, Comm]] = {}  # the terms the hand-offs' rounds change
        self._layouts: list[tuple] | None = None  # every layer's, while a plan is evaluated
        self.choices = choices
        # the host reducer's sums are priced as it takes them where the planner runs its engine
        self.reducer = choices.reducer
        compute = r.compute or FlopsModel(net.rank_flops())
        self.compute_model = compute
        # the busiest rank's samples' worth, any style
        self.compute = [compute.times(x, max(even_split(B, P))) for x in layers]
        self._time: dict[tuple[int, Style], tuple[float, float, float]] = {}
        self._redist = lru_cache(maxsize=None)(self._redistribute)
        self._own: dict[tuple[int, Style], tuple[float, float]] = {}
        # the share of each layer's modules recomputed in backward (activation checkpointing)
        done = covered([m for x in layers for m in x.members], choices.activation_checkpointing)
        self.recomputed = [
            sum(m in done for m in x.members) / max(1, len(x.members)) for x in layers
        ]

    def why_not(self, i: int, s: Style) -> str:
        x = self.layers[i]
        return (
            why_not_grid(s.pr, s.pc, self.P, self.B)
            or why_not(x, s, self.B)
            or why_not_choices(self.choices, [s], [x])
        )

    def slow(self, *styles: Style | None) -> int:
        """The batch the layouts of `styles` are timed by: their slowest group's (core.splits)."""
        return max(slowest_batch(self.B, s.pr, s.pc) for s in styles if s is not None)

    def _redistribute(self, a: Style | None, b: Style, d: int, whole: bool) -> Comm | None:
        if whole and a is not None and a.layout != b.layout:  # a pooled value: no rows to cut
            if b.kind == "domain":
                return None  # it would be cut into bands it never had
            if a.kind == "domain":  # none to gather: whole on every rank of its model group
                a = Style.model(a.pr, a.pc)
        return slowest(
            lambda B: redistribute(a, b, d, B, self.net, self.e), self.B, self.slow(a, b)
        )

    def head(self, i: int) -> list[int]:
        """The layers a hand-off into layer i runs in rounds (core.handoff.head): within a plan
        evaluated as a whole, as the runtime runs them; in the search, its segment."""
        return head(self.layers, self._layouts, i)

    def schemes(self, i: int, prev: Style, s: Style) -> list[Handoff]:
        """The hand-off schemes the move into layer i may take (`handoff`: a, b, c or auto)."""
        x = self.layers[i]
        if self.fixed is not None:
            return [self.fixed.get(x.name, Handoff())]
        if self.handoff == "a" or not is_gather(prev, s) or self.choices.activation_checkpointing:
            return [Handoff()]  # (the runtime recomputes no hand-off sent in rounds)
        m = prev.pc // s.pc
        ks = {"b": [("b", m)], "c": [("c", self.rounds or m)]}.get(self.handoff)
        if ks is None:  # auto
            ks = [("b", m)] + [("c", k) for k in sorted({2, 4, m})]
        head = [self.layers[j] for j in self.head(i)]
        acts = self.choices.activations_encoded
        ok = [Handoff(*k) for k in ks]
        ok = [h for h in ok if not why_not_handoff(h, prev, s, head, self.B, acts, x.name)]
        return [Handoff(), *ok] if self.handoff == "auto" or not ok else ok

    def move(
        self, i: int, prev: Style, s: Style, h: Handoff
    ) -> tuple[Comm, dict[str, dict[str, Comm]]] | None:
        """The hand-off into layer i by scheme `h`: its `redistribute` term (bytes both ways;
        seconds exposed: what the head's compute of a round cannot hide), and the terms of the
        head's layers it changes (per layer: their activation collectives K times on 1/K of the
        batch; the split layer's dX all-reduce gone where the hand-off reduce-scatters it)."""
        x = self.layers[i]
        d = x.entry_elements or x.d_in
        base = self._redist(prev, s, d, x.entry_whole)
        if base is None or not is_gather(prev, s):
            return (base, {}) if base is not None else None
        fused = self.fuse_handoff and handoff_fused(x, prev, s, self.choices.activations_encoded)
        if h.scheme == "a" and not fused:
            return base, {}
        m, K, wire = prev.pc // s.pc, h.rounds, Wire.of(self.e)
        net = self.net.regroup(self.P, prev.pc, s.pc)

        def rounds(B: float) -> dict[str, Comm]:
            n = B / s.pc * d * wire.acts / K  # one round's gathered bytes
            if h.scheme == "b":
                g, r = broadcast(n, m, net), broadcast(n, m, net)
                v = (m - 1) / m * n  # bytes per rank, averaged (the ledger's convention)
                g = Comm("broadcast", m, v, g.seconds)
                r = Comm("reduce", m, v, r.seconds) if fused else Comm.zero("reduce", m)
            else:
                g = on_host(all_gather(n, m, net), net, wire.acts_compressed, n / m)
                g = plus(g, codec_s(n, m, wire, grads=False, reduce=False))
                r = on_host(reduce_scatter(n, m, net), net, wire.acts_compressed, n)
                r = r if fused else Comm.zero("reduce_scatter", m)
            return {"g": g, "r": r}

        g, r = slowest(rounds, self.B, self.slow(prev, s)).values()
        heads = self.head(i)
        f = math.fsum(self.time(j, s)[0] for j in heads) / K
        b = math.fsum(self.time(j, s)[1] for j in heads) / K
        waits = exposed(g.seconds, r.seconds, f, b, K)  # what the rounds cannot hide
        rounds = (K if g.bytes > 0 else 0, K if r.bytes > 0 else 0)
        comm = Comm(Term.REDISTRIBUTE, m, K * (g.bytes + r.bytes), waits, rounds)
        changed: dict[str, dict[str, Comm]] = {}
        for j in heads:
            y = self.layers[j]
            full = self.terms(j, s)
            per = self.terms(j, s, K, bucket=False)
            new = dict(full)
            for t in (Term.ALLGATHER, Term.DX_ALLREDUCE, Term.DX_ALLGATHER):
                if t in per:
                    c = per[t]
                    f, b = calls(t, c)  # once per round
                    new[t] = Comm(c.kind, c.group, K * c.bytes, K * c.seconds, (K * f, K * b))
            if j == i and fused:
                new[Term.DX_ALLREDUCE] = Comm.zero("all_reduce", s.pr)
            changed[y.name] = new
        return comm, changed

    def best_move(self, i: int, prev: Style, s: Style):
        """(seconds for the search, the redistribute term, the head's changed terms, the scheme)
        of the cheapest scheme for the move into layer i; None when no move exists."""
        key = (i, prev, s, tuple(self.head(i)))
        if key not in self._moves:
            self._moves[key] = self._best_move(i, prev, s)
        return self._moves[key]

    def _best_move(self, i: int, prev: Style, s: Style):
        best = None
        for h in self.schemes(i, prev, s):
            got = self.move(i, prev, s, h)
            if got is None:
                return None
            comm, changed = got
            delta = math.fsum(
                c.seconds for terms in changed.values() for c in terms.values()
            ) - math.fsum(
                c.seconds
                for j in self.head(i)
                if self.layers[j].name in changed
                for c in self.terms(j, s).values()
            )
            cost = comm.seconds + delta
            if best is None or cost < best[0]:
                best = (cost, comm, changed, h)
        return best

    def transition(self, i: int, prev: Style | None, s: Style) -> Comm | None:
        """The redistribution into layer i from the style before it, with what its scheme
        changes in the head's terms; None when impossible."""
        if i == 0 or prev is None:
            return Comm.zero(Term.REDISTRIBUTE)
        if _shares_segment(self.layers, i):
            return Comm.zero(Term.REDISTRIBUTE) if prev == s else None
        if why_not_move(self.layers[i], prev, s):
            return None
        best = self.best_move(i, prev, s)
        if best is None:
            return None
        cost, comm, _, _ = best
        return dataclasses.replace(comm, seconds=cost)

    def memory(self, i: int, s: Style) -> float:
        """Bytes of layer i on the busiest rank under s, held throughout a step: weights,
        gradients and momentum (a model split's shard), and what autograd keeps for the backward
        pass (`kept`; where the layer is recomputed, only its input); in evaluation its weights
        alone."""
        x, w = self.layers[i], self.net.word_bytes
        held = x.params / (s.pr if s.kind == "model" else 1)
        if self._sharded(s):  # each rank 1/Pr of the padded parameters its members hold
            held = sharded_elements(x, s.pr) / s.pr + x.params - sharded_elements(x, 1)
        if self.predict:
            return held * w
        n = self.slow(s) / s.pc  # the largest group's examples
        acts = x.d_in / (s.pr if s.kind == "domain" else 1) if self.recomputed[i] else kept(x, s)
        joined = 0.0
        if i == len(self.layers) - 1:  # the loss keeps a tensor of the output's size (log-softmax)
            acts += x.d_out / (s.pr if s.kind == "domain" else 1)
            if self.choices.joined_loss:  # the whole batch's outputs on this rank, and their grad
                joined = 2 * self.B * (x.out or x.d_out) * w
        return 3 * held * w + n * acts * w + joined

    def peak(self, i: int, s: Style) -> float:
        """Bytes the busiest rank holds beyond `memory` at layer i's worst moment under s
        (cost.memory.at_worst): the plan's peak is its layers' `memory` and the largest of
        these."""
        n, x = self.slow(s) / s.pc, self.layers[i]
        # sharded states: a member's parameters gathered whole while it runs, and its gradients
        most = max((padded(m, s.pr) for m in x.shards), default=0)
        gathered = 2 * most if self._sharded(s) else 0
        return (n * at_worst(x, s, self.predict) + gathered) * self.net.word_bytes

    def _sharded(self, s: Style) -> bool:
        return self.choices.shard_states and s.kind == "domain" and s.pr > 1 and not self.predict

    def time(self, i: int, s: Style) -> tuple[float, float, float]:
        """(forward, backward, update) seconds of layer i under s on one rank; the backward
        computes the forward again where it is recomputed (activation checkpointing)."""
        key = (i, s)
        if key not in self._time:
            f, b, u = style_times(self.compute_model, self.layers[i], s, self.slow(s), self.P)
            self._time[key] = (f, 0.0, 0.0) if self.predict else (f, b + f * self.recomputed[i], u)
        return self._time[key]

    def terms(self, i: int, s: Style, rounds: int = 1, bucket: bool = True) -> dict[str, Comm]:
        """Layer i's terms under s (on 1/rounds of the batch: a hand-off's round): the bytes a
        rank sends on average, the seconds of the slowest group."""
        x, first, bucket_ = self.layers[i], i == 0, self.bucket if bucket else None
        choices = (self.choices.bn, bucket_, self.reducer, self.choices.shard_states)

        def price(B: float) -> dict[str, Comm]:
            terms = layer_comms(x, first, s, B / rounds, self.net, self.e, *choices)
            if self.choices.joined_loss and i == len(self.layers) - 1:  # the outputs joined
                terms[Term.LOSS_JOIN] = t_loss_join(x, s, B / rounds, self.net, self.e)
            if self.predict:  # the forward's (batch norms use their running statistics)
                return {k: c for k, c in terms.items() if k in (Term.ALLGATHER, Term.HALO_FWD)}
            return terms

        return slowest(price, self.B, self.slow(s))

    def own(self, i: int, s: Style) -> tuple[float, float, float]:
        """(exposed seconds, hideable seconds, memory bytes) of layer i under s, redistribution left
        out; exposed includes the layer's compute under s (the same for every style when the
        compute model prices B/P samples' worth). Without overlap nothing is hideable; with it
        the OVERLAPPABLE terms are."""
        key = (i, s)
        if key not in self._own:
            terms = self.terms(i, s)
            hide = math.fsum(c.seconds for k, c in terms.items() if k in OVERLAPPABLE)
            hide = hide if self.overlap else 0.0
            comm = math.fsum(c.seconds for c in terms.values())
            work = math.fsum(self.time(i, s))
            self._own[key] = (comm - hide + work, hide, self.memory(i, s) + self.peak(i, s))
        return self._own[key]

    def layer_plan(self, i: int, s: Style, prev: Style | None) -> LayerPlan | str:
        why = self.why_not(i, s)
        if why:
            return why
        x = self.layers[i]
        shares = _shares_segment(self.layers, i)
        if shares and prev != s:
            return (
                f"{self.layers[i - 1].name} and {x.name} share one layout (no point between "
                f"them to change it, e.g. a residual block) but got {prev} and {s}"
            )
        h, r = None, Comm.zero(Term.REDISTRIBUTE)
        if i > 0 and prev is not None and not shares:
            why = why_not_move(x, prev, s)
            if why:
                return why
            fixed = self.schemes(i, prev, s)[0] if self.fixed is not None else Handoff()
            why = fixed.scheme != "a" and why_not_handoff(
                fixed,
                prev,
                s,
                [self.layers[j] for j in self.head(i)],
                self.B,
                self.choices.activations_encoded,
                x.name,
            )
            if why:
                return why
            best = self.best_move(i, prev, s)
            if best is None:
                return f"no redistribution from {prev} to {s} before {x.name}"
            _, r, heads, h = best
            self._heads |= heads  # a layer is in one hand-off's head at most
            h = h if is_gather(prev, s) else None
        terms = dict(self._heads.get(x.name) or self.terms(i, s))
        if i > 0:  # in evaluation its forward half (a move's backward mirrors it)
            half = Comm(r.kind, r.group, r.bytes / 2, r.seconds / 2, r.calls and (r.calls[0], 0))
            terms[Term.REDISTRIBUTE] = half if self.predict else r
        fwd, bwd, update = self.time(i, s)
        return LayerPlan(x, s, terms, fwd, bwd, self.memory(i, s), update, h, self.peak(i, s))

    def evaluate(self, scenario: str, grid: tuple[int, int] | None, styles: list[Style]) -> Plan:
        whole = self.choices.shard_states and why_not_choices(self.choices, styles, whole=True)
        if whole:  # what no layer's rule says: sharded states need a layer on bands
            return Plan(scenario, grid, overlap=self.overlap, reason=whole)
        plan = Plan(scenario, grid, overlap=self.overlap)
        prev, self._heads, self._layouts = None, {}, [s.layout for s in styles]
        try:
            for i, s in enumerate(styles):
                lp = self.layer_plan(i, s, prev)
                if isinstance(lp, str):
                    return Plan(scenario, grid, overlap=self.overlap, reason=lp)
                plan.layers.append(lp)
                prev = s
        finally:
            self._layouts = None
        if self.bucket is not None:
            self._by_buckets(plan.layers)
        plan.sync = sync_of(plan.layers, self.net.meeting_s())
        plan.shared_bytes = self.shared(plan.layers)
        return plan

    def shared(self, chosen: list[LayerPlan]) -> float:
        """Bytes of the host shared segments a rank writes in a step (cost.memory.segment),
        where its ranks share one CPU host: its model group's, where the halos of bands travel
        through it (tiles send theirs point to point), and in training the world's, which
        carries the step's metrics."""
        net = self.net
        if self.P == 1 or not net.shared_memory or net.two_level or self.choices.device == "cuda":
            return 0.0
        bands = [(x.layer, x.style) for x in chosen if x.style.kind == "domain" and x.style.pw == 1]
        halos = [largest_halo(x, s.pr, s.pc, self.slow(s), self.e) for x, s in bands]
        most, group = max(halos, default=0.0), max((s.pr for _, s in bands), default=1)
        total = segment(group, most) if 0 < most <= SHM_MAX_BYTES else 0.0
        return total if self.predict else total + segment(self.P, 0.0)

    def _by_buckets(self, chosen: list[LayerPlan]) -> None:
        """The weight-gradient sums priced by the buckets the runtime fills: per group, in
        reverse layer order, cut by `core.splits.buckets` as GradSync cuts them. `fused` charges
        a layer the latency in proportion to its share of a full bucket, which the search needs
        per layer; but a group pays a whole latency for every bucket however little it holds
        (all of resnet20's 1.1 MB goes in one 4 MiB bucket: 0.27 of a latency priced, one
        paid). Each layer is priced again with its share of the bucket it lands in, so a group
        pays one latency per bucket."""
        groups: dict[tuple[int, int], list[LayerPlan]] = {}
        for lp in chosen:
            st = lp.style
            sums = Term.DW_ALLREDUCE in lp.terms and lp.terms[Term.DW_ALLREDUCE].bytes > 0
            if sums and not self._sharded(st):  # sharded states sum a shard per member
                key = (1, st.pr * st.pc) if st.kind == "domain" else (st.pr, st.pc)
                groups.setdefault(key, []).append(lp)
        held = self.net.word_bytes / Wire.of(self.e).grads  # a bucket holds uncompressed ones
        for (shard, p), members in groups.items():
            members = members[::-1]  # as the gradients arrive
            # each layer's gradient bytes on the wire, as `fused` takes them from its all-reduce
            wire = [lp.terms[Term.DW_ALLREDUCE].bytes * p / (2 * (p - 1)) for lp in members]
            for run in buckets([n * held for n in wire], self.bucket):
                fill = math.fsum(wire[i] for i in run)
                for i in run:
                    lp = members[i]
                    dw = t_dw_allreduce(lp.layer, p, shard, self.net, self.e, self.reducer, fill)
                    lp.terms[Term.DW_ALLREDUCE] = dw

    def chain(self, options: list[list[Style]], lam: float) -> list[Style] | str:
        """Dynamic programming over layers: the chain of styles, one per layer, with the least
        exposed communication + lambda * memory; a string says which layer nothing fits.

        With overlap the objective is N + max(0, H - K): N the communication that cannot hide
        (and lambda * memory), H the weight all-reduces that can hide behind the backward pass,
        K the backward time (the same for every chain). That is not a sum over layers, so each
        state keeps the Pareto front of (N, H) pairs instead of one number; an H beyond K is
        moved into N (it is exposed whatever comes later), which keeps the pruning exact."""
        K = math.fsum(b for _, b in self.compute) if self.overlap else 0.0
        State = tuple[float, float, list[Style]]  # (N, H, chain)

        def add(front: list[State], n: float, h: float, chain: list[Style]) -> None:
            if h > K:
                n, h = n + (h - K), K
            for fn, fh, _ in front:
                if fn <= n and fh <= h:
                    return
            front[:] = [f for f in front if not (n <= f[0] and h <= f[1])]
            front.append((n, h, chain))

        best: dict[Style, list[State]] = {}
        for i, opts in enumerate(options):
            nxt: dict[Style, list[State]] = {}
            for s in opts:
                if self.why_not(i, s):
                    continue
                exposed, hide, mem = self.own(i, s)
                own = exposed + lam * mem
                front: list[State] = []
                if i == 0:
                    add(front, own, hide, [s])
                for p, states in best.items():
                    r = self.transition(i, p, s)
                    if r is None:
                        continue
                    for n, h, chain in states:
                        add(front, n + r.seconds + own, h + hide, [*chain, s])
                if front:
                    nxt[s] = front
            if not nxt:
                return f"no style fits layer {self.layers[i].name}"
            best = nxt
        finals = [(n + max(0.0, h - K), c) for st in best.values() for n, h, c in st]
        return min(finals, key=lambda v: v[0])[1]

    def search(
        self,
        scenario: str,
        grid: tuple[int, int] | None,
        options: list[list[Style]],
        memory_limit: float | None,
    ) -> Plan:
        def run(lam: float) -> Plan:
            chain = self.chain(options, lam)
            if isinstance(chain, str):
                return Plan(scenario, grid, overlap=self.overlap, reason=chain)
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
            reason=f"no per-layer plan fits the memory limit of {_size(memory_limit)} "
            f"(the smallest found: {_size(plan.memory_bytes)}; {_largest(plan)})"
            if plan.feasible
            else f"no per-layer plan fits the memory limit of {_size(memory_limit)}",
        )


def _fits_memory(plan: Plan, limit: float | None) -> Plan:
    if plan.feasible and limit is not None and plan.memory_bytes > limit:
        return Plan(
            plan.scenario,
            plan.grid,
            overlap=plan.overlap,
            reason=f"needs {_size(plan.memory_bytes)} per process, over the limit of "
            f"{_size(limit)}; {_largest(plan)} (--activation-checkpointing keeps less)",
        )
    return plan


def _largest(plan: Plan) -> str:
    """The layer of a plan that holds the most bytes, in words."""
    x = max(plan.layers, key=lambda x: x.memory_bytes + x.peak_bytes)
    held = x.memory_bytes + x.peak_bytes
    return f"the largest layer is {x.layer.name}, {_size(held)} under {x.style}"


def _size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"


def _best(plans: list[Plan], scenario: str, empty_reason: str) -> Plan:
    chosen = best_of(plans)
    if chosen is not None:
        return chosen
    reason = plans[0].reason if plans else empty_reason
    return Plan(scenario, None, reason=reason)


def _check(P: int, B: int) -> list[tuple[int, int]]:
    all_grids = grids(P, B)
    if not all_grids:
        raise ConfigError(f"no Pr x Pc grid fits P={P} with B={B}: give a batch of 1 or more")
    return all_grids


def _domain(ctx: _Context, g: tuple[int, int], conv: list[bool], limit: float | None) -> Plan:
    """The domain scenario on grid g: each convolution split by height or by channels, whichever
    the cost model prefers, with at least one split by height (a plan called domain that splits no
    image would be mislabelled): where the cheapest splits none, the cheapest that holds one of
    the convolutions that can take it at domain; infeasible, with the rule's reason, where none
    can."""
    dom, mod = Style.domain(*g), Style.model(*g)
    split = _split(g)
    options = [[*split, mod] if c else [mod] for c in conv]
    plan = ctx.search("domain", g, options, limit)
    if not plan.feasible or any(x.style.kind == "domain" for x in plan.layers):
        return plan
    can = [(i, d) for i, c in enumerate(conv) for d in split if c and not ctx.why_not(i, d)]
    held = [ctx.search("domain", g, [[d] if j == i else o for j, o in enumerate(options)], limit)
            for i, d in can]  # fmt: skip
    held = [p for p in held if p.feasible]
    if held:
        return min(held, key=lambda p: (p.total_s, p.comm_s))
    first = next((i for i, c in enumerate(conv) if c), None)
    why = ctx.why_not(first, dom) if first is not None else "the model has no convolution"
    return Plan("domain", g, overlap=ctx.overlap, reason=f"no layer splits by height: {why}")


def _split(g: tuple[int, int]) -> list[Style]:
    """The domain styles of grid g: bands, and the squarest tiles where Pr is not prime."""
    return [Style.domain(*g), *filter(None, [Style.tiles(*g)])]


def _candidates(
    ctx: _Context,
    name: str,
    all_grids: list[tuple[int, int]],
    memory_limit: float | None,
) -> list[Plan]:
    """Every candidate plan of one scenario."""
    P, L = ctx.P, len(ctx.layers)
    conv = [x.kind == "conv" for x in ctx.layers]

    def fixed(grid: tuple[int, int] | None, styles: list[Style]) -> Plan:
        return _fits_memory(ctx.evaluate(name, grid, styles), memory_limit)

    if name == "batch":
        return [fixed((1, P), [Style.batch(P)] * L)]
    if name == "model":
        return [fixed((P, 1), [Style.model(P, 1)] * L)]
    if name == "same-grid":
        return [fixed(g, [Style.model(*g)] * L) for g in all_grids]
    if name == "fc-grid":
        return [
            fixed(g, [Style.batch(P) if c else Style.model(*g) for c in conv]) for g in all_grids
        ]
    if name == "domain":
        return [_domain(ctx, g, conv, memory_limit) for g in all_grids if g[0] > 1]
    options = [
        [Style.model(*g) for g in all_grids]
        + ([d for g in all_grids if g[0] > 1 for d in _split(g)] if c else [])
        for c in conv
    ]
    # the search prices each layer's share of a gradient bucket; the evaluated plan pays whole
    # buckets per group (`_Context._by_buckets`), so a chain of one grid can come out cheaper
    same = [[Style.model(*g)] * L for g in all_grids]
    same += [[Style.batch(P) if c else Style.model(*g) for c in conv] for g in all_grids]
    return [ctx.search(name, None, options, memory_limit), *(fixed(None, c) for c in same)]


def plan_layers(layers: list[CostLayer], request: PlanRequest) -> PlanResult:
    """Evaluate the request's scenarios for `layers` (hybridpar.planning.request.PlanRequest: P,
    B, the cluster, the plan-wide choices, ...). Whether a layer can take a style is
    core.rules.why_not, the runtime's own rule: every candidate is a plan `parallelize` runs."""
    r = request
    P, B = r.procs, r.batch
    all_grids = _check(P, B)
    candidates: dict[str, list[Plan]] = {n: [] for n in r.scenarios}
    with _collected_after():
        for placement in placements(r.cluster, all_grids):
            grids_here = [g for g in all_grids if not why_not_placement(placement, [g])]
            ctx = _Context(layers, r, r.priced(placement))
            for n in r.scenarios:
                found = _candidates(ctx, n, grids_here, r.memory_limit)
                candidates[n] += _placed(found, placement)
            for n, found in _sharded(layers, r, placement, grids_here).items():
                candidates[n] += _placed(found, placement)
    best = [_best(candidates[n], n, f"no grid with Pr > 1 fits P={P}, B={B}") for n in r.scenarios]
    base = r.elem_bytes or r.cluster.word_bytes
    return PlanResult(r.model, P, B, r.cluster, best, candidates, base, r.choices, r.input_shape)


def _sharded(layers, r: PlanRequest, placement, grids_here) -> dict[str, list[Plan]]:
    """Under a memory limit, the scenarios that split layers by height once more with their
    states sharded (Choices.shard_states): candidates beside the others, the fastest that fits
    wins. Without a limit there is no point: sharded states send 3/2 of a replicated
    gradient sum's bytes, none of it hidden behind the backward pass."""
    if r.memory_limit is None or r.choices.shard_states or r.mode != "train":
        return {}
    alt = dataclasses.replace(r, choices=r.choices.with_(shard_states=True))
    ctx, out = _Context(layers, alt, alt.priced(placement)), {}
    for n in ("domain", "per-layer"):
        if n in r.scenarios:
            found = _candidates(ctx, n, grids_here, r.memory_limit)
            out[n] = [p for p in found if any(x.style.kind == "domain" for x in p.layers)]
            for p in out[n]:
                p.sharded = True
    return out


@contextlib.contextmanager
def _collected_after():
    """The search allocates thousands of small records and frees them as it goes; a garbage
    collection of the whole heap meanwhile (a process that imported torch has a large one)
    costs more than the search: 0.10 of AlexNet's 0.16 s at P = 512 beside torch. The
    collector is off while it runs and takes its next turn after (nothing it frees is a cycle
    that outlives the search)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _placed(plans: list[Plan], placement: tuple[int, int] | None) -> list[Plan]:
    """The candidates at `placement`, each refused where its grids cannot sit so; without a
    placement the infeasible ones too (they say why)."""
    out = []
    for plan in plans:
        plan.placement = placement
        grids = [(x.style.pr, x.style.pc) for x in plan.layers]
        why = plan.feasible and why_not_placement(placement, grids)
        if why:
            plan.reason = why
        if plan.feasible or placement is None:
            out.append(plan)
    return out


def placements(cluster: Cluster, grids: list[tuple[int, int]]) -> list[tuple[int, int] | None]:
    """The placements the planner tries: rank = position, and on a cluster of several hosts each
    grid with Pr, Pc > 1 transposed (its batch groups on consecutive ranks, so within a host)."""
    if not cluster.two_level:
        return [None]
    return [None, *[(pr, pc) for pr, pc in grids if pr > 1 and pc > 1]]


def make_plan(
    model: str,
    P: int,
    B: int,
    cluster: Cluster,
    *,
    input_size: int | None = None,
    input_shape: tuple[int, ...] | None = None,
    **options: object,
) -> PlanResult:
    """`plan_layers` for a zoo model by name or a user's factory (`model_layers`); `options`:
    the rest of a PlanRequest's fields (choices, scenarios, compute, ...)."""
    layers, shape = model_layers(model, input_size, input_shape)
    request = PlanRequest(P, B, cluster, model=model, input_shape=shape, **options)  # type: ignore[arg-type]
    return plan_layers(layers, request)


def plan_for(
    module, input_shape: tuple[int, ...], P: int, B: int, cluster: Cluster, **options: object
) -> PlanResult:
    """`plan_layers` for any nn.Module (traced on the meta device; the module is not changed);
    `options`: the rest of a PlanRequest's fields. Its `export()` is a plan `parallelize` runs:
    the same rules decided both."""
    from hybridpar.core.analysis import analyze

    layers = cost_layers(analyze(module, input_shape))
    name = str(options.pop("model", type(module).__name__))
    request = PlanRequest(P, B, cluster, model=name, input_shape=tuple(input_shape), **options)  # type: ignore[arg-type]
    return plan_layers(layers, request)


def wire(elem_bytes: float, choices: Choices, net: Priced | None = None) -> float | Wire:
    """Bytes per element by kind of traffic: `elem_bytes` everywhere; the codec's payload size for
    the traffic it encodes (grads and/or activations), and its seconds per element to encode and
    decode on a rank of the job `net` prices, where its cluster was calibrated with it
    (`Priced.codec_times`); bf16 activations (2 bytes) under amp bf16 autocast, where no codec
    encodes them."""
    acts_amp = 2 if choices.amp == "bf16" else elem_bytes
    if choices.codec == "none":
        return elem_bytes if acts_amp == elem_bytes else Wire(elem_bytes, acts_amp)
    b = payload_bytes(choices.codec)
    g, a = choices.grads_encoded, choices.activations_encoded
    enc, dec = net.codec_times(choices.codec) if net is not None else (0.0, 0.0)
    return Wire(b if g else elem_bytes, b if a else acts_amp, g, a, acts_amp, enc, dec)


def evaluate(
    layers: list[CostLayer],
    styles: list[Style],
    request: PlanRequest,
    *,
    name: str = "custom",
    handoffs: dict[str, Handoff] | None = None,
    placement: tuple[int, int] | None = None,
) -> Plan:
    """The predicted cost of one given chain of styles (what the runtime is about to execute),
    with the hand-off schemes it names by the layer they enter (scheme (a) elsewhere), its
    positions placed on the ranks by `placement`."""
    ctx = _Context(layers, request, request.priced(placement), fixed=handoffs or {})
    plan = ctx.evaluate(name, None, styles)
    plan.placement = placement
    return plan
