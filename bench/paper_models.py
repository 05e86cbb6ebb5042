"""The papers' models and a config for one of their runs (``bench/estimate_papers.py``, ``bench/paper_times.py``).

    cfg = config("gpt-7b", 65536, parallel__tensor_model_parallel_size=4, memory__mst=True)   # section__key=value
"""
from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from megatron_lc.config import Config  # noqa: E402

K = 1024
GPT = {"normalization": "LayerNorm", "swiglu": False, "add_bias_linear": True, "position_embedding_type": "rope",
       "vocab_size": 50257}
MODELS = {  # Memo Table 2; FPDT's GPT sizes; Llama 2/3 (ALST's Llama-3.1-8B has Llama3-8B's sizes)
    "gpt-2.7b": dict(GPT, num_layers=32, hidden_size=2560, ffn_hidden_size=10240, num_attention_heads=32),
    "gpt-7b": dict(GPT, num_layers=32, hidden_size=4096, ffn_hidden_size=16384, num_attention_heads=32),
    "gpt-13b": dict(GPT, num_layers=40, hidden_size=5120, ffn_hidden_size=20480, num_attention_heads=40),
    "gpt-30b": dict(GPT, num_layers=48, hidden_size=7168, ffn_hidden_size=28672, num_attention_heads=56),
    "gpt-65b": dict(GPT, num_layers=80, hidden_size=8192, ffn_hidden_size=32768, num_attention_heads=64),
    "llama3-8b": dict(num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
                      num_query_groups=8, vocab_size=128256),
    "llama3-70b": dict(num_layers=80, hidden_size=8192, ffn_hidden_size=28672, num_attention_heads=64,
                       num_query_groups=8, vocab_size=128256),
    "llama2-7b": dict(num_layers=32, hidden_size=4096, ffn_hidden_size=11008, num_attention_heads=32,
                      vocab_size=32000),
}


def config(model: str, seq: int, **sections) -> Config:
    """``model`` at ``seq`` tokens, micro-batch 1, bf16 on CUDA, mock data; ``section__key=value`` overrides."""
    raw = {"model": dict(MODELS[model], max_position_embeddings=seq), "data": {"seq_length": seq, "mock_data": True},
           "train": {"micro_batch_size": 1, "bf16": True, "device": "cuda"}}
    for key, value in sections.items():
        section, name = key.split("__")
        raw.setdefault(section, {})[name] = value
    return Config.from_dict(raw)
