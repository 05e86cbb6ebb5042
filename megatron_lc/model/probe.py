"""The input the calibrations run one layer on (Memo's profile, FPDT's host share): a fixed random draw of this
rank's training shape, so every calibration measures the same thing. Example, tp=2 with sequence parallelism,
cp=4, 1M tokens, micro-batch 1, hidden 4096: ``x`` is ``[131072, 1, 4096]`` (a layer input: block rows) and the
RoPE tables cover the 262144 local positions."""
from __future__ import annotations

import torch

from ..config import Layout


def probe_input(model, layout: Layout, device: torch.device, dtype: torch.dtype):
    """(x ``[block rows, b, h]`` in ``dtype`` requiring grad, the RoPE tables of the ``local_seq_length`` positions or
    None). ``dtype``: the residual stream's (``Execution.residual_dtype``), a layer input's as the step gives it --
    bf16 on a GPU without ``model.fp32_residual_connection``: a probe in fp32 would measure twice the input's bytes."""
    S, b = layout.local_seq_length, layout.micro_batch_size
    g = torch.Generator(device="cpu").manual_seed(1234)
    x = torch.randn(layout.block_seq_length, b, model.cfg.hidden_size, generator=g).to(device, dtype)
    x.requires_grad_(True)
    rope = None
    if model.rotary is not None:
        rope = model.rotary(torch.arange(S, device=device).unsqueeze(1).expand(S, b))
    return x, rope
