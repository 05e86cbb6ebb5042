"""Check, in the image or on a node before a job books GPUs, that this Python's torch, flash-attn and
TransformerEngine have every API the code calls: a missing one otherwise fails hours into a job (the first save, the
first document-masked block) or, worse, on one rank.

    python tools/preflight.py                          # torch (its CUDA part when it is a CUDA build)
    python tools/preflight.py --require flash-attn,te  # the image: both must be installed, with their APIs

flash-attn, TransformerEngine and FlashAttention-3 / 4 are optional (``parallel.attention_backend: auto`` uses what
is installed and measured, PyTorch's own kernels without them): checked when installed, required only with
``--require``. The CUDA part of torch (its fused attention
kernels registered for CUDA, ``cudaHostRegister``, the pluggable allocator) is checked when torch is a CUDA build,
with or without a GPU (an image builds without one). The last line is one line either way (wrapped here)::

    preflight: torch 2.13.0 (CUDA 12.8), flash-attn 2.7.4.post1, te 2.8.0: every API the code calls is present
    preflight: missing: torch.distributed.fsdp.FSDPModule.set_force_sum_reduction_for_comms (FSDP2's gradient SUM
    over gloo, parallel/fsdp.py); ... -- with torch 2.7.0a0 (CUDA 12.9), flash-attn 2.7.3, te 2.2.0

Exit status: 0 all present, 1 something missing, 2 bad input.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import json
import sys
from dataclasses import dataclass
from typing import Optional

try:
    import torch
except ImportError:  # no torch at all is this tool's first finding: main says it in its one line
    torch = None


@dataclass(frozen=True)
class Api:
    """``path``: a module and the attributes below it (``torch.distributed.fsdp.FSDPModule.set_gradient_divide_
    factor``), or ``aten::op`` / ``aten::op@CUDA`` (an operator, with a kernel for that dispatch key); ``params``:
    keyword arguments the code passes; ``why``: where the code calls it."""

    path: str
    why: str
    params: tuple = ()


TORCH = [
    Api("torch.distributed.fsdp.fully_shard", "FSDP2, parallel/fsdp.py", ("mesh", "mp_policy", "offload_policy",
                                                                          "shard_placement_fn",
                                                                          "reshard_after_forward")),
    Api("torch.distributed.fsdp.FSDPModule.set_force_sum_reduction_for_comms",
        "FSDP2's gradient SUM over gloo, parallel/fsdp.py"),
    Api("torch.distributed.fsdp.FSDPModule.set_gradient_divide_factor", "FSDP2, parallel/fsdp.py"),
    Api("torch.distributed.fsdp.MixedPrecisionPolicy", "FSDP2 bf16, parallel/fsdp.py", ("cast_forward_inputs",)),
    Api("torch.distributed.fsdp.CPUOffloadPolicy", "parallel.fsdp_cpu_offload", ("pin_memory",)),
    Api("torch.distributed.tensor.DTensor.from_local", "checkpoint shards, training/checkpointing/sharded_state.py",
        ("run_check", "shape", "stride")),
    Api("torch.distributed.device_mesh.DeviceMesh.from_group", "FSDP2 and checkpoints", ("mesh", "mesh_dim_names")),
    Api("torch.distributed.checkpoint.save", "checkpoints", ("storage_writer", "no_dist")),
    Api("torch.distributed.checkpoint.async_save", "checkpoint.async_save", ("storage_writer", "process_group",
                                                                            "no_dist", "async_stager")),
    Api("torch.distributed.checkpoint.staging.DefaultStager", "the async save's one staging area, async_save.py"),
    Api("torch.distributed.checkpoint.staging.StagingOptions", "pinned, reused checkpoint staging",
        ("use_pinned_memory", "use_shared_memory", "use_async_staging", "use_non_blocking_copy")),
    Api("torch.distributed.reduce_scatter_tensor", "sequence parallelism's reduce-scatter, parallel/collectives.py"),
    Api("torch.distributed.checkpoint.load", "resume", ("storage_reader", "no_dist")),
    Api("torch.distributed.checkpoint.filesystem._StorageInfo", "checkpoint metadata read as data"),
    Api("torch.nn.functional.rms_norm", "RMSNorm on CUDA, model/norm.py"),
    Api("torch.nn.attention.varlen.varlen_attn", "document masks as ranges on CUDA (attention/fused_cuda.py)"),
    Api("aten::_scaled_dot_product_flash_attention", "core attention (bf16), attention/fused_cuda.py"),
    Api("aten::_scaled_dot_product_flash_attention_backward", "core attention backward from a merged lse"),
    Api("aten::_scaled_dot_product_efficient_attention", "core attention (fp32, masks), attention/fused_cuda.py"),
    Api("aten::_scaled_dot_product_efficient_attention_backward", "core attention backward (fp32, masks)"),
    Api("aten::_scaled_dot_product_cudnn_attention", "attention_backend cudnn, attention/hopper.py"),
    Api("aten::_scaled_dot_product_cudnn_attention_backward", "attention_backend cudnn backward from a merged lse"),
    Api("torch.nn.attention.activate_flash_attention_impl", "attention_backend fa3 / fa4, attention/hopper.py"),
    Api("torch.nn.attention.list_flash_attention_impls", "attention_backend fa3 / fa4 (auto skips them without)"),
    Api("torch.nn.attention.current_flash_attention_impl", "attention_backend fa3 / fa4"),
    Api("torch.get_autocast_dtype", "MsT and Memo under autocast"),
    Api("torch.utils.backend_registration._setup_privateuseone_for_python_backend",
        "the rehearsal's stand-in device, rehearsal/standin.py"),
    Api("torch.library.Library.fallback", "the rehearsal's autocast, rehearsal/standin_autocast.py"),
]
TORCH_CUDA = [
    Api("aten::_scaled_dot_product_flash_attention@CUDA", "core attention (bf16) on the GPU"),
    Api("aten::_scaled_dot_product_efficient_attention@CUDA", "core attention (fp32, masks) on the GPU"),
    Api("aten::_scaled_dot_product_cudnn_attention@CUDA", "attention_backend cudnn on the GPU"),
    Api("torch.cuda.cudart", "the host pool's cudaHostRegister, device/adapter.py"),
    Api("torch.cuda.memory.CUDAPluggableAllocator", "planning/replay_cuda.py"),
    Api("torch.cuda.memory._record_memory_history", "the memory plan's CUDA trace, planning/capture/"),
]
FLASH_ATTN = [
    Api("flash_attn.flash_attn_interface._flash_attn_forward", "attention_backend flash, attention/backends.py",
        ("window_size_left", "window_size_right", "softcap", "alibi_slopes", "return_softmax")),
    Api("flash_attn.flash_attn_interface._flash_attn_backward", "attention_backend flash backward"),
]
TE = [
    Api("transformer_engine.pytorch.cpp_extensions.fused_attn.fused_attn_fwd", "attention_backend te",
        ("attn_scale", "dropout")),
    Api("transformer_engine.pytorch.cpp_extensions.fused_attn.fused_attn_bwd", "attention_backend te backward"),
    Api("transformer_engine.pytorch.cpp_extensions.fused_attn.FusedAttnBackend", "attention_backend te"),
    Api("transformer_engine.pytorch.constants.TE_DType", "attention_backend te"),
]
FA3 = [Api("torch.ops.flash_attn_3.fwd", "attention_backend fa3 (what torch's FA3 registry calls)"),
       Api("torch.ops.flash_attn_3.bwd", "attention_backend fa3 backward")]
FA4 = [Api("flash_attn.cute.interface._flash_attn_fwd", "attention_backend fa4 (what torch's FA4 registry calls)"),
       Api("flash_attn.cute.interface._flash_attn_bwd", "attention_backend fa4 backward")]
PACKAGES = {"flash-attn": ("flash_attn", FLASH_ATTN), "te": ("transformer_engine", TE),
            "fa3": ("flash_attn_interface", FA3), "fa4": ("flash_attn.cute.interface", FA4)}


def resolve(path: str):
    """The object at ``path`` (the longest importable module, then attributes); AttributeError / ImportError when
    a part is missing."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            if i == 1:
                raise
            continue
        for name in parts[i:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(path)


def missing(api: Api) -> Optional[str]:
    """What is missing of ``api`` (None: all of it is there)."""
    if api.path.startswith("aten::"):
        name, _, key = api.path[len("aten::"):].partition("@")
        op, _, overload = name.partition(".")
        if not hasattr(torch.ops.aten, op):
            return api.path
        if key and not torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{op}", key):
            return f"{api.path} (no {key} kernel)"
        return None
    try:
        obj = resolve(api.path)
    except (ImportError, AttributeError):
        return api.path
    if api.params:
        try:
            params = inspect.signature(obj).parameters
        except (TypeError, ValueError):  # a C function without a signature: present is all that can be said
            return None
        absent = [p for p in api.params if p not in params]
        if absent and not any(p.kind == p.VAR_KEYWORD for p in params.values()):
            return f"{api.path}({', '.join(absent)}=)"
    return None


def check(require: set) -> tuple[list, list]:
    """(what was checked, one line each: "torch 2.13.0 (CUDA 12.8)"; what is missing: "path (why)")."""
    checks = list(TORCH)
    seen = [f"torch {torch.__version__} ({'CUDA ' + torch.version.cuda if torch.version.cuda else 'CPU build'})"]
    if torch.version.cuda:
        checks += TORCH_CUDA
    gaps = []
    for name, (module, apis) in PACKAGES.items():
        try:
            mod = importlib.import_module(module)
        except ImportError:
            seen.append(f"{name} absent" + ("" if name in require else " (optional)"))
            if name in require:
                gaps.append(f"{module} ({name} is required and not installed)")
            continue
        seen.append(f"{name} {getattr(mod, '__version__', '?')}")
        checks += apis
    gaps += [f"{m} ({api.why})" for api in checks if (m := missing(api)) is not None]
    return seen, gaps


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--require", default="", help="comma-separated: flash-attn, te, fa3, fa4 (default: none required)")
    p.add_argument("--json", default=None, help="also write the line and what is missing to this file")
    args = p.parse_args(argv)
    require = {r.strip() for r in args.require.split(",") if r.strip()}
    unknown = require - set(PACKAGES)
    if unknown:
        print(f"error: --require {args.require!r}: unknown {', '.join(sorted(unknown))} (known: "
              f"{', '.join(PACKAGES)})", file=sys.stderr)
        return 2
    if torch is None:
        print("preflight: missing: torch (not installed in this Python)")
        return 1
    seen, gaps = check(require)
    line = (f"preflight: missing: {'; '.join(gaps)} -- with {', '.join(seen)}" if gaps else
            f"preflight: {', '.join(seen)}: every API the code calls is present")
    print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"line": line, "seen": seen, "missing": gaps}, f, indent=1)
    return 1 if gaps else 0


if __name__ == "__main__":
    sys.exit(main())
