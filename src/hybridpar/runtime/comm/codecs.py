"""Codecs: lossy encodings of float32 tensors for the wire (Dettmers, "8-Bit Approximations").

| name         | bits | what an element is                                                            |
| ------------ | ---- | ----------------------------------------------------------------------------- |
| none         | 32   | the float32 itself                                                            |
| fp16, bf16   | 16   | a cast                                                                        |
| dynamic-tree | 8    | sign and Dettmers' table: decades e = 0..5, each split at 0.45 x 10^-e, each   |
|              |      | half in 2^(5-e) steps, levels at the step midpoints (6 - e bits after e zeros |
|              |      | and a flag), plus 0 and 1.0: 126 + 2 magnitudes                               |
| static-tree  | 8    | sign, 3-bit decimal exponent E, 4 bits: the half of the same split, 8 steps   |
| mantissa     | 8    | sign, 3-bit decimal exponent E, 4-bit integer mantissa M: M * 10^-(E+1)       |
| linear       | 8    | sign and round(127 * |x| / absmax)                                            |

Every 8-bit type is normalised by the absolute maximum, per tensor (as in the paper) or per block
of `block` elements (default 4096, the improvement bitsandbytes made popular): the payload is one
byte per element plus one float32 scale per block. The paper gives the mantissa and static-tree
types fixed exponent offsets instead; normalising all four the same way makes them comparable and
removes the offset as a tuning knob. The tree types place their levels at the midpoints of their
steps, as Dettmers' table does, and keep a code for 1.0, so the largest magnitude of a block (1.0
after normalising) is represented exactly and a scale survives a round trip.

Properties (tests check each): zeros decode to exact zeros; encoding a decoded tensor again gives
the same bytes; a block holding NaN or +-inf decodes to non-finite values across the block (the
scale is non-finite), so a diverging run stays visibly diverged instead of being clipped.

On CPU, tensors of 1024 elements or more go through C kernels (`hybridpar.runtime.comm.kernels`, built on
first use with the system compiler), the same bytes at memory speed (docs/codecs.md). The rest of this paragraph is the torch path, used elsewhere and as the fallback.
Encoding is one fused pass. Rather than a binary search over the 255 levels, the top 17 bits of
the normalised float32 (|x|/absmax in [0, 1]) index a 32513-entry table that gives the nearest level
at the bucket's lower edge; one comparison with the midpoint to the next level finishes the
rounding (every codec's levels are at least 2^-8 apart relative to their size, so a bucket holds at
most one midpoint: checked when the tables are built). Decoding is a 256-entry table lookup times
the block's scale. Both are compiled with torch.compile for large tensors and run eagerly for
small ones (same arithmetic, same bytes); `reference_encode` is the plain nearest-level search the
tests compare against. On a GPU the Triton kernels (`triton_codecs`, where triton imports) take
the place of the compiled path: one read and one write per element.
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading
import warnings
from dataclasses import dataclass
from functools import cache

import numpy as np
import torch

from hybridpar.core.choices import CODECS, DEFAULT_BLOCK, EIGHT_BIT, check_codec, payload_bytes
from hybridpar.core.timing import clock
from hybridpar.runtime.comm import kernels, triton_codecs

__all__ = [
    "CODECS",
    "Codec",
    "Encoded",
    "get_codec",
    "magnitude_levels",
    "reference_encode",
    "time_codec",
]

_SHIFT = 15  # bucket = top 17 bits of a non-negative float32
_BUCKETS = (0x3F800000 >> _SHIFT) + 1  # up to and including 1.0
_COMPILE_MIN = 1 << 16  # smaller tensors are encoded eagerly: compiling would not pay
_KERNEL_MIN = 1024  # below this the C kernels' call overhead is not worth it either


def _split_decade(e: int, steps: int) -> list[float]:
    """Dettmers' bisection of the decade [0.1, 1] x 10^-e, as his implementation builds it
    (clusterNet's source/8bit_floats.hdf5, searched by kCompression_8bit): split at 0.45, each
    half cut into `steps` equal steps, each level the midpoint of its step."""
    lo, split, hi = 0.1 * 10.0**-e, 0.45 * 10.0**-e, 10.0**-e
    return [lo + (k + 0.5) * (split - lo) / steps for k in range(steps)] + [
        split + (k + 0.5) * (hi - split) / steps for k in range(steps)
    ]


def _dynamic_tree() -> list[float]:
    """Dettmers' table: decades e = 0..5, 2^(5-e) steps in each half (a magnitude with e leading
    zeros keeps 6 - e bits: one for the half, 5 - e for the step), 126 levels, plus 0 and 1.0;
    the code is the level's index in ascending order, as in his implementation."""
    levels = [v for e in range(6) for v in _split_decade(e, 2 ** (5 - e))]
    return sorted([0.0, 1.0, *levels])


