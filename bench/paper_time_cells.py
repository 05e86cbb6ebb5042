"""Every published step-time measurement the estimator's time model is checked against, with its layout and its
set -- data for ``bench/estimate_papers.py --time`` (docs/estimator.md, "Against the published step times").

The split was named before any ratio of the model was computed, and a cell never moves between sets:

* ``calibration`` (may set efficiencies and overheads; nothing else does):
  - Memo's Table 4, "Full Recomputation + Memory Plan" (6 cells, 7B GPT on 8 A800, tp 4 x cp 2): the A800's
    FA2-class attention and GEMM efficiencies (no published kernel figure for that GPU and kernel);
  - Memo's Table 4, "Full Swapping + Memory Plan" (3 cells): the bandwidth of host copies when all eight GPUs of
    the node copy at once;
  - ALST's 1.1M and 2.4M runs (its Table 1): a check of the published FlashAttention-2 figures on H100; they set
    nothing unless the check fails;
  - MsT's Table 6, the two pairs "activation recomputation" / "MsT" at the same batch size (Llama3-8B, batch 2;
    Llama2-7B, batch 8): their step-time difference is MsT's re-run cost; what the four leave after the model's
    step, the host work a step of MsT's harness (its data streamed over the network each step: ``MST_C4_MEAN_TOKENS``
    below). Until 2026-11-28 only the pairs' ratios were used; the harness's host work was added after the
    validation cells had been seen (docs/estimator.md says so).
* ``validation``: the papers' runs of the techniques this framework implements -- Memo's rows of Table 3 (and
  Table 4's one Memo cell with another layout than Table 3's), ALST's other long runs, FPDT's own row, MsT's other
  cells.
* ``baseline``: the systems the papers compare against (Megatron-LM, DeepSpeed-Ulysses, Memo's full recompute
  without a plan, ALST's Hugging Face baselines), reported with what the model cannot represent.

Sources (cite by title): Memo = "Efficiently Training 7B LLM with 1 Million Sequence Length on 8 GPUs" (Tables 3,
4: MFU and TGS; Tables 5-7: layouts); ALST = "Arctic Long Sequence Training: Scalable And Efficient Training For
Multi-Million Token Sequences" (arXiv 2506.13996v1, Tables 1-4: iteration time h:mm:ss and TFLOPS per GPU); FPDT
= "Training Ultra Long Context Language Model with Fully Pipelined Distributed Transformer" (Table 3: MFU); MsT =
"Mini-Sequence Transformer" (Table 6: seconds per step).

What each paper's figure means, and how it is compared (predicted / published throughput, > 1: the model is too
fast):

* Memo: MFU = (6sP + 6nhs^2) per sample / (step x GPUs x 312 TFLOPS), Memo section 5.1 -- the estimator's own
  definition: the ratio is predicted MFU / published MFU.
* ALST: "TFLOPS" counts non-causal attention and the re-run (Megatron-LM's formula with the recompute factor), so
  it is not compared; the published iteration time is: ratio = published seconds / predicted seconds. Its "3.7M"
  and "15M" runs are 3,800,000 and 15,500,000 tokens: the published TFLOPS and times agree only for those lengths
  (590.4 and 590.5 TFLOPS by that formula, 590.6 published; 3.7M and 15M give 559.9 and 553), and ALST's recipes
  say so (ArcticTraining, projects/sequence-parallelism/run-h100-sp8-llama-8b.yml: max_length 3800000;
  run-h100-sp32-llama-8b.yml: 15_500_000; the baselines' recipe: 32_000). The 32K baselines' TFLOPS disagree with
  their times (1-second resolution) and are not used either.
* FPDT: MFU, its definition not stated, no times published: predicted MFU (Memo's definition) / published MFU,
  flagged "definition unknown".
* MsT: seconds per step (its "TFLOPS" column exceeds the A100's 312 peak and is not used): ratio = published
  seconds / predicted seconds.
"""
from __future__ import annotations

K = 1024

