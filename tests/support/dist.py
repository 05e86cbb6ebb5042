"""Run a function on N gloo ranks in fresh processes and collect what each returns.

    results = run_dist(4, my_module.fn, arg1, arg2)   # fn(rank, world_size, arg1, arg2) -> picklable

``fn`` must be importable (defined at module level). A failure on any rank is re-raised here with the child's
traceback, so asserts inside ``fn`` fail the test. Children use 1 thread each (2-core machines)."""
from __future__ import annotations

import os
import socket
import tempfile
import traceback

import torch.multiprocessing as mp

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


_PRELOADED = False


def _preload() -> None:
    """Children come from a forkserver that imported torch and the package once (about 1 s per spawn instead
    of 3-4 s); the server never runs torch ops, so forking it is safe."""
    global _PRELOADED
    if not _PRELOADED:
        mp.set_forkserver_preload(["torch", "torch.distributed", "tests.support.dist", "megatron_lc.config",
                                   "torch._dynamo"])  # torch.optim imports dynamo: ~5 s per child otherwise
        _PRELOADED = True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank, world_size, port, fn, args, out_dir):
    import pickle
    import sys

    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    result = {"ok": True}
    try:
        if world_size > 1:
            import datetime

            dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                    timeout=datetime.timedelta(seconds=300))
        result["value"] = fn(rank, world_size, *args)
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        result = {"ok": False, "error": f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}"}
    finally:
        with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass


def run_dist(world_size: int, fn, *args):
    import pickle

    _preload()

    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(_child, args=(world_size, _free_port(), fn, args, out_dir), nprocs=world_size,
                                 join=False, start_method="forkserver")
        try:
            while not ctx.join():
                pass
        except Exception as e:  # a child died without writing its result
            errors = []
            for r in range(world_size):
                p = os.path.join(out_dir, f"{r}.pkl")
                if os.path.exists(p):
                    with open(p, "rb") as f:
                        res = pickle.load(f)
                    if not res["ok"]:
                        errors.append(res["error"])
            raise AssertionError("\n".join(errors) or str(e)) from None
        results = []
        for r in range(world_size):
            with open(os.path.join(out_dir, f"{r}.pkl"), "rb") as f:
                res = pickle.load(f)
            if not res["ok"]:
                raise AssertionError(res["error"])
            results.append(res["value"])
        return results
