"""Memo's offload fraction alpha: the linear program of the Memo paper's section 4.1 (equations 1-3). One home: the
calibration (``profiler.py``) and the estimator (``estimate/terms/memo_offload.py``) both solve it here.

    maximise    alpha
    subject to  (S_input + S_attn + alpha * S_others) / B  <=  T_layer          (transfer hidden by compute)
                (n - 2) * (S_input + S_attn + alpha * S_others)  <=  M_cpu       (host memory, n-2 layers swapped)
                0 <= alpha <= 1

S_* are one layer's skeletal bytes on this rank (input, attention output + lse, everything else), B the
device->host bandwidth, T_layer one layer's forward time, n the number of layers, M_cpu this rank's share of the
node's host memory. One variable, two constraints, so the optimum is also the closed form

    alpha* = min(1, (B * T_layer - S_k) / S_others, (M_cpu / (n - 2) - S_k) / S_others),   S_k = S_input + S_attn

``solve_alpha`` uses ``scipy.optimize.linprog`` (HiGHS) and the tests check it against the closed form and
hand-worked examples. Two infeasible cases, handled differently:

* the host constraint fails at alpha = 0 (the layer inputs and attention outputs alone do not fit): a
  ``HostMemoryError`` (a ``ConfigError``) before training, naming the numbers;
* the time constraint fails at alpha = 0 (short sequences: even input + attention output take longer to copy than
  a layer computes): alpha = 0 and ``hidden = False``; training runs, the copy is not fully hidden.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional

from scipy.optimize import linprog

from ...device import HostMemoryError
from ...units import GIB, fmt_bytes

@dataclass
class AlphaInputs:
    s_input: float  # bytes of the layer input (one layer, this rank)
    s_attn: float  # bytes of the attention output + lse
    s_others: float  # bytes of every other skeletal tensor
    bandwidth: float  # device -> host bytes per second
    t_layer: float  # seconds, one layer's forward
    num_layers: int
    host_budget: float  # bytes of host memory this rank may fill

    @property
    def s_kept(self) -> float:
        return self.s_input + self.s_attn

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class AlphaResult:
    alpha: float
    time_bound: float  # largest alpha allowed by the time constraint (may be < 0 or > 1)
    memory_bound: float  # largest alpha allowed by the host constraint (inf when n <= 2)
    binding: str  # "time" | "memory" | "one" (alpha = 1, nothing binds) | "none" (no other tensors)
    hidden: bool  # the transfer of one layer fits in its forward time at this alpha
    host_bytes: float  # (n-2) * (S_k + alpha * S_others)
    transfer_seconds: float  # (S_k + alpha * S_others) / B

    def as_dict(self) -> dict:
        return asdict(self)


def bounds(inp: AlphaInputs) -> tuple[float, float]:
    """(time bound, memory bound) on alpha, from the closed form of each constraint alone."""
    swapped = inp.num_layers - 2
    if inp.s_others <= 0:
        t = float("inf") if inp.s_kept <= inp.bandwidth * inp.t_layer else float("-inf")
        m = float("inf") if swapped <= 0 or swapped * inp.s_kept <= inp.host_budget else float("-inf")
        return t, m
    t = (inp.bandwidth * inp.t_layer - inp.s_kept) / inp.s_others
    m = float("inf") if swapped <= 0 else (inp.host_budget / swapped - inp.s_kept) / inp.s_others
    return t, m


def closed_form(inp: AlphaInputs) -> Optional[float]:
    """alpha* of the LP, or None when the host constraint fails at alpha = 0 (time infeasibility -> 0)."""
    t, m = bounds(inp)
    if m < 0:
        return None
    return max(0.0, min(1.0, t, m))


def _linprog(inp: AlphaInputs, with_time: bool) -> Optional[float]:
    a_ub, b_ub = [], []
    if with_time and math.isfinite(inp.bandwidth * inp.t_layer):
        a_ub.append([inp.s_others / inp.bandwidth])
        b_ub.append(inp.t_layer - inp.s_kept / inp.bandwidth)
    if inp.num_layers > 2:
        a_ub.append([(inp.num_layers - 2) * inp.s_others / GIB])  # GiB units keep HiGHS well scaled
        b_ub.append((inp.host_budget - (inp.num_layers - 2) * inp.s_kept) / GIB)
    if not a_ub:
        return 1.0
    res = linprog(c=[-1.0], A_ub=a_ub, b_ub=b_ub, bounds=[(0.0, 1.0)], method="highs")
    return float(res.x[0]) if res.status == 0 else None


def solve_alpha(inp: AlphaInputs) -> AlphaResult:
    """Solve the LP (linprog); raise ``HostMemoryError`` when even alpha = 0 does not fit in host memory."""
    t, m = bounds(inp)
    swapped = max(inp.num_layers - 2, 0)
    if m < 0:
        need = swapped * inp.s_kept
        raise HostMemoryError(
            f"memory.activation_offload=memo: out of host memory even with offload_fraction 0: the layer inputs "
            f"and attention outputs of {swapped} swapped layers need {fmt_bytes(need)} on this rank "
            f"({fmt_bytes(inp.s_input)} + {fmt_bytes(inp.s_attn)} per layer), budget {fmt_bytes(inp.host_budget)}; "
            f"raise memory.host_memory_gb, use more ranks (cp/tp) or a shorter sequence, or turn offload off "
            f"(recompute_granularity: full)")
    alpha = _linprog(inp, with_time=True)
    hidden = alpha is not None
    if alpha is None:  # time constraint infeasible at 0: keep the host constraint only, alpha = 0
        alpha = 0.0
    alpha = min(max(alpha, 0.0), 1.0)
    if inp.s_others <= 0:
        binding = "none"
    elif alpha >= 1.0 - 1e-9:
        binding = "one"
    elif not hidden or t <= m:
        binding = "time"
    else:
        binding = "memory"
    per_layer = inp.s_kept + alpha * inp.s_others
    return AlphaResult(alpha=alpha, time_bound=t, memory_bound=m, binding=binding, hidden=hidden,
                       host_bytes=swapped * per_layer, transfer_seconds=per_layer / inp.bandwidth)


def check_fixed_alpha(inp: AlphaInputs, alpha: float) -> AlphaResult:
    """A user-given alpha: raise ``HostMemoryError`` when it does not fit in host memory (naming the largest
    alpha that does); report whether its transfer is hidden."""
    t, m = bounds(inp)
    swapped = max(inp.num_layers - 2, 0)
    if m < 0:
        solve_alpha(inp)  # raises the alpha = 0 message
    per_layer = inp.s_kept + alpha * inp.s_others
    if alpha > m + 1e-12:
        raise HostMemoryError(
            f"memory.offload_fraction ({alpha}) needs {fmt_bytes(swapped * per_layer)} of host memory on this "
            f"rank ({swapped} swapped layers x {fmt_bytes(per_layer)}), budget {fmt_bytes(inp.host_budget)}; "
            f"the largest fraction that fits is {max(0.0, min(1.0, m)):.4f} (or set offload_fraction: auto)")
    return AlphaResult(alpha=alpha, time_bound=t, memory_bound=m, binding="fixed", hidden=alpha <= t + 1e-12,
                       host_bytes=swapped * per_layer, transfer_seconds=per_layer / inp.bandwidth)
