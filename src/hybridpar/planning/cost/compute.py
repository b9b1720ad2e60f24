"""Per-layer compute time: FLOPs over a sustained rate, or a profile measured on a machine at the
sample counts a rank runs (ProfileModel: planning.profile, here or by `hybridpar profile`).

FLOPs give each process B/P samples' worth of a layer's work whatever the style (batch: B/P samples of the whole layer; model: B/Pc samples of 1/Pr of it; domain: B/Pc
samples of 1/Pr of the image); the backward pass costs twice the forward (dX and dW). That is
exact in FLOPs but not in seconds: a matrix multiply with fewer rows runs at a lower rate, and
the layers riding along with a model-parallel one (ReLU, pooling, batch norm) act on the
gathered output, all B/Pc samples of it. ProfileModel prices each style by what a rank runs
under it, from times measured at B/Pc samples, with the optimizer's update of the rank's
parameters and the slowdown of ranks sharing cores.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from hybridpar.core.layers import CostLayer
from hybridpar.core.plan import Style

__all__ = ["ComputeModel", "FlopsModel", "ProfileModel", "style_times"]


class ComputeModel(Protocol):
    def times(self, layer: CostLayer, samples: float) -> tuple[float, float]:
        """(forward seconds, backward seconds) of `layer` for `samples` samples on one process."""


@dataclass(frozen=True)
class FlopsModel:
    flops: float  # sustained FLOP/s of one process

    def times(self, layer: CostLayer, samples: float) -> tuple[float, float]:
        fwd = layer.flops * samples / self.flops
        return fwd, 2 * fwd


@dataclass(frozen=True)
class ProfileModel:
    """Seconds measured here for each leaf layer at the sample counts a rank runs, with the thread
    count a rank gets: {samples: {leaf: (forward s, backward s)}}; the optimizer's seconds per
    parameter element; and `contention`, how much slower a rank runs because the job's ranks share
    the cores (P x threads / cores, at least 1)."""

    per_count: dict[int, dict[str, tuple[float, float]]]
    # {(Pr, samples): {leaf: (forward, backward) share of its time on the busiest band}}: the
    # domain style's convolutions and poolings, measured on band and halo (planning.profile)
    bands: dict[tuple[int, int], dict[str, tuple[float, float]]] = field(default_factory=dict)
    # {(Pr, samples): {leaf: (forward, backward) share of its time with the most output units
    # of Pr}}: the model style's weighted modules, measured with their split weights
    splits: dict[tuple[int, int], dict[str, tuple[float, float]]] = field(default_factory=dict)
    update_s: float = 0.0  # optimizer step, seconds per parameter element
    contention: float = 1.0
    source: str = ""

    def _leaf(self, name: str, samples: float) -> tuple[float, float]:
        """A leaf's (forward, backward) seconds for `samples`: measured at that count, else the
        nearest count's per-sample times scaled."""
        n = min(self.per_count, key=lambda k: (abs(k - samples), k))
        # a member that is no module (a function in forward) has no entry: its time is spread
        # over the modules' (planning.profile scales them to the whole iteration)
        f, b = self.per_count[n].get(name, (0.0, 0.0))
        k = samples / n
        return f * k, b * k

    def _fixed(self, name: str) -> tuple[float, float]:
        """A leaf's (forward, backward) seconds per call that do not grow with the samples (its
        weights' share, the call's overhead): the intercept of a least-squares line through its
        measured counts, between 0 and the time at the smallest count; 0 with a single count."""
        counts = sorted(n for n in self.per_count if name in self.per_count[n])
        if len(counts) < 2:
            return 0.0, 0.0
        out = []
        for j in (0, 1):
            ys = [self.per_count[n][name][j] for n in counts]
            mx, my = sum(counts) / len(counts), sum(ys) / len(ys)
            sxx = sum((n - mx) ** 2 for n in counts)
            slope = sum((n - mx) * (y - my) for n, y in zip(counts, ys, strict=True)) / sxx
            out.append(min(max(0.0, my - slope * mx), ys[0]))
        return out[0], out[1]

    def _sum(self, names, samples: float, share: float = 1.0) -> tuple[float, float]:
        """Seconds of `names` on `samples` samples, or of a `share` of each of them: its fixed
        cost whole and the rest in proportion."""
        f = b = 0.0
        for m in names:
            lf, lb = self._leaf(m, samples)
            if share != 1.0:
                ff, fb = self._fixed(m)
                ff, fb = min(ff, lf), min(fb, lb)
                lf, lb = ff + (lf - ff) * share, fb + (lb - fb) * share
            f, b = f + lf, b + lb
        return f * self.contention, b * self.contention

    def times(self, layer: CostLayer, samples: float) -> tuple[float, float]:
        return self._sum(layer.members, samples)

    def style_times(self, layer: CostLayer, s: Style, B: int, P: int) -> tuple[float, float, float]:
        """(forward, backward, optimizer update) seconds of `layer` on one rank under `s`: batch
        runs all of it on B/P samples; model runs the weighted module with 1/Pr of its weights
        on B/Pc samples, at the share of its time measured with the busiest rank's units
        (`splits`), where the profile has one, else 1/Pr of it (a wide layer's time on a small
        batch is mostly its weights', which do not shrink with the samples), and all of the
        layers riding along (they act on the gathered output); domain
        runs everything on 1/Pr of the rows of B/Pc samples with whole weights: its convolutions
        and poolings at the share of their time measured on the busiest rank's band and halo
        (`bands`), where the profile has one; elsewhere what does not grow with the samples (the
        weight gradient's share, `_fixed`) whole, 1/Pr of the rest."""
        n = B / s.pc
        params = layer.params
        if s.kind == "model":
            weighted = [m for m in layer.members if m == layer.name]
            riders = [m for m in layer.members if m != layer.name]
            wf, wb = self._sum(weighted, n)
            rf, rb = self._sum(riders, n)
            split = self.splits.get((s.pr, round(n)), {}).get(layer.name)
            sf, sb = split if split is not None else (1.0 / s.pr, 1.0 / s.pr)
            f, b = wf * sf + rf, wb * sb + rb
            params = (layer.params - layer.extra_params) / s.pr + layer.extra_params
        elif s.kind == "domain":
            # the windows at their measured share of the busiest band (halo rows, the joins);
            # the rest on 1/Pr of the rows, what does not grow with the samples whole
            shares = self.bands.get((s.pr, round(n)), {})
            banded = [m for m in layer.members if m in shares]
            f, b = self._sum([m for m in layer.members if m not in shares], n, 1.0 / s.pr)
            k = self.contention
            for m in banded:
                lf, lb = self._leaf(m, n)
                f, b = f + lf * shares[m][0] * k, b + lb * shares[m][1] * k
        else:
            f, b = self._sum(layer.members, n)
        return f, b, params * self.update_s * self.contention


def style_times(
    compute: ComputeModel, layer: CostLayer, s: Style, B: int, P: int
) -> tuple[float, float, float]:
    """(forward, backward, update) seconds of `layer` under `s` on one rank: the model's own
    pricing by style where it has one, else B/P samples' worth and no update term."""
    by_style = getattr(compute, "style_times", None)
    if by_style is not None:
        return by_style(layer, s, B, P)
    f, b = compute.times(layer, B / P)
    return f, b, 0.0
