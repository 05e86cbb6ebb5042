"""Bytes one rank sends for one layer's context-parallel attention (the formulas of docs/context_parallel.md).

Symbols: s full sequence, b micro-batch, nq / nkv query / kv heads per tp rank, d head dim, e bytes per element of
q/k/v, cp = R (ring) x U (Ulysses), nkv' = nkv * lcm(nkv, U) / nkv (kv heads after GQA replication).

    ring    (p2p)      K = 2 (s/R) b nkv d e        fwd (R-1) K        bwd (R-1) K + (R-1) K * 4/e   (dk/dv in fp32)
    Ulysses (a2a)      A = (U-1)/U (s/U) b d e      fwd A (nq + 2 nkv' + nq)   bwd the same
    hybrid  (a2a+p2p)  Ulysses terms with s/cp local tokens, plus ring terms with nkv'/U kv heads:
                       K_h = 2 (s/R) b (nkv'/U) d e   fwd A_h (2 nq + 2 nkv') + (R-1) K_h   bwd A_h (...) + 2 (R-1) K_h

    >>> cp_attention_bytes("p2p", s=32, b=2, nq=4, nkv=4, d=8, cp=2)   # K = 2*16*2*4*8*4 = 8192
    {'fwd': 8192, 'bwd': 16384}
"""
from __future__ import annotations

import math
from typing import Optional


def cp_attention_bytes(kind: str, s: int, b: int, nq: int, nkv: int, d: int, cp: int,
                       ulysses: Optional[int] = None, elem: int = 4) -> dict:
    """Per-rank bytes sent by one layer's attention, ``{"fwd": ..., "bwd": ...}`` (cp > 1)."""
    U = {"p2p": 1, "a2a": cp}.get(kind, ulysses)
    if U is None:
        raise ValueError("ulysses size needed for a2a+p2p")
    R = cp // U
    nkv_rep = math.lcm(nkv, U) if U > 1 else nkv
    fwd = bwd = 0
    if U > 1:
        one = s // cp * b * d * elem
        a2a = int((U - 1) / U * one * (nq + 2 * nkv_rep)) + int((U - 1) / U * one * nq)
        fwd, bwd = fwd + a2a, bwd + a2a
    if R > 1:
        k = 2 * (s // R) * b * (nkv_rep // U) * d
        fwd += (R - 1) * k * elem
        bwd += (R - 1) * k * elem + (R - 1) * k * 4
    return {"fwd": fwd, "bwd": bwd}
