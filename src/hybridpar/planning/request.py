"""What a plan is asked for, as one value: the planner's entry points (`search.plan_layers`,
`search.evaluate`, `presets.plan_preset`) take a PlanRequest in place of the dozen keywords each
of them used to repeat; `make_plan` and `plan_for` build one from their keywords, and the CLI's
configs from their fields. The request checks itself when it is made (one line to change), and
makes the job's priced view of its cluster (`Cluster.priced`) for a placement."""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridpar.core.choices import Choices
from hybridpar.core.cluster import Cluster, Priced
from hybridpar.core.errors import ConfigError
from hybridpar.planning.cost.compute import ComputeModel

__all__ = ["GRAD_BUCKET_BYTES", "MAX_PROCS", "SCENARIOS", "PlanRequest"]

SCENARIOS = ("batch", "model", "same-grid", "fc-grid", "domain", "per-layer")

MAX_PROCS = 1 << 24
"""beyond any machine (16 M ranks): a larger P is a typo, refused at once"""

# the runtime's gradient bucket (RuntimeOptions.bucket_mb's default, 4 MiB): weight-gradient
# all-reduces are priced fused into buckets of this size (cost.terms.fused)
GRAD_BUCKET_BYTES = 4 * 2**20


@dataclass(frozen=True)
class PlanRequest:
    """A plan for `procs` ranks and a global batch of `batch` examples on `cluster`."""

    procs: int
    batch: int
    cluster: Cluster
    choices: Choices = field(default_factory=Choices)
    """codec, bn, reducer, ... (hybridpar.core.choices): with bn global or adaptive the batch
    norms' all-reduces are priced too"""
    model: str = "model"
    """what is planned, for the result's name"""
    compute: ComputeModel | None = None
    """per-layer seconds (planning.cost.compute); None: FLOPs at the cluster's rate"""
    scenarios: tuple[str, ...] = SCENARIOS
    elem_bytes: float | None = None
    """bytes of one element on the wire (None: the cluster's word)"""
    memory_limit: float | None = None
    """bytes a rank may hold; the search trades time for memory to meet it"""
    overlap: bool = False
    """price the weight-gradient sums hidden behind the backward pass"""
    input_shape: tuple[int, ...] | None = None
    grad_bucket: float | None = GRAD_BUCKET_BYTES
    handoff: str = "a"
    """the schemes a batch -> model hand-off may take: a; b; c (in `rounds` rounds or one per
    gathering rank); auto: the cheapest of a, b and c in 2, 4 or m rounds (core/handoff.py)"""
    rounds: int | None = None
    fuse_handoff: bool = True
    """False: a hand-off's backward priced as Gholami et al.'s Eqs. 6 and 8 do (the split
    layer's dX all-reduced, each rank keeping its rows) instead of the runtime's reduce-scatter"""
    shared_memory: bool = True
    """the job's groups take the host's shared-memory paths (`train --no-shared-memory`: no)"""
    mode: str = "train"
    """train, or predict: a forward in evaluation (no backward, gradients or optimizer state;
    the memory the activations alive at once, core.live)"""

    def __post_init__(self) -> None:
        object.__setattr__(self, "scenarios", tuple(self.scenarios))
        P, B = self.procs, self.batch
        if not isinstance(P, int) or isinstance(P, bool) or P < 1:
            raise ConfigError(f"the number of processes must be a positive integer, got {P!r}")
        if P > MAX_PROCS:
            raise ConfigError(f"--procs {P} is more than {MAX_PROCS} processes; give a real count")
        if not isinstance(B, int) or isinstance(B, bool) or B < 1:
            raise ConfigError(f"the global batch must be a positive integer, got {B!r}")
        unknown = [s for s in self.scenarios if s not in SCENARIOS]
        if unknown:
            raise ConfigError(
                f"unknown scenario(s) {unknown}; choose from {', '.join(SCENARIOS)} or all"
            )
        if self.mode not in ("train", "predict"):
            raise ConfigError(f"unknown mode {self.mode!r}; choose train or predict")
        if self.handoff not in ("a", "b", "c", "auto"):
            raise ConfigError(f"unknown hand-off {self.handoff!r}; choose a, b, c or auto")
        if self.rounds is not None and (self.handoff != "c" or self.rounds < 1):
            raise ConfigError("--rounds is for --handoff c: a positive number of rounds")
        if self.handoff in ("b", "c") and self.choices.activation_checkpointing:
            raise ConfigError(
                f"--activation-checkpointing cannot recompute a hand-off sent in rounds (--handoff "
                f"{self.handoff}); use --handoff a or drop the checkpointing"
            )

    def priced(self, placement: tuple[int, int] | None = None) -> Priced:
        """The job's view of its cluster (`Cluster.priced`) with its positions placed so."""
        return self.cluster.priced(self.procs, placement, self.shared_memory)