def _static_tree() -> list[float]:
    """3-bit exponent E = 0..7 and 4 tree bits (the half, then 8 steps), Dettmers' split of each
    decade: 128 levels, of which the two smallest (about 1.2e-8 and 1.6e-8 of the absmax) give way
    to 0 and 1.0."""
    levels = sorted(v for e in range(8) for v in _split_decade(e, 8))
    return [0.0, *levels[2:], 1.0]


def _mantissa() -> list[float]:
    """m = E << 4 | M, value M * 10^-(E+1): an integer mantissa M in 0..15 (Dettmers section 3.1:
    "the mantissa will hold values between 0 and 15"), exponent offset 1 so that 1.0 (M=10, E=0)
    is the top of the normalised range. M > 10 at E = 0 lies above 1 and is never chosen; many
    values have several codes (2 * 10^-1 = 20 * 10^-2 is not one, M < 16, but 1 * 10^-1 = 10 *
    10^-2 is)."""
    return [min((m & 15) * 10.0 ** -((m >> 4) + 1), 1.0) for m in range(128)]


def _linear() -> list[float]:
    return [m / 127 for m in range(128)]


_BUILDERS = {
    "dynamic-tree": _dynamic_tree,
    "static-tree": _static_tree,
    "mantissa": _mantissa,
    "linear": _linear,
}


def magnitude_levels(name: str) -> list[float]:
    """The 128 magnitudes of an 8-bit codec, indexed by the code's low 7 bits."""
    return _BUILDERS[name]()


@dataclass(frozen=True)
class _Tables:
    decode: torch.Tensor  # float32[256]: code -> value in [-1, 1]
    lut: torch.Tensor  # int32[_BUCKETS]: bucket -> index of the nearest level at its lower edge
    mid: torch.Tensor  # float32[levels]: midpoint between level i and i + 1 (inf after the last)
    canon: torch.Tensor  # int32[levels]: level index -> its (canonical) magnitude code
    levels: torch.Tensor  # float32[levels], ascending
    packed: torch.Tensor  # int64[_BUCKETS]: the C encoder's one lookup per element (_packed)


@cache
def _tables(name: str) -> _Tables:
    # 12 significant digits: equal values reached by different arithmetic (mantissa's 10/15*10^-2
    # and 1/15*10^-1) become one level instead of two a rounding error apart
    mags = [float(f"{v:.12g}") for v in magnitude_levels(name)]
    assert len(mags) == 128 and max(mags) == 1.0 and min(mags) == 0.0
    code_of: dict[float, int] = {}
    for m, v in enumerate(mags):  # the canonical code of a value: its largest code
        code_of[v] = m
    levels = sorted(code_of)
    lv = torch.tensor(levels, dtype=torch.float64)
    mid64 = torch.cat([(lv[1:] + lv[:-1]) / 2, torch.tensor([math.inf], dtype=torch.float64)])
    mid = mid64.float()
    edges = (
        (torch.arange(_BUCKETS, dtype=torch.int64) << _SHIFT).to(torch.int32).view(torch.float32)
    )
    lut = torch.searchsorted(mid, edges, right=True).to(torch.int32)
    # a bucket [edge_i, edge_{i+1}) may hold at most one midpoint, or one comparison is not enough
    nxt = torch.cat([edges[1:], torch.tensor([math.inf])])
    inside = torch.searchsorted(mid, nxt, right=False) - torch.searchsorted(mid, edges, right=True)
    if int(inside.max()) > 1:
        raise AssertionError(f"codec {name}: levels too close for the bucket table")
    signed = torch.tensor(mags + [-v for v in mags], dtype=torch.float32)
    canon = torch.tensor([code_of[v] for v in levels], dtype=torch.int32)
    return _Tables(signed, lut, mid, canon, lv.float(), _packed(lut, mid, canon))


