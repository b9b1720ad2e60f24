"""The largest image whose plan fits a memory limit (`hybridpar plan --fit`): the planner asked
at growing sizes, then between the last that fits and the first that does not."""

from __future__ import annotations

from hybridpar.core.cluster import Cluster
from hybridpar.core.errors import ConfigError
from hybridpar.core.zoo import is_factory
from hybridpar.planning.candidates import PlanResult, best_of
from hybridpar.planning.search import make_plan

__all__ = ["largest_fitting"]


def largest_fitting(
    model: str, shape: tuple[int, ...], P: int, B: int, cluster: Cluster, **options: object
) -> tuple[PlanResult, tuple[tuple[int, ...], str]]:
    """(the plans of the largest image of `shape`'s aspect (of a zoo model, square or a cube)
    whose best plan fits the request's memory limit, (the next size up, why it fits none)): sizes in steps of 16 pixels along the
    first spatial dimension (of its size where smaller), the others scaled alike; doubled
    until nothing fits, then halved in between."""
    step = min(16, shape[1])

    def sized(k: int) -> tuple[int, ...]:
        return (shape[0], *(max(1, round(k * step * d / shape[1])) for d in shape[1:]))

    def tried(k: int) -> tuple[PlanResult | None, str]:
        # a zoo model is built for a side (its images square, its volumes cubes)
        given = {"input_shape": sized(k)} if is_factory(model) else {"input_size": sized(k)[-1]}
        try:
            result = make_plan(model, P, B, cluster, **given, **options)
        except ConfigError as exc:
            return None, str(exc)
        best = best_of(result.scenarios)
        return (result, "") if best is not None else (None, result.scenarios[-1].reason)

    lo = max(1, shape[1] // step)
    found, why = tried(lo)
    if found is None:
        size = " x ".join(map(str, shape[1:]))
        raise ConfigError(f"no plan fits even {size} under the memory limit ({why})")
    hi = lo * 2
    while (got := tried(hi))[0] is not None:
        lo, found, hi = hi, got[0], hi * 2
    refused = got[1]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        result, reason = tried(mid)
        if result is None:
            hi, refused = mid, reason
        else:
            lo, found = mid, result
    return found, (sized(hi), refused)
