"""hybridpar's CPU kernels in C (the 8-bit codecs, global batch norm), built on first use with the
system C compiler and loaded with ctypes.

Why plain C and ctypes, not torch.compile, a torch C++ extension, or numba:
- torch.compile (the previous path) does not vectorise the table gathers on CPU, while decoding
  is a 256-entry lookup and a multiply that memory bandwidth should bound (docs/codecs.md).
- A torch C++ extension needs torch's headers. One build takes about a minute, once per machine,
  test run and CI job. This file needs none: one C file and `cc`, under a second.
- numba would add a large dependency (llvmlite) for two loops.

Each kernel makes one pass over its input per block: the block's absmax (a block of 4096 floats
stays in L1), then the codes. The arithmetic is the torch path's, operation for operation:
float32 multiplies, no fused multiply-add (-ffp-contract=off), no fast-math. So the bytes are
the same, and the tests compare them with `reference_encode`. A block holding NaN or inf is left
to the torch path, which defines what such a block becomes (the kernel marks it; it is rare).
ctypes releases the GIL during a call, so a reducer thread encodes while autograd runs.

Global batch norm (hybridpar.runtime.parallel.batchnorm) on CPU: per layer a per-rank batch of 8
holds a few thousand values, so torch's path costs its ~20 small ops (a few microseconds each),
not its arithmetic. Four kernels replace them: the per-channel moments (in float64, two passes),
the normalisation with the running-statistics update, the backward's per-channel sums, and dx;
on float32 activations, and on bfloat16 ones as autocast hands them over (no casts both ways).

HYBRIDPAR_KERNELS=0 turns the kernels off. A missing or failing compiler falls back to the torch
path with one warning.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import tempfile
import threading
import warnings
from functools import cache
from pathlib import Path
from types import SimpleNamespace

from hybridpar.core.cluster import cache_dir

__all__ = ["available", "bn", "decode", "encode"]

_SOURCE = r"""
#include <stdint.h>
#include <math.h>
#include <string.h>

/* Encode n floats in blocks of `block`: per block the absmax into scales[b], then per element the
   nearest level: bucket k = top 17 bits of |x|/absmax; packed[k - first] holds the midpoint above the
   bucket's lower level (low 32 bits, float) and the codes of that level and the next, each with
   its sign mask (codecs._packed): one comparison picks the level. Returns how many blocks hold a
   non-finite value; their scale is set to NaN and their codes are left for the caller. */
int64_t hp_encode(const float *x, int64_t n, int64_t block, const uint64_t *packed,
                  int32_t nbuckets, uint8_t *codes, float *scales) {
    int64_t bad_blocks = 0;
    const int32_t first = (0x3F800000 >> 15) + 1 - nbuckets; /* packed[0]'s bucket: 1.0's is last */
    for (int64_t lo = 0, b = 0; lo < n; lo += block, b++) {
        int64_t len = n - lo < block ? n - lo : block;
        const float *xs = x + lo;
        uint8_t *cs = codes + lo;
        float m = 0.0f;
        int bad = 0;
#pragma omp simd reduction(max : m) reduction(| : bad)
        for (int64_t j = 0; j < len; j++) {
            float a = fabsf(xs[j]);
            bad |= !(a <= 3.4028234663852886e38f); /* NaN or inf */
            m = a > m ? a : m;
        }
        if (bad) {
            scales[b] = NAN;
            bad_blocks++;
            continue;
        }
        scales[b] = m;
        float inv = m > 0.0f ? 1.0f / m : 0.0f;
#pragma omp simd
        for (int64_t j = 0; j < len; j++) {
            float v = fabsf(xs[j]) * inv;
            v = v < 1.0f ? v : 1.0f;
            int32_t bits;
            memcpy(&bits, &v, 4);
            int32_t k = (bits >> 15) - first;
            k = k < 0 ? 0 : k < nbuckets - 1 ? k : nbuckets - 1;
            uint64_t e = packed[k];
            uint32_t mb = (uint32_t)e, both = (uint32_t)(e >> 32);
            float mid;
            memcpy(&mid, &mb, 4);
            uint32_t sel = v >= mid ? both >> 16 : both & 0xffffu;
            cs[j] = (uint8_t)((sel & 0xffu) | (xs[j] < 0.0f ? (sel >> 8) & 0xffu : 0u));
        }
    }
    return bad_blocks;
}

