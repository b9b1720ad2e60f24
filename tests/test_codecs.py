"""Codecs (Dettmers' four 8-bit types and the 16-bit casts) and the compressed collectives."""

import math

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_ranks

from hybridpar.core.choices import EIGHT_BIT
from hybridpar.runtime.comm.codecs import CODECS, get_codec, magnitude_levels, reference_encode
from hybridpar.runtime.comm.collectives import Via, all_gather_uneven, compressed_all_reduce
from hybridpar.runtime.comm.ledger import Ledger, bus_bytes

BLOCKS = [None, 64]


def _data(n=5000, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * scale


@pytest.mark.parametrize("name", EIGHT_BIT)
@pytest.mark.parametrize("block", BLOCKS)
def test_fast_encoder_equals_reference(name, block):
    codec = get_codec(name, block)
    x = torch.cat([_data(3001), _data(999, 1e-4, 1), torch.zeros(7)])  # uneven tail, tiny values
    e = codec.encode(x)
    codes, scales = reference_encode(codec, x)
    assert torch.equal(e.payload, codes) and torch.equal(e.scales, scales)


@pytest.mark.parametrize("name", EIGHT_BIT)
def test_c_kernels_equal_reference_and_the_torch_path(name, monkeypatch):
    """The C kernels (hybridpar.runtime.comm.kernels) give the reference's bytes and the torch path's
    decoded values, blocks with NaN or inf included (handed to the torch path), in a reused
    buffer too."""
    from hybridpar.runtime.comm import codecs, kernels

    if not kernels.available():
        pytest.skip("no C compiler here: the codecs run on the torch path")
    codec = get_codec(name, 512)
    x = torch.cat([_data(5000), _data(1000, 1e-5, 1), torch.zeros(700), _data(333, 7.0, 2)])
    x[700], x[2100] = float("nan"), float("-inf")
    x[5:9] = torch.tensor([1e-9, -3e-12, 1e-40, 2e-7])  # below the packed table's first bucket
    e = codec.encode(x)
    codes, scales = reference_encode(codec, x)
    finite = torch.isfinite(scales).repeat_interleave(512)[: x.numel()]
    assert torch.equal(e.payload[finite], codes[finite])  # the reference's bytes
    assert torch.equal(e.scales.nan_to_num(0.5), scales.nan_to_num(0.5))  # NaN == NaN here
    d = codec.decode(e)
    again = codec.decode(codec.encode(x, out=e), out=torch.empty_like(x))
    assert torch.equal(d.nan_to_num(7.0), again.nan_to_num(7.0))
    monkeypatch.setattr(codecs, "_KERNEL_MIN", 1 << 40)  # the torch path
    torch_enc = codec.encode(x)
    assert torch.equal(e.payload, torch_enc.payload)  # non-finite blocks: the torch path's bytes
    torch_path = codec.decode(torch_enc)
    assert torch.equal(d.nan_to_num(7.0), torch_path.nan_to_num(7.0))
    assert not torch.isfinite(d[512:1024]).any() and not torch.isfinite(d[2048:2560]).any()
    # decode_add: the kernel's one pass equals acc + decode bit for bit, as does the torch path
    acc = _data(x.numel(), seed=9)
    fused = codec.decode_add(e, acc.clone())
    assert torch.equal(fused.nan_to_num(7.0), (acc + torch_path).nan_to_num(7.0))
    assert torch.equal(
        codec.decode_add(torch_enc, acc.clone()).nan_to_num(7.0), fused.nan_to_num(7.0)
    )


def test_compiled_path_equals_reference(monkeypatch):
    from hybridpar.runtime.comm import codecs

    monkeypatch.setattr(codecs, "_KERNEL_MIN", 1 << 40)  # not the C kernels: torch.compile
    """Large tensors go through torch.compile: same bytes as the eager reference."""
    codec = get_codec("dynamic-tree", 4096)
    x = _data(70_000) * torch.linspace(0.01, 3, 70_000)
    e = codec.encode(x)
    codes, scales = reference_encode(codec, x)
    assert torch.equal(e.payload, codes) and torch.equal(e.scales, scales)
    # the compiled decode equals a plain table lookup of the reference codes times their scales
    from hybridpar.runtime.comm.codecs import _tables

    table = _tables("dynamic-tree").decode
    plain = (table[codes[: 17 * 4096].long()].view(17, 4096) * scales[:17, None]).reshape(-1)
    assert torch.equal(codec.decode(e)[: plain.numel()], plain)


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("block", BLOCKS)
def test_zeros_exact_and_reencoding_is_stable(name, block):
    codec = get_codec(name, block)
    x = _data(2000, 0.3)
    x[::7] = 0.0
    x[3] = -0.0
    d = codec.decode(codec.encode(x))
    assert torch.all(d[::7] == 0)
    e1 = codec.to_bytes(codec.encode(d))
    e2 = codec.to_bytes(codec.encode(codec.decode(codec.encode(d))))
    assert torch.equal(e1, e2)
    assert codec.decode(codec.encode(torch.zeros(10))).abs().sum() == 0  # an all-zero block


@pytest.mark.parametrize("name", EIGHT_BIT)
def test_absmax_survives_and_levels_are_sane(name):
    levels = magnitude_levels(name)
    assert len(levels) == 128 and max(levels) == 1.0 and min(levels) == 0.0
    x = _data(1000)
    d = get_codec(name, None).roundtrip(x)
    i = int(x.abs().argmax())
    assert d[i] == x[i]  # the largest magnitude is represented exactly


@pytest.mark.parametrize("name", EIGHT_BIT)
def test_non_finite_values_poison_their_block(name):
    codec = get_codec(name, 8)
    x = _data(32)
    x[3], x[20] = float("nan"), float("inf")
    d = codec.decode(codec.encode(x))
    assert not torch.isfinite(d[:8]).any() and not torch.isfinite(d[16:24]).any()
    torch.testing.assert_close(d[8:16], codec.roundtrip(x[8:16]))  # other blocks untouched


@pytest.mark.parametrize("block", [None, 4096])
def test_table_2_ordering_on_normal_data(block):
    """Dettmers Table 2, first row: dynamic tree 1.39 % < linear 2.16 % < static tree 4.82 % <
    mantissa 7.22 %. Per block (ours) the same order. Per tensor (the paper's setting) dynamic
    tree is best and mantissa worst, and the trees are within 0.5 points of the paper's numbers
    (about 1.6 and 4.6 %), while our linear type (127 steps of |x| / absmax) comes out at about
    4.8 %, far above the paper's 2.16 %, between the two trees (docs/fidelity.md)."""
    for scale in (1.0, 0.01):
        x = _data(200_000, scale, 3)
        err = {}
        for name in EIGHT_BIT:
            d = get_codec(name, block).roundtrip(x)
            nz = x != 0
            err[name] = float(((d - x).abs()[nz] / x.abs()[nz]).mean())
        order = sorted(err, key=err.get)
        if block is not None:
            assert order == ["dynamic-tree", "linear", "static-tree", "mantissa"], (scale, err)
        else:
            assert order == ["dynamic-tree", "static-tree", "linear", "mantissa"], (scale, err)
            assert abs(err["dynamic-tree"] * 100 - 1.39) < 0.5, err
            assert abs(err["static-tree"] * 100 - 4.82) < 0.5, err


def test_section_3_1_worked_examples():
    """Section 3.1's examples, to the paper's printed digits, from Dettmers' own level table
    (split at 0.45, step midpoints): dynamic tree 0.2345678 -> 0.236719 and 0.0000234 ->
    0.000019, mantissa 0.2345678 -> 0.2. The static tree with the same split and all 4 tree bits
    gives 0.253125, not the paper's 0.23125 (which needs 2 tree bits per half: a reading that
    leaves 8.7 % error on normal data against the paper's 4.82 %; docs/fidelity.md)."""
    from hybridpar.commands.papers.codec_report import PAPER_EXAMPLES

    def approx(name, v):
        return float(get_codec(name, None).roundtrip(torch.tensor([v, 1.0]))[0])

    printed = {(v, name): paper for v, name, paper in PAPER_EXAMPLES}
    for (v, name), paper in printed.items():
        digits = len(f"{paper:.10f}".rstrip("0").split(".")[1])  # the decimals the paper prints
        ours = round(approx(name, v), digits)
        if name == "static-tree":
            assert approx(name, v) == pytest.approx(0.253125, rel=1e-6) and paper == 0.23125
        else:
            assert ours == paper, (v, name, ours, paper)
    # the table's exact values behind the printed digits
    assert approx("dynamic-tree", 0.2345678) == pytest.approx(0.1 + 12.5 * 0.35 / 32, rel=1e-6)
    assert approx("dynamic-tree", 0.0000234) == pytest.approx(1e-5 + 0.5 * 0.35e-4 / 2, rel=1e-6)
    assert approx("mantissa", 0.0000234) == pytest.approx(2e-5, rel=1e-6)  # M=2, E=4


def test_the_dynamic_tree_is_dettmers_table():
    """The 126 levels of clusterNet's source/8bit_floats.hdf5 (Dettmers' implementation), read
    there and compared here through a few of its float32 values: the first two, the e = 3 decade's
    2.3125e-4, the e = 0 decade's first and last, plus 0 and 1.0."""
    levels = magnitude_levels("dynamic-tree")
    assert len(set(levels)) == 128 and levels[0] == 0.0 and levels[-1] == 1.0
    f32 = torch.tensor(levels[1:-1], dtype=torch.float32)
    for i, v in [
        (0, 2.75e-06),
        (1, 7.2499997e-06),
        (7, 2.3125e-04),
        (62, 0.10546875),
        (125, 0.99140614),
    ]:
        # his file holds float32 sums (0.99140614 where the exact midpoint is 0.99140625)
        assert float(f32[i]) == pytest.approx(v, rel=2e-7), (i, float(f32[i]), v)


def test_mantissa_is_an_integer_mantissa():
    levels = magnitude_levels("mantissa")
    for m, v in enumerate(levels):
        M, E = m & 15, m >> 4
        assert v == min(M * 10.0 ** -(E + 1), 1.0)


def test_wire_bytes_and_byte_buffers():
    c = get_codec("dynamic-tree", 64)
    x = _data(200)
    e = c.encode(x)
    assert c.wire_bytes(200) == 200 + 4 * 4 == e.nbytes()
    back = c.decode(c.from_bytes(c.to_bytes(e), 200))
    assert torch.equal(back, c.decode(e))
    h = get_codec("bf16")
    assert h.wire_bytes(200) == 400
    assert torch.equal(h.decode(h.from_bytes(h.to_bytes(h.encode(x)), 200)), h.roundtrip(x))


def _allreduce(name, block, n, ef, dtype=torch.float32):
    P, rank = dist.get_world_size(), dist.get_rank()
    codec = get_codec(name, block)
    xs = [_data(n, 1.0, seed=s).to(dtype).float() for s in range(P)]
    ledger = Ledger()
    t = xs[rank].to(dtype, copy=True)
    residuals = {} if ef else None
    via = Via(dist.group.WORLD, ledger, "dw_allreduce", {"w": n}, codec)
    compressed_all_reduce(t, via, residuals, key=0)
    exact = sum(xs)
    same = [torch.empty_like(t) for _ in range(P)]
    dist.all_gather(same, t)
    identical = all(torch.equal(same[0], s) for s in same)
    rel = float((t.float() - exact).norm() / exact.norm())
    payload = ledger.bytes_by_term().get("dw_allreduce", 0.0)
    overhead = ledger.bytes_by_term().get("codec_overhead", 0.0)
    # error feedback: the residual of a second identical call corrects the first's error
    ef_rel = None
    if ef:
        t2 = xs[rank].clone()
        compressed_all_reduce(t2, Via(dist.group.WORLD, codec=codec), residuals, 0)
        ef_rel = float(((t + t2) - 2 * exact).norm() / (2 * exact).norm())
    return identical, rel, payload, overhead, ef_rel


@pytest.mark.parametrize(
    ("P", "name", "dtype"),
    [
        (2, "dynamic-tree", torch.float32),
        (3, "fp16", torch.float32),
        (4, "dynamic-tree", torch.bfloat16),
    ],
)
def test_compressed_all_reduce_is_close_identical_and_booked(P, name, dtype):
    """bf16 gradients are encoded from float32 and the sums written back as bf16."""
    n = 1001  # does not split evenly
    got = run_ranks(_allreduce, P, name, 64, n, False, dtype)
    for identical, rel, payload, overhead, _ in got:
        assert identical  # every rank holds the same sum
        assert rel < (0.03 if name != "fp16" else 1e-3), rel
        elem = 1 if name != "fp16" else 2
        assert payload == pytest.approx(2 * bus_bytes("all_gather", n * elem, P))
        assert 0 < overhead < 0.2 * payload  # scales (8-bit) and the padding of uneven chunks


def test_error_feedback_reduces_the_accumulated_error():
    for _, rel, _, _, ef_rel in run_ranks(_allreduce, 2, "linear", None, 3000, True):
        assert ef_rel < rel  # two steps with feedback: the second adds back what the first lost


def _gather(name):
    P, rank = dist.get_world_size(), dist.get_rank()
    codec = get_codec(name, 16)
    sizes = [3, 2, 3, 1][:P]
    pieces = [_data(sizes[i] * 5, seed=i).view(sizes[i], 5) for i in range(P)]
    out = all_gather_uneven(pieces[rank], sizes, 0, Via(dist.group.WORLD, codec=codec))
    want = torch.cat([codec.roundtrip(p.reshape(-1)).view_as(p) for p in pieces])
    return torch.equal(out, want)


@pytest.mark.parametrize("P", [2, 4])
def test_compressed_all_gather_gives_every_rank_the_decoded_pieces(P):
    assert all(run_ranks(_gather, P, "dynamic-tree"))


def test_bytes_ratio_formula_at_p4():
    """8-bit compressed all-reduce vs float32 ring all-reduce: 2(P-1)/P vs 8(P-1)/P bytes/elem."""
    n = 1 << 20
    c = get_codec("dynamic-tree", 4096)
    ours = 2 * bus_bytes("all_gather", n, 4) + 2 * 3 / 4 * 4 * c.blocks(n // 4) * 4
    fp32 = bus_bytes("all_reduce", 4 * n, 4)
    assert ours / fp32 < 0.27
    assert math.isclose(2 * bus_bytes("all_gather", n, 4) / fp32, 0.25)


def test_table_2_mnist_mlp_activations_dynamic_tree_best_per_layer():
    """Table 2's model-parallel rows: on the paper's 784-1024-1024-10 RMSProp network (digits
    upsampled to 28x28, 60 steps, as `hybridpar codecs` prints it) dynamic tree has the lowest
    relative error on every layer's activations, one scale per tensor as in the paper."""
    from hybridpar.commands.papers.codec_report import error_table, mlp_tensors

    acts = {k: v for k, v in mlp_tensors(60).items() if k.startswith("mlp acts")}
    rows = error_table(acts, (None,))
    for layer in acts:
        errs = {r["codec"]: r["tensor"]["mean_rel_pct"] for r in rows if r["data"] == layer}
        assert min(errs, key=errs.get) == "dynamic-tree", (layer, errs)


class _FakeBucket:
    def __init__(self, t, index=3, last=True):
        self.t, self._index, self._last = t, index, last

    def buffer(self):
        return self.t

    def index(self):
        return self._index

    def is_last(self):
        return self._last


def _threaded_hook(P_split):
    """compressed_hook on a CommWorker and its own group, three buckets (3001, 1500 and 700
    elements) in one step, with the main thread issuing its own collectives on WORLD meanwhile (as
    global BN does during backward); the step twice, for error feedback. The middle bucket belongs
    to another reducer state on the same worker (as two grids' batch groups do), so two pipelines
    share the thread while their collectives are in flight."""
    from hybridpar.runtime.comm.grid import new_group
    from hybridpar.runtime.comm.hooks import ReducerState, compressed_hook, piece_key
    from hybridpar.runtime.comm.worker import CommWorker

    P, rank = dist.get_world_size(), dist.get_rank()
    twin = new_group(list(range(P)), None, "test_grads", tag="grads")
    codec = get_codec("dynamic-tree", 64)
    xs = {3: _data(3001, seed=rank), 4: _data(1500, seed=10 + rank), 5: _data(700, seed=20 + rank)}
    ledger = Ledger()
    worker = CommWorker()
    # buckets 3 and 5 are one state's (5 its last), 4 another's: 4 is pushed while 3's last
    # pieces are still in flight
    a, b = (
        ReducerState(
            group=twin, average=True, ledger=ledger, codec=codec, worker=worker,
            split_elements=P_split, error_feedback=True, bucket_layers={i: {"w": 1} for i in xs},
        )
        for _ in range(2)
    )  # fmt: skip
    states, last = {3: a, 4: b, 5: a}, {3: False, 4: True, 5: True}
    calls = [0]
    real = dist.all_to_all_single

    def counted(*args, **kw):
        calls[0] += 1
        return real(*args, **kw)

    dist.all_to_all_single = counted
    results = []
    for _ in range(2):
        futs = [
            compressed_hook(states[i], _FakeBucket(x.clone(), i, last[i])) for i, x in xs.items()
        ]
        side = [torch.full((4,), float(rank)) for _ in range(5)]
        for t in side:
            dist.all_reduce(t)  # the main thread's collectives, on another group
        results.append([f.wait() for f in futs])
    worker.close()
    dist.all_to_all_single = real
    # the same pieces reduced one after another, synchronously: 2 collectives each
    refs, residuals = [], {}
    for _ in range(2):
        step = []
        for i, x in xs.items():
            ref = x.clone()
            for k, lo in enumerate(range(0, x.numel(), P_split)):
                via = Via(twin, term="dw_allreduce", codec=codec)
                compressed_all_reduce(ref[lo : lo + P_split], via, residuals, piece_key(i, k))
            step.append(ref / P)
        refs.append(step)
    got = torch.cat([t for step in results for t in step])
    same = [torch.empty_like(got) for _ in range(P)]
    dist.all_gather(same, got)
    pieces = sum(-(-x.numel() // P_split) for x in xs.values())
    return (
        torch.equal(got, torch.cat([t for step in refs for t in step])),
        all(torch.equal(same[0], s) for s in same),
        all(float(t[0]) == sum(range(P)) for t in side),
        sorted([*a.residuals, *b.residuals]) == sorted(residuals),
        ledger.bytes_by_term().get("dw_allreduce", 0.0),
        (calls[0], 2 * 2 * pieces),  # two all-to-alls a piece
    )


@pytest.mark.parametrize("P", [2, 3])
def test_compressed_hook_on_its_thread_splits_and_overlaps_safely(P):
    for equal, identical, side_ok, keys, booked, calls in run_ranks(_threaded_hook, P, 1000):
        assert equal and identical and side_ok and keys and booked > 0
        assert calls[0] == calls[1], calls