# ---- Memo (8 A800-80GB a node, 2 TB host; SP and ZeRO-1 on; Memo offload with a memory plan) --------------------
SEQS = [64, 128, 256, 384, 512, 640, 768, 896, 1024, 1152, 1280, 1408]
# Table 3, Memo's rows: (MFU %, TGS) per sequence; None = oom / oohm
MEMO_T3 = {
    (8, "gpt-7b"): [(52.34, 1786.22), (50.96, 1111.99), (53.62, 679.92), (53.04, 474.02), (51.84, 357.70),
                    (52.59, 295.51), (51.89, 245.76), (52.71, 215.98), (52.30, 188.73), None, None, None],
    (16, "gpt-13b"): [(52.65, 1042.5), (50.93, 667.41), (51.22, 400.39), (51.91, 289.11), (52.40, 226.65),
                      (52.13, 184.33), (51.71, 154.63), (51.76, 134.08), (52.06, 118.96), (51.74, 105.74),
                      (51.78, 95.72), (52.10, 87.93)],
    (32, "gpt-30b"): [(52.12, 516.16), (49.66, 344.09), (50.00, 216.41), (50.69, 159.52), (51.06, 126.23),
                      (51.72, 105.28), (51.18, 88.55), (51.50, 77.48), (51.24, 68.20), (51.73, 61.72),
                      (51.59, 55.79), None],
    (64, "gpt-65b"): [(47.80, 230.62), (48.61, 167.69), (49.87, 109.58), (48.85, 78.76), (49.71, 63.29),
                      (50.05, 52.65), (51.16, 45.84), (51.05, 39.85), (51.27, 35.45), (51.20, 31.77),
                      (51.42, 28.94), (51.45, 26.50)],
}
# Table 7: (tp, cp, dp, pp, alpha) per sequence, or the status Table 3 publishes ("oom" / "oohm"); the 65B row's
# alpha line is labelled "AR" in the text extraction
MEMO_T7 = {
    (8, "gpt-7b"): [(2, 2, 2, 1, 0.0), (4, 2, 1, 1, 0.0), (4, 2, 1, 1, 1.0), (4, 2, 1, 1, 0.5), (4, 2, 1, 1, 0.125),
                    (4, 2, 1, 1, 0.125), (4, 2, 1, 1, 0.0), (4, 2, 1, 1, 0.0), (8, 1, 1, 1, 0.0), "oom", "oom", "oom"],
    (16, "gpt-13b"): [(2, 2, 4, 1, 0.0), (4, 2, 2, 1, 0.0), (4, 2, 2, 1, 0.0), (4, 2, 1, 2, 0.0), (4, 4, 1, 1, 0.5),
                      (4, 4, 1, 1, 0.125), (4, 4, 1, 1, 0.125), (4, 4, 1, 1, 0.0), (4, 4, 1, 1, 0.0),
                      (4, 4, 1, 1, 0.0), (4, 4, 1, 1, 0.0), (4, 4, 1, 1, 0.0)],
    (32, "gpt-30b"): [(4, 1, 8, 1, 0.0), (8, 1, 4, 1, 0.0), (8, 2, 2, 1, 0.0), (8, 2, 2, 1, 0.0), (8, 2, 2, 1, 0.0),
                      (8, 4, 1, 1, 0.25), (8, 4, 1, 1, 0.125), (8, 4, 1, 1, 0.125), (8, 4, 1, 1, 0.125),
                      (8, 4, 1, 1, 0.125), (8, 4, 1, 1, 0.0), "oohm"],
    (64, "gpt-65b"): [(8, 1, 8, 1, 0.0), (4, 4, 4, 1, 0.0), (8, 4, 2, 1, 0.0), (8, 8, 1, 1, 0.25), (8, 8, 1, 1, 0.25),
                      (8, 8, 1, 1, 0.25), (8, 8, 1, 1, 0.25), (8, 8, 1, 1, 0.125), (8, 8, 1, 1, 0.125),
                      (8, 8, 1, 1, 0.0), (8, 8, 1, 1, 0.0), (8, 8, 1, 1, 0.0)],
}
# Table 4 (7B GPT on 8 A800, tp 4 x cp 2 fixed, section 5.3): MFU % per sequence of SEQS[:8]; None = oom / oohm
MEMO_T4 = {
    "full recompute": [41.19, 23.00, 29.07, 25.67, None, None, None, None],
    "full recompute + plan": [42.91, 43.17, 42.05, 42.49, 41.90, 42.15, None, None],
    "full swapping + plan": [37.40, 46.33, 53.62, None, None, None, None, None],
    # 128K-896K are Table 3's 7B cells (the same layout); 64K is another layout than Table 3's (tp 2 x cp 2 x dp 2)
    # and alpha 0 (section 5.3.2: at 64K only the layer input and the attention output go to the host)
    "memo": [47.99, 50.96, 53.62, 53.04, 51.84, 52.59, 51.89, 52.71],
}
# Table 3's baselines: (MFU %, TGS) per sequence, and their layouts (Tables 5, 6); full recompute ("AR On") always
MEGATRON_T3 = {
    (8, "gpt-7b"): [(41.55, 1417.74), (24.13, 526.62), (29.07, 368.65), (27.98, 250.07), (34.43, 237.56),
                    (30.90, 173.63)],
    (16, "gpt-13b"): [(38.51, 762.46), (23.02, 301.67), (25.30, 197.78), (22.88, 127.40), (29.10, 125.86),
                      (19.41, 83.94)],
    (32, "gpt-30b"): [(35.76, 354.20), (14.70, 101.85), (17.15, 74.24), (23.32, 73.37)],
    (64, "gpt-65b"): [(22.79, 109.94), (15.10, 52.10), (9.57, 21.03), (12.07, 19.46), (5.32, 6.77)],
}
MEGATRON_T6 = {  # (tp, cp, dp, pp); the 7B row lists 4 layouts where Table 3 has 6 cells: 512K, 640K have none
    (8, "gpt-7b"): [(2, 4, 1, 1), (4, 2, 1, 1), (4, 2, 1, 1), (4, 2, 1, 1)],
    (16, "gpt-13b"): [(8, 2, 1, 1), (4, 2, 1, 2), (4, 2, 1, 2), (4, 2, 1, 2), (8, 2, 1, 1), (8, 2, 1, 1)],
    (32, "gpt-30b"): [(4, 4, 1, 2), (4, 8, 1, 1), (8, 4, 1, 1), (8, 4, 1, 1)],
    (64, "gpt-65b"): [(8, 8, 1, 1), (32, 1, 2, 1), (16, 1, 1, 4), (16, 4, 1, 1), (64, 1, 1, 1)],
}
DEEPSPEED_T3 = {
    (8, "gpt-7b"): [(27.95, 935.76), (25.46, 555.51), (23.38, 296.48)],
    (16, "gpt-13b"): [(27.97, 553.85), (25.45, 333.51), (21.98, 171.82)],
    (32, "gpt-30b"): [(29.93, 296.41), (25.54, 176.92)],
    (64, "gpt-65b"): [(31.05, 149.8), (26.13, 90.15), (22.07, 48.51), (20.40, 32.89), (19.83, 25.24), (19.06, 20.04),
                      (19.53, 17.50), (19.12, 14.93), (19.00, 13.14), (19.11, 11.86), (18.90, 10.64)],
}
DEEPSPEED_T5 = {  # (Ulysses SP, dp); ZeRO-3
    (8, "gpt-7b"): [(2, 4), (4, 2), (8, 1)],
    (16, "gpt-13b"): [(4, 4), (8, 2), (8, 2)],
    (32, "gpt-30b"): [(8, 4), (8, 4)],
    (64, "gpt-65b"): [(8, 8), (8, 8), (16, 4), (32, 2), (32, 2), (32, 2), (64, 1), (64, 1), (64, 1), (64, 1),
                      (64, 1)],
}

