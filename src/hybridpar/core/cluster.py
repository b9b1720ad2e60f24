"""Cluster descriptions for the alpha-beta model: latency alpha (s), inverse bandwidth beta (s/byte),
word size (bytes per element on the wire) and a sustained compute rate (FLOP/s per process).

Two levels. A cluster of hosts gives `ranks_per_host` and the network between hosts (`net_alpha`,
`net_beta`); `alpha`, `beta` and the shared-memory numbers are then those within a host. A
collective is priced by the level its group spans (`Cluster.over`): within one host at the
host's numbers, across hosts at the network's latency and at its beta times the number of
groups that cross the network from one host at once (they share its link). A file without the
second level describes one level: every pair of ranks alike.

Bandwidths are decimal: 6 GB/s is 6e9 bytes/s, the convention that makes Krizhevsky's footnote 4
come out ("4096 floats take 2.73 us at 6 GB/s").
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import asdict, dataclass, fields, replace
from functools import lru_cache
from pathlib import Path

from hybridpar.core.errors import ConfigError
from hybridpar.core.groups import (
    Span,
    batch_groups,
    hosts_by_rank,
    model_groups,
    placed,
    regroup_groups,
    span,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = [
    "BYTES_ONLY",
    "CALIBRATED",
    "PRESETS",
    "SHM_MAX_BYTES",
    "SHM_MIN_BYTES",
    "Cluster",
    "Priced",
    "as_priced",
    "contention",
    "for_device",
    "load_cluster",
    "rank_threads",
]

# the ranks on a host `hybridpar calibrate` times by default: one core each, some waiting for one,
# two to a core on a 2-core host (each kind meets at a different cost)
CALIBRATED = (2, 3, 4)

# the largest collective, per rank, that the runtime sends through host shared memory (comm.small);
# larger ones go on torch.distributed, and the cost model prices them there
SHM_MAX_BYTES = 1 << 24
# what a group's shared segment holds per rank and call to start with (it grows to the largest
# call, in powers of two): 8192 float64, a batch norm of 4096 channels
SHM_MIN_BYTES = 1 << 16


@dataclass(frozen=True)
class Cluster:
    name: str
    alpha: float  # seconds per message
    beta: float  # seconds per byte (1 / bandwidth)
    flops: float  # sustained FLOP/s of one process
    word_bytes: int = 4  # bytes per element of an uncompressed tensor (fp32)
    source: str = ""  # where the numbers come from
    # seconds per small all-reduce (BN statistics, metrics) through host shared memory
    # (comm.small), measured by `hybridpar calibrate`; None: the alpha-beta model prices them
    small_alpha: float | None = None
    # seconds per byte of an activation collective through host shared memory (comm.small: the
    # all-gathers, dX all-reduces and hand-offs of a job on one host), measured by `hybridpar
    # calibrate`; with small_alpha it prices them; None: the alpha-beta model prices them
    shm_beta: float | None = None
    # cores of the one host of a calibrated cluster (`localhost`): `flops` is then one core's rate,
    # and P ranks on it each get cores / P of the host (Priced.rank_flops); None: per process
    cores: int | None = None
    # the collectives of a job of P ranks on this host measured at that P (`hybridpar calibrate
    # --nproc 2,3,4`): (P, alpha, beta, small_alpha, shm_beta) each; ranks that share cores make
    # them slower than a 2-rank fit says. `priced(P)` prices a P-rank job with its own entry
    by_procs: tuple[tuple[int, float, float, float | None, float | None], ...] = ()
    # the second level (all three or none): ranks of a job on each host, numbered host by host
    # (torchrun's order), and the latency and seconds per byte of the network between hosts
    ranks_per_host: int | None = None
    net_alpha: float | None = None
    net_beta: float | None = None
    # seconds of a small all-reduce (batch-norm statistics) over all of a two-level job's ranks
    # across the hosts, measured by `hybridpar calibrate` (`[network]`'s `small_alpha`); a group
    # that spans hosts prices its small sums so (`Priced.over`); None: alpha-beta
    net_small: float | None = None
    # seconds per element one thread takes to encode and decode with each codec, measured by
    # `hybridpar calibrate`: (codec, encode s, decode s); `Priced.codec_times` prices a rank's
    codecs: tuple[tuple[str, float, float], ...] = ()
    # the device a calibration measured its compute and collectives on (cpu, cuda): a job on
    # another device is not priced with it; empty for a described cluster (a preset, a file)
    device: str = ""

    @property
    def two_level(self) -> bool:
        return self.ranks_per_host is not None

    def local(self, P: int) -> int:
        """Ranks of a P-rank job that share one host."""
        return P if self.ranks_per_host is None else min(P, self.ranks_per_host)

    def slowdown(self, P: int) -> float:
        """How much slower than alone one of a P-rank job's ranks runs on this host: its ranks
        times their threads over the cores (`contention`); 1 where the cores are not known."""
        if self.cores is None:
            return 1.0
        local = self.local(P)
        return contention(self.cores, local, rank_threads(self.cores, local))

    def priced(
        self, P: int, placement: tuple[int, int] | None = None, shared_memory: bool = True
    ) -> Priced:
        """This cluster as a job of P ranks sees it (`Priced`): the collectives of as many ranks
        on a host where `hybridpar calibrate` measured them; for a count it did not measure,
        those of the nearest count that shares the cores as P does (`_nearest`; none: this
        cluster's own alpha and beta). Its shared-memory numbers take the slowdown of its ranks
        on the host's cores: timed back to back, the waiting ranks hand each other the cores; in
        a step the ranks around a collective compute, and it gets its share of a core."""
        alpha, beta, small, shm = self.alpha, self.beta, self.small_alpha, self.shm_beta
        fits = {p: rest for p, *rest in self.by_procs}
        if fit := self._nearest(fits, self.local(P)):
            alpha, beta, small, shm = fits[fit]
            c = self.slowdown(P)
            small, shm = (None if x is None else x * c for x in (small, shm))
        return Priced(self, P, alpha, beta, small, shm, placement, shared_memory)

    def _nearest(self, counts, p: int) -> int:
        """Which of `counts` (ranks on a host a calibration measured) prices p of them: the
        largest up to p, or else the smallest above it, of those that share the host's cores as p
        does (every rank on a core of its own, or some waiting for one: a collective of ranks
        that wait for cores costs a multiple of one whose ranks do not); none such, the largest
        up to p; 0 where there is none."""
        if self.cores is not None:
            alike = [c for c in counts if (c > self.cores) == (p > self.cores)]
            if alike:
                return max((c for c in alike if c <= p), default=min(alike))
        return max((c for c in counts if c <= p), default=0)

    def __post_init__(self) -> None:
        for f in ("alpha", "beta", "flops"):
            v = getattr(self, f)
            if (
                not isinstance(v, int | float)
                or not math.isfinite(v)
                or v < 0
                or (f != "alpha" and v == 0)
            ):
                raise ConfigError(
                    f"cluster {self.name!r}: {f} must be a positive number, got {v!r}"
                )
        if self.cores is not None and (not isinstance(self.cores, int) or self.cores <= 0):
            raise ConfigError(f"cluster {self.name!r}: cores must be a positive integer")
        if not isinstance(self.word_bytes, int) or self.word_bytes <= 0:
            raise ConfigError(f"cluster {self.name!r}: word_bytes must be a positive integer")
        second = (self.ranks_per_host, self.net_alpha, self.net_beta)
        if any(v is not None for v in second) and any(v is None for v in second):
            raise ConfigError(
                f"cluster {self.name!r}: a second level needs ranks_per_host and the network's "
                "alpha and beta (or bandwidth) together: a [network] table with ranks_per_host, "
                "alpha and beta"
            )
        if self.ranks_per_host is not None and (
            not isinstance(self.ranks_per_host, int)
            or isinstance(self.ranks_per_host, bool)
            or self.ranks_per_host <= 0
        ):
            raise ConfigError(f"cluster {self.name!r}: ranks_per_host must be a positive integer")
        if self.net_beta is not None and not (
            isinstance(self.net_beta, int | float) and self.net_beta > 0
        ):
            raise ConfigError(f"cluster {self.name!r}: the network's beta must be positive")
        for f, unit in (
            ("small_alpha", "seconds"),
            ("shm_beta", "seconds per byte"),
            ("net_alpha", "seconds"),
            ("net_small", "seconds"),
            ("net_beta", "seconds per byte"),
        ):
            v = getattr(self, f)
            if v is not None and (not isinstance(v, int | float) or not math.isfinite(v) or v < 0):
                key = {"net_alpha": "[network] alpha", "net_small": "[network] small_alpha"}
                raise ConfigError(
                    f"cluster {self.name!r}: {key.get(f, f)} must be a number of {unit} >= 0, "
                    f"got {v!r}"
                )

    @property
    def bandwidth(self) -> float:
        """bytes per second"""
        return 1.0 / self.beta

    def to_dict(self) -> dict:
        by_procs: dict[str, dict] = {
            str(p): {"alpha": a, "beta": b, "small_alpha": sa, "shm_beta": sb}
            for p, a, b, sa, sb in self.by_procs
        }
        out = {**asdict(self), "by_procs": by_procs, "bandwidth_GBps": self.bandwidth / 1e9}
        out["codecs"] = {name: [enc, dec] for name, enc, dec in self.codecs}
        for k in ("ranks_per_host", "net_alpha", "net_beta", "net_small"):
            out.pop(k)
        if self.two_level:
            out["network"] = {
                "ranks_per_host": self.ranks_per_host,
                "alpha": self.net_alpha,
                "beta": self.net_beta,
                "bandwidth_GBps": 1 / self.net_beta / 1e9 if self.net_beta else None,
            }
            if self.net_small is not None:
                out["network"]["small_alpha"] = self.net_small
        return out


@dataclass(frozen=True)
class Priced:
    """A cluster as one job prices it (`Cluster.priced`): made once from the job's P ranks, the
    placement of its grid positions on them (hybridpar.core.groups) and whether its groups take
    the host's shared-memory paths (`--no-shared-memory`: no); `alpha` to `shm_beta` are this
    job's. What the cluster's file says stays in `cluster`."""

    cluster: Cluster
    P: int
    alpha: float
    beta: float
    small_alpha: float | None = None
    shm_beta: float | None = None
    placement: tuple[int, int] | None = None
    shared_memory: bool = True

    @property
    def name(self) -> str:
        return self.cluster.name

    @property
    def word_bytes(self) -> int:
        return self.cluster.word_bytes

    @property
    def two_level(self) -> bool:
        return self.cluster.two_level

    @property
    def shm_paths(self) -> bool:
        """Whether the job's activation collectives and halos on one host are priced through
        shared memory: calibrated (small_alpha, shm_beta) and not turned off for the run."""
        return self.shared_memory and self.small_alpha is not None and self.shm_beta is not None

    def placed(self, placement: tuple[int, int] | None) -> Priced:
        """The same job with its positions placed by `placement`."""
        return self if placement == self.placement else replace(self, placement=placement)

    def rank_flops(self) -> float:
        """FLOP/s one rank sustains: the cluster's `flops`, or on a calibrated host its share of
        the cores (the trainer gives each of a host's ranks cores // ranks threads)."""
        c = self.cluster
        return c.flops if c.cores is None else c.flops * c.cores / max(1, c.local(self.P))

    def codec_times(self, codec: str) -> tuple[float, float]:
        """(encode, decode) seconds per element for a rank: as one thread measured them, times
        the slowdown of the ranks sharing a host's cores; (0, 0) where it was not measured."""
        for name, enc, dec in self.cluster.codecs:
            if name == codec:
                s = self.cluster.slowdown(self.P)
                return enc * s, dec * s
        return 0.0, 0.0

    def meeting_s(self) -> float:
        """What the job's ranks lose each time they meet in a blocking collective (some arrive
        before others, the last waits for a core): the small-message latency `hybridpar
        calibrate` fitted for the job's count of ranks on the host (its `alpha`: what the ranks
        of a round of small all-reduces lose to one another, cores shared alike), or the small
        all-reduce it timed over all the ranks where the job spans a two-level cluster's hosts;
        0 on a cluster nothing was measured on (a preset, a file without `by_procs`)."""
        c = self.cluster
        if c.two_level and c.local(self.P) < self.P:
            return c.net_small or 0.0
        return self.alpha if c.by_procs else 0.0

    def over(self, groups: list[list[int]]) -> Priced:
        """The job as the collectives of `groups` see them (lists of positions, every group
        running its collective at once, on ranks by `placement`): itself where each group sits
        on one host; where one spans hosts, the network's alpha, its beta times the groups that
        cross from one host at once, and no shared memory."""
        c = self.cluster
        if c.ranks_per_host is None or c.net_alpha is None or c.net_beta is None:
            return self
        groups = placed(groups, self.placement)
        P = 1 + max((k for g in groups for k in g), default=0)
        s = span(groups, hosts_by_rank(P, c.ranks_per_host))
        if s.hosts <= 1:
            return self
        # small sums across the hosts, as measured there
        return replace(
            self, alpha=c.net_alpha, beta=c.net_beta * s.flows, small_alpha=c.net_small,
            shm_beta=None,
        )  # fmt: skip

    def group(self, kind: str, pr: int, pc: int) -> Priced:
        """`over` the "model" or the "batch" groups of grid pr x pc."""
        if self.cluster.ranks_per_host is None:
            return self
        return _over(self, kind, pr, pc, 0)

    def span(self, kind: str, pr: int, pc: int) -> Span:
        """How the "model" or "batch" groups of grid pr x pc meet the hosts (one host each on a
        one-level cluster)."""
        if self.cluster.ranks_per_host is None:
            return Span(1, 0, pc if kind == "batch" else pr)
        return _span(kind, pr, pc, self.cluster.ranks_per_host, self.placement)

    def regroup(self, P: int, fine: int, coarse: int) -> Priced:
        """`over` the groups that move an activation between layouts of `fine` and `coarse`
        batch groups (hybridpar.core.groups.regroup_groups)."""
        if self.cluster.ranks_per_host is None:
            return self
        return _over(self, "regroup", P, fine, coarse)


PRESETS: dict[str, Cluster] = {
    c.name: c
    for c in (
        Cluster(
            "cori-knl",
            alpha=2e-6,
            beta=1 / 6e9,
            flops=1.5e12,
            source="Gholami et al. 2018, Table 1 (alpha, beta); flops: our assumption for Intel Caffe "
            "on one KNL (the paper measures compute instead, Fig. 4)",
        ),
        Cluster(
            "k20-pcie",
            alpha=10e-6,
            beta=1 / 6e9,
            flops=2e12,
            source="Krizhevsky 2014: PCIe 2.0 at about 6 GB/s, 2 TFLOP/s K20 GPUs (footnote 4); "
            "alpha: our assumption",
        ),
        Cluster(
            "fdr-infiniband",
            alpha=1.3e-6,
            beta=1 / 6.8e9,
            flops=7e12,
            source="FDR InfiniBand 4x: 56 Gb/s signalling, about 6.8 GB/s achievable; MPI latency "
            "about 1.3 us; flops: a P100-class GPU",
        ),
        Cluster(
            "p100-nvlink",
            alpha=5e-6,
            beta=1 / 40e9,
            flops=7e12,
            source="NVLink 1.0, two links (40 GB/s per direction) between P100s; sustained fp32 of "
            "about 7 TFLOP/s: our assumptions",
        ),
    )
}


def as_priced(net: Cluster | Priced, P: int) -> Priced:
    """`net` as a job of P ranks prices it: itself if it is already a job's view."""
    return net if isinstance(net, Priced) else net.priced(P)


@lru_cache(maxsize=4096)
def _span(
    kind: str, pr: int, pc: int, ranks_per_host: int, placement: tuple[int, int] | None
) -> Span:
    groups = model_groups(pr, pc) if kind == "model" else batch_groups(pr, pc)
    return span(placed(groups, placement), hosts_by_rank(pr * pc, ranks_per_host))


@lru_cache(maxsize=4096)
def _over(net: Priced, kind: str, a: int, b: int, c: int) -> Priced:
    if kind == "model":
        groups = model_groups(a, b)
    elif kind == "batch":
        groups = batch_groups(a, b)
    else:
        groups = regroup_groups(a, b, c)
    return net.over(groups)


# prices bytes exactly and seconds as ~0: for checking a plan's volumes, or where nothing is calibrated
BYTES_ONLY = Cluster(
    "bytes-only",
    alpha=0.0,
    beta=1e-300,
    flops=1e300,
    source="bytes only: run `hybridpar calibrate` for seconds",
)


def rank_threads(cores: int, P: int) -> int:
    """The threads each of P ranks sharing `cores` cores runs with (the launcher and the trainer
    set them, the compute profile measures with them): more threads than cores make OpenMP
    spin-wait."""
    return max(1, cores // P)


def contention(cores: int, P: int, threads: int) -> float:
    """How much slower each of P ranks of `threads` threads runs when they share `cores` cores:
    P threads / cores, at least 1: the scheduler gives each its share of the cores over a
    stretch of work (the compute model's one price of oversubscription; what the ranks lose at
    each meeting is `Priced.meeting_s`)."""
    return max(1.0, P * threads / cores)


def cache_dir() -> Path:
    return Path(os.environ.get("HYBRIDPAR_CACHE", Path.home() / ".cache" / "hybridpar"))


def cache_write(path: Path, data: object, indent: int | None = 1) -> None:
    """Write `data` as JSON at `path` atomically: a reader (another rank, another job) never
    sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=indent))
    tmp.replace(path)


def localhost_path(device: str = "cpu") -> Path:
    """Where `hybridpar calibrate` caches what it measured of this machine, one file per device
    (`--device cuda`: localhost-cuda.json)."""
    return cache_dir() / ("localhost.json" if device == "cpu" else f"localhost-{device}.json")


def for_device(cluster: Cluster, device: str) -> Cluster:
    """`cluster`, if it may price a job on `device`: a calibration prices only the device it
    measured (a CPU's for a GPU job once printed 6.4e-289 s per iteration)."""
    if cluster.device and device in ("cpu", "cuda") and cluster.device != device:
        flag = "" if device == "cpu" else f" --device {device}"
        raise ConfigError(
            f"cluster {cluster.name!r} was calibrated on {cluster.device}, but this job runs "
            f"on {device}: run `hybridpar calibrate{flag}` and price it on localhost"
        )
    return cluster


def _from_mapping(data: dict, origin: str) -> Cluster:
    if not isinstance(data, dict):
        raise ConfigError(
            f"{origin}: expected a table/object with alpha, beta (or bandwidth) and flops"
        )
    known = {f.name for f in fields(Cluster)} - {"net_alpha", "net_beta", "net_small"}
    known |= {"bandwidth", "bandwidth_GBps", "network", "spread"}
    unknown = set(data) - known
    if unknown:
        raise ConfigError(f"{origin}: unknown key(s) {sorted(unknown)}; allowed: {sorted(known)}")
    data = dict(data)
    data.pop("spread", None)  # how much each measured quantity varied (calibrate --check)
    bw = data.pop("bandwidth", None)
    bw_gb = data.pop("bandwidth_GBps", None)
    if "beta" not in data:
        if bw is None and bw_gb is None:
            raise ConfigError(f"{origin}: give beta (s/byte) or bandwidth (bytes/s)")
        bw = bw if bw is not None else float(bw_gb) * 1e9
        if not isinstance(bw, int | float) or bw <= 0:
            raise ConfigError(f"{origin}: bandwidth must be a positive number, got {bw!r}")
        data["beta"] = 1.0 / bw
    missing = [k for k in ("alpha", "flops") if k not in data]
    if missing:
        raise ConfigError(f"{origin}: missing key(s) {missing}")
    if "by_procs" in data:
        data["by_procs"] = _by_procs(data["by_procs"], origin)
    if "codecs" in data:
        data["codecs"] = _codecs(data["codecs"], origin)
    if "network" in data:
        net = data.pop("network")
        if isinstance(net, dict) and "ranks_per_host" in data:  # at the top level or in it
            net = {**net, "ranks_per_host": data.pop("ranks_per_host")}
        data.update(_network(net, origin))
    data.setdefault("name", Path(origin).stem)
    data.setdefault("source", origin)
    try:
        return Cluster(**data)
    except TypeError as exc:
        raise ConfigError(f"{origin}: {exc}") from exc


def _network(table: object, origin: str) -> dict:
    """The [network] table of a two-level cluster: ranks_per_host, alpha, and beta (s/byte) or
    bandwidth (bytes/s) or bandwidth_GBps, as Cluster's second level."""
    keys = {"ranks_per_host", "alpha", "beta", "bandwidth", "bandwidth_GBps", "small_alpha"}
    if isinstance(table, dict) and "sync" in table:
        raise ConfigError(_REMOVED.format(origin=origin, key="[network] sync"))
    if not isinstance(table, dict) or not {"ranks_per_host", "alpha"} <= set(table):
        raise ConfigError(
            f"{origin}: [network] needs ranks_per_host, alpha and beta (or bandwidth): the "
            "ranks of a job on each host and the link between hosts"
        )
    unknown = set(table) - keys
    if unknown:
        raise ConfigError(
            f"{origin}: [network]: unknown key(s) {sorted(unknown)}; allowed: {sorted(keys)}"
        )
    beta = table.get("beta")
    if beta is None:
        bw = table.get("bandwidth")
        bw = bw if bw is not None else table.get("bandwidth_GBps")
        if not isinstance(bw, int | float) or isinstance(bw, bool) or bw <= 0:
            raise ConfigError(f"{origin}: [network]: give beta (s/byte) or a positive bandwidth")
        beta = 1.0 / (bw if "bandwidth" in table else bw * 1e9)
    out = {
        "ranks_per_host": table["ranks_per_host"],
        "net_alpha": table["alpha"],
        "net_beta": beta,
    }
    if table.get("small_alpha") is not None:
        out["net_small"] = table["small_alpha"]
    return out


_REMOVED = (
    "{origin}: {key} is no longer read (the meetings' table: each meeting is priced at the "
    "small all-reduce now); run `hybridpar calibrate` again"
)


def _by_procs(table: object, origin: str) -> tuple:
    """{"4": {"alpha": .., "beta": .., "small_alpha": .., "shm_beta": ..}, ...} as Cluster holds it."""
    if isinstance(table, dict):
        old = next((p for p, v in table.items() if isinstance(v, dict) and "sync" in v), None)
        if old is not None:
            raise ConfigError(_REMOVED.format(origin=origin, key=f"by_procs {old} sync"))
    try:
        out = tuple(
            sorted(
                (
                    int(p),
                    float(v["alpha"]),
                    float(v["beta"]),
                    None if v.get("small_alpha") is None else float(v["small_alpha"]),
                    None if v.get("shm_beta") is None else float(v["shm_beta"]),
                )
                for p, v in table.items()  # type: ignore[union-attr]
            )
        )
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise ConfigError(
            f"{origin}: by_procs must map a number of ranks to alpha, beta, small_alpha and "
            f"shm_beta ({exc.__class__.__name__})"
        ) from None
    for p, alpha, beta, _, _ in out:
        if p < 2 or not (math.isfinite(alpha) and alpha >= 0 and math.isfinite(beta) and beta > 0):
            raise ConfigError(f"{origin}: by_procs {p}: needs P >= 2, alpha >= 0 and beta > 0")
    return out


def _codecs(table: object, origin: str) -> tuple:
    """{"dynamic-tree": [encode s, decode s], ...} per element, as Cluster.codecs holds it."""
    try:
        out = tuple(sorted((str(k), float(v[0]), float(v[1])) for k, v in table.items()))  # type: ignore[union-attr]
    except (AttributeError, TypeError, ValueError, IndexError, KeyError) as exc:
        raise ConfigError(
            f"{origin}: codecs must map a codec to [encode s, decode s] per element "
            f"({exc.__class__.__name__}); run `hybridpar calibrate` again"
        ) from None
    if any(not (math.isfinite(e) and math.isfinite(d) and e >= 0 and d >= 0) for _, e, d in out):
        raise ConfigError(f"{origin}: codecs need finite seconds per element >= 0")
    return out


def load_cluster(spec: str, device: str = "cpu") -> Cluster:
    """A preset name, `localhost` (after `hybridpar calibrate`: its calibration for `device`), or
    a path to a .toml / .json file; a calibration of another device is refused (`for_device`)."""
    return for_device(_load(spec, device), device)


def _load(spec: str, device: str) -> Cluster:
    if spec in PRESETS:
        return PRESETS[spec]
    if spec == "localhost":
        path = localhost_path(device)
        if not path.exists():
            flag = "" if device == "cpu" else f" --device {device}"
            raise ConfigError(
                f"cluster 'localhost' is not calibrated for {device} yet; run "
                f"`hybridpar calibrate{flag}` first"
            )
        try:
            return _from_mapping(json.loads(path.read_text()), str(path))
        except (ConfigError, json.JSONDecodeError) as exc:
            raise ConfigError(
                f"the calibration of 'localhost' is unusable ({str(exc).splitlines()[0]}); "
                "run `hybridpar calibrate` again"
            ) from None
    path = Path(spec)
    if path.suffix.lower() in (".toml", ".json"):
        if not path.is_file():
            raise ConfigError(f"cluster file {spec!r} does not exist")
        try:
            text = path.read_text()
            data = tomllib.loads(text) if path.suffix.lower() == ".toml" else json.loads(text)
        except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(
                f"cluster file {spec!r} is malformed: {str(exc).splitlines()[0]}"
            ) from exc
        return _from_mapping(data, spec)
    raise ConfigError(
        f"unknown cluster {spec!r}; choose a preset ({', '.join(PRESETS)}), localhost, "
        "or a .toml/.json file with alpha, beta (or bandwidth) and flops"
    )
