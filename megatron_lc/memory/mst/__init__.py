"""MsT: mini-sequence MLP and LM head + loss (Mini-Sequence Transformer, section 3). ``modules.py``: the two
modules the model spec constructs; ``moe.py``: the MoE block in mini-sequences; ``mlp_function.py`` /
``head_function.py``: their chunked autograd functions; ``rules.py``: the chunk sizes (shared with the estimator)."""
from .modules import MiniSequenceLMHead, MiniSequenceMLP
from .moe import MiniSequenceMoE
from .rules import MIN_HEAD_CHUNK, head_chunk_count, head_chunk_tokens, mlp_chunk_tokens

__all__ = ["MiniSequenceLMHead", "MiniSequenceMLP", "MiniSequenceMoE", "MIN_HEAD_CHUNK", "head_chunk_count",
           "head_chunk_tokens",
           "mlp_chunk_tokens"]
