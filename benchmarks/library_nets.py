"""Claim (issue 71): segmentation nets from libraries nobody here wrote train as one process does
under the planner's plans, or are refused by name before any rank starts; never silently wrong.

By hand, not in CI (the libraries are not dependencies): MONAI's DynUNet (2-D and 3-D) and
torchvision's DeepLabV3, LR-ASPP and FCN, each through the public API as a user would call it:
`plan_for(model, ...).export()` of a scenario, `HybridTrainer(model, plan, ...)` with the plan's
check on (verify.py), float64, 3 steps of SGD with momentum and weight decay, one image per step
(two where a pooled branch batch-norms a 1 x 1 map), against one process drawing the same
counter-based dropout masks (runtime/parallel/dropout.counter_dropout; torch's own would differ
by design), on P = 2 and 4. A library that is not installed is said so and left out.

    pip install torch==2.14.1 torchvision==0.29.1 && pip install --no-deps monai
    python benchmarks/library_nets.py [--procs 2,4] [--scenarios domain,auto]
"""

from __future__ import annotations

import argparse
import importlib.util
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from hybridpar.core.cluster import Cluster
from hybridpar.core.errors import ConfigError
from hybridpar.planning.search import plan_for
from hybridpar.runtime.launcher import launch
from hybridpar.runtime.parallel.dropout import counter_dropout
from hybridpar.runtime.parallel.trainer import HybridTrainer

NET = Cluster("bench-net", alpha=1e-6, beta=1e-9, flops=1e12)
STEPS = 3


class Out(nn.Module):
    """A torchvision segmentation model read as its users read it: output["out"]."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)["out"]


def _dynunet(dims: int) -> nn.Module:
    from monai.networks.nets import DynUNet

    return DynUNet(dims, 1, 3, kernel_size=[3, 3, 3], strides=[1, 2, 2],
                   upsample_kernel_size=[2, 2], filters=[8, 16, 32], norm_name="instance")  # fmt: skip


def _tv(name: str) -> nn.Module:
    from torchvision.models import segmentation

    kw = {"weights": None, "weights_backbone": None, "num_classes": 3}
    if name != "lraspp_mobilenet_v3_large":
        kw["aux_loss"] = False
    return Out(getattr(segmentation, name)(**kw))


# label -> (library, builder, per-example input, batch)
NETS = {
    "DynUNet 2-D 64x64": ("monai", lambda: _dynunet(2), (1, 64, 64), 1),
    "DynUNet 2-D 32x32": ("monai", lambda: _dynunet(2), (1, 32, 32), 1),
    "DynUNet 3-D 32^3": ("monai", lambda: _dynunet(3), (1, 32, 32, 32), 1),
    "DeepLabV3-ResNet50 64x64": ("torchvision", lambda: _tv("deeplabv3_resnet50"), (3, 64, 64), 2),
    "LR-ASPP-MobileNetV3 64x64": (
        "torchvision",
        lambda: _tv("lraspp_mobilenet_v3_large"),
        (3, 64, 64),
        2,
    ),
    "FCN-ResNet50 64x64": ("torchvision", lambda: _tv("fcn_resnet50"), (3, 64, 64), 2),
}


def _model(label: str) -> nn.Module:
    torch.manual_seed(0)
    return NETS[label][1]().double()


def _data(label: str):
    _, _, shape, b = NETS[label]
    g = torch.Generator().manual_seed(1)
    classes = 3
    return [
        (torch.randn(b, *shape, generator=g, dtype=torch.float64),
         torch.randint(0, classes, (b, *shape[1:]), generator=g))
        for _ in range(STEPS)
    ]  # fmt: skip


def _optimizer(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=5e-4)


def _one(label: str, scenario: str) -> str:
    _, _, shape, b = NETS[label]
    P = dist.get_world_size()
    model = _model(label)
    before = {k: v for k, v in model.state_dict(keep_vars=True).items()}
    try:
        kw = {} if scenario == "auto" else {"scenarios": [scenario]}
        plan = plan_for(model, shape, P, b, NET, elem_bytes=8, **kw).export()
    except ConfigError as exc:
        return f"refused by the planner: {str(exc)[:160]}"
    now = model.state_dict(keep_vars=True)
    if any(now[k] is not v or now[k].is_meta for k, v in before.items()):
        return "CHANGED BY PLANNING"
    styles = ",".join(sorted({str(s) for s in plan.styles.values()}))
    t0 = time.perf_counter()
    try:
        t = HybridTrainer(model, plan, _optimizer, input_shape=shape)
    except ConfigError as exc:
        return f"refused by the check: {str(exc)[:200]} [{styles}]"
    for x, y in _data(label):
        t.step(x, y)
    got = t.full_state_dict()
    want = _one_process(label, 0.0)
    for k, v in want.items():
        if got[k].shape != v.shape:
            return f"WRONG SHAPE {k}: {tuple(got[k].shape)} for {tuple(v.shape)}"
    worst, where = _apart(got, want)
    verdict = "matches"
    if worst > 1:  # one process against itself, its input moved by a rounding error
        floor, _ = _apart(_one_process(label, 1e-15), want)
        verdict = f"{worst:.3g} tolerances at {where}; one process against itself with x (1 + "
        verdict += f"1e-15): {floor:.3g}: " + ("rounding, amplified" if worst <= floor else "WRONG")
    took = time.perf_counter() - t0
    return f"{verdict} (rtol 1e-7) [{styles}] {t.checked}; {took:.0f} s"


def _one_process(label: str, eps: float) -> dict:
    """One process's 3 steps (the counter-based dropout masks hybridpar draws), its input
    multiplied by 1 + eps."""
    ref = counter_dropout(_model(label))
    opt = _optimizer(ref.parameters())
    for x, y in _data(label):
        opt.zero_grad()
        F.cross_entropy(ref(x * (1 + eps)), y).backward()
        opt.step()
    return ref.state_dict()


def _apart(got: dict, want: dict) -> tuple[float, str]:
    """The largest difference in tolerances (rtol 1e-7, atol 1e-10), and where."""
    worst, where = 0.0, ""
    for k, v in want.items():
        if v.is_floating_point():
            err = float(((got[k] - v).abs() / (1e-10 + 1e-7 * v.abs())).max())
            worst, where = max((worst, where), (err, k))
    return worst, where


def _cells(cells: list[tuple[str, str]]) -> list[str]:
    out = []
    for label, scenario in cells:
        try:
            out.append(_one(label, scenario))
        except Exception as exc:  # what the table shows: a crash is a result too
            out.append(f"CRASH {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--procs", default="2,4")
    ap.add_argument("--scenarios", default="domain,auto")
    ap.add_argument("--nets", default=",".join(NETS))
    args = ap.parse_args()
    labels = [n for n in args.nets.split(",") if n]
    missing = {lib for lib, *_ in NETS.values() if importlib.util.find_spec(lib) is None}
    for lib in sorted(missing):
        print(f"{lib} is not installed: its nets are left out")
    labels = [n for n in labels if NETS[n][0] not in missing]
    cells = [(n, s) for n in labels for s in args.scenarios.split(",")]
    for P in (int(p) for p in args.procs.split(",")):
        for (label, scenario), verdict in zip(
            cells, launch(_cells, P, cells, timeout_s=1800)[0], strict=True
        ):
            print(f"P={P} {label:<27} {scenario:<7} {verdict}", flush=True)


if __name__ == "__main__":
    main()
