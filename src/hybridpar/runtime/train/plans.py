"""Where a training job's plan comes from: a fixed preset or a plan file (decided in the parent,
before any rank starts), or a searched preset (`auto`, the scenarios), which rank 0 decides in
the job, after a collective calibration of `localhost` if there is none yet, and broadcasts
(DESIGN.md invariant 3). Every path goes through the planner, on the layers the parent traced."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import torch.distributed as dist

from hybridpar.core.cluster import BYTES_ONLY, Cluster, load_cluster, localhost_path
from hybridpar.core.errors import ConfigError
from hybridpar.core.handoff import Handoff
from hybridpar.core.plan import ParallelPlan, Style
from hybridpar.planning.cost.compute import ProfileModel
from hybridpar.planning.presets import SEARCHED, plan_preset
from hybridpar.planning.profile import planning_compute
from hybridpar.planning.request import PlanRequest
from hybridpar.planning.search import evaluate, export
from hybridpar.runtime.launcher import settle_server, under_torchrun
from hybridpar.runtime.train.calibration import calibrate_in_job
from hybridpar.runtime.train.job import Job

__all__ = ["agreed_plan", "checked_file_plan", "parent_plan", "preset_plan", "pricing_cluster"]


def settled_compute(job: Job, cluster: Cluster) -> ProfileModel | None:
    """planning.profile.planning_compute for the job, once a fork server `hybridpar train`
    started early has finished importing (launcher.settle_server; at once otherwise): a profile
    it measures would otherwise share a core with that import, and be cached for every later
    plan."""
    if cluster.cores is None:  # not this host (a preset, bytes only): priced by FLOPs
        return None
    settle_server()
    P, B, c = job.procs, job.batch, job.choices
    return planning_compute(cluster, job.model, job.input_shape, P, B, c.device, c.amp)


def pricing_cluster(job: Job, required: bool) -> Cluster:
    """The cluster presets are planned and priced on, for `job` (on its device). An uncalibrated `localhost`
    prices bytes only (no seconds: the report says so) for a fixed preset, and is calibrated in
    the job for a searched one; a calibration of another device is refused. Under torchrun,
    ranks other than 0 price bytes only: rank 0 prices the plan in the job and sends it
    (`agreed_plan`), so only it measures the compute profile, and every rank runs its plan."""
    spec, device = job.cfg.cluster, job.choices.device
    if spec == "localhost" and not localhost_path(device).exists() and not required:
        return BYTES_ONLY
    # every rank checks the spec: a bad one is named everywhere
    cluster = load_cluster(spec, device)
    if not required and under_torchrun() and os.environ.get("RANK", "0") != "0":
        return BYTES_ONLY
    return cluster


def parent_plan(job: Job) -> ParallelPlan | None:
    """A preset's plan as the parent decides it: a fixed one planned (on a calibrated cluster,
    after a bytes-only planning has checked that it can run, before a profile is measured); a
    searched one only checked (None: rank 0 plans it in the job)."""
    cluster, search = pricing_cluster(job, False), job.cfg.preset in SEARCHED
    if search or cluster is not BYTES_ONLY:  # what the arguments decide, checked
        preset_plan(job, BYTES_ONLY)
    return None if search else preset_plan(job, cluster)


def request(
    job: Job, cluster: Cluster, procs: int, batch: int, choices=None, profiled: bool = True
) -> PlanRequest:
    """What the job asks of the planner on `cluster` (its runtime's bucket, shared memory and
    hand-off options, its compute profile unless `profiled` is False: the bytes and the checks
    need none)."""
    cfg = job.cfg
    return PlanRequest(
        procs,
        batch,
        cluster,
        choices=choices or job.choices,
        model=job.model,
        input_shape=tuple(job.input_shape),
        compute=settled_compute(job, cluster) if profiled else None,
        grad_bucket=cfg.runtime.bucket_bytes,
        handoff=cfg.handoff or "a",
        rounds=cfg.rounds,
        shared_memory=cfg.runtime.shared_memory,
        memory_limit=cfg.memory_limit * 2**30 if cfg.memory_limit else None,
    )


def preset_plan(job: Job, cluster: Cluster) -> ParallelPlan:
    """The job's preset, planned on `cluster`."""
    return plan_preset(job.cfg.preset, job.layers, request(job, cluster, job.procs, job.batch))


