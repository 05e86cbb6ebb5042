"""The MoE block at long context on the CPU, with and without MsT's mini-sequences (``memory/mst/moe.py``): peak RSS
of its forward + backward and the time, side by side in one run, a fresh process per point.

    python bench/moe_block.py                          # 16K, 32K, 64K tokens (~3 minutes on 2 cores)
    python bench/moe_block.py --tokens 4096,8192       # a quick look

Block: hidden 256, 16 experts, top-4, each expert 256 wide, fp32, one process (every expert here), the load-balancing
loss on; input ``[T, 1, 256]``, the loss ``sum(y * w)`` for a fixed ``w``. Mini-sequences: ``memory.mst_mlp_chunk_size``
tokens (default 2048). Each point is a fresh worker process: the block built and initialised, the input made, then
Linux's RSS high-water mark reset (``echo 5 > /proc/self/clear_refs``), one forward + backward, and the peak read
(``VmHWM``) less the RSS before it: the bytes the step added. Without mini-sequences a step holds every token's k
copies, the rows sent to the experts and their ``[T*k, 2f]`` intermediates at once; with them, one chunk's at a time
(each chunk re-made in backward: the time ratio is that re-run's cost). Workers run with
``MALLOC_MMAP_THRESHOLD_=65536`` so freed blocks return to the OS and RSS follows live tensors.

Output: one JSON object on stdout: per token count the two peaks (MiB), their ratio, the seconds of each.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCK = ["model.num_layers=1", "model.hidden_size=256", "model.num_attention_heads=4", "model.vocab_size=256",
         "model.num_moe_experts=16", "model.moe_router_topk=4", "model.moe_ffn_hidden_size=256",
         "model.moe_aux_loss_coeff=0.01", "data.mock_data=true", "train.device=cpu", "train.micro_batch_size=1"]


def _hwm() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


def worker(tokens: int, mst: bool, chunk: int) -> dict:
    """One forward + backward of the block on ``tokens`` tokens: {peak bytes added, seconds}."""
    sys.path.insert(0, ROOT)
    import torch

    from megatron_lc.compose import ModelParts, model_context
    from megatron_lc.compose.spec import model_spec
    from megatron_lc.config import load_config, resolve_layout
    from megatron_lc.model.init import init_model
    from megatron_lc.parallel.topology import Topology

    torch.set_num_threads(1)
    cfg = load_config(None, BLOCK + [f"data.seq_length={tokens}", f"memory.mst={str(mst).lower()}",
                                     f"memory.mst_mlp_chunk_size={chunk}"])
    layout = resolve_layout(cfg, 1)
    ctx = model_context(cfg, layout)
    topo = Topology()
    parts = ModelParts(cfg, layout, topo, spec=model_spec(cfg, layout, ctx), ctx=ctx)
    block = parts.spec.mlp_of(0)(cfg.model, parts, 0.02)
    init_model(block, 0, topo)
    x = torch.randn(tokens, 1, 256, generator=torch.Generator().manual_seed(0)).requires_grad_(True)
    w = torch.linspace(-1, 1, 256)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _rss()
    t0 = time.perf_counter()
    ctx.routing.begin()
    y = block(x)
    ctx.routing.finish(topo)
    (y * w).sum().backward()
    seconds = time.perf_counter() - t0
    return {"peak_bytes": _hwm() - base, "seconds": seconds, "block": type(block).__name__}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="16384,32768,65536")
    p.add_argument("--chunk", type=int, default=2048, help="memory.mst_mlp_chunk_size")
    p.add_argument("--worker", nargs=2, metavar=("TOKENS", "MST"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        print(json.dumps(worker(int(a.worker[0]), a.worker[1] == "1", a.chunk)))
        return 0
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    rows = []
    for tokens in [int(t) for t in a.tokens.split(",")]:
        row = {"tokens": tokens}
        for name, mst in (("whole", "0"), ("mini_sequences", "1")):
            print(f"{tokens} tokens, {name}", file=sys.stderr, flush=True)
            out = subprocess.run([sys.executable, __file__, "--chunk", str(a.chunk), "--worker", str(tokens), mst],
                                 capture_output=True, text=True, env=env, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            row[name] = {"peak_mib": round(r["peak_bytes"] / 2**20, 1), "seconds": round(r["seconds"], 2),
                         "block": r["block"]}
        row["peak_ratio"] = round(row["whole"]["peak_mib"] / row["mini_sequences"]["peak_mib"], 2)
        row["time_ratio"] = round(row["mini_sequences"]["seconds"] / row["whole"]["seconds"], 2)
        rows.append(row)
    print(json.dumps({"block": BLOCK, "chunk_tokens": a.chunk, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