# ---- ALST (Llama-3.1-8B-Instruct, 8 H100-80GB a node; flash_attn 2.7.4; ZeRO-3 + optimizer states on the CPU,
# activation checkpointing, bf16; micro-batch 1, non-packed samples) -----------------------------------------------
# (id, table, gpus, tokens, seconds, ulysses, tiled logits & loss, tiled MLP, checkpoint offload, set)
# the baselines run data parallel (each GPU its own sample: ZeRO-3 over all GPUs, no sequence parallelism); the
# 1-GPU cells also offload the weights (its footnote 24)
ALST = [
    ("alst-t1-32k", "Table 1", 8, 32_000, 17, False, False, False, False, "baseline"),
    ("alst-t1-160k", "Table 1", 8, 160_000, 2 * 60 + 3, False, True, False, False, "baseline"),
    ("alst-t1-1.1m", "Table 1", 8, 1_100_000, 9 * 60 + 24, True, True, False, False, "calibration"),
    ("alst-t1-1.2m", "Table 1", 8, 1_200_000, 11 * 60 + 43, True, True, True, False, "validation"),
    ("alst-t1-2.4m", "Table 1", 8, 2_400_000, 43 * 60 + 30, True, True, False, True, "calibration"),
    ("alst-t3-3.7m", "Tables 1, 3", 8, 3_800_000, 3600 + 47 * 60 + 35, True, True, True, True, "validation"),
    ("alst-t2-32k", "Table 2", 1, 32_000, 26, False, False, False, False, "baseline"),
    ("alst-t2-500k", "Table 2", 1, 500_000, 16 * 60 + 50, False, True, True, True, "validation"),
    ("alst-t4-32k", "Table 4", 32, 32_000, 12, False, False, False, False, "baseline"),
    ("alst-t4-15m", "Table 4", 32, 15_500_000, 7 * 3600 + 25 * 60 + 9, True, True, True, True, "validation"),
]

