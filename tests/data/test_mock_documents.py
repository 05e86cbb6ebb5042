"""Mock documents (``data.mock_data`` with ``data.mean_document_length``): packed documents of seeded long-tailed
lengths whose length-weighted mean (sum len^2 / sum len, what the key means) is the one asked for; the batch's host
document ranges follow the end-of-document tokens."""
import numpy as np

from megatron_lc.config import load_config
from megatron_lc.data import build_dataset, make_batch
from megatron_lc.data.dataset import MockDataset, document_lengths, mock_document_ends


def lw_mean(lengths) -> float:
    n = np.asarray(lengths, dtype=np.float64)
    return float((n * n).sum() / n.sum())


def test_lengths_have_the_requested_length_weighted_mean():
    """200,000 lengths per target. Tolerance 3%: with sigma 1 the sum of len^2 has a coefficient of variation of
    sqrt(e^4 / 200000) ~ 1.7%, and the seeded draw is one fixed sample (measured deviations 0.7-1.3%). The plain mean
    is the length-weighted one over e (lognormal, sigma 1), the long tail of real corpora (the demo's: 2.7x)."""
    rng = np.random.default_rng(0)
    for target in (64, 1024, 65536):
        n = document_lengths(rng, 200_000, target)
        assert abs(lw_mean(n) / target - 1) < 0.03, (target, lw_mean(n))
        assert abs(n.mean() / (target / np.e) - 1) < 0.03 and n.min() >= 1


def test_mock_samples_are_seeded_packed_documents():
    """Same (seed, sample) -> the same tokens; another seed or sample -> others. The end-of-document id ends each
    document and appears nowhere else. Over 100 samples of 65536 tokens, the tokens' length-weighted mean document
    length is within 10% of 1024 (measured 1.045: a few hundred documents a sample, so the long tail sets the
    sample; documents straddling a sample's ends are cut, which shortens a few)."""
    ds = MockDataset(65536, 1000, seed=1, mean_document_length=1024)
    a = ds[3]
    assert (ds[3] == a).all() and (ds[4] != a).any() and (MockDataset(65536, 1000, 2, 0, 1024)[3] != a).any()
    lengths = []
    for k in range(100):
        ends = np.flatnonzero(ds[k][:-1] == ds.eod)
        lengths += np.diff(np.concatenate([[0], ends + 1, [65536]])).tolist()
    assert abs(lw_mean([n for n in lengths if n]) / 1024 - 1) < 0.10
    g = np.random.default_rng(0)
    ends = mock_document_ends(g, 1000, 64)
    assert (np.diff(ends) > 0).all() and ends.min() >= 0 and ends.max() < 1000


def test_mock_batch_carries_the_documents():
    cfg = load_config(None, ["data.mock_data=true", "data.seq_length=4096", "data.reset_attention_mask=true",
                             "data.mean_document_length=256", "model.vocab_size=512"])
    batch = make_batch(build_dataset(cfg, [2, 0, 0]).train, [0, 1], cfg.data)
    docs = batch["documents"]
    assert docs.rows == 2 and docs.seq_length == 4096 and len(docs.cu[0]) > 4
    assert (docs.ids() == batch["document_ids"]).all()
