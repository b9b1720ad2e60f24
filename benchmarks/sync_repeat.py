"""Does the calibration's sync table repeat? (issue 42, item 2: measurements that repeat)

The sync table (`calibration._time_sync`: P ranks sharing the cores doing W matrix products, then
meeting) is what the cost model prices each meeting's excess from (`Cluster.sync_cost`). Its
excess is a few per cent of a segment's compute, measured as the difference of two numbers
twice as large, so one table's rows are noisy. This benchmark measures, in one launch of
--procs ranks, --tables tables in a row and prints the excess each prices for one meeting after
1 ms and after 5 ms of priced compute: every single table's, and the row-wise median of each
group of --group tables (what a calibration that measured --group tables would keep), with the
spread (max / min) of each, so the two can be compared on the same machine at the same time.

    python benchmarks/sync_repeat.py [--procs 4] [--tables 9] [--group 3]
"""

from __future__ import annotations

import argparse
import statistics

from hybridpar.core.cluster import Cluster
from hybridpar.runtime.launcher import launch
from hybridpar.runtime.train import calibration


def _tables(n: int) -> list[list[list[float]]]:
    """n single tables (what a calibration kept before it took the median of SYNC_TABLES)."""
    calibration.SYNC_TABLES = 1
    return [calibration._time_sync() for _ in range(n)]


def _excess(rows: list[list[float]], procs: int, cores: int) -> tuple[float, float]:
    c = Cluster("t", alpha=0.0, beta=1e-9, flops=1e10, cores=cores, sync=tuple(map(tuple, rows)))
    c = Cluster("t", alpha=0.0, beta=1e-9, flops=1e10, cores=cores, sync=c.sync, sync_ranks=procs)
    return c.sync_cost(1e-3)[0], c.sync_cost(5e-3)[0]


def _median_rows(tables: list) -> list[list[float]]:
    return [
        [statistics.median(col) for col in zip(*rows, strict=True)]
        for rows in zip(*tables, strict=True)
    ]


def _show(name: str, values: list[tuple[float, float]]) -> None:
    one = [a * 1e6 for a, _ in values]
    five = [b * 1e6 for _, b in values]
    print(
        f"{name:22s} after 1 ms: "
        + " ".join(f"{x:5.0f}" for x in one)
        + f"  (median {statistics.median(one):.0f} us, range {min(one):.0f}-{max(one):.0f})"
    )
    print(
        f"{'':22s} after 5 ms: "
        + " ".join(f"{x:5.0f}" for x in five)
        + f"  (median {statistics.median(five):.0f} us, range {min(five):.0f}-{max(five):.0f})"
    )


def main() -> None:
    import os

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--tables", type=int, default=9)
    ap.add_argument("--group", type=int, default=calibration.SYNC_TABLES)
    args = ap.parse_args()
    cores = os.cpu_count() or 1
    tables = launch(_tables, args.procs, args.tables, backend="gloo")[0]
    print(
        f"{args.procs} ranks on {cores} cores, {args.tables} sync tables in a row; priced excess of one meeting, us"
    )
    _show("one table", [_excess(t, args.procs, cores) for t in tables])
    groups = [
        tables[i : i + args.group] for i in range(0, len(tables) - args.group + 1, args.group)
    ]
    _show(
        f"median of {args.group} tables",
        [_excess(_median_rows(g), args.procs, cores) for g in groups],
    )


if __name__ == "__main__":
    main()
