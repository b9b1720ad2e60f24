"""Run in a fresh interpreter with TRITON_INTERPRET=1 (tests/test_triton_codecs.py): the Triton
codec kernels on CPU tensors against the reference and the torch path; prints one JSON line per
case (blocks of 7 to 2500). `--shift 1` launches the encoder with every block boundary one element off (the check must
then fail); `--finite` replaces the NaN and inf values by finite ones."""

import json
import sys

import torch

from hybridpar.core.choices import EIGHT_BIT
from hybridpar.runtime.comm import triton_codecs
from hybridpar.runtime.comm.codecs import (
    _decode_blocks,
    _encode_blocks,
    _tables,
    get_codec,
    reference_encode,
)


def data(n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=g) * 3  # a short tail block
    x[16:32] = 0.0  # a block of zeros
    x[32:48] *= 1e-6
    x[50], x[70], x[90] = float("nan"), float("inf"), -0.0  # NaN and inf blocks; a negative zero
    x[100] = float("-inf")
    x[1:5] = torch.tensor([1e-9, -3e-12, 1e-40, 2e-7])  # below the packed table's first bucket
    return x


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.nan_to_num(7.0, 8.0, 9.0), b.nan_to_num(7.0, 8.0, 9.0))


def case(name: str, block: int, shift: int, finite: bool) -> dict:
    n = 16 * 7 + 5 if block < 1024 else 2 * block + 117  # a block over several decode tiles
    x, t, codec = data(n), _tables(name), get_codec(name, block)
    if finite:
        x = x.nan_to_num(0.5, 4.0, -4.0)
    nb = -(-n // block)
    codes, scales = torch.empty(n, dtype=torch.uint8), torch.empty(nb)
    triton_codecs.encode(x, block + shift, t.packed, codes, scales)
    ref_codes, ref_scales = reference_encode(codec, x)
    torch_codes = torch.cat([_encode_blocks(p.view(1, -1), t.lut, t.mid, t.canon)[0].view(-1)
                             for p in x.split(block)])  # fmt: skip
    finite = torch.isfinite(ref_scales).repeat_interleave(block)[:n]
    want = torch.cat([_decode_blocks(c, s.view(1), t.decode)
                      for c, s in zip(codes.split(block), scales, strict=True)])  # fmt: skip
    out, acc = torch.empty(n), torch.randn(n, generator=torch.Generator().manual_seed(1))
    triton_codecs.decode(codes, block, scales, t.decode, out, add=False)
    summed = acc.clone()
    triton_codecs.decode(codes, block, scales, t.decode, summed, add=True)
    return {
        "codec": name,
        "block": block,
        "finite_codes_are_the_reference": torch.equal(codes[finite], ref_codes[finite]),
        "codes_are_the_torch_path": torch.equal(codes, torch_codes),
        "scales": same(scales, ref_scales),
        "decode": same(out, want),
        "decode_add": same(summed, acc + want),
        "non_finite_blocks_decode_non_finite": not torch.isfinite(out[~finite]).any().item(),
    }


if __name__ == "__main__":
    shift = int(sys.argv[sys.argv.index("--shift") + 1]) if "--shift" in sys.argv else 0
    for name in EIGHT_BIT:
        for block in (7, 16, 64, 200, 2500):
            print(json.dumps(case(name, block, shift, "--finite" in sys.argv)))
