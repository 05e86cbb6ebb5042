"""Device-resident skeletal bytes of the transformer layers, by accounting, for recompute / Memo offload variants
side by side (one process, same model, same batch), plus host bytes, recompute work and step time ratios.

    python bench/offload_bytes.py                         # seq 2048, every row (~1-3 min on 2 cores)
    python bench/offload_bytes.py --seq 1024 --rows none,full,memo_a0.5

Model: the tiny Llama of bench/activation_bytes.py (hidden 256, 4 layers, 8 heads, 2 kv heads, FFN 896, vocab
32000), fp32, batch 1, CPU. On CPU host and "device" are the same RAM, so RSS cannot show what offload saves;
the figure is the framework's accounting instead (``BufferAccount`` of ``MemoRuntime``; for rows without a runtime,
the bytes autograd saves inside the layers, counted by storage with a saved-tensors hook):

    steady   bytes of layer activations resident on the device at the end of the forward (what backward needs)
             none/selective: every tensor the layers saved; full: n x (input + attention out + lse);
             memo: the two rounding buffers
    peak     steady + the largest transient of the memory technique: the recomputed tokens' tensors of one layer
             during its backward (full, memo)
    host     bytes held in host memory (memo: n-2 layers)

Plus, per step: tokens recomputed, core-attention forwards (recompute never adds one), and wall time / none's.
Output: one JSON object on stdout.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

MODEL = dict(num_layers=4, hidden_size=256, ffn_hidden_size=896, num_attention_heads=8, num_query_groups=2,
             vocab_size=32000)
BASE = [f"model.{k}={v}" for k, v in MODEL.items()] + [
    "model.untie_embeddings_and_output_weights=true", "data.mock_data=true", "train.micro_batch_size=1",
    "train.global_batch_size=1", "train.device=cpu"]
MEMO = ["memory.activation_offload=memo"]
ROWS = {
    "none": [],
    "selective": ["memory.recompute_granularity=selective"],
    "full": ["memory.recompute_granularity=full"],
    **{f"memo_a{a}": MEMO + [f"memory.offload_fraction={a}"] for a in (0, 0.125, 0.25, 0.5, 1)},
    "memo_auto": MEMO + ["memory.offload_fraction=auto"],
}


class LayerSavedBytes:
    """Bytes autograd saves inside the transformer layers (unique storages, parameters excluded)."""

    def __init__(self, model):
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.storages: dict = {}
        self.ctx = None
        for layer in model.layers:
            layer.register_forward_pre_hook(self._enter)
            layer.register_forward_hook(self._exit)

    def _pack(self, t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in self.params:
            self.storages[ptr] = t.untyped_storage().nbytes()
        return t

    def _enter(self, module, args):
        self.ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self.ctx.__enter__()

    def _exit(self, module, args, out):
        self.ctx.__exit__(None, None, None)

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def run_row(name: str, overrides: list, seq: int, steps: int) -> dict:
    from megatron_lc.config import load_config
    from tests.support.parity import build

    cfg = load_config(None, BASE + [f"data.seq_length={seq}", f"model.max_position_embeddings={seq}"] + overrides)
    model, ctx = build(cfg)
    rt = ctx.memo
    saved = LayerSavedBytes(model) if rt is None else None
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, MODEL["vocab_size"], (1, seq + 1), generator=g)
    pos = torch.arange(seq).unsqueeze(0)
    times, steady = [], 0
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        if saved is not None:
            saved.storages.clear()
        if rt is not None:
            rt.account.reset_peak()
            rt.attn_forward_calls = 0
        t0 = time.perf_counter()
        loss = model(tokens[:, :-1], pos, tokens[:, 1:]).mean()
        steady = saved.total if saved is not None else rt.account.current
        loss.backward()
        times.append(time.perf_counter() - t0)
    out = {"row": name, "overrides": overrides, "step_seconds": min(times[1:] or times)}
    if rt is None:
        out.update(steady_bytes=steady, peak_bytes=steady, host_bytes=0)
        return out
    acc = rt.account.peak_by_tag
    transient = acc.get("memo.recompute", 0)
    stats = rt.stats()
    out.update(steady_bytes=steady, peak_bytes=steady + transient, host_bytes=rt.host_bytes(), alpha=rt.alpha,
               tokens_recomputed=sum(s["tokens_recomputed"] for s in stats),
               attention_forwards=rt.attn_forward_calls, per_layer=stats[0])
    if getattr(rt, "alpha_result", None) is not None:
        out["alpha_solver"] = rt.alpha_result.as_dict()
        out["profile"] = rt.profile.as_dict()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--rows", default=",".join(ROWS))
    args = ap.parse_args()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    rows = [run_row(r, ROWS[r], args.seq, args.steps) for r in args.rows.split(",")]
    base = next((r for r in rows if r["row"] == "none"), rows[0])
    for r in rows:
        r["steady_vs_none"] = r["steady_bytes"] / base["steady_bytes"]
        r["peak_vs_none"] = r["peak_bytes"] / base["peak_bytes"]
        r["time_vs_none"] = r["step_seconds"] / base["step_seconds"]
    print(json.dumps({"seq": args.seq, "model": MODEL, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
