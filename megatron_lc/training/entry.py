"""``run(cfg)``: what ``pretrain_gpt.py`` does after parsing the config."""
from __future__ import annotations

import logging

import torch.distributed as dist

from ..config import Config
from ..data.demo import prepare_demo_data
from .loop import Trainer, TrainState
from .runtime import init_distributed, shutdown
from .save_lock import lock_save_dir

log = logging.getLogger("megatron_lc")


def prepare_data(cfg: Config, rank: int) -> None:
    """Build the demo corpus and its tokenizer when the config asks for the demo and they are missing (rank 0
    builds, others wait). Only the demo's own paths (``config.data.demo_files``) are ever written."""
    d = cfg.data
    if not d.prepare_demo_data or d.mock_data:
        return
    if rank == 0:
        prepare_demo_data(*d.files(cfg.model.vocab_size), cfg.model.vocab_size)
    if dist.is_initialized():
        dist.barrier()


def run(cfg: Config) -> TrainState:
    layout, topo, device = init_distributed(cfg)
    lock = None
    try:
        lock = lock_save_dir(cfg.checkpoint.save, topo.rank)  # one run per save directory, for the run's life
        log.info("%s | layout tp=%d cp=%d (ring %d x ulysses %d, %s) dp=%d | model %.2fM params",
                 topo.describe(), topo.tp, topo.cp, topo.ring, topo.ulysses, cfg.parallel.cp_comm_type, topo.dp,
                 cfg.model.num_parameters() / 1e6)
        prepare_data(cfg, topo.rank)
        trainer = Trainer(cfg, topo, device, layout)
        return trainer.train()
    finally:
        if lock is not None:
            lock.release()
        shutdown()
