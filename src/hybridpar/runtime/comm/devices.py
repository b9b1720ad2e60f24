"""Which GPU a rank computes on, and a clock that waits for it."""

from __future__ import annotations

import os
import time

import torch

__all__ = ["clock", "local_gpu"]


def clock(device: torch.device | str) -> float:
    """time.perf_counter once `device`'s queued work is done (a GPU runs asynchronously)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def local_gpu() -> int:
    """This rank's GPU: its local rank modulo the GPUs here (gloo ranks may share one)."""
    return int(os.environ.get("LOCAL_RANK", os.environ["RANK"])) % torch.cuda.device_count()
