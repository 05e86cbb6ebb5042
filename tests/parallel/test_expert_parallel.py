"""Expert parallelism (parallel/expert_parallel.py) trains as one process.

* The tiny Qwen3-MoE, Qwen2-MoE and Mixtral (tests/dist_cases/moe.py) under ep 2 over 2 ranks (dp 2, ring cp 2,
  Ulysses cp 2 with one kv head, FPDT with offload, FSDP2, MsT, token-wise recompute with MsT, host checkpoints under
  the ring, packed documents under the ring; Memo's offload with MsT at ep 1) and over 4 ranks (ep 2 beside tp 2 +
  SP; ep 4 over dp 2 x cp 2 with the ring, Ulysses, FPDT, FSDP2, MsT, token-wise recompute, host checkpoints,
  documents; ep 4 over the hybrid's cp 4): the first step's full gradients within 1e-4 of the single-process model's
  and both steps' losses within 1e-5 relative (tests/support/parity.py). The layouts re-associate fp32 sums (~1e-7
  relative per op); the routing is discrete, so a token whose k-th and (k+1)-th probabilities were within ~1e-7
  could pick another expert under another layout -- none does in these runs (a flip would show as a loss off by
  ~1e-3). The router gradients hold the load-balancing loss's (coefficient 0.02, over every rank's tokens of the
  micro-batch): seen failing with it over a rank's own tokens (the embedding's gradient 2.0e-3 off) and with rows
  sent by another rank's counts (every case).
* Dropless: a block whose router puts expert 0 in every token's top-2 (ep 2 and ep 4: expert 0's rank receives
  every token of the group) gives the one-process output and gradients.
* Checkpoints saved under ep (with and without FSDP2's shards of the experts) resume at another layout.
"""
from __future__ import annotations

import pytest
import torch

from tests.dist_cases import families as df
from tests.dist_cases import moe as dm
from tests.support.dist import run_dist
from tests.support.parity import assert_close_grads

pytest.importorskip("transformers")


def test_ep2_trains_as_one_process_under_every_layout():
    cases = [(f"{family}/{layout}", dm.section(family), over) for family in ("qwen3_moe", "mixtral")
             for layout, over in dm.EP2.items()]
    cases.append(("qwen2_moe/ring", dm.section("qwen2_moe"), dm.EP2["ring"]))
    cases += [(f"{family}/ep1/{t}", dm.section(family), over) for family in ("qwen3_moe", "mixtral")
              for t, over in dm.EP1.items()]
    df.check_as_one_process(cases, run_dist(2, df.train_cases, cases))


def test_ep2_and_ep4_on_four_ranks_train_as_one_process():
    cases = [(f"qwen3_moe/{layout}", dm.section("qwen3_moe"), over) for layout, over in dm.EP4.items()]
    cases.append(("qwen2_moe/ep2/tp2+sp", dm.section("qwen2_moe"), dm.EP4["ep2/tp2+sp"]))
    df.check_as_one_process(cases, run_dist(4, df.train_cases, cases))


@pytest.mark.parametrize("ep", [2, 4])
def test_one_expert_taking_every_token_gives_the_one_process_block(ep):
    """Every token's copies reach expert 0 (on expert rank 0): its rank receives the whole group's tokens."""
    got = run_dist(ep, dm.one_expert_block, ep)
    ref = dm.one_expert_block(0, 1, 1)
    assert ref["counts"][0] == 24  # expert 0 in every token's top-2
    y = torch.cat([g["y"] for g in got])
    dx = torch.cat([g["dx"] for g in got])
    assert (y - ref["y"]).abs().max() <= 1e-5, (y - ref["y"]).abs().max()
    assert (dx - ref["dx"]).abs().max() <= 1e-5
    assert abs(got[0]["aux"] - ref["aux"]) <= 1e-6 * ref["aux"]
    assert_close_grads(got[0]["grads"], ref["grads"])


@pytest.mark.parametrize("saved_at,resumed_at", [
    (dm.ep(2) + ["train.micro_batch_size=1"], ["parallel.use_torch_fsdp2=true", "train.micro_batch_size=1"]),
    (dm.ep(2) + ["parallel.use_torch_fsdp2=true", "train.micro_batch_size=1"], dm.EP2["ring"]),
], ids=["ep2-to-fsdp2-ep1", "ep2-fsdp2-to-ring-ep2"])
def test_checkpoint_saved_under_ep_resumes_at_another_layout(tmp_path, saved_at, resumed_at):
    """The experts are stored whole ([E, ...], DCP), so a checkpoint saved at one ep (with or without FSDP2's
    shards of them) resumes at another: step 3 after the resume is step 3 of the run that never stopped."""
    got = run_dist(2, dm.save_then_resume, dm.section("qwen3_moe"), saved_at, resumed_at, str(tmp_path / "run"))
    for r in got:
        assert len(r["resumed"]) == 1 and len(r["whole"]) == 3
        a, b = r["resumed"][0], r["whole"][2]
        assert abs(a - b) <= 1e-5 * abs(b), (a, b)