def checked_file_plan(plan: ParallelPlan, job: Job, styles: dict[str, Style]) -> ParallelPlan:
    """A plan file must be for this model and data (`styles`: its style of every layer, as
    `resolve` found them). A hand-written one (no predictions) becomes the exact plan it means:
    one style per layer, priced on --cluster; a planned one keeps its styles and is priced
    again on --cluster (its bytes must be this model's). Every check runs on the bytes alone,
    before anything is measured for the seconds (a compute profile)."""
    shape = tuple(job.input_shape)
    if plan.input_shape and tuple(plan.input_shape) != shape:
        raise ConfigError(
            f"the plan was made for input {tuple(plan.input_shape)} but the data gives "
            f"{shape}; re-plan with the data's --input-size"
        )
    cluster = pricing_cluster(job, False)
    fresh = _priced_file_plan(plan, job, styles, cluster, profiled=False)
    if plan.predicted and _bytes(plan) != _bytes(fresh):
        raise ConfigError(
            "the plan's predicted bytes do not match this model (different widths or classes?): "
            "it was made for another model; re-plan for this one"
        )
    if cluster.cores is not None:  # seconds by a compute profile
        fresh = _priced_file_plan(plan, job, styles, cluster)
    if not plan.predicted:
        return replace(fresh, scenario=plan.scenario)
    # its seconds priced again on the cluster it runs on, not the one it was made for (a plan
    # made for cori-knl would promise a laptop a supercomputer's step)
    return replace(plan, predicted=fresh.predicted, cluster=fresh.cluster, totals=fresh.totals)


def _priced_file_plan(
    plan: ParallelPlan, job: Job, styles: dict[str, Style], cluster: Cluster, profiled=True
) -> ParallelPlan:
    """The plan file's styles priced on `cluster` (its own hand-offs and placement)."""
    chosen = [styles[x.name] for x in job.layers]
    asked = request(job, cluster, plan.procs, plan.batch, plan.choices, profiled)
    asked = replace(asked, handoff="a", rounds=None)  # the plan's own schemes, below
    handoffs = {r.layer: Handoff(r.scheme, r.rounds) for r in plan.redistributions}
    priced = evaluate(job.layers, chosen, asked, handoffs=handoffs, placement=plan.placement)
    if not priced.feasible:
        raise ConfigError(f"the plan cannot run on {job.model}: {priced.reason}")
    return export(
        priced,
        procs=plan.procs,
        batch=plan.batch,
        choices=plan.choices,
        model=job.model,
        input_shape=tuple(job.input_shape),
        engine=plan.engine,
        cluster=cluster.name,
    )


def _bytes(plan: ParallelPlan) -> dict:
    return {k: round(v, 3) for k, v in plan.predicted_bytes(by_layer=True).items()}


def _broadcast(value: object) -> object:
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def agreed_plan(job: Job) -> ParallelPlan:
    """The plan every rank runs where the parent did not decide it for all of them (the
    launcher's one plan, `Job.plan`, is sent to every rank): a searched preset is decided by
    rank 0 alone (after a collective calibration of `localhost` if there is none yet) and
    broadcast (DESIGN.md invariant 3); so is a fixed preset's or a plan file's pricing under
    torchrun."""
    cfg, rank = job.cfg, dist.get_rank()
    if job.plan is not None:
        # each rank resolved the preset or file itself: the styles agree, the predictions are
        # rank 0's (the others priced bytes only, `pricing_cluster`)
        text = _broadcast(job.plan.to_json() if rank == 0 else None)
        return job.plan if text == job.plan.to_json() else ParallelPlan.from_dict(json.loads(text))
    # one process has nothing to calibrate (no all-reduce to time) and one plan: it is priced on
    # whatever `localhost` holds, bytes only when it was never calibrated
    search = job.procs > 1
    missing = (
        search
        and cfg.cluster == "localhost"
        and not (rank == 0 and localhost_path(job.choices.device).exists())
    )
    if _broadcast(missing):
        if rank == 0:
            print(
                f"calibrating this machine for --preset {cfg.preset} (once; "
                "`hybridpar calibrate` redoes it) ...",
                flush=True,
            )
        calibrate_in_job(device=job.choices.device, backend=job.choices.backend)
    answer: object = None
    if rank == 0:
        try:
            plan = preset_plan(job, pricing_cluster(job, search))
            answer = ("plan", plan.to_json())
        except ConfigError as exc:
            answer = ("error", str(exc))
    kind, text = _broadcast(answer)
    if kind == "error":
        raise ConfigError(text)
    return ParallelPlan.from_dict(json.loads(text))
