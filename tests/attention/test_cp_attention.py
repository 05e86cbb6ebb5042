"""Context-parallel core attention (ring, Ulysses, hybrid) equals SDPA on the full sequence, forward and backward,
on gloo ranks; the bytes each rank sent equal the formulas of docs/context_parallel.md."""
import math

import pytest

from megatron_lc.attention.cp_bytes import cp_attention_bytes

from tests.dist_cases import cp as dist_cases_cp
from tests.support.dist import run_dist

B, S, D = 2, 32, 8
E = 4  # fp32


def ring_bytes(s_local, nkv, ring):
    """Per rank: forward (R-1) K, backward (R-1) K + (R-1) K_fp32, K = bytes of one local k+v."""
    k = 2 * s_local * B * nkv * D * E
    return (ring - 1) * k, 2 * (ring - 1) * k


def ulysses_bytes(s_local, nq, nkv_rep, u):
    """Per rank, each way: (U-1)/U * s_local * b * d * e * ((nq + 2 nkv') [q,k,v] + nq [out])."""
    one = s_local * B * D * E
    return int((u - 1) / u * one * (nq + 2 * nkv_rep)) + int((u - 1) / u * one * nq)


# (kind, cp, ulysses, nq, nkv): MHA and GQA; kv heads < ulysses ranks (replicated); an lcm case (nkv=2, U=3).
CASES = [
    ("p2p", 2, None, 4, 4),
    ("p2p", 4, None, 8, 2),
    ("a2a", 2, None, 4, 2),
    ("a2a", 4, None, 8, 8),
    ("a2a", 4, None, 8, 2),     # nkv=2 < U=4 -> each kv head replicated twice
    ("a2a", 3, None, 6, 2),     # lcm(2, 3) = 6 -> replicated 3 times
    ("a2a+p2p", 4, 2, 8, 2),
    ("a2a+p2p", 4, 2, 4, 1),    # nkv=1 < U=2 inside the hybrid
]


@pytest.mark.parametrize("kind,cp,ulysses,nq,nkv", CASES)
def test_cp_attention_matches_full(kind, cp, ulysses, nq, nkv):
    seq = 24 if cp == 3 else S
    res = run_dist(cp, dist_cases_cp.attention_parity, kind, ulysses, nq, nkv, B, seq, D)
    u = ulysses if kind == "a2a+p2p" else (cp if kind == "a2a" else 1)
    ring = cp // u
    rep = math.lcm(nkv, u) // nkv if u > 1 else 1
    s_local = seq // cp
    fwd_r, bwd_r = ring_bytes(s_local * u, nkv * rep // u, ring)
    a2a = ulysses_bytes(s_local, nq, nkv * rep, u) if u > 1 else 0
    for r in res:  # every rank sends the same amount
        assert r == {"p2p_fwd": fwd_r, "p2p_bwd": bwd_r, "a2a_fwd": a2a, "a2a_bwd": a2a}, (r, fwd_r, bwd_r, a2a)
    # the library's formula (used by bench/cp_memory.py) agrees with the measurement
    assert cp_attention_bytes(kind, seq, B, nq, nkv, D, cp, ulysses) == {"fwd": fwd_r + a2a, "bwd": bwd_r + a2a}


def test_ring_refuses_odd_local_length():
    msgs = run_dist(2, dist_cases_cp.odd_local_length)
    assert all("must be even" in m and "(5)" in m for m in msgs), msgs


def test_ring_does_not_hold_a_block_through_the_next_blocks_kernel():
    """Ranks 0..2 of a ring of 3 see blocks after and before their own (both zigzag cases), forward and backward."""
    calls = run_dist(3, dist_cases_cp.ring_blocks_released)
    assert calls == [4, 4, 4]  # 2 off-diagonal blocks forward + 2 backward on each rank
