"""Devices and precision. On CPU: bf16 autocast training through `parallelize` stays within a
stated tolerance of single-process bf16 training, and `--device` is checked before spawning.
With a GPU (skipped without one): the CUDA / NCCL paths against their CPU references."""

import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_ranks
from nets import MAKERS, B, batches, make, optimizer
from torch.nn import functional as F

from hybridpar.core.choices import Choices
from hybridpar.core.errors import ConfigError
from hybridpar.core.plan import ParallelPlan, Style
from hybridpar.runtime.parallel import parallelize

# bf16 keeps 8 bits of mantissa (a rounding is up to 2**-8 = 0.4 % relative): after 4 steps the
# split runs stay within this of one process running the same bf16 steps
BF16 = {"rtol": 2e-2, "atol": 2e-3}


def _bf16_steps(model, data, hp=None):
    opt = optimizer((hp or model).parameters())
    for x, y in data:
        n = len(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if hp is None:
                loss = F.cross_entropy(model(x), y)
            else:
                hp.set_batch(n)
                out = hp(x[hp.input_rows(n)])
                loss = F.cross_entropy(out, y[hp.output_rows(n)], reduction="sum") / n
        opt.zero_grad()
        loss.backward()
        if hp is not None:
            hp.finish_backward()
        opt.step()
    return hp.full_state_dict() if hp is not None else model.state_dict()


def _bf16(name, styles):
    P = dist.get_world_size()
    shape = MAKERS[name][1]
    data = batches(shape)
    want = _bf16_steps(make(name), data)
    styles = {k: Style.parse(v, P) for k, v in styles.items()}
    plan = ParallelPlan(P, B, styles, input_shape=shape, choices=Choices(amp="bf16"))
    got = _bf16_steps(make(name), data, parallelize(make(name), plan))
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, **BF16, msg=lambda m, k=k: f"{name} {k}: {m}")


@pytest.mark.parametrize(
    "P, name, styles",
    [
        (2, "tv-alexnet", {"features.3": "model(2x1)", "classifier.*": "model(2x1)"}),
        (4, "tv-alexnet", {"features.3": "model(2x2)", "classifier.*": "model(4x1)"}),
        (4, "digits-cnn", {"2": "model(4x1)", "6": "model(2x2)"}),
    ],
)
def test_bf16_autocast_training_stays_within_the_stated_tolerance(P, name, styles):
    run_ranks(_bf16, P, name, styles)


def test_cuda_is_refused_where_there_is_no_gpu_for_every_rank():
    from hybridpar.core.config import build
    from hybridpar.runtime.train.config import TrainConfig
    from hybridpar.runtime.train.run import prepare

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    grid = "grid:1x" + str(gpus + 1)
    with pytest.raises(ConfigError, match=f"{gpus + 1} local ranks but {gpus} GPUs"):
        prepare(build(TrainConfig, device="cuda", nproc=gpus + 1, preset=grid, batch=64))
    job = prepare(build(TrainConfig, nproc=2, preset="owt"))  # auto: cpu without a GPU per rank
    device = job.choices.device
    assert device == ("cuda" if gpus >= 2 else "cpu") and job.plan.choices.device == device


# --- with a GPU: skipped cleanly without one ------------------------------------------------

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device here (issue 15: run on a GPU machine)"
)


@needs_cuda
def test_training_on_one_gpu_equals_the_cpu():
    """P = 1 on cuda:0 (NCCL) against P = 1 on the CPU: the same plan, data and steps."""
    cmd = [
        sys.executable,
        "-m",
        "hybridpar",
        "train",
        "--quiet",
        "--model",
        "digits-cnn",
        "--nproc",
        "1",
        "--epochs",
        "1",
        "--max-steps",
        "4",
        "--batch",
        "48",
    ]
    gpu = subprocess.run(
        [*cmd, "--device", "cuda", "--save", "/tmp/hp-gpu.pt"], capture_output=True, text=True
    )
    cpu = subprocess.run(
        [*cmd, "--device", "cpu", "--save", "/tmp/hp-cpu.pt"], capture_output=True, text=True
    )
    assert gpu.returncode == 0 and cpu.returncode == 0, gpu.stderr + cpu.stderr
    a, b = torch.load("/tmp/hp-gpu.pt"), torch.load("/tmp/hp-cpu.pt")
    for k, v in b.items():
        torch.testing.assert_close(a[k], v, rtol=1e-4, atol=1e-5, msg=k)


@needs_cuda
@pytest.mark.parametrize("name", ["dynamic-tree", "linear", "mantissa", "static-tree"])
def test_codecs_on_cuda_are_byte_equal_to_the_cpu_reference(name):
    from hybridpar.runtime.comm.codecs import get_codec, reference_encode

    x = torch.randn(1 << 18, generator=torch.Generator().manual_seed(0))
    codec = get_codec(name, 4096)
    e = codec.encode(x.cuda())
    codes, scales = reference_encode(codec, x)
    assert torch.equal(e.payload.cpu(), codes) and torch.equal(e.scales.cpu(), scales)


