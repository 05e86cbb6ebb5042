"""Data resumption without loss: the global sample ids every rank reads (recorded by a test hook on
``TrainingSetup.microbatches``) over an interrupted-and-resumed run are exactly those of an uninterrupted run -- none
skipped, none repeated -- also when the resumed run uses another global batch size or data-parallel size."""
import itertools

from tests.dist_cases import faults as dist_cases_faults
from tests.support.dist import run_dist


def _all_ids(per_rank):
    """Per-rank lists of per-step ids -> the sorted global ids of every step (dp ranks read disjoint shares)."""
    return [sorted(itertools.chain(*step)) for step in zip(*per_rank)]


def test_resume_reads_every_sample_exactly_once_dp2(tmp_path):
    """Uninterrupted, step t reads global samples [8t, 8t+8) (data/dataset.py's schedule); 3 steps + save +
    resume + 3 steps must read exactly those."""
    common = ["train.global_batch_size=8", "train.micro_batch_size=2"]
    ck = str(tmp_path / "ck")
    first = run_dist(2, dist_cases_faults.record_sample_ids,
                     common + ["train.train_iters=3", f"checkpoint.save={ck}"])
    second = run_dist(2, dist_cases_faults.record_sample_ids,
                      common + ["train.train_iters=6", f"checkpoint.save={ck}", f"checkpoint.load={ck}"])
    ids = _all_ids([r[0] for r in first]) + _all_ids([r[0] for r in second])
    assert ids == [list(range(8 * t, 8 * t + 8)) for t in range(6)]
    # each rank reads its own share: in step 4, dp rank 0 reads micro-batches [24, 25], [28, 29]
    assert second[0][0][0] == [24, 25, 28, 29] and second[1][0][0] == [26, 27, 30, 31]
    assert second[0][1] == second[1][1] == 48


def test_resume_with_other_batch_size_and_dp_continues_at_the_next_sample(tmp_path):
    """3 steps of 8 samples on one rank, then resumed on dp=2 with 4 samples per step: ids 24, 25, ... follow
    (the data position is the number of consumed samples, not the step number)."""
    ck = str(tmp_path / "ck")
    (before, consumed, _), = [dist_cases_faults.record_sample_ids(0, 1, ["train.global_batch_size=8",
                                                                        "train.train_iters=3",
                                                                        f"checkpoint.save={ck}"])]
    assert consumed == 24
    after = run_dist(2, dist_cases_faults.record_sample_ids,
                     ["train.global_batch_size=4", "train.train_iters=5", f"checkpoint.save={ck}",
                      f"checkpoint.load={ck}"])
    ids = list(itertools.chain(*before)) + list(itertools.chain(*_all_ids([r[0] for r in after])))
    assert ids == list(range(32))
    assert after[0][1] == 32
