"""One point of the GPU check (``tests/gpu``, T4-T6) in a fresh process: a few training steps, one JSON line out.

    python bench/gpu_worker.py '<json spec>'     # prints 'GPU_WORKER_RESULT {...}' as its last line

spec: ``{"kind": "framework" | "hf", "device": "cuda" | "cpu", "seq": N, "steps": k, "bf16": bool,
"model": {hidden_size, num_layers, num_attention_heads, num_query_groups, ffn_hidden_size, vocab_size,
rotary_base}, "sets": [extra --set items, framework only], "config": a config file the ``sets`` apply to (framework
only, in place of ``model``: ``bench/gpu_step.py``), "profile_trace": path (profile the last step, Chrome
trace), "simulate_oom_above": N (dry run: tokens above N fail like an out-of-memory, to exercise the search)}``.

The framework runs through ``Trainer.train_step`` (mock data, batch 1, fp32 master weights, bf16 autocast with
``bf16``); Hugging Face ``LlamaForCausalLM`` is built from a config (random init, nothing downloaded) with gradient
checkpointing and SDPA attention and trained by the equivalent plain loop (AdamW, clip 1.0) under the same autocast.
Result: ``ok``, per-step seconds, peak allocated / reserved device bytes, and for the framework the arena's
statistics and, with ``memory.plan: auto``, the plan's peak and lower bound. An out-of-memory error gives
``ok: false, oom: true``; any other error ``ok: false`` with the message.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

MARK = "GPU_WORKER_RESULT "


def framework_sets(spec: dict) -> list:
    m, seq = spec["model"], spec["seq"]
    return [f"model.{k}={v}" for k, v in m.items()] + [
        "model.untie_embeddings_and_output_weights=false", "model.make_vocab_size_divisible_by=128",
        f"model.max_position_embeddings={seq}", f"data.seq_length={seq}", "data.mock_data=true",
        "train.micro_batch_size=1", "train.global_batch_size=1", f"train.train_iters={spec['steps']}",
        f"train.bf16={str(spec['bf16']).lower()}", f"train.device={spec['device']}", "checkpoint.save=",
        "logging.log_interval=1"] + list(spec.get("sets", []))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _profiled(spec: dict, device: torch.device, step_fn, i: int):
    """Run step ``i``; the last one under ``torch.profiler`` when ``profile_trace`` is set (Chrome trace)."""
    if not spec.get("profile_trace") or i != spec["steps"] - 1:
        return step_fn(i)
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CUDA] if device.type == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=acts) as prof:
        out = step_fn(i)
        _sync(device)
    prof.export_chrome_trace(spec["profile_trace"])
    return out


def _framework(spec: dict, device: torch.device, res: dict) -> None:
    from megatron_lc.config import load_config
    from megatron_lc.parallel.topology import Topology
    from megatron_lc.planning import memory_plan as plan_runtime
    from megatron_lc.training.loop import Trainer

    simulate = plan_runtime.simulate

    def keep_sim(trace):  # the caching allocator's simulated reserve is only logged by the plan runtime: keep it
        sim = simulate(trace)
        res["plan_sim_reserved_bytes"] = sim.peak_reserved_bytes
        return sim

    plan_runtime.simulate = keep_sim
    with tempfile.TemporaryDirectory() as d:
        metrics = [f"logging.metrics_file={os.path.join(d, 'm.jsonl')}"]
        if spec.get("config"):  # a config file and its --set items, as given (bench/gpu_step.py)
            cfg = load_config(spec["config"], list(spec.get("sets", [])) + [
                f"train.train_iters={spec['steps']}", f"train.device={spec['device']}",
                f"train.bf16={str(spec['bf16']).lower()}", "data.mock_data=true", "logging.log_interval=1"] + metrics)
        else:
            cfg = load_config(None, framework_sets(spec) + metrics)
        trainer = Trainer(cfg, Topology(), device)
        for i in range(spec["steps"]):
            rec = _profiled(spec, device, trainer.train_step, i)
            res["step_s"].append(rec["step_seconds"])
            res["loss"].append(rec["loss"])
    plan = trainer.ctx.plan.plan if trainer.ctx.plan is not None else None
    if plan is not None:
        res["plan"] = {"peak_bytes": plan.peak_bytes, "lower_bound_bytes": plan.lower_bound_bytes,
                       "status": plan.status, "solver": plan.solver}
    res["arena"] = trainer.ctx.arena.current.stats.summary()
    memo = trainer.ctx.memo
    if memo is not None and memo.offload:
        res["memo_alpha"] = memo.alpha


def _hf(spec: dict, device: torch.device, res: dict) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    m, seq = spec["model"], spec["seq"]
    torch.manual_seed(1234)
    c = LlamaConfig(vocab_size=m["vocab_size"], hidden_size=m["hidden_size"], intermediate_size=m["ffn_hidden_size"],
                    num_hidden_layers=m["num_layers"], num_attention_heads=m["num_attention_heads"],
                    num_key_value_heads=m["num_query_groups"], max_position_embeddings=seq, rms_norm_eps=1e-5,
                    rope_theta=float(m["rotary_base"]), tie_word_embeddings=True, use_cache=False,
                    attn_implementation="sdpa")
    model = LlamaForCausalLM(c).to(device).train()  # fp32 master weights, like the framework
    model.gradient_checkpointing_enable()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    bf16 = spec["bf16"] and device.type == "cuda"

    def step(i):
        ids = torch.randint(0, m["vocab_size"], (1, seq), generator=torch.Generator().manual_seed(i)).to(device)
        _sync(device)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        _sync(device)
        return time.perf_counter() - t0, float(loss)

    for i in range(spec["steps"]):
        dt, loss = _profiled(spec, device, step, i)
        res["step_s"].append(dt)
        res["loss"].append(loss)


def run(spec: dict) -> dict:
    device = torch.device(spec["device"])
    res = {"ok": True, "kind": spec["kind"], "seq": spec["seq"], "step_s": [], "loss": []}
    try:
        if spec.get("simulate_oom_above") is not None and spec["seq"] > spec["simulate_oom_above"]:
            raise torch.OutOfMemoryError(f"simulated: {spec['seq']} tokens > {spec['simulate_oom_above']}")
        (_hf if spec["kind"] == "hf" else _framework)(spec, device, res)
    except torch.OutOfMemoryError as e:
        res.update(ok=False, oom=True, error=str(e).splitlines()[0][:300])
    except Exception as e:  # noqa: BLE001 - reported to the driver, which decides
        res.update(ok=False, oom=False, error=f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
    if device.type == "cuda":
        res["max_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
        res["max_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
    return res


if __name__ == "__main__":
    print(MARK + json.dumps(run(json.loads(sys.argv[1])), default=str), flush=True)
