"""`hybridpar train`: the job (hybridpar.runtime.train.run), then its outcome in a few lines."""

from __future__ import annotations

import argparse
import sys

from hybridpar.core.config import from_namespace

__all__ = ["cmd_predict", "cmd_train"]

UNSHOWN = ("metrics", "codec_overhead", "bn_switch", "param_broadcast", "state")


def cmd_train(args: argparse.Namespace) -> int:
    from hybridpar.runtime.launcher import RankFailure, start_server

    start_server()  # imports torch for the ranks while this process imports it to plan
    from hybridpar.runtime.train.config import TrainConfig
    from hybridpar.runtime.train.run import run

    cfg = from_namespace(TrainConfig, args)
    try:
        report = run(cfg)
    except RankFailure as exc:
        print(f"hybridpar train: error: {exc}", file=sys.stderr)
        if args.verbose and exc.details:
            print(exc.details, file=sys.stderr)
        return 1
    if report is None:  # a non-zero rank under torchrun
        return 0
    _print_report(report)
    return 0


def _iteration_line(it: dict) -> str:
    ms = {k: it[k] * 1e3 for k in ("time_s", "compute_s", "comm_wait_s")}
    return (
        f"iteration {ms['time_s']:.1f} ms (compute {ms['compute_s']:.1f}, communication wait "
        f"{ms['comm_wait_s']:.1f}"
        + (
            f", of which {it['waiting_slowest_s'] * 1e3:.1f} waiting for the slowest rank)"
            if "waiting_slowest_s" in it
            else ")"
        )
        + (
            f"; predicted {it['predicted_s'] * 1e3:.1f} ms"
            if it.get("predicted_s")
            else "; time not predicted (priced bytes only: run `hybridpar calibrate` for seconds)"
        )
        + (
            f" (waiting {it['predicted_waiting_s'] * 1e3:.1f})"
            if it.get("predicted_waiting_s")
            else ""
        )
    )


def _print_compute_and_memory(report: dict) -> None:
    """What was compiled and recomputed, and memory per rank: predicted, counted, peaks."""
    c, peak = report.get("compute", {}), report.get("memory", {})
    said = []
    if c.get("compiled"):
        first = report["steps"][0]["time_s"] if report["steps"] else 0.0
        said.append(f"compiled {len(c['compiled'])} parts (first step {first:.1f} s)")
    if c.get("checkpointed"):
        said.append(f"recomputed in backward: {', '.join(c['checkpointed'])}")
    if said:
        print("; ".join(said))
    memory = ", ".join(f"{k[5:-3]} peak {v:.0f}" for k, v in peak.items() if k.startswith("peak"))
    if "counted_mb" in peak:
        plan = report["plan"]
        predicted, held = plan.get("memory_bytes"), plan.get("held_bytes")
        before = f"predicted peak {predicted / 2**20:.1f}, " if predicted else ""
        before += f"held throughout {held / 2**20:.1f}, " if held else ""
        print(
            f"memory per rank, MiB (the largest): {before}counted {peak['counted_mb']:.1f} "
            f"(parameters, gradients, optimizer state, kept for backward); {memory}"
        )
    if "read_kib" in peak:
        print(
            f"examples read from disk per rank (memory-mapped, the largest): "
            f"{peak['read_kib']:.1f} KiB an example of its {peak['whole_kib']:.1f} KiB"
        )


def _print_report(report: dict) -> None:
    """The outcome; the plan and the epoch lines were printed live by rank 0."""
    it, b = report["iteration"], report["bytes"]
    if it.get("trained", it.get("steps", 1)) == 0:  # a resume that found the run complete
        print(
            f"{report['model']} on {report['data']}: nothing left to train (the checkpoint is "
            f"at the end of the run); final test accuracy {report['final']['test_acc']:.4f}"
        )
        for w in report.get("written", []):
            print(f"wrote {w}")
        return
    head = (
        f"{report['model']} on {report['data']}: P={report['procs']}, "
        f"{report['preset'] or report['plan_file']}: {report['plan']['scenario']} plan; "
        f"final test accuracy {report['final']['test_acc']:.4f}; "
    )
    if it.get("steps") == 0:  # one step: it paid the start's one-off costs, and is not timed
        print(head + "one step, not timed (a run's first pays one-off costs): run two or more")
    else:
        print(head + _iteration_line(it))
    bn = report.get("bn", {})
    if bn.get("requested") == "adaptive":
        when = bn["switched_at_step"]
        how = f"global from step {when}: " if when is not None else "local throughout"
        print(f"batch norm: adaptive, {how}{bn['reason']}")
    _print_compute_and_memory(report)
    print(f"bytes per iteration per rank: {'term':<14} {'measured':>14} {'predicted':>14}")
    for k in sorted(set(b["measured"]) | set(b["predicted"])):
        if k not in UNSHOWN:
            want = b["predicted"].get(k)
            shown = f"{want:14.0f}" if want is not None else f"{'not priced':>14}"
            print(f"{'':30}{k:<14} {b['measured'].get(k, 0):14.0f} {shown}")
    if "recompute" in b["measured"]:
        print(
            f"{'':30}(recompute: the collectives of what --activation-checkpointing recomputes, "
            "run again in backward)"
        )
    if report.get("reducer") == "host":  # the plan's table shows the sums' volume
        volume = sum(p["bytes"] for p in report["plan"]["predicted"] if p["term"] == "dw_allreduce")
        print(
            f"{'':30}(the host reducer sums dw_allreduce's {volume / 1e3:.0f} KB a rank in host "
            "shared memory: the bytes above are those between hosts)"
        )
    for w in report.get("written", []):
        print(f"wrote {w}")


def cmd_predict(args: argparse.Namespace) -> int:
    """`hybridpar predict`: each image's class mask (and probabilities) written by band."""
    from hybridpar.runtime.launcher import RankFailure, launch, start_server

    start_server()
    from hybridpar.runtime.train.config import PredictConfig
    from hybridpar.runtime.train.predict import predict_worker, prepare_predict

    cfg = from_namespace(PredictConfig, args)
    job = prepare_predict(cfg)
    try:
        records = launch(predict_worker, job.procs, job, backend=job.backend)[0]
    except RankFailure as exc:
        print(f"hybridpar predict: error: {exc}", file=sys.stderr)
        return 1
    seconds = sum(r["seconds"] for r in records)
    plans = []
    for g in job.groups:  # each size's plan, its predicted peak next to the one measured
        measured = max(r["peak"] for r in records if tuple(r["shape"]) == g.shape)
        predicted = g.layout.plan.memory_bytes
        said = f"predicted {predicted / 2**20:.1f} MiB, " if predicted else ""
        plans.append(
            f"{' x '.join(map(str, g.shape[1:]))}: {g.layout.segments[0].label}, peak per rank "
            f"{said}measured {measured / 2**20:.1f} MiB"
        )
    shown = "; ".join(plans)
    n, P = len(records), job.procs
    print(
        f"{n} image{'s' * (n > 1)} in {seconds:.1f} s on {P} process{'es' * (P > 1)} "
        f"({shown}); wrote {cfg.out}"
    )
    return 0
