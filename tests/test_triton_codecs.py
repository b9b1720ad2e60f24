"""Issue 40: the 8-bit codecs' Triton kernels, run on the CPU through Triton's interpreter
(TRITON_INTERPRET=1, a fresh interpreter: Triton reads it when the kernels are built). Every
8-bit type at blocks of 7, 16, 64, 200 and 2500 elements (decoded in several tiles), with a short tail block, a block of zeros,
NaN and +-inf blocks and a negative zero: the finite blocks' bytes are the reference's, every
block's are the torch path's (as the C kernels'), and decode and the fused decode-add are the
torch path's values bit for bit. The same check fails on the encoder launched with every block
boundary one element off."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install -e .[dev])")

CHECK = Path(__file__).with_name("triton_check.py")


def _cases(*args: str) -> list[dict]:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, str(CHECK), *args], env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def test_triton_kernels_give_the_reference_bytes_and_the_torch_values():
    cases = _cases()
    assert len(cases) == 20
    bad = [c for c in cases if not all(v for k, v in c.items() if k not in ("codec", "block"))]
    assert not bad, bad


def test_the_check_fails_on_an_encoder_with_block_boundaries_one_element_off():
    # finite data: a NaN or inf in every block of 64 would hide where its boundary falls
    split = [c for c in _cases("--shift", "1", "--finite") if c["block"] < 117]  # several blocks
    assert len(split) == 12 and not any(c["finite_codes_are_the_reference"] for c in split)