/* Decode: out = table[code] * scale of the element's block; with `add`, out += that product (the
   same float32 product, then one add: bit for bit out + decode). */
void hp_decode(const uint8_t *codes, int64_t n, int64_t block, const float *scales,
               const float *table, float *out, int32_t add) {
    for (int64_t lo = 0, b = 0; lo < n; lo += block, b++) {
        int64_t len = n - lo < block ? n - lo : block;
        float s = scales[b];
        const uint8_t *cs = codes + lo;
        float *os = out + lo;
        if (add) {
#pragma omp simd
            for (int64_t j = 0; j < len; j++) os[j] += table[cs[j]] * s;
        } else {
#pragma omp simd
            for (int64_t j = 0; j < len; j++) os[j] = table[cs[j]] * s;
        }
    }
}

/* Global batch norm over x of shape (n, c, s), contiguous (s = the spatial size), once per
   element type (`_BN` below, _SFX = _f32 or _bf16): x, y, dy and dx hold ELEM_SFX, read as float
   (LD_SFX) and written rounded to their type (ST_SFX, bf16 to nearest even as torch rounds); the
   parameters, the running and saved statistics are float32 in both, as under torch's autocast. */
typedef float ELEM_f32;
typedef uint16_t ELEM_bf16;
#define LD_f32(p, j) ((p)[j])
#define ST_f32(q, j, v) ((q)[j] = (v))
static inline float hp_bf16_load(const uint16_t *p, int64_t j) {
    uint32_t u = (uint32_t)p[j] << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline uint16_t hp_bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : r); /* NaN stays NaN */
}
#define LD_bf16(p, j) hp_bf16_load((p), (j))
#define ST_bf16(q, j, v) ((q)[j] = hp_bf16_round(v))
"""

# the batch-norm kernels, written once for an element type (see the comment above), compiled
# for each of BN_TYPES: hp_bn_stats_f32, hp_bn_stats_bf16, ...
BN_TYPES = ("f32", "bf16")
_BN = r"""
/* This rank's share of the moments, in float64, two passes per channel (mean, then squared
   deviations): stats[ch] = sum x, stats[c + ch] = sum (x - mean)^2 + m mean^2 (= sum x^2, without
   the cancellation), stats[2c] = m = n s. */
void hp_bn_stats_SFX(const ELEM_SFX *x, int64_t n, int64_t c, int64_t s, double *stats) {
    double m = (double)(n * s);
    for (int64_t ch = 0; ch < c; ch++) {
        double sum = 0.0;
        for (int64_t i = 0; i < n; i++) {
            const ELEM_SFX *p = x + (i * c + ch) * s;
#pragma omp simd reduction(+ : sum)
            for (int64_t j = 0; j < s; j++) sum += LD_SFX(p, j);
        }
        double mean = m > 0.0 ? sum / m : 0.0, sq = 0.0;
        for (int64_t i = 0; i < n; i++) {
            const ELEM_SFX *p = x + (i * c + ch) * s;
#pragma omp simd reduction(+ : sq)
            for (int64_t j = 0; j < s; j++) {
                double d = LD_SFX(p, j) - mean;
                sq += d * d;
            }
        }
        stats[ch] = sum;
        stats[c + ch] = sq + sum * mean;
    }
    stats[2 * c] = m;
}

/* After the all-reduce (stats global, m = stats[2c] > 1): the mean and invstd saved for the
   backward, the running statistics updated as torch's BatchNorm does (unbiased variance; skipped
   when run_mean is NULL), and y = (x - mean) invstd w + b (w, b may be NULL). */
