"""Save and load time of a checkpoint of the demo model: torch.distributed.checkpoint (the format written today)
against format 2 (one ``torch.save`` file per tp rank for the weights and one for AdamW, as the previous release
wrote it; still loaded), side by side in one run.

    python bench/checkpoint_formats.py [--world 1 2] [--repeats 5] [--set model.hidden_size=1024 ...]  # JSON

The model is configs/tiny_cpu.yaml's (4 layers, hidden 256, vocab 8000: 7.5M parameters, fp32) after one AdamW
step on mock data, so the checkpoint holds weights and both moments (~77 MB). World 2 is tp=2 (every rank holds half
of each tp-sharded tensor). Each repeat saves both formats into fresh directories and loads each back into the
same model; times are ``checkpoint.save_checkpoint`` / ``load_checkpoint`` wall time on rank 0 including the
checksums of meta.json (both formats write and verify them), medians over the repeats; ``ratio`` is DCP / format 2.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

OVERRIDES = ["data.mock_data=true", "data.prepare_demo_data=false", "train.train_iters=1",
             "train.micro_batch_size=1", "train.global_batch_size=1", "data.seq_length=64", "checkpoint.save=",
             "logging.log_interval=1"]


def save_format2(path: str, cfg, topo, model, opt, iteration: int, consumed: int) -> None:
    """Format 2 as the previous release wrote it: weights per tp rank (dp x cp rank 0 of the tp group), AdamW per tp
    rank, RNG per rank, meta.json with every file's checksum (written by rank 0 after all ranks hashed theirs)."""
    import torch
    import torch.distributed as dist

    from megatron_lc.parallel.topology import Axis
    from megatron_lc.parallel.collectives import all_gather_objects
    from megatron_lc.training.checkpointing.load import file_digest
    from megatron_lc.training.checkpointing.data_only import rng_state

    tmp = path + ".tmp"
    if topo.rank == 0:
        os.makedirs(tmp)
    if topo.world_size > 1:
        dist.barrier()
    written = []
    if topo.axis_rank(Axis.DP_CP) == 0:
        written.append(f"model_tp{topo.tp_rank:02d}.pt")
        torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, os.path.join(tmp, written[-1]))
        written.append(f"optim_tp{topo.tp_rank:02d}.pt")
        torch.save(opt.state_dict(), os.path.join(tmp, written[-1]))
    written.append(f"rng_rank{topo.rank:05d}.pt")
    torch.save(rng_state(), os.path.join(tmp, written[-1]))
    files = {}
    for mine in all_gather_objects({n: file_digest(os.path.join(tmp, n)) for n in written}):
        files.update(mine)
    if topo.rank == 0:
        meta = {"format_version": 2, "iteration": iteration, "consumed_samples": consumed,
                "world_size": topo.world_size, "tp": topo.tp, "cp": topo.cp, "dp": topo.dp, "zero": False,
                "config": cfg.to_dict(), "files": files}
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f)
        os.replace(tmp, path)
    if topo.world_size > 1:
        dist.barrier()


def rank_bench(rank, world, repeats, extra):
    import copy

    import torch.distributed as dist

    from megatron_lc.config import load_config, resolve_layout
    from megatron_lc.parallel.topology import Topology
    from megatron_lc.training.checkpointing import load as ck
    from megatron_lc.parallel.collectives import all_gather_objects
    from megatron_lc.training.checkpointing.save import save_checkpoint
    from megatron_lc.training.loop import Trainer

    cfg = load_config(os.path.join(ROOT, "configs/tiny_cpu.yaml"),
                      OVERRIDES + [f"parallel.tensor_model_parallel_size={world}"] + list(extra))
    layout = resolve_layout(cfg, world)
    topo = Topology.build(tp=layout.tp, cp=layout.cp, ulysses=layout.ulysses) if world > 1 else Topology()
    trainer = Trainer(cfg, topo, layout=layout)
    trainer.train()
    model, opt = trainer.model, trainer.optimizer
    times = {k: [] for k in ("dcp_save", "dcp_load", "format2_save", "format2_load")}
    sizes = {}
    base = tempfile.mkdtemp(prefix="ckbench") if rank == 0 else None
    base = all_gather_objects(base)[0]

    def timed(key, fn):
        if world > 1:
            dist.barrier()
        t0 = time.perf_counter()
        fn()
        if world > 1:
            dist.barrier()
        times[key].append(time.perf_counter() - t0)

    for i in range(repeats):
        run = copy.deepcopy(cfg)
        run.checkpoint.save = os.path.join(base, f"dcp{i}")
        timed("dcp_save", lambda: save_checkpoint(run, topo, model, opt, 1, 1))
        run.checkpoint.load = run.checkpoint.save
        timed("dcp_load", lambda: ck.load_checkpoint(run, topo, model, opt))
        old = os.path.join(base, f"f2_{i}", "iter_0000001")
        if rank == 0:
            os.makedirs(os.path.dirname(old))
        timed("format2_save", lambda: save_format2(old, cfg, topo, model, opt, 1, 1))
        run.checkpoint.load, run.checkpoint.save = os.path.dirname(old), None
        timed("format2_load", lambda: ck.load_checkpoint(run, topo, model, opt))
        if rank == 0:
            for name, d in (("dcp", os.path.join(base, f"dcp{i}")), ("format2", os.path.dirname(old))):
                d_it = os.path.join(d, "iter_0000001")
                sizes[name] = sum(os.path.getsize(os.path.join(d_it, f)) for f in os.listdir(d_it))
                shutil.rmtree(d)
        if world > 1:
            dist.barrier()
    if rank == 0:
        shutil.rmtree(base)
    return {k: statistics.median(v) for k, v in times.items()}, sizes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--set", nargs="*", default=[], help="config overrides (a bigger model)")
    args = ap.parse_args()
    from tests.support.dist import run_dist

    rows = []
    for world in args.world:
        med, sizes = run_dist(world, rank_bench, args.repeats, args.set)[0]
        rows.append({"world": world, "layout": f"tp={world}", "median_s": {k: round(v, 4) for k, v in med.items()},
                     "save_ratio_dcp_over_format2": round(med["dcp_save"] / med["format2_save"], 3),
                     "load_ratio_dcp_over_format2": round(med["dcp_load"] / med["format2_load"], 3),
                     "bytes": sizes})
    print(json.dumps({"model": "configs/tiny_cpu.yaml (fp32, AdamW states)", "overrides": args.set,
                      "repeats": args.repeats, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
