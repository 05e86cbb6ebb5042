"""One measurement of ``bench/activation_bytes.py`` in a fresh process:

    python bench/activation_worker.py '<json spec>'      # prints one JSON line

spec: ``{"kind": "framework"|"hf", "sets": [--set items, complete] | "hf": {model dims, "gradient_checkpointing"},
"layer_checkpoint": bool, "seq": N, "steps": k, "threads": t}``. Runs k training steps and reports, per step, wall
and CPU seconds and the peak RSS of forward+backward and of the rest of the step (see the driver's docstring).
"""
from __future__ import annotations

import json
import os
import resource
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class PeakMeter:
    """Peak RSS of a phase: Linux resets the high-water mark on ``echo 5 > /proc/self/clear_refs``; elsewhere the
    process-lifetime ``ru_maxrss`` is used (then phases cannot be separated)."""

    def __init__(self) -> None:
        self.lifetime = 0  # the process's peak across resets
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.resettable = True
        except OSError:
            self.resettable = False

    def reset(self) -> None:
        self.lifetime = max(self.lifetime, self.peak())
        if self.resettable:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")

    @staticmethod
    def peak() -> int:
        r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(r if sys.platform == "darwin" else r * 1024)


class StepRecorder:
    """Per step: wall and CPU seconds, peak RSS of forward+backward (reset at its start, read at its end) and of
    the whole step (reset at the step's start), loss."""

    def __init__(self) -> None:
        self.meter, self.steps = PeakMeter(), []

    def start_step(self) -> None:
        self.meter.reset()
        self.cur = {"t0": time.perf_counter(), "c0": time.process_time()}

    def start_fwd_bwd(self) -> None:
        self.meter.reset()

    def end_fwd_bwd(self) -> None:
        self.cur["peak_fwd_bwd"] = self.meter.peak()
        self.meter.reset()

    def end_step(self, loss: float) -> None:
        c = self.cur
        self.steps.append({"wall_s": time.perf_counter() - c["t0"], "cpu_s": time.process_time() - c["c0"],
                           "peak_fwd_bwd": c["peak_fwd_bwd"], "peak_optimizer": self.meter.peak(),
                           "loss": loss})


def _framework_steps(spec: dict, metrics_file: str, rec: StepRecorder):
    sys.path.insert(0, ROOT)
    import torch

    from megatron_lc.config import ConfigError, load_config
    from megatron_lc.parallel.topology import Topology
    from megatron_lc.training.loop import Trainer

    from megatron_lc.memory.recompute import with_layer_checkpoint

    try:  # layer_checkpoint: HF's scheme on our model, for the comparison rows
        trainer = Trainer(load_config(None, spec["sets"] + [f"logging.metrics_file={metrics_file}"]), Topology(),
                          torch.device("cpu"), adjust_spec=with_layer_checkpoint if spec.get("layer_checkpoint") else None)
    except ConfigError as e:
        return str(e)
    fwd_bwd = trainer.forward_backward
    rt = trainer.ctx.memo  # Memo's own accounting, when present

    def measured_fwd_bwd(batches):  # Trainer.train_step calls self.forward_backward: bracket it
        if rt is not None:
            rt.account.reset_peak()
        rec.start_fwd_bwd()
        out = fwd_bwd(batches)
        rec.end_fwd_bwd()
        return out

    trainer.forward_backward = measured_fwd_bwd
    for step in range(spec["steps"]):
        rec.start_step()
        out = trainer.train_step(step)
        rec.end_step(out["loss"])
    ck = trainer.ctx.checkpoints  # activation_offload checkpoints: the layer inputs' host share
    if ck is not None:
        rec.memo = {"host_bytes": ck.pool.reserved[ck.TAG]}
    if rt is not None:
        rec.memo = {"host_bytes": rt.host_bytes(), "accounted_peak_bytes": rt.account.peak, "alpha": rt.alpha,
                    "rounding_buffer_bytes": 2 * rt.buffers[0].capacity if rt.buffers[0] is not None else 0}
    return None


def _hf_steps(spec: dict, rec: StepRecorder) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1234)
    m, seq = spec["hf"], spec["seq"]
    c = LlamaConfig(vocab_size=m["vocab_size"], hidden_size=m["hidden_size"], intermediate_size=m["ffn_hidden_size"],
                    num_hidden_layers=m["num_layers"], num_attention_heads=m["num_attention_heads"],
                    num_key_value_heads=m["num_query_groups"], max_position_embeddings=seq, rms_norm_eps=1e-5,
                    rope_theta=10000.0, tie_word_embeddings=False, use_cache=False, attn_implementation="sdpa")
    model = LlamaForCausalLM(c).float().train()
    if m.get("gradient_checkpointing"):
        model.gradient_checkpointing_enable()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    for step in range(spec["steps"]):
        ids = torch.randint(0, m["vocab_size"], (1, seq), generator=torch.Generator().manual_seed(step))
        rec.start_step()
        opt.zero_grad(set_to_none=True)
        rec.start_fwd_bwd()
        out = model(input_ids=ids, labels=ids, use_cache=False)
        loss = out.loss
        del out  # do not keep the full logits alive through backward (what a lean HF loop does)
        loss.backward()
        rec.end_fwd_bwd()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        rec.end_step(float(loss))


def worker(spec: dict) -> dict:
    import tempfile

    import torch

    torch.set_num_threads(spec["threads"])
    rec = StepRecorder()
    if spec["kind"] == "hf":
        _hf_steps(spec, rec)
    else:
        with tempfile.TemporaryDirectory() as d:
            err = _framework_steps(spec, os.path.join(d, "metrics.jsonl"), rec)
        if err is not None:
            return {"available": False, "reason": err}
    last = rec.steps[-1]  # Adam states exist and grads were freed by zero_grad: the steady state
    return {"available": True, "peak_fwd_bwd": last["peak_fwd_bwd"],
            "peak_step": max(last["peak_fwd_bwd"], last["peak_optimizer"]),
            "peak_process": max(rec.meter.lifetime, PeakMeter.peak()),
            "peak_resettable": rec.meter.resettable, "steps": rec.steps, "memo": getattr(rec, "memo", None)}


if __name__ == "__main__":
    print(json.dumps(worker(json.loads(sys.argv[1]))))
