"""The host reducer (Sekiyama et al.): equivalence with the process-group all-reduce, the
hierarchical path on two emulated hosts, a missing rank ends the wait with its name, and nothing
is left in /dev/shm."""

import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_ranks
from nets import assert_same_state, batches, make, optimizer, preset, train_reference

from hybridpar.runtime.comm.grid import new_group
from hybridpar.runtime.comm.host import HostReducer
from hybridpar.runtime.options import RuntimeOptions
from hybridpar.runtime.parallel import HybridTrainer

TWO_SECONDS = datetime.timedelta(seconds=2)


def _ours():
    return {f for f in os.listdir("/dev/shm") if f.startswith("hybridpar-")}


def _sum(n, hosts, stage_bytes):
    """Three ways in: a tensor copied in and out, one written into its slot first (zero-copy),
    and a staged all-reduce fed in uneven pieces (`start`, as the gradient synchroniser packs)."""
    rank = dist.get_rank()
    host = None if hosts == 1 else f"host{rank * hosts // dist.get_world_size()}"
    r = HostReducer(host=host, stage_bytes=stage_bytes)
    out, same = [], []
    for step in range(3):  # several steps: both parities of the double buffer
        for key, size in ((0, n), (1, n // 3 + 1)):
            for how in ("copy", "slot", "start"):
                gen = torch.Generator().manual_seed(rank * 10 + step)
                x = torch.randn(size, generator=gen)
                ref = x.clone()
                dist.all_reduce(ref)
                if how == "copy":
                    got = r.all_reduce(x, key=(key, how))
                elif how == "slot":
                    slot = r.slot((key, how), size)
                    slot.copy_(x)
                    got = r.all_reduce(slot, key=(key, how))
                else:
                    run = r.start((key, how), size)
                    lo = 0
                    for hi in (size // 7, size // 7 + 1, size // 2, size):
                        run.buffer[lo:hi].copy_(x[lo:hi])
                        run.deliver(hi)
                        lo = hi
                    got = run.future.wait()
                out.append(torch.allclose(got, ref, rtol=1e-5, atol=1e-5))
                every = [torch.empty_like(got) for _ in range(dist.get_world_size())]
                dist.all_gather(every, got.clone())
                same.append(all(torch.equal(every[0], e) for e in every))
    topo = (r.topo.local_size, r.topo.hosts, r.topo.leader)
    stages = {k: seg.stages for k, seg in r.segments.items()}
    got = slot = run = None  # views of the segments go before they are unmapped
    r.close()
    return all(out), all(same), topo, stages


@pytest.mark.parametrize("P,hosts", [(2, 1), (3, 1), (4, 1), (4, 2)])
@pytest.mark.parametrize("stage_bytes", [0, 400])
def test_host_sum_equals_all_reduce(P, hosts, stage_bytes):
    """Same sums as gloo, the same bits on every rank, in one stage and in many (1001 floats in
    stages of 100; 334 in stages of 100 and a short one)."""
    for i, (ok, same, topo, stages) in enumerate(run_ranks(_sum, P, 1001, hosts, stage_bytes)):
        local, nhosts, leader = topo
        assert ok and same
        assert (local, nhosts) == (P // hosts, hosts)
        assert leader == (i % (P // hosts) == 0)
        assert stages[(0, "start")] == (11 if stage_bytes else 1)
        assert stages[(1, "copy")] == (4 if stage_bytes else 1)
    assert not _ours()


def _early(n):
    """Half of a staged all-reduce delivered: its first stages must be summed by every rank
    before the rest is written."""
    from hybridpar.runtime.comm.host import _FLAGS, DONE

    rank = dist.get_rank()
    r = HostReducer(stage_bytes=400)
    x = torch.full((n,), float(rank + 1))
    run = r.start("k", n)
    run.buffer[: n // 2].copy_(x[: n // 2])
    run.deliver(n // 2)
    seg = r.segments["k"]
    done = seg.flags[1, :, DONE::_FLAGS]  # step 1: parity 1; one column per stage
    deadline = time.monotonic() + 30
    while not (done[:, 0] == 1).all() and time.monotonic() < deadline:
        time.sleep(1e-3)
    early = bool((done[:, 0] == 1).all())
    late = bool((done[:, -1] == 0).all())  # the last stage: nobody has delivered it
    dist.barrier()  # every rank has looked before anyone delivers the rest
    run.buffer[n // 2 :].copy_(x[n // 2 :])
    run.deliver(n)
    got = run.future.wait()
    P = dist.get_world_size()
    ok = torch.equal(got, torch.full((n,), float(P * (P + 1) // 2)))
    got = run = done = seg = None
    r.close()
    return early, late, ok


@pytest.mark.parametrize("P", [2, 3])
def test_a_staged_all_reduce_sums_what_has_arrived(P):
    for early, late, ok in run_ranks(_early, P, 1000):
        assert early and late and ok
    assert not _ours()


def _train(kind, hosts, stage_mb, codec="none"):
    rank, P = dist.get_rank(), dist.get_world_size()
    if hosts > 1:
        os.environ["HYBRIDPAR_HOST"] = f"host{rank * hosts // P}"
    extra = {"codec": codec, "compress": ("grads",)} if codec != "none" else {}
    plan = preset("tv-alexnet", kind, P, reducer="host", bn="local", **extra)
    options = RuntimeOptions(host_stage_mb=float(stage_mb), bucket_mb=0.0005)
    t = HybridTrainer(make("tv-alexnet"), plan, optimizer, options=options)
    data = batches()
    for x, y in data:
        t.train_step(x, y)
    if codec == "none":  # lossy across hosts otherwise: the bytes below are the check
        assert_same_state(t.full_state_dict(), train_reference(make("tv-alexnet"), batches()), kind)
    if plan.engine == "hybridpar":  # bytes = prediction: only the leaders' sums cross hosts
        from hybridpar.runtime.comm.host import host_name
        from hybridpar.runtime.train.report import measured, predicted

        names: list = [None] * P
        dist.all_gather_object(names, host_name())
        got = measured(t.ledger, set(range(len(data))))["by_layer"]
        want = predicted(plan, names)[1]
        got = {k: v for k, v in got.items() if k[1] != "codec_overhead"}
        for key in {k for k in {*got, *want} if k[1] == "dw_allreduce"}:
            assert got.get(key, 0.0) == pytest.approx(want.get(key, 0.0), rel=1e-9), (kind, key)
        if hosts > 1 and any(s.pc > 1 for s in plan.styles.values()):
            assert sum(v for k, v in got.items() if k[1] == "dw_allreduce") > 0, kind
    return True


@pytest.mark.parametrize(
    "P,kind,hosts,stage_mb",
    [
        (2, "batch", 1, "0.0001"),  # stages of 26 floats: buckets and parameters in pieces
        (3, "batch", 1, "0.0001"),
        (4, "batch", 1, "0"),  # one stage per bucket
        (4, "batch", 2, "0.0001"),
        (2, "ddp", 1, "0.0001"),  # DDP's hook: copied in, summed as one stage
        # Pr > 1 (a reducer per batch group of the grid, each with its leaders' group) across
        # two hosts, even and uneven: tests/test_composed.py, with bytes = prediction there too
    ],
)
def test_training_with_the_host_reducer_equals_single_process(P, kind, hosts, stage_mb):
    """Same parameters after 5 steps as single-process SGD (and so as the process-group
    all-reduce, which the runtime's equivalence tests hold to the same oracle)."""
    run_ranks(_train, P, kind, hosts, stage_mb)  # each rank asserts its own state
    assert not _ours()


@pytest.mark.parametrize("P,kind", [(4, "grid:2x2")])
def test_the_host_reducer_sends_8_bit_gradients_across_hosts(P, kind):
    """Sums in float32 through shared memory within a host, and the leaders' sum across hosts
    encoded (dynamic tree): it trains, and the bytes that cross hosts are the predicted
    payload per layer (the codec's scales booked apart)."""
    run_ranks(_train, P, kind, 2, "0", "dynamic-tree")  # each rank asserts its own state
    assert not _ours()


def _missing():
    r = HostReducer(new_group([0, 1], TWO_SECONDS, "test_missing"))
    r.all_reduce(torch.ones(10))  # the segment is made collectively, at first use
    msg = ""
    if dist.get_rank() == 0:
        try:
            r.all_reduce(torch.ones(10))
        except RuntimeError as exc:
            msg = str(exc)
    dist.barrier()  # rank 1 never delivers; it waits here for rank 0 to give up
    r.close()
    return msg


def test_a_missing_rank_ends_the_wait_with_its_name():
    msg = run_ranks(_missing, 2)[0]
    assert "rank(s) [1] did not deliver bucket 0 within 2 s" in msg, msg
    assert not _ours()


def _small(sizes):
    """Shared-memory all-reduces (comm.small) against gloo: same sums, the same bits on every
    rank, both parities, float64 and float32, a tensor over the first segment's capacity (which
    grows), a non-contiguous one, and one over MAX_BYTES back on gloo."""
    from hybridpar.runtime.comm import small
    from hybridpar.runtime.comm.collectives import Via, all_reduce
    from hybridpar.runtime.comm.ledger import Ledger

    rank, P = dist.get_rank(), dist.get_world_size()
    small.MAX_BYTES = 1 << 18  # so that the last tensor stays on gloo
    group = new_group(list(range(P)), None, "test_small", tag="small-test", shm=True)
    r = group.shm
    ledger, ok, same = Ledger(), [], []
    for step, (n, dtype) in enumerate(sizes):
        x = torch.randn(n, generator=torch.Generator().manual_seed(rank * 7 + step)).to(dtype)
        if n % 2 == 0:  # a non-contiguous view: summed in place all the same
            x = torch.stack([x, x]).t()[:, 0]
        ref = x.clone()
        dist.all_reduce(ref)
        all_reduce(x, Via(group, ledger, "bn_stats", {"bn": n}))
        # another order of the same sums than gloo's: float32 rounding apart
        tol = 1e-12 if dtype == torch.float64 else 1e-6
        ok.append(torch.allclose(x, ref, rtol=tol, atol=tol))
        gathered = [torch.empty_like(x) for _ in range(P)]
        dist.all_gather(gathered, x)
        same.append(all(torch.equal(gathered[0], g) for g in gathered))
    booked = ledger.bytes_by_term()["bn_stats"]
    return all(ok), all(same), r.calls, booked, [e.seconds for e in ledger.entries]


@pytest.mark.parametrize("P", [2, 3, 4])
def test_small_all_reduce_through_shared_memory(P):
    sizes = [(33, torch.float64), (7, torch.float32), (1, torch.float64), (65, torch.float64)]
    sizes += [(20000, torch.float32), (3, torch.float32)]  # 80 KB: the segment grows
    sizes += [(70000, torch.float32)]  # 280 KB: over MAX_BYTES (set to 256 KB), gloo
    for ok, same, calls, booked, seconds in run_ranks(_small, P, sizes):
        assert ok and same
        assert calls == 6  # all but the last went through shared memory
        # each call's time is booked, whichever path ran: the report's time split counts the
        # shared-memory sums (dX, batch norms) as communication, not as compute
        assert len(seconds) == len(sizes) and all(s > 0 for s in seconds), seconds
        # the ledger books what an all-reduce would, whichever path ran
        from hybridpar.runtime.comm.ledger import bus_bytes

        expect = sum(
            bus_bytes("all_reduce", n * (8 if d == torch.float64 else 4), P) for n, d in sizes
        )
        assert booked == pytest.approx(expect)
    assert not _ours()


def _shm_all_gather():
    """all_gather_uneven through shared memory against the concatenation every rank can build
    itself: along dim 0 and dim 1, uneven pieces with an empty one, float32 and float64, a
    non-contiguous input, pieces that outgrow the first segment; then the same calls on gloo."""
    from hybridpar.runtime.comm.collectives import Via, all_gather_uneven
    from hybridpar.runtime.comm.ledger import Ledger

    rank, P = dist.get_rank(), dist.get_world_size()
    cases = [  # (sizes, dim, other dims, dtype)
        ([2] * P, 0, (3, 5), torch.float32),
        ([0, *range(3, 3 + P - 1)], 1, (4, 6), torch.float64),
        ([100 + 30 * i for i in range(P)], 0, (64, 3), torch.float32),  # up to 300 KB a piece
        ([1] * P, 0, (7,), torch.float32),
    ]

    def piece(case: int, i: int) -> torch.Tensor:
        sizes, dim, other, dtype = cases[case]
        shape = list(other)
        shape.insert(dim, sizes[i])
        g = torch.Generator().manual_seed(100 * case + i)
        return torch.randn(shape, generator=g).to(dtype)

    def run(group) -> tuple[bool, float]:
        ledger, ok = Ledger(), []
        for k, (sizes, dim, _, _) in enumerate(cases):
            mine = piece(k, rank)
            if k == 1:
                mine = mine.transpose(0, 1).contiguous().transpose(0, 1)  # not contiguous
            got = all_gather_uneven(mine, sizes, dim, Via(group, ledger, "allgather", "fc"))
            want = torch.cat([piece(k, i) for i in range(P)], dim=dim)
            ok.append(torch.equal(got, want))
        return all(ok), ledger.bytes_by_term()["allgather"]

    shm = new_group(list(range(P)), None, "test_gather", tag="gather-test", shm=True)
    r = shm.shm
    ok_shm, booked_shm = run(shm)
    ok_gloo, booked_gloo = run(new_group(list(range(P)), None, "t", tag="gloo-test"))
    return ok_shm, ok_gloo, r.calls, booked_shm == booked_gloo, r.capacity


@pytest.mark.parametrize("P", [2, 3, 4])
def test_all_gather_through_shared_memory(P):
    for ok_shm, ok_gloo, calls, same_booking, capacity in run_ranks(_shm_all_gather, P):
        assert ok_shm and ok_gloo and same_booking
        assert calls == 4  # every case through shared memory
        assert capacity >= (100 + 30 * (P - 1)) * 64 * 3 * 4  # grown to the largest piece
    assert not _ours()


def _small_missing():
    from hybridpar.runtime.comm.collectives import Via, all_reduce

    group = new_group([0, 1], TWO_SECONDS, "test_small_missing", shm=True)
    if dist.get_rank() == 1:
        return "skipped"  # rank 1 never joins the all-reduce
    try:
        all_reduce(torch.ones(3), Via(group))
    except RuntimeError as exc:
        return str(exc)
    return "returned"


def test_small_all_reduce_names_the_missing_rank():
    out = run_ranks(_small_missing, 2)
    assert "rank(s) [1] did not join an all-reduce" in out[0] and out[1] == "skipped"