void hp_bn_forward_SFX(const ELEM_SFX *x, int64_t n, int64_t c, int64_t s, const double *stats,
                       double eps, const float *w, const float *b, ELEM_SFX *y, float *save_mean,
                       float *save_invstd, float *run_mean, float *run_var, double factor) {
    double m = stats[2 * c];
    for (int64_t ch = 0; ch < c; ch++) {
        double mean = stats[ch] / m, var = stats[c + ch] / m - mean * mean;
        var = var > 0.0 ? var : 0.0;
        double invstd = 1.0 / sqrt(var + eps);
        save_mean[ch] = (float)mean;
        save_invstd[ch] = (float)invstd;
        if (run_mean) {
            run_mean[ch] = run_mean[ch] * (float)(1.0 - factor) + (float)factor * (float)mean;
            run_var[ch] = run_var[ch] * (float)(1.0 - factor) +
                          (float)factor * (float)(var * (m / (m - 1.0)));
        }
        float mu = (float)mean, alpha = (float)(invstd * (w ? w[ch] : 1.0f)), beta = b ? b[ch] : 0.0f;
        for (int64_t i = 0; i < n; i++) {
            const ELEM_SFX *p = x + (i * c + ch) * s;
            ELEM_SFX *q = y + (i * c + ch) * s;
#pragma omp simd
            for (int64_t j = 0; j < s; j++) ST_SFX(q, j, (LD_SFX(p, j) - mu) * alpha + beta);
        }
    }
}

/* This rank's sums for the backward, in float64: sums[ch] = sum dy, sums[c + ch] = invstd sum dy
   (x - mean); also as float32 into dbias and dweight (this rank's shares; either may be NULL). */
void hp_bn_backward_reduce_SFX(const ELEM_SFX *dy, const ELEM_SFX *x, int64_t n, int64_t c,
                               int64_t s, const float *mean, const float *invstd, double *sums,
                               float *dweight, float *dbias) {
    for (int64_t ch = 0; ch < c; ch++) {
        double sdy = 0.0, sdyx = 0.0;
        float mu = mean[ch];
        for (int64_t i = 0; i < n; i++) {
            const ELEM_SFX *g = dy + (i * c + ch) * s, *p = x + (i * c + ch) * s;
#pragma omp simd reduction(+ : sdy, sdyx)
            for (int64_t j = 0; j < s; j++) {
                float gj = LD_SFX(g, j);
                sdy += gj;
                sdyx += (double)gj * (double)(LD_SFX(p, j) - mu);
            }
        }
        sums[ch] = sdy;
        sums[c + ch] = sdyx * invstd[ch];
        if (dbias) dbias[ch] = (float)sdy;
        if (dweight) dweight[ch] = (float)(sdyx * invstd[ch]);
    }
}

/* dx = w invstd (dy - sum dy / m - (x - mean) invstd^2 sum dy (x - mean) / m), from the global
   sums (sums[c + ch] holds invstd times the second). w may be NULL. */
