"""The engine contract: what runs a plan on this rank, for either `plan.engine`.

Two engines run a ParallelPlan: `HybridParallel` (hybridpar's runtime, any mix of styles) and
`DDPEngine` (torch DistributedDataParallel with hybridpar's reducers: the baseline, every layer
batch). `parallelize(model, plan)` returns the one the plan names; both keep the same per-step
contract, so one step (`HybridTrainer`) serves both, the command line and user code alike:

    engine.set_batch(n)                   the step's global batch size, known to every rank
    out = engine(x[engine.input_rows(n)]) this rank's examples in
    loss = loss_fn(out, y[engine.output_rows(n)], reduction="sum") / n
    loss.backward(); engine.finish_backward()    every gradient is then the global batch's
    optimizer.step()

The loss is summed over this rank's output rows and divided by the *global* batch, so every
gradient is a plain sum over the ranks that hold a parameter (hybridpar's reducers sum, they do
not average; DDPEngine registers them so).

For checkpoints (torch.distributed.checkpoint) an engine shows its state with split layers'
shards as DTensor views (`distributed_state_dict`), and gathers the original model's state dict
(`full_state_dict`).
"""

from __future__ import annotations

import torch
from torch import nn

from hybridpar.core.errors import ConfigError
from hybridpar.core.plan import ParallelPlan
from hybridpar.core.terms import Term
from hybridpar.runtime.comm.collectives import (
    Via,
    all_gather_sizes,
    all_gather_uneven,
    even_split,
)
from hybridpar.runtime.comm.group import Group
from hybridpar.runtime.comm.ledger import Ledger
from hybridpar.runtime.options import RuntimeOptions
from hybridpar.runtime.parallel import compute
from hybridpar.runtime.parallel.batchnorm import BNSwitch
from hybridpar.runtime.parallel.layout import Layout

__all__ = ["Engine"]


class Engine(nn.Module):
    """A model running a plan on this rank; the user's model is `.module` (changed in place).
    `layout`: the plan resolved against the model; `device`: where its parameters are."""

    kind: str = ""  # the plan.engine this class runs
    bn_switch: BNSwitch | None = None
    world: Group  # every rank, for metrics and agreed decisions
    variable = None  # the hand-off whose layers after it step per round (variable batch)
    # the ranks host by host where the launcher numbered them otherwise and the plan's groups
    # follow the hosts (core.groups.host_order), and why not where they cannot
    order: list[int] | None = None
    why_not_hosts: str = ""

    def __init__(
        self,
        model: nn.Module,
        plan: ParallelPlan,
        layout: Layout,
        options: RuntimeOptions,
        device: torch.device,
        ledger: Ledger | None = None,
    ) -> None:
        super().__init__()
        if plan.engine != self.kind:
            raise ConfigError(
                f"{type(self).__name__} runs plans with engine {self.kind}; "
                f"this one's is {plan.engine} (parallelize picks the engine)"
            )
        self.plan, self.layout, self.options, self.ledger = plan, layout, options, ledger
        self.device = device
        self.build(model)
        # the parts recomputed in backward, and those compiled (inside them too)
        patterns = plan.choices.activation_checkpointing
        self.checkpointed = compute.checkpoint_modules(self.module, patterns, layout, ledger)
        backend = options.compile_backend
        self.compiled = compute.compile_plain(self.module, backend) if options.compile else []

    def build(self, model: nn.Module) -> None:
        """Apply the plan to `model` on this rank (collective: it makes the process groups)."""
        raise NotImplementedError

    # --- the per-step contract -----------------------------------------------------------------

    def set_batch(self, n: int) -> None:
        """The number of examples in the coming step's global batch (known to every rank)."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"set_batch takes the global batch size, a positive int; got {n!r}")
        self.split(even_split(n, self.plan.procs))

    def split(self, sizes: list[int]) -> None:
        """The coming step's examples per rank in the finest layout (`even_split(n, P)`)."""
        raise NotImplementedError

    def input_rows(self, n: int) -> slice:
        """The examples of a global batch of n that this rank feeds in."""
        raise NotImplementedError

    def output_rows(self, n: int) -> slice:
        """The examples its outputs belong to."""
        raise NotImplementedError

    def input_band(self) -> tuple[int, int] | None:
        """The rows [lo, hi) of the input images this rank needs, where the plan's first segment
        splits them by height (the halo comes from the ranks that hold it); None: whole."""
        return None

    def output_band(self) -> tuple[int, int] | None:
        """The rows [lo, hi) of the output images this rank's outputs hold, where the plan's
        last segment leaves them split by height (a dense prediction's loss runs on its band);
        None where they are whole."""
        return None

    @property
    def counts_outputs(self) -> bool:
        """Whether this rank's outputs count in the metrics (replicas hold the same outputs: one
        of them counts)."""
        return True

    def gather_output(self, out: torch.Tensor) -> torch.Tensor:
        """The outputs of the whole global batch, on every rank, from this rank's `out`
        (collective, booked under metrics): the ranks that count their outputs send them."""
        counted = self._counted(out)
        via = Via(self.world, term=Term.METRICS)
        sizes = all_gather_sizes(len(counted), via, out.device)
        return all_gather_uneven(counted, sizes, 0, via)

    def _counted(self, out: torch.Tensor) -> torch.Tensor:
        """This rank's part of the whole outputs (its examples', or none for a replica)."""
        return out if self.counts_outputs else out[:0]

    def finish_backward(self) -> float:
        """Wait for the gradient sums (and count the step); returns the exposed wait in seconds."""
        self.step += 1
        return 0.0

    @property
    def exposed_s(self) -> float:
        """The last step's communication after its last gradient was produced."""
        return 0.0

    step: int = 0
    """backward passes finished (optimizer steps): the run's one step counter, which dropout
    streams, the ledger and checkpoints read"""

    # --- state ---------------------------------------------------------------------------------

    def distributed(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """A tensor shaped like parameter `name` (the parameter, an optimizer buffer) as
        torch.distributed.checkpoint should see it (a replicated one: itself)."""
        return t

    def distributed_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state_dict (original keys), split layers' shards as DTensor views."""
        return {k: self.distributed(k, v) for k, v in self.module.state_dict().items()}

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The original model's state_dict (collective: call on every rank)."""
        return {k: v.clone() for k, v in self.module.state_dict().items()}

    @torch.no_grad()
    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load the original model's state_dict (each rank keeps what it holds of it)."""
        self.module.load_state_dict(state)

    def reducer_states(self) -> dict[int, object]:
        """Gradient bucket index -> the reducer state that holds its error-feedback residuals."""
        return {}

    def named_parameters_for_state(self) -> dict[str, nn.Parameter]:
        """The parameters by their original names (the optimizer's state is keyed by them)."""
        return dict(self.module.named_parameters())
