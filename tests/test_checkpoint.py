"""Checkpoints (torch.distributed.checkpoint): kill-and-resume on the same grid is bit-exact; a
checkpoint of a 2x2 plan on 4 ranks resumes on a 3x1 plan on 3 ranks and ends where the
uninterrupted run ends (rtol 1e-5); the final weights load into the plain model with torch.load."""

import contextlib
import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from procs import TRAIN

from hybridpar.core.models import build_model

CMD = [*TRAIN, *["--model", "digits-cnn", "--batch", "48", "--max-steps", "5", "--lr", "0.05"]]


def train(*args, env=None, check=True):
    r = subprocess.run(
        CMD + list(args),
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, **(env or {})},
    )
    if check:
        assert r.returncode == 0, r.stderr
    return r


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """10 steps (2 epochs of 5) on a 2x2 grid, 4 ranks, without a stop."""
    out = tmp_path_factory.mktemp("whole") / "final.pt"
    train("--nproc", "4", "--preset", "grid:2x2", "--epochs", "2", "--save", str(out))
    return torch.load(out)


def test_kill_and_resume_on_the_same_grid_is_bit_exact(tmp_path, uninterrupted):
    ck = tmp_path / "ck"
    args = (
        f"--nproc 4 --preset grid:2x2 --epochs 2 --checkpoint-dir {ck} --checkpoint-every 3".split()
    )
    killed = train(*args, env={"HYBRIDPAR_FAULT": "optimizer:rank=2:step=7"}, check=False)
    assert killed.returncode == 1 and "rank 2 was killed by SIGKILL" in killed.stderr, killed.stderr
    assert (ck / "latest").read_text() == "step-00000006"  # the checkpoint before the kill
    train(*args, "--resume", "auto")
    got = torch.load(ck / "final.pt")
    assert list(got) == list(uninterrupted)
    for k, v in uninterrupted.items():
        assert torch.equal(got[k], v), k
    # an elastic restart after the last step: it says so (it printed "iteration 0.0 ms" and 0
    # bytes against the prediction on 5135867)
    again = train(*args, "--resume", "auto").stdout
    assert "nothing left to train" in again and "iteration 0.0" not in again, again


def test_resume_onto_another_grid_and_p(tmp_path, uninterrupted):
    """2x2 on 4 ranks for 5 steps, then 3x1 on 3 ranks for 5 more: DCP re-splits the split
    layers' shards (halves of the model group of 2 become thirds of the model group of 3)."""
    ck = tmp_path / "ck"
    train(*f"--nproc 4 --preset grid:2x2 --epochs 1 --checkpoint-dir {ck}".split())
    more = f"--nproc 3 --preset grid:3x1 --epochs 2 --checkpoint-dir {ck} --resume auto"
    train(*more.split(), "--report", str(tmp_path / "r.json"))
    log = [json.loads(x) for x in (tmp_path / "r.jsonl").read_text().splitlines()]
    # epoch 1 was the first run's; the plan is checked again on resuming
    assert [e["event"] for e in log] == ["plan", "check", "resume", "epoch"]
    report = json.loads((tmp_path / "r.json").read_text())
    assert log[2]["step"] == 5 and report["procs"] == 3 and len(report["epochs"]) == 2
    got = torch.load(ck / "final.pt")
    for k, v in uninterrupted.items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=k)
    model = build_model("digits-cnn")  # the final weights are the plain model's
    model.load_state_dict(got)


