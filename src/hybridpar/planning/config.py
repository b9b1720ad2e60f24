"""PlanConfig: what `hybridpar plan` and `simulate` plan for, typed; their options are generated
from it (the number of processes is theirs: one P for plan, a list for simulate)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hybridpar.core.choices import Choices
from hybridpar.core.config import check_fields, meta, nested
from hybridpar.core.errors import ConfigError
from hybridpar.core.zoo import MODELS, parse_input_shape, shape_option, size_option

__all__ = ["PlanConfig"]


@dataclass
class PlanConfig:
    model: str = meta(
        None,
        f"zoo model ({', '.join(MODELS)}) or your own: package.module:factory, a function "
        "returning an nn.Module (with --input-shape)",
        required=True,
    )
    batch: int = meta(None, "global mini-batch B", required=True)
    cluster: str = meta(
        "cori-knl",
        "preset (cori-knl, k20-pcie, fdr-infiniband, p100-nvlink), localhost, or a .toml/.json file",
    )
    input_size: int | None = size_option("the model's")
    input_shape: str | None = shape_option(", e.g. 3,32,32")
    compute: str | None = meta(
        None,
        "compute times: a profile `hybridpar profile` wrote (for any cluster), or 'flops' "
        "(FLOPs / the cluster's rate); default: on the calibrated localhost a profile measured "
        "here at the batches a rank runs (cached), elsewhere flops",
    )
    bytes_per_element: float | None = meta(
        None, "wire bytes per element (default: the cluster's word size)", positive=True
    )
    memory_limit: float | None = meta(
        None, "GiB per process (parameters + activations)", positive=True
    )
    overlap: bool = meta(False, "hide the weight all-reduce behind the backward pass (Fig. 8)")
    grad_bucket_mb: float = meta(
        4.0,
        "weight-gradient all-reduces priced fused into buckets of this many MiB, as the runtime "
        "sends them (--bucket-mb of train); 0: one message per layer, as Gholami et al.'s Eq. 4",
        nonneg=True,
    )
    handoff: Literal["a", "b", "c", "auto"] = meta(
        "a",
        "Krizhevsky's hand-off into model-parallel layers: a (one all-gather), b (each rank's "
        "batch in turn), c (1/K of every rank's batch per round, --rounds K), auto (the "
        "cheapest of a, b and c in 2, 4 or one round per gathering rank)",
    )
    rounds: int | None = meta(
        None,
        "rounds of --handoff c (default: one per rank that gathers, the paper's K)",
        positive=True,
    )
    shared_memory: bool = meta(
        True,
        "activations' and small collectives priced through host shared memory, as `hybridpar "
        "train` sends them (off: on gloo, for a run with `train --no-shared-memory`)",
        flag="--no-shared-memory",
    )
    choices: Choices = nested(Choices)

    def __post_init__(self) -> None:
        check_fields(self)
        if self.rounds is not None and self.handoff != "c":
            raise ConfigError("--rounds is for --handoff c; drop it or add --handoff c")
        if not isinstance(self.batch, int) or self.batch < 1:
            raise ConfigError(f"--batch must be a positive integer, got {self.batch!r}")
        if self.input_shape is not None:
            parse_input_shape(self.input_shape)

    def plan_kwargs(self) -> dict:
        """Keyword arguments of `hybridpar.planning.search.make_plan`."""
        from hybridpar.planning.profile import load_profile

        return dict(
            input_size=self.input_size,
            input_shape=parse_input_shape(self.input_shape) if self.input_shape else None,
            compute=load_profile(self.compute) if self.compute not in (None, "flops") else None,
            elem_bytes=self.bytes_per_element,
            memory_limit=self.memory_limit * 2**30 if self.memory_limit else None,
            overlap=self.overlap,
            choices=self.choices,
            grad_bucket=self.grad_bucket_mb * 2**20 if self.grad_bucket_mb else None,
            handoff=self.handoff,
            rounds=self.rounds,
            shared_memory=self.shared_memory,
        )