def _packed(lut: torch.Tensor, mid: torch.Tensor, canon: torch.Tensor) -> torch.Tensor:
    """Per bucket, in one 64-bit word, everything the encoder's three dependent lookups (lut, then
    mid and canon) would find: the midpoint above the bucket's lower level (bits 0-31, float32),
    that level's code and sign mask (0x80 unless it is level 0; bits 32-47), the next level's code
    and sign mask (bits 48-63). The kernels make one gather per element instead of three.

    The table ends at 1.0's bucket and starts at the last bucket of the leading run of equal
    words (the magnitudes too small to reach any level but 0 or the first): bucket k is entry
    max(k - (_BUCKETS - len), 0). That is 16-55 KB a codec instead of 254, small enough to stay
    in a GPU's L1 and a CPU core's L2."""
    last = canon.shape[0] - 1
    lo = lut.long().clamp(max=last)
    hi = (lo + 1).clamp(max=last)
    mid_bits = mid[lo].view(torch.int32).numpy().astype(np.uint32).astype(np.uint64)
    codes = [
        canon[i].numpy().astype(np.uint64)
        | np.where(i.numpy() > 0, 0x80, 0).astype(np.uint64) << np.uint64(8)
        for i in (lo, hi)
    ]
    word = mid_bits | codes[0] << np.uint64(32) | codes[1] << np.uint64(48)
    word = torch.from_numpy(word.view(np.int64))
    changes = torch.nonzero(word != word[0])
    return word[int(changes[0]) - 1 :].clone() if changes.numel() else word[-1:].clone()


def _encode_blocks(x: torch.Tensor, lut: torch.Tensor, mid: torch.Tensor, canon: torch.Tensor):
    """x: (blocks, n) float32 -> (codes uint8 (blocks, n), absmax float32 (blocks, 1))."""
    a = x.abs()
    absmax = a.amax(1, keepdim=True)
    inv = torch.where(absmax > 0, 1.0 / absmax, torch.zeros_like(absmax))
    v = (a * inv).clamp(max=1.0)
    bucket = (v.view(torch.int32) >> _SHIFT).clamp(0, _BUCKETS - 1)  # NaN lands in range too
    i = lut[bucket]
    i = i + (v >= mid[i]).to(torch.int32)
    i = i.clamp(max=canon.shape[0] - 1)
    code = canon[i] + ((x < 0) & (i > 0)).to(torch.int32) * 128  # level 0 is 0: no negative zero
    return code.to(torch.uint8), absmax


