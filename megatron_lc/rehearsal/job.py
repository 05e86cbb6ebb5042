"""The rest of a training job after its steps, rehearsed through the code a run uses for each (``rehearse_job``):

    validation     training's ``Validator`` on the valid split (one global batch: every batch has one shape)
    save           ``save_checkpoint``: the finite check, ``iter_N.tmp``, DCP's save, RNG files, meta.json, rename
    async save     ``AsyncCheckpointer``: the same state staged to host memory and written in the background, then
                   finished (``checkpoint.async_save``), as a re-save of the same iteration
    resume         a restarted job's ``load_checkpoint`` from it: the checks, DCP's load into the sharded model
                   and fresh AdamW states (a new process has none: the rehearsal drops them first)
    resumed step   one training step after the resume (AdamW steps from the loaded states)

The checkpoint goes to a temporary directory: DCP's metadata, meta.json and the RNG files for real, the tensors'
bytes counted, not written (``training/checkpointing/size_only.py``: fake tensors have none). Example, Llama3-8B at
1M tokens on 8 ranks, FSDP2: each rank's pieces add up to its weights and AdamW states, 12 bytes per parameter of
its shard (about 11.2 GiB).
"""
from __future__ import annotations

import copy

import torch

from ..device import DeviceAdapter
from ..training.checkpointing.async_save import AsyncCheckpointer
from ..training.checkpointing.data_only import DataOnlyReader
from ..training.checkpointing.load import load_checkpoint
from ..training.checkpointing.save import save_checkpoint
from ..training.checkpointing.sharded_state import local_optimizer
from ..training.checkpointing.size_only import written_bytes
from .moments import Moments

JOB = ("validation", "save", "async save", "resume", "resumed step")


def forget_optimizer_state(trainer) -> None:
    """What a restarted process does not have: AdamW's states, the gradients, and work in flight on the device (a
    copy of FSDP2's host shards to the device still reading them while the load writes there)."""
    DeviceAdapter.for_device(trainer.device).synchronize()
    trainer.optimizer.zero_grad(set_to_none=True)
    local_optimizer(trainer.optimizer).state.clear()


def known_step_counts(optimizer, iteration: int) -> None:
    """AdamW reads each parameter's step count as a number (``_get_value``, in its foreach step, CUDA's default);
    the counts a rehearsal loads have no value (fake tensors, nothing was written), so they are set to what they
    hold -- the checkpoint's iteration -- keeping the loaded tensor's device and dtype."""
    for st in local_optimizer(optimizer).state.values():
        st["step"] = torch.tensor(float(iteration), dtype=st["step"].dtype, device=st["step"].device)


def rehearse_job(trainer, moments: Moments, save_dir: str) -> dict:
    """Each phase of ``JOB`` in order on a trainer after its steps (``cfg.checkpoint.save`` is ``save_dir``);
    returns what they made: the checkpoint's directory and its bytes on this rank."""
    cfg, topo, s = trainer.cfg, trainer.topo, trainer.state
    moments.begin("validation")
    moments.start_pass("validation")
    trainer.validator.evaluate("valid", s.iteration)
    moments.begin("save")
    moments.set("save")
    path = save_checkpoint(cfg, topo, trainer.model, trainer.optimizer, s.iteration, s.consumed_samples,
                           trainer.skips.meta())
    saved = written_bytes(DataOnlyReader(path).read_metadata())
    moments.begin("async save")
    moments.set("async save")
    writer = AsyncCheckpointer(cfg, topo)
    writer.save(trainer.model, trainer.optimizer, s.iteration, s.consumed_samples, trainer.skips.meta())
    path = writer.wait()
    moments.begin("resume")
    moments.set("resume")
    forget_optimizer_state(trainer)
    resume = copy.deepcopy(cfg)
    resume.checkpoint.load = save_dir
    meta = load_checkpoint(resume, topo, trainer.model, trainer.optimizer)
    s.iteration, s.consumed_samples = meta["iteration"], meta["consumed_samples"]
    known_step_counts(trainer.optimizer, meta["iteration"])
    moments.begin("resumed step")
    topo.comm.reset()  # the bytes of one step: this one
    moments.start_step(s.iteration)
    trainer.train_step(s.iteration)
    s.iteration += 1
    return {"checkpoint": path, "checkpoint_bytes": saved, "resumed_from": meta["path"]}
