"""`hybridpar codecs`: the error of every codec in the layout of Dettmers' Table 2, and its speed.

Rows: normal data of scales 1 and 0.01, uniform data on [0, 1], and the gradients and
fully-connected activations captured from a short digits-cnn training run. Columns: mean absolute
error and mean relative error in % (over the non-zero elements) for each codec, then encode and
decode throughput on one thread, in GB/s of float32 going in (encode) or coming out (decode).
"""

from __future__ import annotations

import time

import torch

from hybridpar.comm.codecs import get_codec
from hybridpar.wire import CODECS

__all__ = ["captured_tensors", "error_table", "throughput"]


def captured_tensors(steps: int = 30, seed: int = 0) -> dict[str, torch.Tensor]:
    """Gradients (all parameters, flattened) and the inputs of the fully-connected layers of
    digits-cnn after `steps` SGD steps on digits, the traffic of data and model parallelism."""
    from torch import nn

    from hybridpar.models import build_model
    from hybridpar.train.data import load_data

    torch.manual_seed(seed)
    data = load_data("digits", None, seed=seed)
    model = build_model("digits-cnn", input_size=8, num_classes=10, in_channels=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    acts: list[torch.Tensor] = []
    hooks = [
        m.register_forward_hook(lambda _m, inp, _out: acts.append(inp[0].detach().reshape(-1)))
        for m in model
        if isinstance(m, nn.Linear)
    ]
    g = torch.Generator().manual_seed(seed)
    grads: list[torch.Tensor] = []
    for step in range(steps):
        idx = torch.randint(0, len(data.x_train), (64,), generator=g)
        acts.clear()
        opt.zero_grad()
        nn.functional.cross_entropy(model(data.x_train[idx]), data.y_train[idx]).backward()
        if step == steps - 1:
            grads = [p.grad.reshape(-1).clone() for p in model.parameters()]
        opt.step()
    for h in hooks:
        h.remove()
    return {"digits-cnn gradients": torch.cat(grads), "digits-cnn activations": torch.cat(acts)}


def datasets(n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {
        "normal(0, 1)": torch.randn(n, generator=g),
        "normal(0, 0.01)": torch.randn(n, generator=g) * 0.01,
        "uniform(0, 1)": torch.rand(n, generator=g),
    }
    out.update(captured_tensors(seed=seed))
    return out


def error_table(
    data: dict[str, torch.Tensor], block: int | None, codecs: tuple[str, ...] = CODECS[1:]
) -> list[dict]:
    rows = []
    for dist_name, x in data.items():
        nz = x != 0
        for name in codecs:
            d = get_codec(name, block).roundtrip(x)
            err = (d - x).abs()
            rows.append(
                {
                    "data": dist_name,
                    "codec": name,
                    "mean_abs": float(err.mean()),
                    "mean_rel_pct": float((err[nz] / x.abs()[nz]).mean() * 100),
                }
            )
    return rows


def throughput(
    name: str, block: int | None, n: int = 1 << 24, repeats: int = 5
) -> tuple[float, float]:
    """(encode, decode) GB/s of float32 on one thread, best of `repeats` after a warm-up."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        codec = get_codec(name, block)
        x = torch.randn(n)
        e = codec.encode(x)
        codec.decode(e)  # warm-up (and compilation)
        enc = dec = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            e = codec.encode(x)
            t1 = time.perf_counter()
            codec.decode(e)
            t2 = time.perf_counter()
            enc, dec = min(enc, t1 - t0), min(dec, t2 - t1)
        return 4 * n / enc / 1e9, 4 * n / dec / 1e9
    finally:
        torch.set_num_threads(threads)


def print_table(rows: list[dict], speeds: dict[str, tuple[float, float]] | None) -> None:
    print(f"{'data':<24} {'codec':<13} {'mean abs error':>15} {'mean rel error %':>17}")
    last = None
    for r in rows:
        data = r["data"] if r["data"] != last else ""
        last = r["data"]
        print(f"{data:<24} {r['codec']:<13} {r['mean_abs']:15.3g} {r['mean_rel_pct']:17.3f}")
    if speeds:
        print()
        print(
            f"{'codec':<13} {'encode GB/s':>12} {'decode GB/s':>12}   (one thread, float32 bytes)"
        )
        for name, (e, d) in speeds.items():
            print(f"{name:<13} {e:12.2f} {d:12.2f}")
