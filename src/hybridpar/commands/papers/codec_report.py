"""`hybridpar codecs`: the error of every codec in the layout of Dettmers' Table 2, and its speed.

Rows: normal data of scales 1 and 0.01, uniform data on [0, 1], then the paper's MNIST network
(784-1024-1024-10, ReLU, dropout 0.2/0.3/0.3, RMSProp at lr 0.003) trained on scikit-learn's digits
upsampled to 28x28: per layer, its weight gradient (the traffic of data parallelism) and its output
activations (the traffic of model parallelism). Columns: mean absolute error and mean relative
error in % (over the non-zero elements), with one scale per tensor (the paper's setting) and one
per block, next to the paper's relative error where Table 2 has one; then encode and decode
throughput on one thread, in GB/s of float32 going in (encode) or coming out (decode).
"""

from __future__ import annotations

import torch

from hybridpar.core.choices import EIGHT_BIT
from hybridpar.runtime.comm.codecs import get_codec, time_codec

__all__ = ["PAPER_EXAMPLES", "PAPER_TABLE2", "datasets", "error_table", "mlp_tensors", "throughput"]

# Dettmers Table 2, mean relative error in % (our copy lost the distributions' parameters; the
# first row block is a normal distribution). MNIST rows: layer 1/2/3 of the 784-1024-1024-10 MLP.
PAPER_TABLE2: dict[str, dict[str, str]] = {
    "normal (paper row 1)": {
        "dynamic-tree": "1.39",
        "linear": "2.16",
        "mantissa": "7.22",
        "static-tree": "4.82",
    },
    "mlp grads": {
        "dynamic-tree": "3/4/5",
        "linear": "5/6/6",
        "mantissa": "4.5/4.5/6",
        "static-tree": "4/4/5",
    },
    "mlp acts": {
        "dynamic-tree": "0.5/2/2",
        "linear": "1/2/3",
        "mantissa": "1.5/2/8",
        "static-tree": "1/2/6",
    },
}
# Section 3.1's worked examples: value -> the paper's approximation by codec
PAPER_EXAMPLES: list[tuple[float, str, float]] = [
    (0.2345678, "dynamic-tree", 0.236719),
    (0.2345678, "static-tree", 0.23125),
    (0.2345678, "mantissa", 0.2),
    (0.0000234, "dynamic-tree", 0.000019),
]


def _uniform_levels(steps_of: dict[int, int]) -> list[float]:
    """The tree types as hybridpar built them before issue 26: decade e split into steps_of[e]
    equal steps of [0.1, 1] x 10^-e, levels at the step ends, plus 0."""
    return [0.0] + [
        10.0**-e * (0.1 + 0.9 * (k + 1) / n) for e, n in steps_of.items() for k in range(n)
    ]


UNIFORM = {
    # 6 - e tree bits after e zeros and a flag, e = 0..6: 127 levels
    "dynamic-tree": lambda: _uniform_levels({e: 2 ** (6 - e) for e in range(7)}),
    # 3-bit exponent, 4 tree bits; the code of E = 7, k = 0 held 0
    "static-tree": lambda: (
        _uniform_levels({e: 16 for e in range(8)})[:113]
        + _uniform_levels({e: 16 for e in range(8)})[114:]
    ),
}
"""Kept for one reason: `hybridpar codecs` prints their Table 2 errors next to the new tables',
the evidence for the change (docs/fidelity.md)."""


def uniform_error(x: torch.Tensor, name: str) -> float:
    """Mean relative error (%) of the old uniform table `name` on x, one scale per tensor,
    round to nearest."""
    levels = torch.tensor(sorted(set(UNIFORM[name]())), dtype=torch.float64)
    a = x.double().abs()
    v = a / a.max()
    i = torch.searchsorted(levels, v).clamp(1, len(levels) - 1)
    lo, hi = levels[i - 1], levels[i]
    q = torch.where(v - lo < hi - v, lo, hi) * a.max()
    nz = a > 0
    return float(((q - a).abs()[nz] / a[nz]).mean() * 100)


def upsampled_digits(size: int = 28):
    """scikit-learn's digits, bilinearly upsampled from 8x8 to size x size and flattened:
    (x_train, y_train) standardised as the training data is."""
    from hybridpar.runtime.train.data import load_data

    data = load_data("digits", None, seed=0)
    x = torch.nn.functional.interpolate(data.x_train, size=(size, size), mode="bilinear")
    return x.reshape(len(x), -1), data.y_train


def mlp_tensors(steps: int = 60, seed: int = 0) -> dict[str, torch.Tensor]:
    """Per layer, the weight gradient and the output activations of Dettmers' MNIST network after
    `steps` RMSProp steps (batch 128) on upsampled digits: "mlp grads L1" ... "mlp acts L3"."""
    from torch import nn

    torch.manual_seed(seed)
    x, y = upsampled_digits()
    layers = [nn.Linear(784, 1024), nn.Linear(1024, 1024), nn.Linear(1024, 10)]
    model = nn.Sequential(
        nn.Dropout(0.2), layers[0], nn.ReLU(), nn.Dropout(0.3), layers[1], nn.ReLU(),
        nn.Dropout(0.3), layers[2],
    )  # fmt: skip
    opt = torch.optim.RMSprop(model.parameters(), lr=0.003)
    outs: list[torch.Tensor] = []
    relu = [model[2], model[5], None]
    hooks = [
        (r or m).register_forward_hook(lambda _m, _i, out: outs.append(out.detach().reshape(-1)))
        for m, r in zip(layers, relu, strict=True)
    ]
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        idx = torch.randint(0, len(x), (128,), generator=g)
        outs.clear()
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
    for h in hooks:
        h.remove()
    out = {f"mlp grads L{i + 1}": m.weight.grad.reshape(-1).clone() for i, m in enumerate(layers)}
    out.update({f"mlp acts L{i + 1}": a for i, a in enumerate(outs)})
    return out


