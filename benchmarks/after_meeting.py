"""What a meeting on a crowded host costs the work after it (issue 42: the layers' excess at P = 4).

P ranks on fewer cores each hold a buffer of --mb MiB and time, in thread CPU, two passes over
it (a multiply and an add in place: memory-bound, as a batch norm or a join is). Before each
timed pass, by mode:

  back to back     no meeting: the passes alone, one after another
  meeting          all ranks meet (the shared-memory all-reduce of global BN and the halos)
  meeting, after   the odd ranks first write 8 fresh buffers of the same size (memory-bound
  memory work      work of their own), so the even ones wait at the meeting while an odd rank
                   runs on their core
  meeting, after   the same with 8 products of 256 x 256 matrices (compute-bound work, as the
  matrix products  calibration's sync table times between its meetings)

Thread CPU leaves out the time a rank waits for a core, so what grows is the pass itself. Modes
run in turn, --rounds times; each prints the even ranks' median over rounds (the ones that waited
in the last two modes), the spread over rounds and ranks, and the ratio to back to back.

    python benchmarks/after_meeting.py [--procs 4] [--mb 1,4] [--rounds 3] [--passes 40]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from hybridpar.runtime.comm.grid import new_group
from hybridpar.runtime.launcher import launch

MODES = ("back to back", "meeting", "meeting, after memory work", "meeting, after matrix products")


def _body(mb: int, rounds: int, passes: int) -> list[dict]:
    torch.set_num_threads(1)
    me, p = dist.get_rank(), dist.get_world_size()
    group = new_group(list(range(p)), None, "after_meeting", "world", shm=True)
    flag = torch.zeros(1, dtype=torch.float64)
    x, w = torch.randn(mb << 18), torch.randn(256, 256)
    out: dict[str, list[float]] = {m: [] for m in MODES}
    for _ in range(rounds):
        for mode in MODES:
            cpu = []
            dist.barrier()
            for _ in range(passes):
                if mode != MODES[0]:
                    if me % 2 and mode == MODES[2]:
                        for _ in range(8):
                            torch.randn(mb << 18)
                    elif me % 2 and mode == MODES[3]:
                        for _ in range(8):
                            w @ w
                    group.shm.small_all_reduce(flag)
                t0 = time.thread_time()
                x.mul_(1.0001).add_(1e-4)
                cpu.append(time.thread_time() - t0)
            out[mode].append(statistics.median(cpu[passes // 4 :]))
    every: list = [None] * p
    dist.all_gather_object(every, out)
    return every


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--mb", default="1,4")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--passes", type=int, default=40)
    args = ap.parse_args()
    print(
        f"{args.procs} ranks on {os.cpu_count()} cores; us of thread CPU for two passes over the "
        f"buffer, the even ranks' median over {args.rounds} rounds [min-max over rounds and even "
        "ranks], and over back to back"
    )
    for mb in (int(m) for m in args.mb.split(",")):
        every = launch(_body, args.procs, mb, args.rounds, args.passes, backend="gloo")[0]
        even = every[::2]
        base = statistics.median(t for r in even for t in r[MODES[0]])
        print(f"{mb} MiB:")
        for mode in MODES:
            ts = [t for r in even for t in r[mode]]
            med = statistics.median(ts)
            print(
                f"  {mode:32s} {med * 1e6:7.0f} [{min(ts) * 1e6:.0f}-{max(ts) * 1e6:.0f}]  "
                f"{med / base:5.2f}x"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
