"""Claim: on a real (emulated) network, 8-bit gradients pay. Two "hosts" on one machine: two
network namespaces joined by a veth pair, each end rate-limited to 1 Gbit/s with a token-bucket
filter, and torchrun run in each namespace (--nnodes 2, gloo over the veth). In one invocation it
runs torch DDP in a plain loop (benchmarks/plain_ddp.py) and hybridpar's contenders on the same
model, data and batch, and prints one table: ms per iteration and the ratio to plain DDP.

    sudo python benchmarks/cluster.py [--rate 1gbit] [--nproc-per-node 1] [--steps 6] [--repeat 3]
    sudo python benchmarks/cluster.py --table composition --nproc-per-node 2 [--rate 10gbit]

`--table codecs` (the default): 8-bit gradients and activations against DDP. `--table
composition` (issue 24): torch DDP, the planner's plan on this cluster (calibrated first, under
torchrun on both hosts, as docs/cluster.md's step 1), the plan with 8-bit gradients and
activations, with the hierarchical host reducer, and with everything at once (host reducer,
8-bit, hand-off scheme (c)); the planner re-plans for each set of choices. Contenders run in
turn, `--repeat` rounds (interleaved); the table gives each one's median and range.

It needs root (ip netns, tc). Where namespaces cannot be created it says so and exits 0 without
running anything. What it creates (two namespaces and one veth pair, named after this process) it
removes on every exit path, Ctrl-C included. Traffic goes only between the two addresses it puts
inside those namespaces (10.213.<pid % 250>.1 and .2): nothing else is routed or touched.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


class TwoHosts:
    def __init__(self, rate: str) -> None:
        tag = os.getpid() % 100000
        self.ns = [f"hp{tag}a", f"hp{tag}b"]
        self.dev = [f"hpv{tag}a", f"hpv{tag}b"]
        net = os.getpid() % 250
        self.addr = [f"10.213.{net}.1", f"10.213.{net}.2"]
        self.rate = rate
        self.created: list[str] = []

    def sh(self, *cmd: str) -> None:
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=30)

    def up(self) -> None:
        for ns in self.ns:
            self.sh("ip", "netns", "add", ns)
            self.created.append(ns)
        self.sh("ip", "link", "add", self.dev[0], "type", "veth", "peer", "name", self.dev[1])
        for ns, dev, addr in zip(self.ns, self.dev, self.addr, strict=True):
            self.sh("ip", "link", "set", dev, "netns", ns)
            run = ("ip", "netns", "exec", ns)
            self.sh(*run, "ip", "addr", "add", f"{addr}/24", "dev", dev)
            self.sh(*run, "ip", "link", "set", dev, "up")
            self.sh(*run, "ip", "link", "set", "lo", "up")
            self.sh(
                *run, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                "rate", self.rate, "burst", "256kb", "latency", "100ms",
            )  # fmt: skip

    def down(self) -> None:
        for ns in reversed(self.created):  # deleting a namespace deletes its veth end and qdisc
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        self.created.clear()

    def transfer_s(self, mb: int = 64) -> float:
        """Seconds to send `mb` MB from the second namespace to the first (a plain TCP copy)."""
        code = (
            "import socket,sys,time;s=socket.socket();s.bind((sys.argv[1],0));s.listen(1);"
            "print(s.getsockname()[1],flush=True);c,_=s.accept();n=0\n"
            "while True:\n b=c.recv(1<<20)\n if not b: break\n n+=len(b)\nprint(n,flush=True)"
        )
        srv = subprocess.Popen(
            ["ip", "netns", "exec", self.ns[0], PY, "-c", code, self.addr[0]],
            stdout=subprocess.PIPE,
            text=True,
        )
        port = srv.stdout.readline().strip()
        send = (
            "import socket,sys;c=socket.create_connection((sys.argv[1],int(sys.argv[2])));"
            f"c.sendall(b'x'*({mb}<<20));c.close()"
        )
        t0 = time.perf_counter()
        subprocess.run(
            ["ip", "netns", "exec", self.ns[1], PY, "-c", send, self.addr[0], port],
            check=True,
            timeout=120,
        )
        srv.wait(timeout=120)
        return time.perf_counter() - t0

    def torchrun(self, args: list[str], nproc: int, timeout: int) -> list[str]:
        """The same command on both hosts; returns each host's stdout (raises on failure)."""
        port = str(29000 + os.getpid() % 1000)
        procs = []
        for k, (ns, dev) in enumerate(zip(self.ns, self.dev, strict=True)):
            env = {
                **os.environ,
                "GLOO_SOCKET_IFNAME": dev,
                # the namespaces share the machine's host name: without this, ranks on the two
                # "hosts" would meet in /dev/shm (comm.small, the host reducer), not on the link
                "HYBRIDPAR_HOST": ns,
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
                "PYTHONPATH": f"{ROOT / 'src'}:{ROOT / 'benchmarks'}",
                "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // (2 * nproc))),
            }
            cmd = [
                "ip", "netns", "exec", ns, PY, "-m", "torch.distributed.run",
                "--nnodes", "2", "--node-rank", str(k), "--nproc-per-node", str(nproc),
                "--master-addr", self.addr[0], "--master-port", port, *args,
            ]  # fmt: skip
            procs.append(
                subprocess.Popen(
                    cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
                )
            )
        outs = []
        for p in procs:
            try:
                out, err = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                raise RuntimeError(f"timed out after {timeout} s: {' '.join(args)}") from None
            if p.returncode:
                for q in procs:
                    q.kill()
                raise RuntimeError(f"failed ({p.returncode}): {' '.join(args)}\n{err[-2000:]}")
            outs.append(out)
        return outs


