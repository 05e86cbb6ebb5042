"""T2: the CPU parity cases that fit one device, on this device. fp32 (TF32 off): loss within 1e-5 relative and
every gradient within 1e-4 of the plain model on the same device (the CPU contract, tests/support/parity.py); bf16
autocast:
loss within 2e-2 of the fp32 plain model. Memo alpha 0 / 1/4 / 1, full and selective recompute, FPDT P=1 u=4 with
and without offload, MsT, ``memory.plan: auto``."""
import pytest
import torch

from megatron_lc.config import resolve_execution, resolve_layout
from megatron_lc.parallel.topology import Topology
from megatron_lc.training.setup import build_and_calibrate
from tests.support.parity import GRAD_ATOL, LOSS_RTOL, batch_for, small_config

SEQ = ["data.seq_length=256", "model.num_layers=3"]
CASES = {
    "memo-a0": ["memory.activation_offload=memo", "memory.offload_fraction=0"],
    "memo-a0.25": ["memory.activation_offload=memo", "memory.offload_fraction=0.25"],
    "memo-a1": ["memory.activation_offload=memo", "memory.offload_fraction=1"],
    "full-recompute": ["memory.recompute_granularity=full"],
    "selective": ["memory.recompute_granularity=selective"],
    "fpdt-u4": ["parallel.cp_comm_type=fpdt", "memory.fpdt_chunk_size=64", "memory.fpdt_offload=false"],
    "fpdt-u4-offload": ["parallel.cp_comm_type=fpdt", "memory.fpdt_chunk_size=64", "memory.fpdt_offload=true"],
    "mst": ["memory.mst=true", "memory.mst_mlp_chunk_size=64", "memory.mst_head_chunks=4"],
    "plan-auto": ["memory.plan=auto", "memory.plan_time_limit=1"],
}


def loss_and_grads(overrides, device, autocast=False):
    cfg = small_config(SEQ + list(overrides))
    topo = Topology()
    layout = resolve_layout(cfg, 1)
    b = {k: v.to(device) for k, v in batch_for(cfg).items()}
    model, ctx = build_and_calibrate(cfg, layout, topo, resolve_execution(cfg, device), batch=lambda: b)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        tok = model(b["tokens"], b["position_ids"], b["labels"])
    loss = (tok.float() * b["loss_mask"]).sum() / b["loss_mask"].sum()
    loss.backward()
    return float(loss.detach()), {n: p.grad.detach().float().cpu() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def plain(device):
    return loss_and_grads([], device)


@pytest.mark.parametrize("name", list(CASES))
def test_fp32_equals_the_plain_model(device, record, plain, name):
    ref_loss, ref_grads = plain
    loss, grads = loss_and_grads(CASES[name], device)
    err = max((grads[k] - ref_grads[k]).abs().max().item() for k in ref_grads)
    record("T2 fp32 parity on the device", name, {"loss_rel": f"{abs(loss - ref_loss) / abs(ref_loss):.1e}",
                                                  "grad_max_abs": f"{err:.1e}"})
    assert abs(loss - ref_loss) <= LOSS_RTOL * abs(ref_loss) and err <= GRAD_ATOL, (loss, ref_loss, err)


@pytest.mark.parametrize("name", ["memo-a0.25", "fpdt-u4-offload", "mst"])
def test_bf16_close_to_fp32(device, record, plain, name):
    if device.type != "cuda":
        pytest.skip("bf16 autocast: CUDA")
    loss, _ = loss_and_grads(CASES[name], device, autocast=True)
    record("T2 bf16 autocast vs fp32 plain (loss)", name, f"{abs(loss - plain[0]) / abs(plain[0]):.1e}")
    assert abs(loss - plain[0]) <= 2e-2 * abs(plain[0])