def _decode_blocks(code: torch.Tensor, scale: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    return table[code.to(torch.int32)] * scale


_compiled: dict[str, object] = {}
_compile_lock = threading.Lock()


def _fast(fn, numel: int):
    """fn compiled with torch.compile for large inputs when allowed (HYBRIDPAR_COMPILE=0 turns it
    off); a failed compilation falls back to eager with one warning."""
    if numel < _COMPILE_MIN or os.environ.get("HYBRIDPAR_COMPILE", "1") == "0":
        return fn
    key = fn.__name__
    with _compile_lock:
        if key not in _compiled:
            _compiled[key] = torch.compile(fn, dynamic=True)
    compiled = _compiled[key]
    if compiled is fn:
        return fn

    def run(*args):
        try:
            return compiled(*args)
        except Exception as exc:  # no C++ compiler, unsupported device, ...
            warnings.warn(
                f"torch.compile failed ({type(exc).__name__}); codecs run eagerly", stacklevel=2
            )
            _compiled[key] = fn
            return fn(*args)

    return run


@dataclass
class Encoded:
    """A tensor on the wire: payload (uint8 for the 8-bit types, the cast tensor otherwise) and
    the per-block scales (None for none/fp16/bf16)."""

    codec: str
    payload: torch.Tensor
    scales: torch.Tensor | None
    shape: torch.Size

    def nbytes(self) -> int:
        n = self.payload.numel() * self.payload.element_size()
        return n + (0 if self.scales is None else self.scales.numel() * 4)


class Codec:
    """encode / decode a float32 tensor; `block=None` scales per tensor, as in the paper."""

    def __init__(self, name: str, block: int | None = DEFAULT_BLOCK) -> None:
        self.name = check_codec(name)
        if block is not None and block < 1:
            raise ValueError("block must be a positive number of elements or None")
        self.block = block
        self.bits = 8 * payload_bytes(name)
        self.eight_bit = name in EIGHT_BIT

    def __repr__(self) -> str:
        return f"Codec({self.name!r}, block={self.block})"

    def blocks(self, numel: int) -> int:
        """How many scales a tensor of `numel` elements carries."""
        if not self.eight_bit or numel == 0:
            return 0
        return 1 if self.block is None else -(-numel // self.block)

    def wire_bytes(self, numel: int) -> int:
        return numel * self.bits // 8 + 4 * self.blocks(numel)

    def encode(self, x: torch.Tensor, out: Encoded | None = None) -> Encoded:
        """`out`: an Encoded of the same codec and size whose payload and scales are reused
        (saves allocating, and first touching, fresh pages on every call)."""
        flat = x.detach().reshape(-1)
        if flat.dtype != torch.float32:
            flat = flat.float()
        if self.name == "none":
            return Encoded(self.name, flat, None, x.shape)
        if self.name in ("fp16", "bf16"):
            return self._encode_half(flat, x.shape, out)
        n = flat.numel()
        if n == 0:
            empty = flat.new_empty(0, dtype=torch.uint8)
            return Encoded(self.name, empty, flat.new_empty(0), x.shape)
        codes, scales = self._buffers(flat, out)
        self._encode_8bit(flat, codes, scales)
        return Encoded(self.name, codes, scales, x.shape)

    def _encode_half(self, flat: torch.Tensor, shape, out: Encoded | None) -> Encoded:
        dt = torch.float16 if self.name == "fp16" else torch.bfloat16
        p = out.payload if out is not None else None
        if p is not None and p.dtype == dt and p.shape == flat.shape and p.device == flat.device:
            p.copy_(flat)
            return Encoded(self.name, p, None, shape)
        return Encoded(self.name, flat.to(dt), None, shape)

    def _buffers(
        self, flat: torch.Tensor, out: Encoded | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The codes and scales to encode `flat` into: `out`'s where they fit, else new ones."""
        n = flat.numel()
        reuse = (
            out is not None
            and out.scales is not None
            and out.payload.numel() == n
            and out.payload.dtype == torch.uint8
            and out.payload.device == flat.device
            and out.payload.is_contiguous()
            and out.scales.numel() == self.blocks(n)
            and out.scales.is_contiguous()
        )
        if reuse:
            return out.payload, out.scales
        codes = torch.empty(n, dtype=torch.uint8, device=flat.device)
        return codes, torch.empty(self.blocks(n), dtype=torch.float32, device=flat.device)

    def _encode_8bit(self, flat: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> None:
        """The 8-bit codes and per-block scales of flat (the C kernel on CPU, the Triton kernel on
        a GPU, torch elsewhere)."""
        t = _tables_for(self.name, flat.device)
        n = flat.numel()
        block = n if self.block is None else self.block
        gpu = flat.is_cuda and triton_codecs.available()
        if gpu and triton_codecs.encode(flat.contiguous(), block, t.packed, codes, scales):
            return
        if flat.device.type == "cpu" and n >= _KERNEL_MIN and kernels.available():
            flat = flat.contiguous()
            if kernels.encode(flat, block, t.packed, codes, scales):
                for b in torch.nonzero(torch.isnan(scales)).view(-1).tolist():  # NaN or inf
                    lo = b * block
                    c, sc = _encode_blocks(flat[lo : lo + block].view(1, -1), t.lut, t.mid, t.canon)
                    codes[lo : lo + block] = c.view(-1)
                    scales[b] = sc.view(-1)[0]
            return
        full = (n // block) * block if block else 0
        enc = _fast(_encode_blocks, n)
        if full:
            c, s = enc(flat[:full].view(-1, block), t.lut, t.mid, t.canon)
            codes[:full] = c.view(-1)
            scales[: full // block] = s.view(-1)
        if full < n:
            c, s = _encode_blocks(flat[full:].view(1, -1), t.lut, t.mid, t.canon)
            codes[full:] = c.view(-1)
            scales[-1] = s.view(-1)[0]

    def decode(self, e: Encoded, out: torch.Tensor | None = None) -> torch.Tensor:
        """`out`: a contiguous float32 tensor of e's size to decode into (returned reshaped)."""
        if e.scales is None:
            if out is not None and out.numel() == e.payload.numel() and out.dtype == torch.float32:
                return out.view(-1).copy_(e.payload.view(-1)).view(e.shape)
            return e.payload.float().view(e.shape)
        t = _tables_for(self.name, e.payload.device)
        n = e.payload.numel()
        if n == 0:
            return e.payload.new_empty(e.shape, dtype=torch.float32)
        block = n if self.block is None else self.block
        if (
            out is None
            or out.numel() != n
            or out.dtype != torch.float32
            or not out.is_contiguous()
            or out.device != e.payload.device
        ):
            out = torch.empty(n, dtype=torch.float32, device=e.payload.device)
        out = out.view(-1)
        if e.payload.is_cuda and triton_codecs.available():
            payload, scales = e.payload.contiguous(), e.scales.contiguous()
            triton_codecs.decode(payload, block, scales, t.decode, out, add=False)
            return out.view(e.shape)
        if e.payload.device.type == "cpu" and n >= _KERNEL_MIN and kernels.available():
            kernels.decode(e.payload.contiguous(), block, e.scales.contiguous(), t.decode, out)
            return out.view(e.shape)
        full = (n // block) * block if block else 0
        dec = _fast(_decode_blocks, n)
        if full:
            nb = full // block
            out[:full] = dec(
                e.payload[:full].view(nb, block), e.scales[:nb].view(nb, 1), t.decode
            ).view(-1)
        if full < n:
            out[full:] = _decode_blocks(e.payload[full:], e.scales[-1:], t.decode)
        return out.view(e.shape)

    def decode_add(self, e: Encoded, acc: torch.Tensor) -> torch.Tensor:
        """acc += decode(e), bit for bit, for a contiguous float32 `acc` of e's size; one pass (no
        decoded temporary) where the C kernels (CPU) or the Triton kernel (GPU) run."""
        n = e.payload.numel()
        fits = e.scales is not None and n and acc.is_contiguous() and acc.dtype == torch.float32
        if fits and acc.numel() == n:
            t = _tables_for(self.name, e.payload.device)
            block = n if self.block is None else self.block
            payload, scales = e.payload.contiguous(), e.scales.contiguous()
            if e.payload.is_cuda and triton_codecs.available():
                triton_codecs.decode(payload, block, scales, t.decode, acc.view(-1), add=True)
                return acc
            if e.payload.device.type == "cpu" and n >= _KERNEL_MIN and kernels.available():
                kernels.decode(payload, block, scales, t.decode, acc, add=True)
                return acc
        return acc.add_(self.decode(e).view(acc.shape))

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        return self.decode(self.encode(x)).to(x.dtype)

    # --- one flat byte buffer per encoded tensor, for collectives -------------------------

    def to_bytes(self, e: Encoded) -> torch.Tensor:
        parts = [e.payload.reshape(-1).view(torch.uint8)]
        if e.scales is not None:
            parts.append(e.scales.view(torch.uint8))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def from_bytes(self, buf: torch.Tensor, numel: int) -> Encoded:
        nb = numel * self.bits // 8
        if self.eight_bit:
            payload = buf[:nb]
            scales = _view(buf[nb : nb + 4 * self.blocks(numel)], torch.float32)
        else:
            dt = {32: torch.float32, 16: torch.float16 if self.name == "fp16" else torch.bfloat16}
            payload, scales = _view(buf[:nb], dt[self.bits]), None
        return Encoded(self.name, payload, scales, torch.Size([numel]))


@cache
def _tables_on(name: str, device: str) -> _Tables:
    t = _tables(name)
    return _Tables(*(getattr(t, f.name).to(device) for f in dataclasses.fields(_Tables)))


def _tables_for(name: str, device: torch.device) -> _Tables:
    return _tables(name) if device.type == "cpu" else _tables_on(name, str(device))


def _view(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bytes as `dtype`; a slice at an unaligned offset is copied first."""
    size = torch.empty(0, dtype=dtype).element_size()
    if b.storage_offset() % size:
        b = b.clone()
    return b.view(dtype)


def get_codec(name: str, block: int | None = DEFAULT_BLOCK) -> Codec:
    return Codec(name, block)


def reference_encode(codec: Codec, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain version, for tests: per block, the nearest level by binary search over the
    midpoints (ties go up), no bucket table, no compilation. Returns (codes, scales)."""
    t = _tables(codec.name)
    flat = x.detach().reshape(-1).float()
    n = flat.numel()
    block = n if codec.block is None else codec.block
    codes, scales = [], []
    for lo in range(0, n, block):
        piece = flat[lo : lo + block]
        absmax = piece.abs().max()
        inv = 1.0 / absmax if absmax > 0 else torch.tensor(0.0)
        v = (piece.abs() * inv).clamp(max=1.0)
        i = torch.searchsorted(t.mid, v, right=True).clamp(max=len(t.canon) - 1)
        codes.append((t.canon[i] + ((piece < 0) & (i > 0)).int() * 128).to(torch.uint8))
        scales.append(absmax.reshape(1))
    return torch.cat(codes), torch.cat(scales)


def time_codec(
    name: str,
    n: int,
    repeats: int,
    block: int | None = DEFAULT_BLOCK,
    reuse: bool = True,
    device: torch.device | str = "cpu",
) -> tuple[list[float], list[float]]:
    """Seconds of each of `repeats` encodes and decodes of n random float32 on `device` (one
    thread of the CPU), after a warm-up (and compilation), into output buffers allocated once
    (as a reducer reuses them) or, with reuse=False, fresh ones each call. `hybridpar codecs`
    reports the best of them and `hybridpar calibrate` keeps the median per element."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    device = torch.device(device)
    try:
        codec = get_codec(name, block)
        x = torch.randn(n, device=device)
        e = codec.encode(x)
        y = codec.decode(e)
        enc, dec = [], []
        for _ in range(repeats):
            t0 = clock(device)
            e = codec.encode(x, out=e if reuse else None)
            t1 = clock(device)
            codec.decode(e, out=y if reuse else None)
            dec.append(clock(device) - t1)
            enc.append(t1 - t0)
        return enc, dec
    finally:
        torch.set_num_threads(threads)
