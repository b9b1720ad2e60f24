"""Wire formats by name, without torch: what the cost model and the CLI need to know about a codec.

The codecs themselves (hybridpar.runtime.comm.codecs) encode a tensor into a payload of `payload_bytes`
per element plus, for the 8-bit types, one float32 scale (the absolute maximum) per block.
"""

from __future__ import annotations

from hybridpar.errors import ConfigError

__all__ = [
    "CODECS",
    "COMPRESSIBLE",
    "DEFAULT_BLOCK",
    "EIGHT_BIT",
    "check_codec",
    "parse_compress",
    "payload_bytes",
]

EIGHT_BIT = ("dynamic-tree", "linear", "mantissa", "static-tree")
CODECS = ("none", "fp16", "bf16", *EIGHT_BIT)
DEFAULT_BLOCK = 4096
COMPRESSIBLE = ("grads", "activations")


def check_codec(name: str) -> str:
    if name not in CODECS:
        raise ConfigError(f"unknown codec {name!r}; choose one of: {', '.join(CODECS)}")
    return name


def payload_bytes(name: str) -> int:
    """Bytes per element of the codec's payload (the 8-bit types' scales come on top)."""
    check_codec(name)
    return 4 if name == "none" else 2 if name in ("fp16", "bf16") else 1


def parse_compress(text: str) -> frozenset[str]:
    """'grads,activations' -> the traffic the codec applies to."""
    parts = frozenset(p.strip() for p in text.split(",") if p.strip())
    bad = sorted(parts - set(COMPRESSIBLE))
    if bad:
        raise ConfigError(f"--compress takes {' and/or '.join(COMPRESSIBLE)}, got {', '.join(bad)}")
    return parts
