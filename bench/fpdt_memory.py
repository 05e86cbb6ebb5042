"""Peak device-resident bytes of one FPDT attention block vs the number of chunks u, at a fixed sequence length.

    python bench/fpdt_memory.py                       # cp=2 gloo ranks, s=4096, u = 1, 2, 4, 8, offload on/off
    python bench/fpdt_memory.py --cp 1 --seq 2048     # one process

Figures are the framework's own accounting (``device.BufferAccount``) of the buffers the FPDT block creates
(``attention/fpdt_buffers.py`` lists the tags and what is not counted). On CPU, host and device are one memory, so
process RSS says nothing about "device" bytes; the accounting is the figure that stands for GPU memory. Host bytes
(offloaded chunks) are counted separately.

``model_bytes`` is the expected peak from the pipeline's structure (per gathered chunk: Q = q bytes, K = k bytes,
L = lse bytes; fp32):
  * offload, backward inner loop (the peak): kv chunk in use 2K + dk/dv accumulators 2K + q-set in use
    (q, out, dout, lse, dq = 4Q + L) + the prefetched next q-set (4Q + L) + finished dq_j (Q) + one block's
    dq/dk/dv (Q + 2K)  =  10Q + 2L + 6K  (u >= 3);  u = 2: 9Q + 2L + 6K;  u = 1 (nothing to prefetch): 5Q + L + 6K.
    So peak(u) ~ (unchunked working set W + the double buffer D) / u: the 1/u of the paper, plus two-chunk buffers.
  * no offload ("chunking only"): the chunks kept for backward stay on the device -- q, out, lse, k, v and, in
    backward, dout and the dq accumulators: 4Q1 + L1 + 2K1 for the whole sequence (constant in u) -- plus, at the
    first backward step, dk/dv accumulators 2K and one block's dq/dk/dv (Q + 2K): Q + 4K per chunk.
Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from megatron_lc.device import BufferAccount  # noqa: E402


class SnapshotAccount(BufferAccount):
    """BufferAccount that also remembers the live bytes per tag at the moment of the peak."""

    def __init__(self):
        super().__init__()
        self.at_peak: dict = {}

    def acquire(self, tag, t_or_bytes):
        super().acquire(tag, t_or_bytes)
        if self.current >= self.peak:
            self.at_peak = {k: v for k, v in self.live.items() if v}


def model_bytes(a, u: int, offload: bool, P: int, kv_repeat: int) -> int:
    """Expected peak (see module doc) for ``u`` chunks; fp32."""
    c = a.seq // u
    Q = a.batch * (a.heads // P) * c * a.head_dim * 4
    K = a.batch * (a.kv_heads * kv_repeat // P) * c * a.head_dim * 4
    L = a.batch * (a.heads // P) * c * 4
    if offload:
        return {1: 5 * Q + L + 6 * K, 2: 9 * Q + 2 * L + 6 * K}.get(u, 10 * Q + 2 * L + 6 * K)
    return u * (4 * Q + L + 2 * K) + Q + 4 * K


def measure(rank: int, world: int, a, out_path: str) -> None:
    from megatron_lc.attention.fpdt.block import FPDTSelfAttention
    from megatron_lc.attention.fpdt.host_share import reserve_for_layers
    from megatron_lc.config import load_config
    from megatron_lc.model.attention import SelfAttention
    from megatron_lc.model.rope import RotaryEmbedding
    from megatron_lc.parallel.token_layout import fpdt_token_index
    from megatron_lc.parallel.topology import Topology
    from tests.support.parity import block_parts

    torch.set_num_threads(1 if world > 1 else 2)
    topo = Topology.build(cp=world, ulysses=world)
    model = [f"model.hidden_size={a.hidden}", f"model.num_attention_heads={a.heads}",
             f"model.num_query_groups={a.kv_heads}", f"data.seq_length={a.seq}"]
    torch.manual_seed(0)
    base_cfg = load_config(None, model)
    base = SelfAttention(base_cfg.model, block_parts(base_cfg), 0, 0.02)
    s_local = a.seq // world
    runs = []
    for offload in (True, False):
        for u in a.chunks:
            cfg = load_config(None, model + [f"parallel.context_parallel_size={world}", "parallel.cp_comm_type=fpdt",
                                             f"memory.fpdt_chunk_size={a.seq // u}", f"memory.fpdt_offload={offload}"])
            parts = block_parts(cfg, topo)
            acct, host = parts.ctx.fpdt.account, parts.ctx.fpdt.host_account = SnapshotAccount(), BufferAccount()
            block = FPDTSelfAttention(cfg.model, parts, 0, 0.02)
            block.load_state_dict(base.state_dict())
            idx = fpdt_token_index(a.seq, world, topo.cp_rank, u)
            pos = idx.view(s_local, 1).expand(s_local, a.batch)
            rope = RotaryEmbedding(a.head_dim, 10000.0)(pos)
            x = torch.randn(s_local, a.batch, a.hidden, requires_grad=True)
            if offload:  # the host pool: this block's parked chunks, measured (attention/fpdt/host_share.py)
                reserve_for_layers(block, x.detach(), rope, 1)
                acct.reset_peak()
            t0 = time.perf_counter()
            y = block(x, rope)
            fwd_peak, fwd_at = acct.peak, dict(acct.at_peak)
            acct.reset_peak()
            y.backward(torch.ones_like(y))
            dt = time.perf_counter() - t0
            assert acct.current == 0 and host.current == 0
            peak = max(fwd_peak, acct.peak)
            runs.append({"u": u, "offload": offload, "chunk_tokens": a.seq // u, "peak_bytes": peak,
                         "peak_forward_bytes": fwd_peak, "peak_backward_bytes": acct.peak,
                         "live_at_peak": acct.at_peak if acct.peak >= fwd_peak else fwd_at,
                         "model_bytes": model_bytes(a, u, offload, world, block.kv_repeat),
                         "host_peak_bytes": host.peak, "seconds": dt})
    ref = next(r for r in runs if r["u"] == a.chunks[0] and r["offload"])
    unchunked = next(r for r in runs if r["u"] == a.chunks[0] and not r["offload"])
    for r in runs:
        r["measured_over_model"] = round(r["peak_bytes"] / r["model_bytes"], 4)
        r["peak_over_u1_offload"] = round(r["peak_bytes"] / ref["peak_bytes"], 4)
        r["u1_offload_over_u"] = round(1 / r["u"] * a.chunks[0], 4)
        r["time_over_u1_no_offload"] = round(r["seconds"] / unchunked["seconds"], 3)
    io = {"block_input_x": s_local * a.batch * a.hidden * 4,
          "attention_output_saved_by_out_proj": s_local * a.batch * a.heads * a.head_dim * 4}
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"runs": runs, "not_counted": io}, f)


def _child(rank, world, port, a, out_path):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        measure(rank, world, a, out_path)
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--chunks", type=str, default="1,2,4,8")
    a = ap.parse_args()
    a.chunks = [int(c) for c in a.chunks.split(",")]
    a.head_dim = a.hidden // a.heads
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "runs.json")
        if a.cp == 1:
            measure(0, 1, a, out_path)
        else:
            import socket

            import torch.multiprocessing as mp

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            mp.spawn(_child, args=(a.cp, port, a, out_path), nprocs=a.cp)
        with open(out_path) as f:
            res = json.load(f)
    print(json.dumps({
        "what": "peak device-resident bytes of one FPDT attention block (forward + backward), rank 0",
        "accounting": "framework's own BufferAccount of the block's buffers; on CPU host and device are one memory, "
                      "so this accounting (not RSS) stands for GPU memory; kernel workspace not counted",
        "command": "python bench/fpdt_memory.py " + " ".join(sys.argv[1:]),
        "setup": {"seq": a.seq, "cp": a.cp, "hidden": a.hidden, "heads": a.heads, "kv_heads": a.kv_heads,
                  "head_dim": a.head_dim, "batch": a.batch, "dtype": "float32"},
        "not_counted_bytes_per_rank": dict(res["not_counted"], note="same for every u; outside the block's "
                                           "working set (the layer's interface; Memo's business)"),
        "runs": res["runs"]}, indent=1))


if __name__ == "__main__":
    main()
