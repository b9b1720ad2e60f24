"""The 8-bit codecs as Triton kernels: what a GPU encodes and decodes with (issue 40).

One read and one write per element. Encoding: a program per block, the block held in registers,
its absolute maximum reduced in the same pass, then per element one gather of the C encoder's
packed 64-bit word (`codecs._packed`: the midpoint above the bucket's lower level and both
levels' codes with their sign masks; 16-55 KB a codec, L1-resident). Decoding: a program per tile of
elements inside one block, one gather from the 256-entry table, times the block's scale (one
load and one division a program, none an element); `decode_add` adds into
the accumulator in the same pass (no decoded temporary), rounding the product first as torch's
`acc.add_(decode(e))` does (the fused multiply-add is turned off for it).

The arithmetic is `codecs._encode_blocks`'s, byte for byte, NaN and inf blocks included: the
block's maximum propagates NaN as torch's `amax` does (taken over the bits as integers), and the clamp keeps NaN, so the bucket
arithmetic sees what torch's sees (on a GPU, `tl.max` and `tl.minimum` would drop NaN). The
tests run these kernels on the CPU through Triton's interpreter (TRITON_INTERPRET=1) against
`codecs.reference_encode` and the torch decode. Triton is optional: `available()` says whether it
imports; without it the codecs keep their torch path.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["available", "decode", "encode"]

TILE = 1024  # elements per decoding program
MAX_BLOCK = 1 << 14  # larger blocks (a scale per tensor) keep the torch path


@functools.cache
def available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:  # not installed, or no backend for this platform
        return False
    return True


@functools.cache
def _kernels():
    """The jitted kernels (built on first use: TRITON_INTERPRET is read when they are made)."""
    import triton
    import triton.language as tl

    @triton.jit
    def encode_kernel(
        x_ptr, codes_ptr, scales_ptr, packed_ptr, n, block,
        SHIFT: tl.constexpr, FIRST: tl.constexpr, TOP: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        idx = b * block + offs
        mask = (offs < block) & (idx < n)
        x = tl.load(x_ptr + idx, mask=mask, other=0.0)
        a = tl.abs(x)
        # one reduction over the bits: non-negative floats order as integers, NaN above inf
        absmax = tl.max(a.to(tl.int32, bitcast=True), axis=0).to(tl.float32, bitcast=True)
        inv = tl.where(absmax > 0, 1.0 / absmax, 0.0)
        v = a * inv
        v = tl.where(v > 1.0, 1.0, v)  # a clamp that keeps NaN
        bucket = (v.to(tl.int32, bitcast=True) >> SHIFT) - FIRST
        bucket = tl.where(bucket < 0, 0, tl.where(bucket > TOP, TOP, bucket))
        word = tl.load(packed_ptr + bucket, mask=mask, other=0)
        mid = (word & 0xFFFFFFFF).to(tl.int32).to(tl.float32, bitcast=True)
        pick = tl.where(v >= mid, (word >> 48) & 0xFFFF, (word >> 32) & 0xFFFF)
        sign = tl.where(x < 0, (pick >> 8) & 0xFF, 0)
        tl.store(codes_ptr + idx, ((pick & 0xFF) + sign).to(tl.uint8), mask=mask)
        tl.store(scales_ptr + b, absmax)

    @triton.jit
    def decode_kernel(
        codes_ptr, scales_ptr, table_ptr, out_ptr, n, block, tiles,
        ADD: tl.constexpr, TILE_: tl.constexpr,
    ):  # fmt: skip
        p = tl.program_id(0).to(tl.int64)
        b = p // tiles  # a tile never straddles blocks: one scale, one division per program
        lo = b * block
        idx = lo + (p - b * tiles) * TILE_ + tl.arange(0, TILE_)
        mask = (idx < lo + block) & (idx < n)
        code = tl.load(codes_ptr + idx, mask=mask, other=0).to(tl.int32)
        scale = tl.load(scales_ptr + b)
        y = tl.load(table_ptr + code, mask=mask, other=0.0) * scale
        if ADD:
            y = tl.load(out_ptr + idx, mask=mask, other=0.0) + y
        tl.store(out_ptr + idx, y, mask=mask)

    return encode_kernel, decode_kernel


def encode(x: torch.Tensor, block: int, packed: torch.Tensor, codes, scales) -> bool:
    """Encode flat float32 `x` in blocks of `block` into `codes` (uint8) and `scales` (one float32
    per block) with the codec's packed table; False (nothing written) where the block is too
    large for one program's registers."""
    import triton

    if block > MAX_BLOCK:
        return False
    n = x.numel()
    top = packed.numel() - 1
    first = (0x3F800000 >> 15) + 1 - packed.numel()  # packed[0]'s bucket: 1.0's is the last
    kernel, _ = _kernels()
    size = triton.next_power_of_2(block)
    kernel[(-(-n // block),)](x, codes, scales, packed, n, block, 15, first, top, size, num_warps=8)
    return True


def decode(codes, block: int, scales, table: torch.Tensor, out: torch.Tensor, add: bool) -> None:
    """out = table[codes] * scale of each element's block, or out += that with `add`."""
    import triton

    n = codes.numel()
    _, kernel = _kernels()
    tile = min(TILE, triton.next_power_of_2(block))
    tiles = -(-block // tile)
    grid = (scales.numel() * tiles,)
    # no fused multiply-add: torch rounds the product, then the sum
    kernel[grid](codes, scales, table, out, n, block, tiles, add, tile, enable_fp_fusion=False)
