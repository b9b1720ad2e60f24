"""Run test functions on N gloo ranks (spawned processes, free port, timeout, the failing rank's
traceback re-raised in the parent). Functions must live at module level (they are pickled)."""

from __future__ import annotations

from hybridpar.runtime.launcher import RankFailure, launch


def run_ranks(fn, nprocs, *args, timeout_s=60.0):
    try:
        return launch(fn, nprocs, *args, timeout_s=timeout_s, backend="gloo")
    except RankFailure as exc:
        raise AssertionError(f"{exc}\n{exc.details}") from None


def bytes_are_predicted(ledger, plan, label: str, steps: int, unpredicted=("metrics",)) -> None:
    """(Inside the ranks.) Every rank's bytes per (layer, term), averaged over the ranks and the
    `steps` steps, equal the plan's prediction (the metrics aside, which no plan predicts, and
    any other `unpredicted` term)."""
    import pytest
    import torch.distributed as dist

    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, ledger.bytes_by_layer_term())
    measured: dict = {}
    for d in every:
        for k, v in d.items():
            if k[1] not in unpredicted:
                measured[k] = measured.get(k, 0.0) + v / steps / len(every)
    predicted = plan.predicted_bytes(by_layer=True)
    assert set(measured) == set(predicted), f"{label}: {set(measured) ^ set(predicted)}"
    for k, v in predicted.items():
        assert measured[k] == pytest.approx(v, rel=1e-12), f"{label}: {k}"
