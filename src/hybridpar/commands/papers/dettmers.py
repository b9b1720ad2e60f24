"""Dettmers' predictive speed-up model (Appendix A of "8-Bit Approximations for Parallelism in Deep
Learning"), as a second cost model next to Gholami's alpha-beta equations.

The layout is Krizhevsky's: data parallelism in the convolutional layers, and the fully-connected
layers model-parallel over sub-batches. Each GPU's convolutional output is one sub-batch. While
one sub-batch is multiplied, the next one is in flight. The inputs are per-layer times:
forward, backward and update, both unsplit and split P ways. To them come the time to move one
sub-batch's activations between the GPUs, for 32-bit and 8-bit transfers.

Our copy of the paper lost Appendix A's equations; the prose and Tables 3-7 survive. The
expressions below are our reading of that prose (docs/fidelity.md says which numbers they
reproduce):

One node of P GPUs (A.1), per iteration of P sub-batches:

    T_conv    = T_total - sum(fc fprop + bprop + update)      "the same time as for 1 GPU but
                                                                without the fully connected part"
    T_fc      = P * sum(split fprop + bprop + update)          every GPU runs every sub-batch
    penalty   = sync(act) + sync(act)                          the first sub-batch's activations and
                                                                the last errors: nothing to hide under
              + (P - 1) * sum_l max(0, sync(out_l) - fprop_split(l + 1))
                                                                each remote sub-batch: the part of a
                                                                layer's output transfer longer than
                                                                the next layer's multiplication
    speed-up  = P * T_total / (T_conv + T_fc + penalty)

The backward transfers are taken as hidden. Their error activities overlap the weight updates,
as A.1.2 says for the errors sent back to the convolutional layers.

A cluster of N nodes, G GPUs each (A.2). Model parallelism in the FC layers is dropped: each
pass is the unsplit FC forward time for one sub-batch s. The activities of each pass go to the
N - 1 other nodes, each transfer after the first hidden under `window` ms of multiplication (Table 6
"full pass w/ overlap"):

    passes    = N G b / s           (b: the per-GPU batch, 128)
    sync_full = max(sync_single(s), (N - 1) * (sync_single(s) - window))
    T         = T_conv + passes * T_fc_unsplit + sync_full
    speed-up  = N G * T_total / T
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hybridpar.core.errors import ConfigError

__all__ = [
    "APPENDIX_A_4GPU",
    "APPENDIX_A_96GPU",
    "PAPER_4GPU",
    "PAPER_96GPU",
    "ClusterProfile",
    "FCLayer",
    "NodePrediction",
    "NodeProfile",
    "cluster_speedup",
    "load_profile",
    "node_speedup",
    "profile_from_layers",
]


@dataclass(frozen=True)
class FCLayer:
    """One fully-connected layer, times in ms for one sub-batch: unsplit and split P ways, and
    the time to send its output activations to the other GPUs at 32 and 8 bits."""

    name: str
    fprop: float
    bprop: float
    update: float
    split_fprop: float
    split_bprop: float
    split_update: float
    sync32: float
    sync8: float

    @property
    def unsplit(self) -> float:
        return self.fprop + self.bprop + self.update

    @property
    def split(self) -> float:
        return self.split_fprop + self.split_bprop + self.split_update


@dataclass(frozen=True)
class NodeProfile:
    """A.1's inputs: the baseline full pass of one GPU on its sub-batch (ms), the FC layers, and
    the time to send one sub-batch of convolutional activities at 32 and 8 bits."""

    gpus: int
    total: float
    act_sync32: float
    act_sync8: float
    fc: tuple[FCLayer, ...]
    source: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.gpus, int) or self.gpus < 1:
            raise ConfigError(f"a Dettmers profile needs gpus >= 1, got {self.gpus!r}")
        if not self.fc:
            raise ConfigError("a Dettmers profile needs at least one fully-connected layer")
        values = [self.total, self.act_sync32, self.act_sync8]
        values += [v for x in self.fc for k, v in asdict(x).items() if k != "name"]
        if not all(isinstance(v, int | float) and math.isfinite(v) and v >= 0 for v in values):
            raise ConfigError("every time in a Dettmers profile must be a finite number >= 0 (ms)")
        if sum(x.unsplit for x in self.fc) > self.total:
            raise ConfigError(
                "the FC layers take longer than the whole pass (`total`): check units"
            )


@dataclass(frozen=True)
class NodePrediction:
    bits: int
    conv: float
    fc: float
    penalty: float
    speedup: float

    @property
    def time(self) -> float:
        return self.conv + self.fc + self.penalty


def node_speedup(p: NodeProfile, bits: int, total: float | None = None) -> NodePrediction:
    """A.1: predicted speed-up of P GPUs over one, at 32- or 8-bit transfers. `total` replaces
    the profile's baseline pass (the paper's check with convnet2 kernels, whose FC and transfer
    times it keeps)."""
    if bits not in (32, 8):
        raise ConfigError(f"Dettmers' model has 32- and 8-bit transfers, not {bits}")
    total = p.total if total is None else total
    sync = (lambda x: x.sync32) if bits == 32 else (lambda x: x.sync8)
    act = p.act_sync32 if bits == 32 else p.act_sync8
    conv = total - math.fsum(x.unsplit for x in p.fc)
    fc = p.gpus * math.fsum(x.split for x in p.fc)
    exposed = math.fsum(
        max(0.0, sync(a) - b.split_fprop) for a, b in zip(p.fc, p.fc[1:], strict=False)
    )
    penalty = 2 * act + (p.gpus - 1) * exposed
    return NodePrediction(bits, conv, fc, penalty, p.gpus * total / (conv + fc + penalty))


@dataclass(frozen=True)
class ClusterProfile:
    """A.2's inputs: nodes x GPUs, the per-GPU batch, one sub-batch's FC forward time, the overlap
    window, and per sub-batch size the single-pass sync time at 32 and 8 bits (Table 6)."""

    nodes: int
    gpus_per_node: int
    batch_per_gpu: int
    fc_pass: float
    window: float
    sync_single: dict[int, tuple[float, float]] = field(default_factory=dict)
    source: str = ""

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


def cluster_speedup(c: ClusterProfile, total: float, sub_batch: int, bits: int) -> dict:
    """A.2: predicted speed-up of the cluster at one sub-batch size, with `total` the one-GPU
    baseline pass (ms)."""
    if sub_batch not in c.sync_single:
        raise ConfigError(f"no sync time for sub-batch {sub_batch}; have {sorted(c.sync_single)}")
    single = c.sync_single[sub_batch][0 if bits == 32 else 1]
    passes = c.gpus * c.batch_per_gpu / sub_batch
    full = max(single, (c.nodes - 1) * (single - c.window))
    forward = passes * c.fc_pass
    t = total - c.fc_pass + forward + full
    return {"forward": forward, "sync_full": full, "time": t, "speedup": c.gpus * total / t}


# --- the paper's inputs (Dettmers, Appendix A) ------------------------------------------------

_T3_T4 = "Dettmers Appendix A, Tables 3 (sync ms) and 4 (fprop/bprop/update ms), NervanaGPU"
APPENDIX_A_4GPU = NodeProfile(
    gpus=4,
    total=104.1,  # Table 4, "Total all layers"
    act_sync32=0.9,  # Table 3, conv 3 activation
    act_sync8=0.4,
    fc=(
        FCLayer("fc 9216x3072", 1.3, 1.3, 1.5, 0.9, 0.9, 0.43, 1.1, 0.5),
        FCLayer("fc 3072x3072", 0.45, 0.45, 0.5, 0.3, 0.3, 0.13, 1.1, 0.5),
        FCLayer("fc 3072x1000", 0.4, 0.4, 0.2, 0.15, 0.15, 0.08, 0.4, 0.25),
    ),
    source=_T3_T4,
)
CONVNET2_TOTAL = 17000 / 96  # ms: Table 7's convnet2 baseline, 17 s for 96 passes of 128

APPENDIX_A_96GPU = ClusterProfile(
    nodes=32,
    gpus_per_node=3,
    batch_per_gpu=128,
    fc_pass=6.5,  # Table 4, "Total fc layers" unsplit (Table 6's forward time is passes x 6.5)
    window=1.3,  # A.2.2: transfers hide under "the matrix multiplication of the subsequent layer"
    sync_single={  # Table 6, "sync time, single pass", 32-bit and 8-bit (ms)
        128: (2.1, 0.35),
        256: (4.2, 0.55),
        512: (7.15, 1.13),
        1024: (17.4, 2.25),
        2048: (25.5, 3.26),
        12288: (250.0, 31.0),  # the paper marks the 32-bit value "(?)"
    },
    source="Dettmers Appendix A, Tables 4-6 (FDR InfiniBand, 6 GB/s)",
)

# the paper's predictions, for comparison
PAPER_4GPU = {32: 3.53, 8: 3.67, "krizhevsky_measured": 3.66}
PAPER_96GPU = {  # Table 7: sub-batch -> (NervanaGPU 32, 8, convnet2 32, 8)
    128: (13.4, 13.8, 20.7, 21.4),
    256: (20.0, 24.4, 29.7, 35.2),
    512: (23.0, 39.3, 33.5, 51.9),
    1024: (14.8, 48.6, 22.7, 61.0),
    2048: (11.3, 50.6, 17.7, 62.8),
    12288: (1.3, 9.7, 2.15, 15.5),
}


def load_profile(spec: str) -> NodeProfile:
    """'appendix-a' (the paper's Tables 3-4) or a JSON file with NodeProfile's fields."""
    if spec == "appendix-a":
        return APPENDIX_A_4GPU
    path = Path(spec)
    if not path.is_file():
        raise ConfigError(f"--dettmers-profile {spec}: not 'appendix-a' and no such file")
    try:
        d = json.loads(path.read_text())
        fc = tuple(FCLayer(**x) for x in d.pop("fc"))
        return NodeProfile(fc=fc, source=str(path), **{k: v for k, v in d.items() if k != "source"})
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise ConfigError(
            f"{spec}: not a Dettmers profile ({exc}); expected gpus, total, act_sync32, act_sync8 "
            "and fc: [{name, fprop, bprop, update, split_fprop, split_bprop, split_update, sync32, "
            "sync8}] in ms"
        ) from None


def profile_from_layers(layers, cluster, gpus: int, sub_batch: int) -> NodeProfile:
    """A.1's inputs from our own models: per-layer times from the cluster's FLOP rate (backward
    twice the forward, update 3 FLOPs per parameter), transfers from its alpha-beta (an all-gather
    of one sub-batch's activations; 8-bit: a quarter of the bytes plus the per-block scales). The
    FC part is the run of linear layers at the end of the model."""
    from hybridpar.planning.cost.collectives import all_gather

    tail = len(layers)
    while tail > 0 and layers[tail - 1].kind == "linear":
        tail -= 1
    fc_layers = layers[tail:]
    if not fc_layers or tail == 0:
        raise ConfigError(
            "Dettmers' model needs convolutional layers followed by fully-connected ones"
        )
    rate = cluster.flops

    def ms(flops: float) -> float:
        return flops / rate * 1e3

    def sync(elements: float, bits: int) -> float:
        n = elements * (4 if bits == 32 else 1 + 4 / 4096)
        return all_gather(n, gpus, cluster).seconds * 1e3

    total = math.fsum(3 * ms(x.flops * sub_batch) + ms(3 * x.params) for x in layers)
    fc = tuple(
        FCLayer(
            x.name,
            ms(x.flops * sub_batch),
            2 * ms(x.flops * sub_batch),
            ms(3 * x.params),
            ms(x.flops * sub_batch) / gpus,
            2 * ms(x.flops * sub_batch) / gpus,
            ms(3 * x.params) / gpus,
            sync(sub_batch * x.d_out, 32),
            sync(sub_batch * x.d_out, 8),
        )
        for x in fc_layers
    )
    act = fc_layers[0].d_in * sub_batch
    return NodeProfile(
        gpus,
        total,
        sync(act, 32),
        sync(act, 8),
        fc,
        source=f"our FLOPs and alpha-beta model, cluster {cluster.name}",
    )