def start_hosts(rate: str) -> TwoHosts | None:
    """Two emulated hosts joined at `rate`, removed on every exit path (also by `down()`); None,
    having said why, where namespaces cannot be created."""
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        print("skipped: needs root and the ip and tc tools to create network namespaces")
        return None
    c = TwoHosts(rate)
    atexit.register(c.down)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda s, f: (c.down(), sys.exit(128 + s)))
    try:
        c.up()
    except subprocess.CalledProcessError as exc:
        c.down()
        print(f"skipped: cannot create network namespaces here ({exc.stderr.strip() or exc})")
        return None
    return c


def contenders(args, report: Path) -> list[tuple[str, list[str]]]:
    cluster = "localhost" if args.table == "composition" else "cori-knl"
    common = [
        "--model", "alexnet-owt", "--input-size", str(args.input_size), "--data", "synthetic:512",
        "--batch", str(args.batch), "--epochs", "1", "--max-steps", str(args.steps),
        "--cluster", cluster, "--quiet", "--report", str(report), "--lr", "0.01",
    ]  # fmt: skip
    train = ["-m", "hybridpar", "train", *common]
    if args.table == "composition":
        eight = ["--codec", "dynamic-tree", "--compress", "grads,activations"]
        return [
            ("torch DDP in trainer", [*train, "--preset", "ddp"]),
            ("planner's plan", [*train, "--preset", "auto"]),
            ("+ 8-bit grads+acts", [*train, "--preset", "auto", *eight]),
            ("+ host reducer", [*train, "--preset", "auto", "--reducer", "host"]),
            (
                "all composed",
                [*train, "--preset", "auto", "--reducer", "host", *eight, "--handoff", "auto"],
            ),
        ]
    return [
        ("hybridpar batch, fp32", [*train, "--preset", "batch"]),
        (
            "hybridpar batch, dynamic-tree grads",
            [*train, "--preset", "batch", "--codec", "dynamic-tree", "--compress", "grads"],
        ),
        ("torch DDP in trainer, fp32", [*train, "--preset", "ddp"]),
        (
            "torch DDP + dynamic8 hook",
            [*train, "--preset", "ddp", "--codec", "dynamic-tree", "--compress", "grads"],
        ),
        ("hybridpar owt (FC model)", [*train, "--preset", "owt"]),
        (
            "owt, dynamic-tree grads+acts",
            [
                *train,
                "--preset",
                "owt",
                "--codec",
                "dynamic-tree",
                "--compress",
                "grads,activations",
            ],
        ),
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", default="1gbit", help="tc tbf rate of each veth end")
    ap.add_argument("--nproc-per-node", type=int, default=1)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--input-size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--timeout", type=int, default=600)
    ap.add_argument("--repeat", type=int, default=3, help="interleaved rounds of every contender")
    ap.add_argument("--table", choices=("codecs", "composition"), default="codecs")
    args = ap.parse_args()
    c = start_hosts(args.rate)
    if c is None:
        return 0
    cache = tempfile.TemporaryDirectory()
    os.environ["HYBRIDPAR_CACHE"] = cache.name  # both hosts read what rank 0 writes
    try:
        t64 = c.transfer_s(64)
        print(
            f"two hosts: namespaces {c.ns[0]} ({c.addr[0]}) and {c.ns[1]} ({c.addr[1]}), veth "
            f"at {args.rate} (tbf); 64 MB in {t64:.2f} s; {args.nproc_per_node} rank(s) per host"
        )
        P = 2 * args.nproc_per_node
        if args.table == "composition":  # the planner plans on this cluster: measure it first
            c.torchrun(["-m", "hybridpar", "calibrate"], args.nproc_per_node, args.timeout)
            path = Path(cache.name) / "localhost.json"
            data = json.loads(path.read_text())
            data["cores"] = max(1, (os.cpu_count() or 2) // 2)  # each emulated host: half
            path.write_text(json.dumps(data, indent=1))
            net = data["network"]
            print(
                f"calibrated: within a host alpha {data['alpha'] * 1e6:.0f} us, "
                f"{1 / data['beta'] / 1e9:.2f} GB/s; between hosts alpha "
                f"{net['alpha'] * 1e6:.0f} us, {1 / net['beta'] / 1e9:.3f} GB/s",
                flush=True,
            )
        plain_args = [
            str(ROOT / "benchmarks" / "plain_ddp.py"), "--model", "alexnet-owt",
            "--input-size", str(args.input_size), "--batch", str(args.batch),
            "--steps", str(args.steps),
        ]  # fmt: skip
        names = ["torch DDP, plain loop (baseline)"]
        runs: dict[str, list[tuple]] = {names[0]: []}
        with tempfile.TemporaryDirectory() as tmp:
            report = Path(tmp) / "r.json"
            todo = contenders(args, report)
            names += [n for n, _ in todo]
            for r_ in range(args.repeat):  # interleaved: a drift of the machine hits everyone
                outs = c.torchrun(plain_args, args.nproc_per_node, args.timeout)
                plain = json.loads(next(o for o in outs if o.strip()).strip().splitlines()[-1])
                runs[names[0]].append((plain["time_s"], None, None, None, None))
                for name, cmd in todo:
                    c.torchrun(cmd, args.nproc_per_node, args.timeout)
                    r = json.loads(report.read_text())
                    it = r["iteration"]
                    runs.setdefault(name, []).append(
                        (
                            it["time_s"],
                            sum(r["bytes"]["measured"].values()),
                            it.get("comm_wait_s"),
                            it.get("predicted_s"),
                            ",".join(sorted(set(r["plan"]["styles"].values()))),
                        )
                    )
                    report.unlink()
                print(f"round {r_ + 1}/{args.repeat} done", flush=True)
        rows = []
        for name in names:
            got = sorted(runs[name], key=lambda x: x[0])
            mid = got[(len(got) - 1) // 2]
            rows.append((name, mid, got[0][0], got[-1][0]))
        base = rows[0][1][0]
        print(
            f"alexnet-owt {args.input_size}x{args.input_size}, global batch {args.batch}, P = {P} "
            f"({args.nproc_per_node} per host) at {args.rate}; median of {args.repeat} "
            f"interleaved rounds, each the median of {args.steps - 1} iterations"
        )
        print(
            f"{'contender':<36} {'ms/iter':>8} {'range':>15} {'pred ms':>8} {'MB/iter/rank':>13} "
            f"{'vs plain DDP':>13} {'comm ms':>8}  styles"
        )
        for name, (t, nbytes, wait, pred, styles), lo, hi in rows:
            mb = f"{nbytes / 1e6:13.1f}" if nbytes is not None else f"{'':>13}"
            w = f"{wait * 1e3:8.1f}" if wait is not None else f"{'':>8}"
            p = f"{pred * 1e3:8.1f}" if pred else f"{'':>8}"
            print(
                f"{name:<36} {t * 1e3:8.1f} {lo * 1e3:7.1f}-{hi * 1e3:<7.1f} {p} {mb} "
                f"{base / t:12.2f}x {w}  {styles or ''}"
            )
        if args.table == "composition":
            t = {name: mid[0] for name, mid, _, _ in rows}
            single = min(t["planner's plan"], t["+ 8-bit grads+acts"], t["+ host reducer"])
            ok = t["all composed"] <= single
            print(
                f"all composed vs the best single idea: {single / t['all composed']:.2f}x "
                f"(goal: at least as fast: {'met' if ok else 'NOT met'})"
            )
        else:
            best8 = min(mid[0] for n, mid, _, _ in rows if "dynamic" in n and "batch" in n)
            print(
                f"pure batch with dynamic-tree gradients vs plain DDP: {base / best8:.2f}x "
                f"(goal >= 2.5x: {'met' if base / best8 >= 2.5 else 'NOT met'})"
            )
    finally:
        c.down()
        cache.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
