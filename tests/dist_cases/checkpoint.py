"""Two-rank cases for tests/training/checkpointing/test_faults_checkpoints.py (run by tests.support.dist.run_dist): a
failure on rank 1 alone --
a write past its file-size limit, a planted RNG file of rank 1 -- is the same one-line error on both ranks."""
from __future__ import annotations

import io
import json
import resource
import signal


def rank1_faults(rank, world, run, marker):
    """Train 2 steps and save; step 3's save with rank 1 limited to 100-byte files; then a resume with rank 1's
    RNG file planted. Returns (the save error, the resume error, whether the payload ran) on this rank."""
    import torch
    import torch.distributed as dist

    from megatron_lc.parallel.topology import Topology
    from megatron_lc.training.checkpointing.load import file_digest
    from megatron_lc.training.checkpointing.data_only import UntrustedCheckpointError, rng_state
    from megatron_lc.training.checkpointing.save import CheckpointWriteError
    from megatron_lc.training.loop import Trainer
    from tests.support.parity import small_config
    from tests.training.checkpointing.test_checkpoint_trust import Payload

    sets = ["train.global_batch_size=4", f"checkpoint.save={run}", f"logging.metrics_file={run}.jsonl"]
    Trainer(small_config(sets + ["train.train_iters=2"]), Topology.build()).train()
    resume = small_config(sets + ["train.train_iters=3", f"checkpoint.load={run}"])
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    if rank == 1:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (100, limit[1]))
    try:
        Trainer(resume, Topology.build()).train()
        save_error = None
    except CheckpointWriteError as e:
        save_error = str(e)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
    # every rank has named the checkpoint kept before rank 0 rewrites its meta.json (rank 1, later under load, read
    # it half-written: "none yet")
    dist.barrier()
    if rank == 0:
        ckpt = f"{run}/iter_0000002"
        buf = io.BytesIO()
        torch.save({**rng_state(), "python": Payload(marker)}, buf)
        with open(f"{ckpt}/rng_rank00001.pt", "wb") as f:
            f.write(buf.getvalue())
        with open(f"{ckpt}/meta.json") as f:
            meta = json.load(f)
        meta["files"]["rng_rank00001.pt"] = file_digest(f"{ckpt}/rng_rank00001.pt")
        with open(f"{ckpt}/meta.json", "w") as f:
            json.dump(meta, f)
    dist.barrier()
    try:
        Trainer(resume, Topology.build())
        load_error = None
    except UntrustedCheckpointError as e:
        load_error = str(e)
    import os

    return save_error, load_error, os.path.exists(marker)
