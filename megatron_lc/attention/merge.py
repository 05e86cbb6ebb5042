"""Online-softmax merge of partial attention results by their log-sum-exp (fp32, stable).

For two partial results over disjoint key sets, ``lse = logaddexp(lse_a, lse_b)`` and
``out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b``. Rows that saw no key (lse = -inf) contribute 0."""
from __future__ import annotations

import torch


def merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor):
    """out: ``[b, n, s, d]`` (any dtype, accumulated in fp32); lse: ``[b, n, s]`` fp32. Returns fp32 (out, lse)."""
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isinf(lse) & (lse < 0), torch.zeros_like(lse), lse)
    wa = torch.exp(lse_a - safe).unsqueeze(-1)
    wb = torch.exp(lse_b - safe).unsqueeze(-1)
    return wa * out_a.float() + wb * out_b.float(), lse


def merge_into(acc_out: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """In-place variant: ``acc_out`` (fp32, may be a view) and ``acc_lse`` updated with a new partial result, with
    no temporary of ``out``'s size but ``out`` itself (``acc_out *= w_a``, then ``acc_out += out * w_b`` in one
    op, ``out`` read in its own dtype)."""
    new = torch.logaddexp(acc_lse, lse)
    safe = torch.where(torch.isinf(new) & (new < 0), torch.zeros_like(new), new)
    acc_out.mul_(torch.exp(acc_lse - safe).unsqueeze(-1))
    acc_out.addcmul_(out, torch.exp(lse - safe).unsqueeze(-1))
    acc_lse.copy_(new)
