"""One simulated rank: ``setup_training``, ``steps`` training steps of the config at its real size and the rest of
a job (``job.py``: validation, save, async save, resume, the step after it), under fake tensors and a fake process
group, every storage traced; returns the rank's figures (``rehearse_rank``).

The accelerator is the stand-in device ``standin:0`` (``standin.py``), a device of its own beside the host, computing
as a GPU run does: the dtypes are those ``resolve_execution`` gives a CUDA run (bf16 autocast with ``train.bf16``,
the residual stream's dtype), the autocast rules are CUDA's, an op mixing host and device tensors raises where
CUDA would (``mix_check.py``: the rank stops there), and what CUDA's kernels hold inside themselves (fp32
accumulators, workspaces, hidden copies: ``device/kernel_scratch.py``) is charged at each op. The host's share is
told apart by device (every ``cpu`` storage) and by identity (the host pool's one allocation; with
``fsdp_cpu_offload``, FSDP2's shards, gradients and optimizer states). Example: rank 7 of ``configs/llama3_8b_1m.yaml`` -> its peak 45.17 GiB at ``step 1 mb 0 layer 0
backward``, each part of the job's peaks, its checkpoint's 11.22 GiB of pieces.

Run it in a fresh process per rank (``tools/rehearse.py`` does): the fake process group, the tracker and the
stand-in device are process-wide (the device is registered when this module is imported). As a process (``main``)
it prints each phase as it starts (setup's stages, each step's forward, backward and optimizer step, the job's
parts), flushed, on a line that begins with ``PROGRESS``: ``tools/rehearse.py`` shows them as they come.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import sys
import tempfile
import time
from contextlib import nullcontext
from typing import Callable, Optional

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from ..config import Config, Execution, load_config, resolve_execution, resolve_layout
from ..device.kernel_scratch import KernelScratch
from ..device.stream_check import StreamCheck
from ..parallel.topology import Topology
from ..planning.capture.tracker import DispatchTracer
from ..training.loop import Trainer
from .figures import ModelStates, rank_figures
from .host_check import HostMathCheck
from .job import rehearse_job
from .mix_check import DeviceMixCheck, DeviceMixError
from .moments import Moments
from .standin import install as install_standin
from .world import fake_world

PROGRESS = "rehearsal progress: "  # the start of a phase line on a rank process's stdout
# the stand-in device, registered when this module is imported: PyTorch's autograd engine counts each device type's
# devices once, at the first backward of the process, so the device must exist before any backward runs here
STANDIN = install_standin()


def stand_in_execution(cfg: Config) -> Execution:
    """A CUDA run's execution on the stand-in device (``standin.py``: a device of its own, not the host): its
    dtypes, its autocast rules, its attention kernels; the model built on the device (``Execution.build_on_device``)."""
    return dataclasses.replace(resolve_execution(cfg, torch.device("cuda")), device=STANDIN,
                               kernel_device="cuda", build_on_device=True)


def rehearsal_config(cfg: Config, steps: int, host_memory_gb: float, save_dir: Optional[str] = None) -> Config:
    """``cfg`` as a rehearsal runs it: ``steps`` steps, mock tokens of the real length, the node's host memory from
    the hardware profile (unless the config names it), the MFU peak given (no GEMM is timed on fake tensors); no
    checkpoint, or with ``save_dir`` the job's phases (``job.py``): checkpoints into ``save_dir`` and a validation
    after the last step, of one global batch of the valid split."""
    cfg = copy.deepcopy(cfg)
    cfg.train.train_iters = steps
    cfg.checkpoint.save, cfg.checkpoint.load = save_dir, None
    if save_dir is not None:
        cfg.train.eval_interval, cfg.train.eval_iters = steps, 1
    cfg.data.mock_data = True
    cfg.logging.metrics_file = None
    if cfg.memory.host_memory_gb is None:
        cfg.memory.host_memory_gb = host_memory_gb
    if cfg.logging.peak_tflops is None:
        cfg.logging.peak_tflops = 1.0
    return cfg


def rehearse_rank(cfg: Config, rank: int, world: int, nproc_per_node: int, steps: int = 2,
                  execution: Optional[Execution] = None,
                  on_phase: Callable[[str], None] = lambda name: None) -> dict:
    """Setup and ``steps`` steps of rank ``rank`` of ``world`` (``cfg`` already a ``rehearsal_config``), then,
    when ``cfg.checkpoint.save`` is set, the job's phases (``job.rehearse_job``). ``execution``: the stand-in's
    (default: a CUDA run's, ``stand_in_execution``); ``on_phase``: told each phase as it starts
    (``moments.phase``). An op CUDA would refuse (``mix_check.DeviceMixError``) stops the rank there: the figures
    are those until then, ``stopped`` says where."""
    execution = execution or stand_in_execution(cfg)
    with fake_world(rank, world, nproc_per_node, execution.device):
        layout = resolve_layout(cfg, world)
        topo = Topology.build(tp=layout.tp, cp=layout.cp, ulysses=layout.ulysses, ep=layout.ep)
        tracer = DispatchTracer()
        charged: dict = {}  # what a CUDA kernel holds inside itself -> the most it held at one call
        kept = 0  # the workspaces charged once and held to the end (cuBLAS's, each communicator's NCCL buffers)

        def charge(func, items) -> None:  # at the op's moment, beside its inputs and outputs
            nonlocal kept
            tracer.charge(str(execution.device), [(s.nbytes, s.what, s.kept) for s in items])
            for s in items:
                charged[s.what] = max(charged.get(s.what, 0), s.nbytes)
                kept += s.nbytes if s.kept else 0

        host_math = HostMathCheck([])
        mixes = DeviceMixCheck(execution.device)
        seconds, job, stopped = {"steps": []}, {}, None
        # the stream-order check is the device adapter every runtime binds to: entered inside the fake mode, before
        # the build; the mix check first, so that the others see an op before it raises
        # the kernels' own workspaces and copies above the tracer, charged after each op's outputs are traced --
        # CUDA's kernels' (the stand-in device's), none for a CPU execution
        scratch = KernelScratch(execution.device, charge) if execution.device.type != "cpu" else nullcontext()
        with FakeTensorMode(), tracer, scratch, mixes, host_math, StreamCheck(execution.device) as streams:
            moments = Moments(tracer.events, on_phase)
            trainer = None
            try:
                t0 = time.perf_counter()
                trainer = Trainer(cfg, topo, layout=layout, execution=execution,
                                  stage=lambda name: moments.set(f"setup {name}"))
                trainer.reads_values = False  # fake tensors have no values (training/loop.py)
                host_math.pools.append(trainer.ctx.host_pool)
                seconds["setup"] = time.perf_counter() - t0
                moments.install(trainer.model, trainer.optimizer)
                states = ModelStates(tracer, trainer)
                states.install()
                moments.begin("steps")
                for k in range(steps):
                    topo.comm.reset()  # the bytes of one step (the last)
                    moments.start_step(k)
                    t0 = time.perf_counter()
                    trainer.state.consumed_samples = trainer.train_step(k)["consumed_samples"]
                    trainer.state.iteration += 1
                    seconds["steps"].append(time.perf_counter() - t0)
                if cfg.checkpoint.save:
                    t0 = time.perf_counter()
                    job = rehearse_job(trainer, moments, cfg.checkpoint.save)
                    seconds["job"] = time.perf_counter() - t0
            except DeviceMixError as e:
                stopped = {"at": moments.log[-1][1], "error": str(e)}
        if trainer is None:
            raise DeviceMixError(stopped["error"])  # setup itself: nothing to report beside it
        trace = tracer.trace()
        states.take()  # (those alive at the end)
        host = states.host(cfg.parallel.use_torch_fsdp2 and cfg.parallel.fsdp_cpu_offload)
        if execution.device.type != "cpu":  # the host's storages, by their device
            host |= {e.id for e in tracer.select("cpu") if e.op == "malloc"}
        out = {"rank": rank, "world": world, "seconds": seconds, "events": len(trace.events), "stopped": stopped,
               "job": [name for _, name in moments.segments[2:]], **job}
        meta = frozenset(e.id for e in tracer.select("meta") if e.op == "malloc")  # (nothing allocated)
        out.update(rank_figures(trace, moments, states.parts, host, meta))
        out["host"].update(host_figures(trainer))
        out["comm_bytes_per_step"] = {f"{tag}/{op}": n for (tag, op), n in sorted(topo.comm.bytes.items())}
        out["attention"] = {"pairs_per_step": sum(topo.comm.pairs.values()),  # every layer's forward (re-runs apart)
                            "kv_received_bytes_per_step": {op: sum(n for (_, o), n in topo.comm.received.items()
                                                                   if o == op) for op in ("p2p_fwd", "p2p_bwd")}}
        out["kernel_scratch"], out["kernel_scratch_kept_bytes"] = charged, kept
        out["violations"] = mixes.violations + host_math.violations + [
            {"kind": v.kind, "buffer": v.buffer, "site": str(v.second), "first_site": str(v.first), "text": str(v)}
            for v in streams.violations]
        return out


def host_figures(trainer) -> dict:
    """The host pool's exact size by technique, and the bytes each technique moved between host and device in
    the whole rehearsal (per step: divide by the steps); beside them the size of each of Memo's two rounding
    buffers on the device, as its calibration set it."""
    ctx = trainer.ctx
    moved = {}
    if ctx.memo is not None:
        stats = ctx.memo.stats()
        moved["memo_to_host"] = sum(r["bytes_to_host"] for r in stats)
        moved["memo_from_host"] = sum(r["bytes_from_host"] for r in stats)
    if ctx.checkpoints is not None:
        moved["checkpoints_to_host"] = ctx.checkpoints.bytes_to_host
    if ctx.fpdt is not None:
        moved["fpdt_host_peak"] = ctx.fpdt.host_account.peak
    return {"pool_bytes": ctx.host_pool.size, "pool_reserved": dict(ctx.host_pool.reserved), "moved": moved,
            "memo_rounding_buffer_bytes": ctx.memo.buffer_bytes if ctx.memo is not None else None}


def main(argv=None) -> int:
    """``python -m megatron_lc.rehearsal.rank --config C --rank R --world W --nproc-per-node N --steps S
    --host-memory-gb H [--set k=v ...] [--steps-only] --out FILE``: one rank's figures as JSON (tools/rehearse.py
    runs it); the job's phases after the steps unless ``--steps-only``, its checkpoint in a temporary directory."""
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--nproc-per-node", type=int, required=True)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--host-memory-gb", type=float, required=True)
    p.add_argument("--steps-only", action="store_true")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="rehearsal-checkpoint-") as d:
        cfg = rehearsal_config(load_config(a.config, a.overrides), a.steps, a.host_memory_gb,
                               None if a.steps_only else os.path.join(d, "save"))
        figures = rehearse_rank(cfg, a.rank, a.world, a.nproc_per_node, a.steps,
                                on_phase=lambda name: print(PROGRESS + name, flush=True))
    figures["seconds"]["total"] = time.perf_counter() - t0
    with open(a.out, "w") as f:
        json.dump(figures, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
