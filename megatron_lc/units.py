"""Byte units, in one place."""
from __future__ import annotations

MIB = 2 ** 20
GIB = 2 ** 30


def fmt_bytes(n: float) -> str:
    """1.50 GiB / 12.00 MiB / 3000 bytes."""
    if n >= GIB:
        return f"{n / GIB:.2f} GiB"
    if n >= MIB:
        return f"{n / MIB:.2f} MiB"
    return f"{int(n)} bytes"
