"""Run test functions on N gloo ranks (spawned processes, free port, timeout, the failing rank's
traceback re-raised in the parent). Functions must live at module level (they are pickled)."""

from __future__ import annotations

from hybridpar.runtime.launcher import RankFailure, launch


def run_ranks(fn, nprocs, *args, timeout_s=60.0):
    try:
        return launch(fn, nprocs, *args, timeout_s=timeout_s, backend="gloo")
    except RankFailure as exc:
        raise AssertionError(f"{exc}\n{exc.details}") from None
