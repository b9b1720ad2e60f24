"""Dettmers' Appendix A speed-up model: the paper's predictions from the paper's tables."""

import json
import subprocess
import sys

import pytest

from hybridpar.commands.papers import dettmers as dm
from hybridpar.core.cluster import PRESETS
from hybridpar.core.errors import ConfigError
from hybridpar.planning.analysis_cache import zoo_cost_layers


@pytest.mark.parametrize("bits", [32, 8])
def test_four_gpu_predictions_within_2_percent(bits):
    """Table 1: 3.53x at 32 bits and 3.67x at 8 bits for 4 GPUs, sub-batch 128."""
    p = dm.node_speedup(dm.APPENDIX_A_4GPU, bits)
    assert p.conv == pytest.approx(104.1 - 6.5)  # the FC layers' 6.5 ms of Table 4 taken out
    assert p.fc == pytest.approx(4 * 3.34)  # 3.34 ms split, once per sub-batch
    assert p.speedup == pytest.approx(dm.PAPER_4GPU[bits], rel=0.02)


def test_eight_bit_pays_less_penalty_and_the_convnet2_check():
    p32, p8 = (dm.node_speedup(dm.APPENDIX_A_4GPU, b) for b in (32, 8))
    assert p8.penalty < p32.penalty and p8.speedup > p32.speedup
    # with Krizhevsky's (convnet2) kernels: the paper says within 1 % of his measured 3.66x;
    # our reading of the lost equation gives 3.71x, 1.3 % over (docs/fidelity.md)
    check = dm.node_speedup(dm.APPENDIX_A_4GPU, 32, total=dm.CONVNET2_TOTAL).speedup
    assert check == pytest.approx(3.66, rel=0.015)


# Table 7 cells where the paper's 2-3 printed digits leave more room than 0.32 %: 12288 with
# Dettmers' kernels, 32-bit (printed 1.3, marked "(?)"), and 8-bit (printed 9.7)
TABLE_7_WIDER = {(12288, 0): 0.017, (12288, 1): 0.006}


@pytest.mark.parametrize("sub_batch", sorted(dm.PAPER_96GPU))
def test_96_gpu_table_7_within_the_stated_tolerance(sub_batch):
    """docs/fidelity.md: every cell within 0.32 %, the two cells above within 1.7 and 0.6 %."""
    c = dm.APPENDIX_A_96GPU
    ours = [
        dm.cluster_speedup(c, total, sub_batch, bits)["speedup"]
        for total in (dm.APPENDIX_A_4GPU.total, dm.CONVNET2_TOTAL)
        for bits in (32, 8)
    ]
    for i, (o, paper) in enumerate(zip(ours, dm.PAPER_96GPU[sub_batch], strict=True)):
        rel = TABLE_7_WIDER.get((sub_batch, i), 0.0032)
        assert o == pytest.approx(paper, rel=rel), (sub_batch, i, o, paper)


def test_table_6_full_pass_and_total():
    """Table 6's derived columns from its single-pass syncs: full pass 24.8 ms and total 650 ms
    at sub-batch 128 (32-bit), 29.5 and 108 at 1024 (8-bit)."""
    c = dm.APPENDIX_A_96GPU
    r = dm.cluster_speedup(c, 104.1, 128, 32)
    assert r["sync_full"] == pytest.approx(24.8, abs=0.1)
    assert r["forward"] + r["sync_full"] == pytest.approx(650, abs=2)
    r = dm.cluster_speedup(c, 104.1, 1024, 8)
    assert r["sync_full"] == pytest.approx(29.5, abs=0.1)
    assert r["forward"] + r["sync_full"] == pytest.approx(108, abs=1)


def test_profile_from_our_cost_model_and_files(tmp_path):
    layers = zoo_cost_layers("alexnet", None)
    prof = dm.profile_from_layers(layers, PRESETS["k20-pcie"], 4, 128)
    assert [x.name for x in prof.fc] == [x.name for x in layers if x.kind == "linear"]
    p32, p8 = (dm.node_speedup(prof, b) for b in (32, 8))
    assert 1 < p32.speedup <= p8.speedup <= 4
    path = tmp_path / "p.json"
    d = {k: v for k, v in dm.APPENDIX_A_4GPU.__dict__.items() if k != "fc"}
    d["fc"] = [x.__dict__ for x in dm.APPENDIX_A_4GPU.fc]
    path.write_text(json.dumps(d))
    assert dm.load_profile(str(path)).fc == dm.APPENDIX_A_4GPU.fc
    path.write_text(json.dumps({**d, "total": -1}))
    with pytest.raises(ConfigError, match=">= 0"):
        dm.load_profile(str(path))
    path.write_text("{}")
    with pytest.raises(ConfigError, match="not a Dettmers profile"):
        dm.load_profile(str(path))


def test_cli_mode():
    def run(*a):
        cmd = [sys.executable, "-m", "hybridpar", "plan", "--model", "alexnet", "--batch", "512"]
        return subprocess.run([*cmd, *a], capture_output=True, text=True, timeout=120)

    r = run("--procs", "4", "--model-of", "dettmers", "--dettmers-profile", "appendix-a", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["node"]["8"]["speedup"] == pytest.approx(3.67, rel=0.02)
    r = run("--procs", "8", "--model-of", "dettmers", "--dettmers-profile", "appendix-a")
    assert r.returncode == 2 and "--procs 4" in r.stderr
    r = run("--procs", "4", "--dettmers-profile", "appendix-a")
    assert r.returncode == 2 and "--model-of dettmers" in r.stderr
