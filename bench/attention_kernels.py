"""Time every attention backend this GPU can run at the kernel calls the shipped layouts make, forward and backward
from an external lse, and write the TFLOP/s and efficiency per call kind into the GPU's hardware profile.

    python bench/attention_kernels.py --write-profile      # on a GPU: every runnable backend, every call kind
    python bench/attention_kernels.py --scale 0.25         # sequence lengths x 0.25 (a quicker, rougher table)
    python bench/attention_kernels.py --dry-run            # no GPU: the calls, their FLOPs and the JSON's layout

The calls (``attention/kernel_table.CALL_KINDS``) of ``--config`` (default configs/llama3_8b_1m.yaml: 32 query / 8
kv heads, head dim 128, 1M tokens) on ``--cp`` GPUs (default the config's, 8), bf16, batch 1, each as the cores pass
it (q, k, v, dout ``[b, n, s, d]`` views of ``[s, b, n, d]`` tensors)::

    ring_diagonal  ring attention's causal diagonal block: 2 zigzag chunks, 128K x 128K, 32 / 8 heads
    ring_block     an off-diagonal block: 128K queries x 64K keys (or the reverse), non-causal, 32 / 8 heads
    ulysses        Ulysses: the full-length causal call with the heads / cp, 1M x 1M, 4 / 1 heads
    fpdt_diagonal  FPDT with ``--fpdt-chunks`` chunks (16): a gathered chunk's causal diagonal, 64K, 4 / 1 heads
    fpdt_block     FPDT: a chunk against an earlier one, 64K x 64K non-causal, 4 / 1 heads

Per backend (torch, cudnn, flash, te, fa3, fa4 -- in that order: FlashAttention-3 / 4 take over PyTorch's flash
kernel for the rest of the process once activated) and call: one warm-up, then the median of ``--repeats`` timed
forwards (CUDA events) and of as many backwards, each backward given the forward's out and lse as ring attention
gives the merged ones. FLOPs: 4 sq sk d nq forward (half that causal), 2.5x backward (``kernel_table.BWD_FLOPS``);
efficiency = TFLOP/s over the profile's ``peak_tflops_bf16``. A backend this process cannot run is skipped with its
reason; a call that fails (out of memory, unsupported) is recorded with its error and left out of the table.

JSON on stdout and in ``--out`` (default bench/results/attention_kernels_<gpu>_<date>.json), a side-by-side table
on stderr (TFLOP/s and the ratio to ``torch``); ``--write-profile`` puts the table into the profile whose
``gpu_names`` the GPU's name contains (``estimate/hardware.profile_for_gpu``), where ``parallel.attention_backend:
auto`` and the estimator read it. Stops starting new measurements after ``--budget-s`` seconds (default 420).
No figure of this benchmark exists yet: no GPU has run it (docs/gpu.md).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402  (after the path)

from megatron_lc.attention.backends import Kernels, missing  # noqa: E402
from megatron_lc.attention.kernel_table import BWD_FLOPS, CALL_KINDS, write_table  # noqa: E402
from megatron_lc.config import ConfigError, load_config  # noqa: E402
from megatron_lc.config.layout import kv_replication  # noqa: E402
from megatron_lc.estimate.hardware import load_hardware, profile_for_gpu  # noqa: E402

BACKENDS = ("torch", "cudnn", "flash", "te", "fa3", "fa4")


def calls(cfg, cp: int, fpdt_chunks: int, scale: float) -> dict:
    """{kind: dict(sq, sk, nq, nkv, d, causal)} of the shipped layouts (module doc); lengths times ``scale``."""
    m = cfg.model
    nq, nkv, d = m.num_attention_heads, m.num_query_groups or m.num_attention_heads, m.hidden_size // \
        m.num_attention_heads
    s = int(cfg.data.seq_length * scale)
    c = s // (2 * cp)  # a zigzag chunk of ring attention
    un, ukv = nq // cp, nkv * kv_replication(nq, nkv, cp) // cp  # heads after Ulysses' all-to-all
    chunk = s // fpdt_chunks
    return {"ring_diagonal": dict(sq=2 * c, sk=2 * c, nq=nq, nkv=nkv, d=d, causal=True),
            "ring_block": dict(sq=2 * c, sk=c, nq=nq, nkv=nkv, d=d, causal=False),
            "ulysses": dict(sq=s, sk=s, nq=un, nkv=ukv, d=d, causal=True),
            "fpdt_diagonal": dict(sq=chunk, sk=chunk, nq=un, nkv=ukv, d=d, causal=True),
            "fpdt_block": dict(sq=chunk, sk=chunk, nq=un, nkv=ukv, d=d, causal=False)}


def forward_flops(call: dict) -> float:
    full = 4.0 * call["sq"] * call["sk"] * call["d"] * call["nq"]
    return full / 2 if call["causal"] else full


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_call(backend, call: dict, device, repeats: int) -> dict:
    """Median forward and backward milliseconds of one call (the backward from the forward's out and lse)."""
    g = torch.Generator(device=device).manual_seed(0)

    def views(n, s):  # [b, n, s, d] views of [s, b, n, d] tensors, as core.to_bnsd hands them over
        return torch.randn(s, 1, n, call["d"], generator=g, device=device, dtype=torch.bfloat16).permute(1, 2, 0, 3)

    q, k, v = views(call["nq"], call["sq"]), views(call["nkv"], call["sk"]), views(call["nkv"], call["sk"])
    dout = views(call["nq"], call["sq"])
    out, lse = backend.forward(q, k, v, call["causal"])  # warm-up (and the out, lse the backward is given)
    backend.backward(dout, q, k, v, out, lse, call["causal"])
    fwd = _median_ms(lambda: backend.forward(q, k, v, call["causal"]), repeats)
    bwd = _median_ms(lambda: backend.backward(dout, q, k, v, out, lse, call["causal"]), repeats)
    return {"fwd_ms": fwd, "bwd_ms": bwd}


def versions() -> dict:
    out = {"torch": torch.__version__, "cuda": torch.version.cuda,
           "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None}
    for module, key in (("flash_attn", "flash_attn"), ("transformer_engine", "transformer_engine"),
                        ("flash_attn_interface", "flash_attn_3")):
        try:
            out[key] = getattr(__import__(module), "__version__", "installed")
        except ImportError:
            pass
    return out


def table_of(results: dict, gpu: str, capability: str, peak: float, cs: dict) -> dict:
    """The ``attention_measured`` mapping (``kernel_table.py``) of the measured calls."""
    backends = {}
    for name, per in results["backends"].items():
        for kind, r in per.items():
            if "fwd_ms" in r:
                f_t = forward_flops(cs[kind]) / (r["fwd_ms"] * 1e-3) / 1e12
                b_t = BWD_FLOPS * forward_flops(cs[kind]) / (r["bwd_ms"] * 1e-3) / 1e12
                backends.setdefault(name, {})[kind] = {"fwd_tflops": round(f_t, 1), "bwd_tflops": round(b_t, 1),
                                                       "fwd": round(f_t / peak, 4), "bwd": round(b_t / peak, 4)}
    return {"gpu": gpu, "capability": capability, "date": results["date"], "versions": results["versions"],
            "peak_tflops": peak, "calls": cs, "backends": backends}


def side_by_side(table: dict) -> str:
    rows = [f"{'call':14s} " + " ".join(f"{b:>16s}" for b in table["backends"]) + "   (fwd / bwd TFLOP/s; x torch)"]
    base = table["backends"].get("torch", {})
    for kind in CALL_KINDS:
        cells = []
        for per in table["backends"].values():
            r = per.get(kind)
            ratio = f" x{r['fwd_tflops'] / base[kind]['fwd_tflops']:.2f}" if r and kind in base else ""
            cells.append(f"{r['fwd_tflops']:.0f}/{r['bwd_tflops']:.0f}{ratio}" if r else "-")
        rows.append(f"{kind:14s} " + " ".join(f"{c:>16s}" for c in cells))
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=os.path.join(ROOT, "configs", "llama3_8b_1m.yaml"))
    p.add_argument("--cp", type=int, default=None, help="GPUs the sequence is cut over (default: the config's cp)")
    p.add_argument("--fpdt-chunks", type=int, default=16)
    p.add_argument("--scale", type=float, default=1.0, help="multiply every sequence length by this")
    p.add_argument("--kinds", default=",".join(CALL_KINDS), help="comma-separated call kinds")
    p.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated, measured in this order")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--budget-s", type=float, default=420.0)
    p.add_argument("--profile", default=None, help="hardware profile (default: the one naming this GPU)")
    p.add_argument("--write-profile", action="store_true", help="write the table into the hardware profile")
    p.add_argument("--out", default=None)
    p.add_argument("--dry-run", action="store_true", help="print the calls and their FLOPs; time nothing")
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config)
        cs = calls(cfg, args.cp or cfg.parallel.context_parallel_size, args.fpdt_chunks, args.scale)
        kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
        names = [b.strip() for b in args.backends.split(",") if b.strip()]
        bad = [k for k in kinds if k not in CALL_KINDS] + [b for b in names if b not in BACKENDS]
        if bad:
            raise ConfigError(f"unknown call kind or backend {bad[0]!r}; valid: {', '.join(CALL_KINDS + BACKENDS)}")
        cs = {k: cs[k] for k in kinds}
        if args.dry_run:
            listed = {k: {**c, "fwd_tflop": forward_flops(c) / 1e12} for k, c in cs.items()}
            if args.out:
                with open(args.out, "w") as f:
                    json.dump({"dryrun": True, "calls": listed}, f, indent=1)
            print(json.dumps(listed, indent=1))
            return 0
        if not torch.cuda.is_available():
            raise ConfigError("no CUDA device: this benchmark times GPU kernels (--dry-run lists the calls)")
        device = torch.device("cuda", 0)
        gpu = torch.cuda.get_device_name(device)
        capability = ".".join(map(str, torch.cuda.get_device_capability(device)))
        profile = args.profile or profile_for_gpu(gpu, torch.cuda.get_device_properties(device).total_memory / 2**30)
        if profile is None:
            raise ConfigError(f"no hardware profile names {gpu!r} in its gpu_names (give --profile)")
        peak = load_hardware(profile).peak_tflops_bf16
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    start = time.monotonic()
    results = {"gpu": gpu, "capability": capability, "date": datetime.date.today().isoformat(),
               "versions": versions(), "profile": profile, "peak_tflops": peak, "calls": cs, "backends": {},
               "skipped": {}, "not_run": []}
    for name in names:
        why = missing(name, device)
        if why is not None:
            results["skipped"][name] = why
            continue
        backend = Kernels(name)(device)
        for kind in kinds:
            if time.monotonic() - start > args.budget_s:
                results["not_run"].append(f"{name} {kind}")
                continue
            try:
                r = time_call(backend, cs[kind], device, args.repeats)
            except (RuntimeError, NotImplementedError) as e:  # out of memory, a shape the kernel refuses
                r = {"error": str(e).splitlines()[0][:300]}
            results["backends"].setdefault(name, {})[kind] = r
            torch.cuda.empty_cache()
            print(f"{name} {kind}: {r}", file=sys.stderr, flush=True)
    table = table_of(results, gpu, capability, peak, cs)
    results["table"] = table
    out = args.out or os.path.join(ROOT, "bench", "results", f"attention_kernels_{gpu.replace(' ', '_')}_"
                                                            f"{results['date']}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(results, f, indent=1)
    print(json.dumps(results, indent=1))
    print(side_by_side(table), file=sys.stderr)
    if args.write_profile and table["backends"]:
        write_table(profile, table)
        print(f"wrote attention_measured into {profile}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
