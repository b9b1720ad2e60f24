"""Krizhevsky's hand-off schemes (b) and (c): the activations move into the gathered layout in K
rounds, and the layers after the hand-off (its *head*) run round by round, so round j+1's
activations travel while round j computes (core/handoff.py states the schemes and the rule).

    forward:  start(0); for j: h_j = wait(j); start(j+1); y_j = head(h_j)       (y: in (a)'s order)
    backward: for j = K-1 .. 0: head's backward of round j; wait(j+1); start(j)'s return
              (each round's activation gradient to the ranks that own its examples)

The head is the module the hand-off enters and, where that module sits in an nn.Sequential, the
modules after it there up to the next change of layout: any module tree has one (the entry module
itself). The entry (or its Sequential) keeps its name, parameters and state-dict keys; only its
`forward` is wrapped on this rank. Rounds are one autograd node: its forward builds each round's
graph under `enable_grad`, its backward runs them (torch.autograd.backward), which accumulates the
head's parameter gradients where the gradient synchroniser sees them, as the one-round hand-off
does. Examples in a round are not contiguous, so counter-based dropout in the head is told their
global indices (StepRows.examples) and draws the masks one process draws.

Backward returns each round's gradient to its owners: where the gradient is the split layer's
partial dX (planning/handoff.fused) by a reduce-scatter ((c)) or a reduce to the round's sender
((b)); otherwise it is complete on every rank and each keeps its rows. On one host the all-gathers
and reduce-scatters go through shared memory in two phases (comm.small), elsewhere they are
asynchronous torch.distributed calls; (b)'s broadcasts and reduces are torch.distributed's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from hybridpar.core import faults
from hybridpar.core.errors import ConfigError
from hybridpar.core.handoff import Handoff, round_rows
from hybridpar.core.terms import Term
from hybridpar.runtime.comm.collectives import (
    Started,
    Via,
    start_all_gather,
    start_broadcast,
    start_reduce,
    start_reduce_scatter,
)
from hybridpar.runtime.comm.grid import rows_of_group
from hybridpar.runtime.comm.group import group_rank
from hybridpar.runtime.parallel import losses
from hybridpar.runtime.parallel.redistribute import Move, regroup_place

__all__ = ["Rounds", "VariableBatch", "install", "optimizer_for"]


class _Plan:
    """One step's rounds on this rank: who sends how many examples in which round; its index
    tensors on `device`, the activations' (they select rows of them)."""

    def __init__(self, r: Rounds, device: torch.device) -> None:
        finest = r.rows.sizes
        if finest is None:
            raise RuntimeError("call set_batch(n) with the step's global batch before the forward")
        groups = [r.first + i for i in range(r.m)]
        self.rows = [rows_of_group(finest, r.pr_fine, g) for g in groups]  # per member
        starts = [sum(rows_of_group(finest, r.pr_fine, g) for g in range(c)) for c in groups]
        self.per_round = [round_rows(n, r.h.scheme, r.h.rounds, i) for i, n in enumerate(self.rows)]
        K = r.h.rounds
        # round j carries, member by member, these global examples
        self.examples, order = [], []
        for j in range(K):
            ex, pos = [], []
            for i in range(r.m):
                off = sum(self.per_round[i][:j])
                first, n = sum(self.rows[:i]) + off, self.per_round[i][j]
                ex.append(torch.arange(starts[i] + off, starts[i] + off + n, device=device))
                pos.append(torch.arange(first, first + n, device=device))
            self.examples.append(torch.cat(ex))
            order.append(torch.cat(pos))
        # y in round order -> (a)'s order (member by member): canonical row c sits at perm[c]
        where = torch.cat(order)
        self.bounds = [0]  # round j's rows are [bounds[j], bounds[j + 1]) in round order
        for j in range(K):
            self.bounds.append(self.bounds[-1] + sum(p[j] for p in self.per_round))
        self.perm = torch.empty_like(where)
        self.perm[where] = torch.arange(where.numel(), device=device)
        self.where = where

    def sizes(self, j: int) -> list[int]:
        """Each member's examples in round j."""
        return [self.per_round[i][j] for i in range(len(self.rows))]