def _bn_on_cuda():
    from hybridpar.runtime.parallel import GlobalBatchNorm2d

    torch.manual_seed(0)
    x = torch.randn(8, 3, 4, 4, device="cuda")
    rank = dist.get_rank()
    bn = GlobalBatchNorm2d(3, group=dist.group.WORLD).cuda()  # a plain process group works too
    mine = x[rank * 4 : rank * 4 + 4].clone().requires_grad_(True)
    bn(mine).square().sum().backward()
    ref = torch.nn.BatchNorm2d(3).cuda()
    whole = x.clone().requires_grad_(True)
    ref(whole).square().sum().backward()
    torch.testing.assert_close(mine.grad, whole.grad[rank * 4 : rank * 4 + 4], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(bn.running_mean, ref.running_mean)


@needs_cuda
def test_global_batchnorm_on_cuda_equals_batchnorm():
    """Two ranks share cuda:0 through gloo (NCCL wants one GPU per rank)."""
    run_ranks(_bn_on_cuda, 2)


def _host_on_cuda():
    from hybridpar.runtime.comm.host import HostReducer

    r = HostReducer()
    x = torch.full((1000,), float(dist.get_rank() + 1), device="cuda")
    r.all_reduce(x)
    r.close()
    return float(x[0])


@needs_cuda
def test_host_reducer_stages_cuda_tensors_through_pinned_memory():
    assert run_ranks(_host_on_cuda, 2) == [3.0, 3.0]


# --- which GPU, which backend, which calibration (issue 38): decided without a GPU -----------


@pytest.mark.parametrize(
    "gpus, device, backend, local, want",
    [
        (0, "auto", "auto", 4, ("cpu", "gloo")),
        (1, "auto", "auto", 4, ("cpu", "gloo")),  # auto: a GPU for every rank, or none
        (4, "auto", "auto", 4, ("cuda", "nccl")),
        (1, "cuda", "gloo", 4, ("cuda", "gloo")),  # a developer's one-GPU box: 4 ranks share it
        (1, "auto", "gloo", 4, ("cuda", "gloo")),
        (2, "cuda", "auto", 2, ("cuda", "nccl")),
        (1, "cuda", "auto", 2, "--backend gloo"),  # NCCL: one rank per GPU
        (0, "cuda", "gloo", 2, "no GPU here"),
        (4, "cpu", "nccl", 2, "--device cuda"),
    ],
)
def test_device_and_backend(monkeypatch, gpus, device, backend, local, want):
    from hybridpar.runtime.train.run import device_and_backend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    if isinstance(want, str):
        with pytest.raises(ConfigError, match=want):
            device_and_backend(device, backend, local)
    else:
        assert device_and_backend(device, backend, local) == want


def test_a_calibration_prices_only_the_device_it_measured(localhost, train_job):
    import json

    from hybridpar.core.cluster import for_device, load_cluster, localhost_path

    localhost(device="cpu")
    cpu = json.loads(localhost_path("cpu").read_text())
    with pytest.raises(ConfigError, match="calibrate --device cuda"):
        load_cluster("localhost", "cuda")  # one file per device: the GPU's is not there
    assert for_device(load_cluster("localhost", "cpu"), "cpu").device == "cpu"
    # a CPU calibration where the GPU's should be (copied, or written by an old version)
    localhost_path("cuda").write_text(json.dumps(cpu))
    with pytest.raises(ConfigError, match="calibrated on cpu, but this job runs on cuda"):
        for_device(load_cluster("localhost", "cuda"), "cuda")
    assert for_device(load_cluster("cori-knl"), "cuda").name == "cori-knl"  # described: any
    # what `hybridpar train --device cuda` prices a fixed preset on: not the CPU's calibration
    from hybridpar.core.cluster import BYTES_ONLY
    from hybridpar.runtime.train.plans import preset_plan, pricing_cluster

    localhost_path("cuda").unlink()
    job = train_job(preset="batch", device="cuda")
    assert pricing_cluster(job, False) is BYTES_ONLY
    plan = preset_plan(job, BYTES_ONLY)
    assert plan.totals == {}  # no seconds printed: "time not predicted"
    assert pricing_cluster(train_job(preset="batch"), False).device == "cpu"


def test_a_plan_priced_bytes_only_carries_no_seconds_and_a_wild_one_is_refused():
    from hybridpar.core.cluster import BYTES_ONLY, Cluster
    from hybridpar.planning.search import make_plan

    bytes_only = make_plan("digits-cnn", 4, 64, BYTES_ONLY)
    plan = bytes_only.export()
    assert plan.totals == {} and plan.predicted_bytes()  # the bytes stay exact
    fine = make_plan("digits-cnn", 4, 64, Cluster("ok", alpha=1e-5, beta=1e-9, flops=1e10))
    assert 1e-9 < fine.export().totals["total_s"] < 1.0
    broken = Cluster("broken", alpha=1e-5, beta=1e-9, flops=1e-6)  # a millionth of a FLOP/s
    with pytest.raises(ConfigError, match="not a plausible time"):
        make_plan("digits-cnn", 4, 64, broken).export()


def test_point_to_point_is_staged_where_gloo_carries_the_device(monkeypatch):
    from hybridpar.runtime.comm import p2p

    monkeypatch.setattr(dist, "get_backend", lambda pg=None: "cpu:gloo,cuda:nccl")
    assert p2p.carrier(None, torch.device("cuda")) == "nccl"
    assert p2p.carrier(None, torch.device("cpu")) == "gloo"
    monkeypatch.setattr(dist, "get_backend", lambda pg=None: "gloo")
    assert p2p.carrier(None, torch.device("cuda")) == "gloo"  # ranks sharing a GPU
