"""Which GPU a rank computes on."""

from __future__ import annotations

import os

import torch

__all__ = ["local_gpu"]


def local_gpu() -> int:
    """This rank's GPU: its local rank modulo the GPUs here (gloo ranks may share one)."""
    return int(os.environ.get("LOCAL_RANK", os.environ["RANK"])) % torch.cuda.device_count()