class Rounds:
    """The hand-off into one segment, sent by scheme (b) or (c), and its head run in rounds."""

    def __init__(self, move: Move, src: int, dst: int, h: Handoff, variable: bool = False) -> None:
        grids, self.variable, self.codec = move.grids, variable, move.codec
        self.group = grids.handoff_group(src, dst)
        # variable batch: a round's gradient goes back while the next round's rows arrive, two
        # split-phase calls in flight: each on its own group
        self.back = grids.handoff_group(src, dst, "handoff-back") if variable else self.group
        self.rows, self.ledger, self.layer = move.rows, move.ledger, move.layer
        self.h, self.fused = h, move.fused
        self.per_round: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None
        """variable batch (Krizhevsky 4.2): called with each round's index, head output and its
        rows' positions in the head's output; it takes the round's loss, runs its backward and
        steps the head's optimizer (HybridTrainer sets it)"""
        self.head_params: list[torch.nn.Parameter] = []
        self.output: torch.Tensor | None = None
        self.pr_fine, self.m, self.first = regroup_place(grids, src, dst)
        self.me = group_rank(self.group)

    # --- one round's traffic -------------------------------------------------------------------

    def _send(self, plan: _Plan, x: torch.Tensor, j: int) -> Started:
        """Start round j's activations on their way to every member."""
        sizes = plan.sizes(j)
        off = sum(plan.per_round[self.me][:j])
        mine = x.narrow(0, off, sizes[self.me])
        via = Via(self.group, self.ledger, Term.REDISTRIBUTE, self.layer, self.codec)
        if self.h.scheme == "b":
            buf = mine if self.me == j else x.new_empty((sizes[j], *x.shape[1:]))
            return start_broadcast(buf, j, via)
        return start_all_gather(mine, sizes, 0, via)

    def _return(self, plan: _Plan, g: torch.Tensor, j: int) -> Started | torch.Tensor:
        """Start round j's activation gradient back to the members that own its examples (or,
        where it is complete everywhere, keep this rank's rows)."""
        sizes = plan.sizes(j)
        via = Via(self.back, self.ledger, Term.REDISTRIBUTE, self.layer)
        if self.fused:
            if self.h.scheme == "b":
                return start_reduce(g, j, via)
            return start_reduce_scatter(g, sizes, 0, via)
        return g.narrow(0, sum(sizes[: self.me]), sizes[self.me])

    def _mine(self, plan: _Plan, got: torch.Tensor, j: int) -> torch.Tensor:
        """This rank's rows of round j's returned gradient."""
        if self.h.scheme == "b" and self.fused:
            return got if self.me == j else got[:0]
        return got

    # --- the pipeline --------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor], params):
        faults.at("handoff")
        if not torch.is_grad_enabled():  # evaluation: the rounds, no graphs kept
            return self.run_forward(x, head, grad=False)
        self.output = _RoundsFn.apply(x, self, head, *params)
        return self.output

    def run_forward(self, x: torch.Tensor, head, grad: bool = True) -> torch.Tensor:
        plan = self.plan = _Plan(self, x.device)
        K = self.h.rounds
        self.saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        variable = grad and self.per_round is not None
        self.mine: list[torch.Tensor | None] = [None] * K
        self.pending: tuple[int, Started] | None = None
        started = self._send(plan, x, 0)
        ys = []
        try:
            for j in range(K):
                h = started.wait()
                if j + 1 < K:
                    started = self._send(plan, x, j + 1)
                self.rows.examples = plan.examples[j]
                if grad:
                    h = h.detach().requires_grad_()
                    with torch.enable_grad():
                        y = head(h)
                    if variable:
                        self._step_round(plan, j, h, y)
                    else:
                        self.saved.append((h, y))
                else:
                    y = head(h)
                ys.append(y.detach())
        finally:
            self.rows.examples = None
        return torch.cat(ys).index_select(0, plan.perm)

    def _step_round(self, plan: _Plan, j: int, h: torch.Tensor, y: torch.Tensor) -> None:
        """Variable batch: round j's loss, backward and head update now, and its activation
        gradient on its way back (the trunk's share of the whole batch's mean loss: the round's
        mean-loss gradient x its rows / all rows) while the next round arrives and computes."""
        positions = plan.where[plan.bounds[j] : plan.bounds[j + 1]]
        with torch.enable_grad():  # inside the rounds' autograd node, where grad mode is off
            self.per_round(j, y, positions)
        share = (plan.bounds[j + 1] - plan.bounds[j]) / plan.bounds[-1]
        g = h.grad if h.grad is not None else torch.zeros_like(h)
        self._give_back(plan, j, g * share)

    def _give_back(self, plan: _Plan, j: int, g: torch.Tensor) -> None:
        """Start round j's activation gradient back to its owners, once the previous round's has
        arrived: one return in flight at a time on the group."""
        self._finish_pending(plan)
        back = self._return(plan, g, j)
        if isinstance(back, Started):
            self.pending = (j, back)
        else:
            self.mine[j] = back

    def _finish_pending(self, plan: _Plan) -> None:
        if self.pending is not None:
            j, started = self.pending
            self.mine[j] = self._mine(plan, started.wait(), j)
            self.pending = None

    def run_backward(self, gy: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the gradient of the hand-off's input. Without variable batch: the
        rounds' backward in one autograd pass (the last round's graph first, as autograd runs the
        newest nodes first), each round's gradient started back to its owners by a hook the
        moment it is computed, while the earlier rounds' backward runs. One pass, not one per
        round: a parameter of the head then accumulates its K rounds' gradients at once, so the
        gradient synchroniser sees it ready once, with the whole sum (with a pass per round it
        would sum the first round's gradient over the batch group and miss the rest). With
        variable batch the rounds' gradients came back during the forward; `gy` is not needed."""
        plan = self.plan
        if self.saved:
            g_round = gy.index_select(0, plan.where)  # round order
            ys, gs = [], []
            for j, (h, y) in enumerate(self.saved):
                h.register_hook(functools.partial(self._returned, plan, j))
                ys.append(y)
                gs.append(g_round[plan.bounds[j] : plan.bounds[j + 1]])
            self.saved = []
            torch.autograd.backward(ys, gs)
        self._finish_pending(plan)
        return torch.cat([t for t in self.mine if t is not None])

    def _returned(self, plan: _Plan, j: int, g: torch.Tensor) -> None:
        """Round j's activation gradient, computed: on its way back (a tensor hook)."""
        self._give_back(plan, j, g)


class _RoundsFn(torch.autograd.Function):
    """The rounds as one autograd node; the head's parameters are inputs only so that the node
    runs backward even where x needs no gradient (their gradients accumulate inside)."""

    @staticmethod
    def forward(ctx, x, rounds: Rounds, head, *params):
        ctx.rounds = rounds
        return rounds.run_forward(x, head)

    @staticmethod
    def backward(ctx, gy):
        gx = ctx.rounds.run_backward(gy.contiguous())
        return gx, None, None, *([None] * (len(ctx.needs_input_grad) - 3))


def _head(parent: nn.Sequential, child: str, prefix: str, later: list[str]) -> tuple[int, int]:
    """The positions [start, end) in `parent` of the entry `child` and the modules after it that
    hold no later change of layout."""
    names = list(parent._modules)
    start = end = names.index(child) + 1
    while end < len(names):
        full = prefix + names[end]
        if any(e == full or e.startswith(full + ".") for e in later):
            break
        end += 1
    return start - 1, end


def install(model: nn.Module, entry: str, later: list[str], rounds: Rounds) -> None:
    """Run the head of the hand-off entering module `entry` (named from `model`) in rounds;
    `later`: the entries of the segments after it. Call it once the model's modules are final
    (after dropout and batch norm are replaced): the head is looked up by name at each call."""
    module = model.get_submodule(entry)
    parent_name, _, child = entry.rpartition(".")
    parent = model.get_submodule(parent_name) if entry else None
    if isinstance(parent, nn.Sequential):
        prefix = parent_name + "." if parent_name else ""
        a, b = _head(parent, child, prefix, later)
        seq = parent
        rounds.head_params = [p for m in list(seq._modules.values())[a:b] for p in m.parameters()]

        def run_head(h: torch.Tensor) -> torch.Tensor:
            for m in list(seq._modules.values())[a:b]:
                h = m(h)
            return h

        def forward(x: torch.Tensor) -> torch.Tensor:
            mods = list(seq._modules.values())
            for m in mods[:a]:
                x = m(x)
            params = [p for m in mods[a:b] for p in m.parameters()]
            x = rounds.forward(x, run_head, params)
            for m in mods[b:]:
                x = m(x)
            return x

        parent.forward = forward
        return
    inner = module.forward

    def forward_entry(x: torch.Tensor, *rest, **kw):
        return rounds.forward(x, lambda h: inner(h, *rest, **kw), list(module.parameters()))

    module.forward = forward_entry
    rounds.head_params = list(module.parameters())


def optimizer_for(trainer, optimizer: Callable, head_optimizer: Callable | None = None):
    """A trainer's one optimizer: `optimizer` of its engine's parameters, or where the engine
    runs a variable batch (`engine.variable`) a VariableBatch of the two."""
    v = trainer.model.variable
    if v is None:
        params = list(trainer.model.parameters())
        sharded = [p for p in params if isinstance(p, DTensor)]  # states sharded (FSDP2)
        if not sharded or len(sharded) == len(params):
            return optimizer(params)
        # two param groups: a foreach step takes the DTensors and the tensors apart
        plain = [p for p in params if not isinstance(p, DTensor)]
        return optimizer([{"params": plain}, {"params": sharded}])
    return VariableBatch(v, trainer, optimizer, head_optimizer or optimizer)


class VariableBatch:
    """Krizhevsky's variable batch size (section 4.2) as the trainer's one optimizer. The head of
    the hand-off sent in rounds (`rounds.head_params`, stepped by `head`) takes its loss,
    backward and step once per round on that round's examples, inside the forward; the other
    parameters (`rest`) step once per iteration, where the trainer steps its optimizer. For a
    checkpoint and a learning-rate schedule it is one optimizer: `state` by parameter, and the
    param groups of both."""

    def __init__(self, rounds: Rounds, trainer, optimizer: Callable, head_optimizer: Callable):
        head = {id(p) for p in rounds.head_params}
        params = trainer.model.parameters()
        self.rest = optimizer([p for p in params if id(p) not in head])
        self.head = head_optimizer(rounds.head_params)
        self.state = _Routed((self.rest, self.head))
        self.param_groups = self.rest.param_groups + self.head.param_groups
        self.defaults = self.rest.defaults
        self.rounds, self.trainer = rounds, trainer
        rounds.per_round = self._round
        trainer.model.register_forward_hook(self._check)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.rest.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        self.rest.step()

    def _round(self, j: int, y: torch.Tensor, positions: torch.Tensor) -> None:
        """Round j's mean loss over its examples (the trainer's loss, on this step's targets at
        `positions`), its backward through the head, and the head's step."""
        t = self.trainer
        target = t.target[positions.to(t.target.device)]
        with t.autocast():
            loss = t.loss(y, target, reduction="sum")
        self.head.zero_grad(set_to_none=True)
        (loss / losses.divisor(t.loss, target).to(loss)).backward()
        self.head.step()

    def _check(self, module, inputs, out) -> None:
        if torch.is_grad_enabled() and out is not self.rounds.output:
            raise ConfigError(
                "--variable-batch takes each round's loss on the output of the layers after the "
                "hand-off, but the model's forward changes it after them; drop --variable-batch"
            )


class _Routed(dict):
    """Several optimizers' per-parameter state seen as one (each parameter's in its own)."""

    def __init__(self, optimizers) -> None:
        super().__init__()
        self.optimizers = optimizers

    def _owner(self, p):
        for o in self.optimizers:
            if any(q is p for g in o.param_groups for q in g["params"]):
                return o
        raise KeyError("a parameter no optimizer steps")

    def __getitem__(self, p):
        return self._owner(p).state[p]

    def items(self):
        return [kv for o in self.optimizers for kv in o.state.items()]
