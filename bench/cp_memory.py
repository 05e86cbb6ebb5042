"""Context parallelism on the tiny model: per-rank peak memory per token for cp = 1, 2, 4, and the bytes each
attention layer sends (ring vs Ulysses vs hybrid) measured against the formulas of docs/context_parallel.md.

    python bench/cp_memory.py [--seq 2048] [--layers 4]      # JSON on stdout, a side-by-side table on stderr

Every variant runs one forward+backward of one micro-batch (b=1, fp32, mock tokens) of the model of
configs/tiny_cpu.yaml, on gloo ranks (tests/support/dist.py's launcher). Memory: torch's ``MemTracker``
(``torch.distributed._tools.mem_tracker``, private API) follows every tensor storage the step allocates on the CPU;
"step_peak" is the peak of all live bytes minus the parameters and their (pre-allocated) gradients, i.e.
activations + temporaries + communication buffers. On CPU this is the accounting that stands for GPU memory
(RSS would mostly show the torch libraries). Bytes: ``topo.comm`` counters of layer 0's attention.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

VARIANTS = [  # (name, cp, cp_comm_type, ulysses)
    ("cp1", 1, "p2p", None),
    ("ring_cp2", 2, "p2p", None),
    ("ulysses_cp2", 2, "a2a", None),
    ("ring_cp4", 4, "p2p", None),
    ("ulysses_cp4", 4, "a2a", None),
    ("hybrid_cp4_2x2", 4, "a2a+p2p", 2),
]


def _overrides(cp, kind, ulysses, seq, layers):
    o = [f"parallel.context_parallel_size={cp}", f"parallel.cp_comm_type={kind}", f"data.seq_length={seq}",
         f"model.num_layers={layers}", "data.mock_data=true", "train.micro_batch_size=1", "checkpoint.save="]
    if ulysses is not None:
        o.append(f"parallel.ulysses_size={ulysses}")
    return o


def rank_step(rank, world, overrides):
    """One measured fwd+bwd on this rank; returns its peak bytes and layer-0 attention bytes."""
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker

    from megatron_lc.config import load_config, resolve_layout
    from megatron_lc.data import build_dataset, make_batch
    from megatron_lc.parallel.token_layout import shard_batch
    from megatron_lc.parallel.topology import Topology
    from tests.support.parity import build

    cfg = load_config(os.path.join(ROOT, "configs/tiny_cpu.yaml"), overrides)
    layout = resolve_layout(cfg, world)
    topo = Topology.build(tp=layout.tp, cp=layout.cp, ulysses=layout.ulysses)
    model, _ = build(cfg, topo)
    batch = shard_batch(make_batch(build_dataset(cfg, [1, 0, 0]).train, [0]), layout, topo)
    total = float(cfg.data.seq_length)

    def step():
        loss = (model(batch["tokens"], batch["position_ids"], batch["labels"]) * batch["loss_mask"]).sum() / total
        loss.backward()

    step()  # warm-up: allocates the gradients, so the measured step accumulates into them
    for q in model.parameters():
        q.grad.zero_()
    topo.comm.reset()
    state_bytes = sum(2 * q.numel() * q.element_size() for q in model.parameters())
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        step()
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    return {"peak_bytes": int(peak), "model_state_bytes": state_bytes, "step_peak_bytes": int(peak - state_bytes),
            "local_tokens": int(batch["tokens"].numel()),
            "attn_bytes": {ph: sum(v for (t, o), v in topo.comm.bytes.items() if t == "layer0.attn" and
                                   o.endswith(ph)) for ph in ("fwd", "bwd")}}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args(argv)

    from megatron_lc.attention.cp_bytes import cp_attention_bytes
    from megatron_lc.config import load_config
    from tests.support.dist import run_dist

    m = load_config(os.path.join(ROOT, "configs/tiny_cpu.yaml")).model
    out = {"command": "python bench/cp_memory.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "model": {"layers": args.layers, "hidden": m.hidden_size, "heads": m.num_attention_heads,
                     "kv_heads": m.num_query_groups, "vocab": m.vocab_size, "seq": args.seq, "batch": 1,
                     "dtype": "fp32"},
           "variants": {}}
    base = None
    for name, cp, kind, u in VARIANTS:
        ranks = run_dist(cp, rank_step, _overrides(cp, kind, u, args.seq, args.layers))
        step_peak = max(r["step_peak_bytes"] for r in ranks)
        base = step_peak if base is None else base
        v = {"cp": cp, "cp_comm_type": kind, "ulysses": u or (cp if kind == "a2a" else 1),
             "per_rank_step_peak_bytes": step_peak,
             "per_rank_peak_bytes_incl_model_state": max(r["peak_bytes"] for r in ranks),
             "per_rank_step_peak_bytes_per_token_of_sequence": step_peak / args.seq,
             "step_peak_ratio_vs_cp1": step_peak / base,
             "ideal_ratio_1_over_cp": 1 / cp}
        if cp > 1:
            formula = cp_attention_bytes(kind, args.seq, 1, m.num_attention_heads, m.num_query_groups,
                                         m.kv_channels, cp, u)
            measured = ranks[0]["attn_bytes"]
            assert all(r["attn_bytes"] == measured for r in ranks), "ranks sent different amounts"
            v["layer_attn_bytes_per_rank"] = {ph: {"measured": measured[ph], "formula": formula[ph]}
                                              for ph in ("fwd", "bwd")}
        out["variants"][name] = v
    _table(out)
    print(json.dumps(out, indent=1))
    return out


def _table(out: dict) -> None:
    err = sys.stderr
    print(f"{'variant':<16}{'step peak MiB':>14}{'B/token':>10}{'vs cp1':>8}{'1/cp':>7}   "
          f"{'attn fwd measured / formula':>30}{'attn bwd measured / formula':>30}", file=err)
    for name, v in out["variants"].items():
        b = v.get("layer_attn_bytes_per_rank")
        fwd = f"{b['fwd']['measured']:>12,} / {b['fwd']['formula']:<12,}" if b else ""
        bwd = f"{b['bwd']['measured']:>12,} / {b['bwd']['formula']:<12,}" if b else ""
        print(f"{name:<16}{v['per_rank_step_peak_bytes'] / 2**20:>14.1f}"
              f"{v['per_rank_step_peak_bytes_per_token_of_sequence']:>10.0f}{v['step_peak_ratio_vs_cp1']:>8.3f}"
              f"{v['ideal_ratio_1_over_cp']:>7.3f}   {fwd:>30}{bwd:>30}", file=err)


if __name__ == "__main__":
    main()
