"""A step's micro-batches for this rank: the step's global samples, this dp rank's share, sharded for its cp rank.
Step-time work, called by the loop once per step (and once by setup when a runtime traces a real micro-batch)."""
from __future__ import annotations

import torch

from ..config import Config, Layout
from ..data import make_batch, microbatch_sample_ids
from ..parallel.token_layout import shard_batch
from ..parallel.topology import Topology


def microbatches(cfg: Config, layout: Layout, topo: Topology, dataset, consumed: int, device: torch.device) -> list:
    """This rank's micro-batches of the step that starts after ``consumed`` global samples, sharded for its cp rank.

    The step's samples are ``[consumed, consumed + gbs)`` whatever the step number, so a run resumed with another
    global batch size (or dp) still reads every sample exactly once. Example, gbs 8, micro-batch 2, dp 2, after
    16 samples: dp rank 1 reads samples 18-19 and 22-23 in its two micro-batches."""
    out = []
    for m in range(layout.num_micro_batches):
        ids = [consumed + i for i in microbatch_sample_ids(m, layout.global_batch_size, layout.micro_batch_size,
                                                           layout.dp, topo.dp_rank)]
        batch = shard_batch(make_batch(dataset, ids, cfg.data), layout, topo)
        out.append({k: v.to(device) for k, v in batch.items()})
    return out