def datasets(n: int, seed: int = 0, mlp_steps: int = 60) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {
        "normal(0, 1)": torch.randn(n, generator=g),
        "normal(0, 0.01)": torch.randn(n, generator=g) * 0.01,
        "uniform(0, 1)": torch.rand(n, generator=g),
    }
    if mlp_steps:
        out.update(mlp_tensors(mlp_steps, seed))
    return out


def error_table(
    data: dict[str, torch.Tensor],
    blocks: tuple[int | None, ...] = (None, 4096),
    codecs: tuple[str, ...] = EIGHT_BIT,
) -> list[dict]:
    """One row per (data, codec): mean absolute and relative (%) error for each scale setting,
    keyed "tensor" (one scale per tensor) or the block size."""
    rows = []
    for dist_name, x in data.items():
        nz = x != 0
        for name in codecs:
            row: dict = {"data": dist_name, "codec": name}
            for block in blocks:
                err = (get_codec(name, block).roundtrip(x) - x).abs()
                key = "tensor" if block is None else str(block)
                row[key] = {
                    "mean_abs": float(err.mean()),
                    "mean_rel_pct": float((err[nz] / x.abs()[nz]).mean() * 100),
                }
            rows.append(row)
    return rows


def paper_value(data: str, codec: str) -> str:
    for key in ("mlp grads", "mlp acts"):
        if data.startswith(key):
            return PAPER_TABLE2[key][codec].split("/")[int(data[-1]) - 1]
    return PAPER_TABLE2["normal (paper row 1)"][codec] if data == "normal(0, 1)" else ""


def throughput(
    name: str, block: int | None, n: int = 1 << 24, repeats: int = 5, reuse: bool = True
) -> tuple[float, float]:
    """(encode, decode) GB/s of float32 on one thread, best of `repeats` after a warm-up, into
    output buffers allocated once (as a reducer reuses them, and as bitsandbytes' `out=`), or
    fresh ones each call with reuse=False (runtime.comm.codecs.time_codec)."""
    enc, dec = time_codec(name, n, repeats, block, reuse)
    return 4 * n / min(enc) / 1e9, 4 * n / min(dec) / 1e9


def print_table(rows: list[dict], speeds: dict[str, tuple[float, float]] | None) -> None:
    keys = [k for k in rows[0] if k not in ("data", "codec")] if rows else []
    head = "".join(
        f" {'abs ' + k:>12} {'rel % ' + k:>12}" for k in keys
    )  # e.g. "abs tensor", "rel % 4096"
    print(f"{'data':<17} {'codec':<13}{head} {'paper rel %':>11}")
    last = None
    for r in rows:
        data = r["data"] if r["data"] != last else ""
        last = r["data"]
        cells = "".join(f" {r[k]['mean_abs']:12.3g} {r[k]['mean_rel_pct']:12.3f}" for k in keys)
        print(f"{data:<17} {r['codec']:<13}{cells} {paper_value(r['data'], r['codec']):>11}")
    order = {}
    for r in rows:
        for k in keys:
            order.setdefault((r["data"], k), []).append((r[k]["mean_rel_pct"], r["codec"]))
    print("\nranking by relative error (best first), per tensor | per block:")
    for data in dict.fromkeys(r["data"] for r in rows):
        ranks = [" < ".join(c for _, c in sorted(order[(data, k)])) for k in keys]
        print(f"  {data:<17} {' | '.join(ranks)}")
    print(
        "\nsection 3.1's worked examples (one scale per tensor, absmax 1), to the paper's digits:"
    )
    for v, name, paper in PAPER_EXAMPLES:
        ours = float(get_codec(name, None).roundtrip(torch.tensor([v, 1.0]))[0])
        digits = len(f"{paper:.10f}".rstrip("0").split(".")[1])
        same = "equal" if round(ours, digits) == paper else "differs"
        print(f"  {name:<13} {v:<10g} -> ours {ours:<12.8g} paper {paper:<9.{digits}f} {same}")
    normal = next((r for r in rows if r["data"] == "normal(0, 1)" and "tensor" in r), None)
    if normal is not None:
        x = torch.randn(1 << 20, generator=torch.Generator().manual_seed(0))
        print("\nTable 2, normal(0, 1), per tensor, mean relative error %: Dettmers' split (ours")
        print("now), a uniform split with levels at the step ends (our first version), the paper")
        for name in UNIFORM:
            now = next(r for r in rows if r["data"] == "normal(0, 1)" and r["codec"] == name)
            old = uniform_error(x, name)
            paper = PAPER_TABLE2["normal (paper row 1)"][name]
            print(f"  {name:<13} {now['tensor']['mean_rel_pct']:8.3f} {old:8.3f} {paper:>8}")
    if speeds:
        print()
        print(
            f"{'codec':<13} {'encode GB/s':>12} {'decode GB/s':>12}   (one thread, float32 bytes)"
        )
        for name, (e, d) in speeds.items():
            print(f"{name:<13} {e:12.2f} {d:12.2f}")
