"""Claim: Krizhevsky's schemes (b) and (c) hide the hand-off behind the FC layers' compute, so their
exposed hand-off communication is below scheme (a)'s, most where the network is slow.

Runs, in one invocation, alexnet-owt with its conv layers batch-parallel and its FC layers split
over P ranks (grid:Px1), the same model, data and global batch for every contender:
(a) one all-gather, (b) each rank's batch in turn (K = P), and (c) for each K of --rounds. On this
machine (--where local, gloo + shared memory), or on two emulated hosts (--where cluster: the
network namespaces of benchmarks/cluster.py, rate-limited, torchrun in each; needs root).

Prints per contender: median ms per iteration over `--repeat` interleaved rounds and its range;
the exposed hand-off (per iteration, the seconds spent starting and waiting for the hand-off's
collectives that the FC compute of a round did not hide: for each call the shortest time any rank
spent in it, so the wait for the slowest rank to arrive, which the first round absorbs, is
counted apart), next to the cost model's prediction of it; that wait; the hand-off's bytes per
rank next to the prediction; and each ratio to scheme (a).

    python benchmarks/handoff.py [--procs 4] [--batch 64] [--input-size 128] [--rounds 2,4]
    sudo python benchmarks/handoff.py --where cluster --rate 1gbit
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from hybridpar.core.config import build
from hybridpar.runtime.train.config import TrainConfig
from hybridpar.runtime.train.run import run


def contenders(P: int, rounds: list[int]) -> list[tuple[str, str, int | None]]:
    return [
        ("(a) one all-gather", "a", None),
        (f"(b) {P} rounds", "b", None),
        *[(f"(c) {k} rounds", "c", k) for k in rounds],
    ]


def summary(r: dict) -> dict:
    pred = [p for p in r["plan"]["predicted"] if p["term"] == "redistribute"]
    return {
        "time": r["iteration"]["time_s"],
        "exposed": r["iteration"]["handoff_exposed_s"],
        "slowest": r["iteration"]["handoff_waiting_slowest_s"],
        "exposed_pred": sum(p["seconds"] for p in pred),
        "bytes": r["bytes"]["measured"].get("redistribute", 0.0),
        "bytes_pred": r["bytes"]["predicted"].get("redistribute", 0.0),
        "pred": r["iteration"]["predicted_s"] or 0.0,
        "scheme": [(x["scheme"], x["rounds"]) for x in r["plan"]["redistributions"]],
    }


def local(args, scheme: str, k: int | None) -> dict:
    cfg = build(
        TrainConfig,
        model="alexnet-owt",
        data="synthetic:1024",
        input_size=args.input_size,
        epochs=1,
        batch=args.batch,
        max_steps=args.steps,
        progress=False,
        quiet=True,
        lr=0.01,
        nproc=args.procs,
        preset=f"grid:{args.procs}x1",
        handoff=scheme,
        rounds=k,
        cluster="localhost",
    )
    return summary(run(cfg))


def on_cluster(args, hosts, scheme: str, k: int | None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "r.json"
        cmd = [
            "-m", "hybridpar", "train", "--model", "alexnet-owt", "--data", "synthetic:1024",
            "--input-size", str(args.input_size), "--batch", str(args.batch), "--epochs", "1",
            "--max-steps", str(args.steps), "--quiet", "--no-progress", "--lr", "0.01",
            "--preset", f"grid:{args.procs}x1", "--handoff", scheme, "--cluster", args.cluster,
            "--report", str(report),
        ]  # fmt: skip
        if k is not None:
            cmd += ["--rounds", str(k)]
        hosts.torchrun(cmd, args.procs // 2, args.timeout)
        return summary(json.loads(report.read_text()))


def emulated_cluster(rate: str) -> str:
    """A cluster file for the emulated link: its rate as beta, 100 us of latency, this machine's
    calibrated FLOP rate (or 1e11); no shared memory (the ranks are on two hosts)."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    unit = next(u for u in units if rate.lower().endswith(u))
    bits = float(rate.lower()[: -len(unit)]) * units[unit]
    flops = 1e11
    try:
        from hybridpar.core.cluster import localhost_path

        flops = json.loads(localhost_path().read_text())["flops"]
    except (OSError, KeyError, ValueError):
        pass
    spec = {"name": f"emulated-{rate}", "alpha": 1e-4, "beta": 8 / bits, "flops": flops}
    path = Path(tempfile.mkdtemp()) / "emulated.json"
    path.write_text(json.dumps(spec))
    return str(path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--where", choices=["local", "cluster"], default="local")
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--input-size", type=int, default=128)
    ap.add_argument("--rounds", default="2,4", help="K of scheme (c), comma-separated")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeat", type=int, default=3, help="interleaved rounds (noise)")
    ap.add_argument("--rate", default="1gbit", help="--where cluster: tc tbf rate of each veth end")
    ap.add_argument(
        "--cluster",
        default=None,
        help="--where cluster: the cluster predictions use (default: the emulated link, "
        "beta = 1 / --rate, alpha = 100 us, this machine's FLOP rate)",
    )
    ap.add_argument("--timeout", type=int, default=600)
    args = ap.parse_args()
    rounds = [int(k) for k in args.rounds.split(",")]
    hosts = None
    if args.where == "cluster":
        sys.path.insert(0, str(Path(__file__).parent))
        from cluster import start_hosts

        hosts = start_hosts(args.rate)
        if hosts is None:
            return 0
        if args.cluster is None:
            args.cluster = emulated_cluster(args.rate)
    where = (
        f"two emulated hosts at {args.rate}, {args.procs // 2} ranks each"
        if hosts
        else "this machine (gloo, shared memory)"
    )
    runs: dict[str, list[dict]] = {}
    try:
        for _ in range(args.repeat):
            for name, scheme, k in contenders(args.procs, rounds):
                got = on_cluster(args, hosts, scheme, k) if hosts else local(args, scheme, k)
                runs.setdefault(name, []).append(got)
    finally:
        if hosts is not None:
            hosts.down()
    print(
        f"alexnet-owt {args.input_size}x{args.input_size}, global batch {args.batch}, P = "
        f"{args.procs}, conv batch / FC model (grid:{args.procs}x1), on {where}; median of "
        f"{args.steps - 1} iterations per run, {args.repeat} interleaved rounds"
    )
    print(
        f"{'scheme':<20} {'ms/iter':>8} {'range':>13} {'exposed hand-off ms':>20} {'predicted':>9} "
        f"{'vs (a)':>7} {'slowest-rank wait ms':>20} {'hand-off KB':>11} {'predicted':>9} "
        f"{'iter vs (a)':>11}"
    )
    base = None
    for name, got in runs.items():
        ordered = sorted(got, key=lambda r: r["time"])
        r = ordered[(len(ordered) - 1) // 2]
        exposed = statistics.median(g["exposed"] for g in got)
        slowest = statistics.median(g["slowest"] for g in got)
        if base is None:
            base = (r["time"], exposed)
        span = f"[{ordered[0]['time'] * 1e3:.1f}-{ordered[-1]['time'] * 1e3:.1f}]"
        print(
            f"{name:<20} {r['time'] * 1e3:8.1f} {span:>13} {exposed * 1e3:20.2f} "
            f"{r['exposed_pred'] * 1e3:9.2f} {exposed / base[1]:6.2f}x {slowest * 1e3:20.2f} "
            f"{r['bytes'] / 1e3:11.1f} "
            f"{r['bytes_pred'] / 1e3:9.1f} {r['time'] / base[0]:10.2f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