def test_a_checkpoint_dir_is_continued_only_on_purpose(tmp_path):
    """Checked before spawning, from the checkpoint's metadata: a folder with checkpoints is only
    written into with --resume auto, and a resume needs the same model, data, batch and seed."""
    from hybridpar.core.errors import ConfigError
    from hybridpar.runtime.train.config import TrainConfig
    from hybridpar.runtime.train.run import prepare

    ck = tmp_path / "ck"
    (ck / "step-00000002").mkdir(parents=True)
    config = {"model": "digits-cnn", "data": "digits", "batch": 48, "seed": 0}
    meta = {
        "format": "hybridpar-checkpoint/1",
        "config": config,
        "plan": {"input_shape": [1, 8, 8]},
    }
    (ck / "step-00000002" / "hybridpar.json").write_text(json.dumps(meta))
    (ck / "latest").write_text("step-00000002")
    base = TrainConfig(model="digits-cnn", nproc=2, preset="owt", batch=48, checkpoint_dir=str(ck))
    with pytest.raises(ConfigError, match="already holds checkpoints"):
        prepare(base)
    assert prepare(base.with_(resume="auto")).resume == ck / "step-00000002"
    with pytest.raises(ConfigError, match="is for batch 48, this run has 32"):
        prepare(base.with_(resume="auto", batch=32))


def test_an_elastic_restart_onto_fewer_ranks_goes_on(tmp_path):
    """Two torchrun agents on a c10d rendezvous (--nnodes 1:2): 2 ranks and 1, B = 50 in groups
    of 17, 17 and 16. At step 7 the second agent's node is lost (its rank kills the agent, then
    itself); the first agent's ranks time out on the dead rank (--timeout 2), torchrun restarts
    them (--max-restarts 1; TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, docs/checkpoints.md), the
    rendezvous closes without the lost node, and the 2 ranks go on from the checkpoint of step 6
    (--resume auto) to the weights a 2-rank run resumed from that checkpoint reaches, bit for
    bit. (It replaces the restart of a killed rank onto the same 2 ranks: the same restart and
    resume, on fewer ranks; a resume on the same grid is bit-exact against the uninterrupted run
    above.)"""
    import socket

    ck, ref = tmp_path / "ck", tmp_path / "ref"
    steps = ["--preset", "ddp", "--batch", "50", "--max-steps", "9", "--epochs", "1"]
    steps += ["--checkpoint-every", "3"]
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    conf = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=2,join_timeout=60"
    agent = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--max-restarts",
             "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}",
             "--rdzv-id", "elastic", "--rdzv-conf"]  # fmt: skip
    # the first agent holds the rendezvous's store: it outlives the lost one
    args = [*CMD[3:], *steps, "--checkpoint-dir", str(ck), "--resume", "auto", "--timeout", "2"]
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}

    def start(rdzv: str, nproc: str, *more: str, **env_more: str) -> subprocess.Popen:
        return subprocess.Popen(  # in a process group of its own: nothing outlives the test
            [*agent, rdzv, "--nproc-per-node", nproc, "-m", "hybridpar", *args, *more],
            env={**env, **env_more}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True,
        )  # fmt: skip

    first = start(f"{conf},is_host=1", "2", "--report", str(tmp_path / "r.json"))
    lost = start(f"{conf},is_host=0", "1", HYBRIDPAR_FAULT="optimizer:rank=2:step=7:node=1")
    try:
        said = lost.communicate(timeout=120)[1]
        assert lost.returncode == -9, said[-2000:]  # SIGKILL: the node went away
        err = first.communicate(timeout=120)[1]
    finally:  # nothing left behind, whatever happened
        for p in (first, lost):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
    assert first.returncode == 0, err[-3000:]
    log = [json.loads(x) for x in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert {"event": "resume", "from": str(ck / "step-00000006"), "step": 6} in log
    assert [e["plan"]["procs"] for e in log if e["event"] == "plan"][-1] == 2
    # the reference: 2 ranks resumed from that checkpoint (the 3 ranks' sums ran through another
    # transport there: two agents are two shared-memory groups, so not bit for bit one host's)
    train("--nproc", "2", *steps, "--checkpoint-dir", str(ref), "--resume",
          str(ck / "step-00000006"))  # fmt: skip
    want, got = torch.load(ref / "final.pt"), torch.load(ck / "final.pt")
    for k, v in want.items():
        assert torch.equal(got[k], v), k
