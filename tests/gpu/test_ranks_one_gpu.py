"""Several ranks on one GPU: 2 processes on ``cuda:0`` joined by gloo (NCCL refuses two ranks on one device) run
ring attention (cp = 2), Ulysses (cp = 2) and tensor parallelism (tp = 2) of the small parity model; the global
loss within 1e-5 relative and every gradient within 1e-4 of one rank on the same device (the CPU contract,
tests/support/parity.py; fp32, TF32 off). First a probe records which collectives gloo takes with CUDA tensors (each in
its
own processes: a refusal may kill them); a case whose collectives it refuses is skipped, saying which. Dry run:
the same on the CPU (what the CPU suite checks), through the same harness."""
import pytest

from tests.support.dist import run_dist
from tests.gpu import _ranks
from tests.support.parity import GRAD_ATOL, LOSS_RTOL

SEQ = ["data.seq_length=64"]
CASES = {  # name -> (overrides, the collectives it needs on device tensors)
    "ring-cp2": (["parallel.context_parallel_size=2", "parallel.cp_comm_type=p2p"], ("all_reduce", "p2p")),
    "ulysses-cp2": (["parallel.context_parallel_size=2", "parallel.cp_comm_type=a2a"], ("all_reduce", "all_to_all")),
    "tp2": (["parallel.tensor_model_parallel_size=2"], ("all_reduce", "all_gather")),
}
OPS = ("all_reduce", "all_gather", "all_to_all", "p2p")


@pytest.fixture(scope="module")
def gloo_takes(device, record):
    got = {}
    for op in OPS:
        try:
            got[op] = run_dist(2, _ranks.probe, op, device.type)[0]
        except AssertionError as e:  # a rank raised or died
            got[op] = str(e).strip().splitlines()[-1][:300]
    record("Several ranks on one GPU (gloo)", f"gloo with {device.type} tensors", got)
    return got


@pytest.fixture(scope="module")
def one_rank(device):
    return run_dist(1, _ranks.loss_and_grads, SEQ, device.type)[0]


@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks_equal_one(device, record, gloo_takes, one_rank, name):
    overrides, needs = CASES[name]
    refused = {op: gloo_takes[op] for op in needs if gloo_takes[op] != "ok"}
    if refused:
        record("Several ranks on one GPU (gloo)", name, {"skipped": refused})
        pytest.skip(f"gloo does not take {device.type} tensors for {', '.join(refused)}: {refused}")
    ref_loss, ref_grads = one_rank
    results = run_dist(2, _ranks.loss_and_grads, SEQ + overrides, device.type)
    loss, grads = results[0]
    err = max((grads[k] - ref_grads[k]).abs().max().item() for k in ref_grads)
    record("Several ranks on one GPU (gloo)", name, {"loss_rel": f"{abs(loss - ref_loss) / abs(ref_loss):.1e}",
                                                      "grad_max_abs": f"{err:.1e}"})
    assert results[1][0] == loss, results  # every rank reports the global loss
    assert abs(loss - ref_loss) <= LOSS_RTOL * abs(ref_loss) and err <= GRAD_ATOL, (loss, ref_loss, err)