void hp_bn_backward_SFX(const ELEM_SFX *dy, const ELEM_SFX *x, int64_t n, int64_t c, int64_t s,
                        const float *mean, const float *invstd, const float *w,
                        const double *sums, double m, ELEM_SFX *dx) {
    for (int64_t ch = 0; ch < c; ch++) {
        double is = invstd[ch];
        float k = (float)(is * (w ? w[ch] : 1.0f)), a = (float)(sums[ch] / m),
              bq = (float)(sums[c + ch] / m * is), mu = mean[ch];
        for (int64_t i = 0; i < n; i++) {
            const ELEM_SFX *g = dy + (i * c + ch) * s, *p = x + (i * c + ch) * s;
            ELEM_SFX *q = dx + (i * c + ch) * s;
#pragma omp simd
            for (int64_t j = 0; j < s; j++)
                ST_SFX(q, j, k * (LD_SFX(g, j) - a - (LD_SFX(p, j) - mu) * bq));
        }
    }
}
"""

_SOURCE += "".join(_BN.replace("_SFX", f"_{t}") for t in BN_TYPES)

_FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-ffp-contract=off", "-shared", "-fPIC"]
_lib: ctypes.CDLL | None = None
_tried = False
_lock = threading.Lock()


def _cpu_key() -> str:
    try:
        flags = next(
            (ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")),
            "",
        )
    except OSError:
        flags = ""
    return platform.machine() + flags


def _build() -> ctypes.CDLL:

    key = hashlib.sha256((_SOURCE + " ".join(_FLAGS) + _cpu_key()).encode()).hexdigest()[:16]
    folder = cache_dir() / "kernels"
    lib = folder / f"hybridpar-{key}.so"
    if not lib.exists():
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            src, out = Path(tmp) / "hybridpar.c", Path(tmp) / "hybridpar.so"
            src.write_text(_SOURCE)
            cc = os.environ.get("CC", "cc")
            subprocess.run(
                [cc, *_FLAGS, str(src), "-o", str(out)],
                check=True,
                capture_output=True,
                timeout=120,
            )
            os.replace(out, lib)  # atomic: ranks building at once each leave a whole file
    dll = ctypes.CDLL(str(lib))
    i64, p = ctypes.c_int64, ctypes.c_void_p
    dll.hp_encode.argtypes = [p, i64, i64, p, ctypes.c_int32, p, p]
    dll.hp_encode.restype = i64
    dll.hp_decode.argtypes = [p, i64, i64, p, p, p, ctypes.c_int32]
    dll.hp_decode.restype = None
    f64 = ctypes.c_double
    for t in BN_TYPES:
        for name, args in (
            ("stats", [p, i64, i64, i64, p]),
            ("forward", [p, i64, i64, i64, p, f64, p, p, p, p, p, p, p, f64]),
            ("backward_reduce", [p, p, i64, i64, i64, p, p, p, p, p]),
            ("backward", [p, p, i64, i64, i64, p, p, p, p, f64, p]),
        ):
            f = getattr(dll, f"hp_bn_{name}_{t}")
            f.argtypes, f.restype = args, None
    return dll


def _get() -> ctypes.CDLL | None:
    global _lib, _tried
    if _tried:
        return _lib
    with _lock:
        if not _tried:
            if os.environ.get("HYBRIDPAR_KERNELS", "1") != "0":
                try:
                    _lib = _build()
                except (OSError, subprocess.SubprocessError) as exc:
                    detail = getattr(exc, "stderr", b"") or b""
                    warnings.warn(
                        f"hybridpar's C kernels not built ({type(exc).__name__}: "
                        f"{detail.decode(errors='replace').strip()[:200] or exc}); "
                        "codecs and global batch norm run on the slower torch path",
                        stacklevel=3,
                    )
            _tried = True
    return _lib


def available() -> bool:
    return _get() is not None


def encode(x, block: int, packed, codes, scales) -> int:
    """x float32 contiguous CPU (n,), packed int64 (codecs._packed), codes uint8 (n,), scales
    float32 (ceil(n/block),); returns the number of blocks holding NaN or inf (scale NaN, codes not
    written)."""
    lib = _get()
    assert lib is not None
    return lib.hp_encode(
        x.data_ptr(), x.numel(), block, packed.data_ptr(), packed.numel(), codes.data_ptr(),
        scales.data_ptr(),
    )  # fmt: skip


def decode(codes, block: int, scales, table, out, add: bool = False) -> None:
    """out = the decoded values, or with `add` out += them (bit for bit out + decode)."""
    lib = _get()
    assert lib is not None
    lib.hp_decode(
        codes.data_ptr(), codes.numel(), block, scales.data_ptr(), table.data_ptr(),
        out.data_ptr(), int(add),
    )  # fmt: skip


@cache
def bn(elem: str) -> SimpleNamespace:
    """The batch-norm kernels for elements of type `elem` (one of BN_TYPES; call `available()`
    first) as .stats, .forward, .backward_reduce and .backward; their pointer arguments are
    passed by the caller (hybridpar.runtime.parallel.batchnorm), 0 for NULL."""
    lib = _get()
    assert lib is not None
    names = ("stats", "forward", "backward_reduce", "backward")
    return SimpleNamespace(**{k: getattr(lib, f"hp_bn_{k}_{elem}") for k in names})
