"""Claim: on a two-host cluster the planner's predictions follow the measured times, and its pick
is (near) the fastest: `hybridpar calibrate` and `hybridpar validate` run under torchrun across
two emulated hosts (benchmarks/cluster.py: two network namespaces joined by a rate-limited veth
pair), as a user runs them on a new cluster.

    sudo python benchmarks/cluster_validate.py [--rate 1gbit] [--nproc-per-node 2]
        [--model alexnet-owt] [--input-size 64] [--batch 32] [--top 6] [--steps 6] [--repeat 2]
        [--out runs/cluster-validate]

Steps, in one invocation:
1. `hybridpar calibrate` under torchrun on both hosts: every host's ranks time all-reduces among
   themselves (the host's level: shared memory and loopback), one rank per host times them over
   the link (the network's level). Rank 0 writes the two-level cluster `localhost` into a fresh
   HYBRIDPAR_CACHE folder that both hosts read.
2. The two emulated hosts share this machine's cores: each gets half of them, so the file's
   `cores` is set to that half (a real host would report its own).
3. `hybridpar validate` under torchrun on both hosts: the planner's top plans on that cluster and
   the presets (ddp, batch, owt) run in turn, interleaved and repeated; rank 0 prints predicted
   against measured time per plan, the median and worst error, Spearman's rho and the pick
   against the measured fastest, and writes validate.json and validate.png into --out.

It needs root (ip netns, tc); where namespaces cannot be created it says so and exits 0 without
running anything. What it creates it removes on every exit path (benchmarks/cluster.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster import start_hosts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", default="1gbit", help="tc tbf rate of each veth end")
    ap.add_argument("--nproc-per-node", type=int, default=2)
    ap.add_argument("--model", default="alexnet-owt")
    ap.add_argument("--input-size", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--top", type=int, default=6)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--presets", default="ddp,batch,owt")
    ap.add_argument("--out", default="runs/cluster-validate")
    ap.add_argument("--timeout", type=int, default=1800)
    args = ap.parse_args()
    c = start_hosts(args.rate)
    if c is None:
        return 0
    out = Path(args.out).resolve()
    try:
        t64 = c.transfer_s(64)
        print(
            f"two hosts: namespaces {c.ns[0]} and {c.ns[1]}, veth at {args.rate} (tbf); 64 MB in "
            f"{t64:.2f} s ({64 * 8 / t64 / 1e3:.2f} Gbit/s); {args.nproc_per_node} rank(s) per host",
            flush=True,
        )
        with tempfile.TemporaryDirectory() as cache:
            os.environ["HYBRIDPAR_CACHE"] = cache  # both hosts read what rank 0 writes
            outs = c.torchrun(["-m", "hybridpar", "calibrate"], args.nproc_per_node, args.timeout)
            print(next(o for o in outs if o.strip()).rstrip(), flush=True)
            path = Path(cache) / "localhost.json"
            data = json.loads(path.read_text())
            data["cores"] = max(1, (os.cpu_count() or 2) // 2)  # each emulated host: half
            path.write_text(json.dumps(data, indent=1))
            print(f"each emulated host gets {data['cores']} of this machine's cores", flush=True)
            P = 2 * args.nproc_per_node
            cmd = [
                "-m", "hybridpar", "validate", "--model", args.model,
                "--input-size", str(args.input_size), "--batch", str(args.batch),
                "--procs", str(P), "--top", str(args.top), "--steps", str(args.steps),
                "--repeat", str(args.repeat), "--presets", args.presets, "--out", str(out),
                "--quiet",
            ]  # fmt: skip
            outs = c.torchrun(cmd, args.nproc_per_node, args.timeout)
            print(next(o for o in outs if o.strip()).rstrip(), flush=True)
            (out / "cluster.json").write_text(path.read_text())
    finally:
        c.down()
    return 0


if __name__ == "__main__":
    sys.exit(main())
