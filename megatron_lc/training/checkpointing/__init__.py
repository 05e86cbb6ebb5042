"""Checkpoints: save, resume at any layout, and what a checkpoint may hold.

    load.py           load_checkpoint: checksums first, the newest complete checkpoint that loads (fallback, the
                      damaged one set aside), the stage options (finetune, no_load_optim, no_load_rng); its readers
                      named by what they read: a torch.distributed.checkpoint directory, or the earlier torch files
                      per tp rank
    save.py           save_checkpoint in phases (finite-state check, every rank agrees on every phase, a failed
                      write's cause in one line)
    async_save.py     checkpoint.async_save: the same phases, dcp.async_save, one save in flight
    common.py         what load and save share: the format version, file checksums, the barrier
    directory.py      complete / newest / good / leftover iteration directories, pruning, atomic writes
    lock.py           one run per save directory
    sharded_state.py  the DCP state: layout-free keys, DTensors on the tp group or, under FSDP2, the (tp, dp x cp) mesh
    reshard.py        the torch files per tp rank resharded across tp
    data_only.py      a checkpoint read as data: DCP metadata through a restricted unpickler, weights_only torch
                      files, RNG states as tensors

Modules are imported by path (``training.checkpointing.load``, ...)."""