# ---- FPDT (A100-80GB, 4 a node, 1 TB host; Table 3: Llama 3 8B on 8 GPUs) -----------------------------------------
# Its last row is FPDT's own setup (section 5.1: activation checkpointing with CPU offload, Ulysses, ZeRO-3, FPDT
# with 64K chunks, FFN and loss chunked): 4M tokens, 55.7% MFU. The other rows' check marks are lost in the text
# this project has; their layouts cannot be read, so they are not used.
FPDT = [("fpdt-t3-4m", 8, 4 * K * K, 55.7, "validation")]

# ---- MsT (one A100-80GB; Hugging Face Llama; Table 6) --------------------------------------------------------------
# (id, model, tokens, batch, variant, seconds, set); variant: vanilla | recompute | mst (with recompute) |
# mst_no_recompute
MST = [
    ("mst-llama3-recompute-b2", "llama3-8b", 8 * K, 2, "recompute", 5.01, "calibration"),
    ("mst-llama3-mst-b2", "llama3-8b", 8 * K, 2, "mst", 5.13, "calibration"),
    ("mst-llama3-mst-b8", "llama3-8b", 8 * K, 8, "mst", 19.35, "validation"),
    ("mst-llama2-vanilla-b1", "llama2-7b", 4 * K, 1, "vanilla", 1.24, "validation"),
    ("mst-llama2-recompute-b1", "llama2-7b", 4 * K, 1, "recompute", 1.52, "validation"),
    ("mst-llama2-mst-no-recompute-b1", "llama2-7b", 4 * K, 1, "mst_no_recompute", 1.31, "validation"),
    ("mst-llama2-recompute-b8", "llama2-7b", 4 * K, 8, "recompute", 8.85, "calibration"),
    ("mst-llama2-mst-b8", "llama2-7b", 4 * K, 8, "mst", 9.33, "calibration"),
    ("mst-llama2-mst-b16", "llama2-7b", 4 * K, 16, "mst", 17.92, "validation"),
]
# the same-batch pairs (calibration): their difference is MsT's re-run cost, what is left of all four after the
# model's step the harness's host work a step (paper_times.fit)
MST_PAIRS = [("mst-llama3-recompute-b2", "mst-llama3-mst-b2"), ("mst-llama2-recompute-b8", "mst-llama2-mst-b8")]
# How MsT's published harness ran a step (github.com/wdlctc/mini-s, benchmark.py and benchmark_minis.py, July 2024:
# the only benchmark scripts MsT published; Table 6 is taken to come from them). The timed region holds a fresh
# iterator over allenai/c4 "en" streamed from the Hugging Face Hub, each sample one document tokenized and padded to
# the length, its attention mask handed to flash_attention_2 (which drops the padding: varlen over the real tokens),
# fp16 weights, torch.optim.Adam(foreach=False) per parameter in post-accumulate-grad hooks, loss.item().
# C4's documents: 828,589,180,707 bytes over 364,868,892 examples in the dataset card (text, url, timestamp): about
# 2,180 bytes of text, 545 tokens at 4 bytes a token (an assumption for Llama's tokenizers on English web text).
# The estimator is given them as packed documents of that mean (data.mean_document_length): S x 545 / 2 pairs a
# sample, an upper bound of the padded document's E[min(L, S)^2] / 2 whatever the lengths' spread (min(L, S) <= S);
# no attention at all is the lower bound, 0.01 s a sample below it at 4K (0.02 at 8K).
MST_C4_MEAN_TOKENS = 545
