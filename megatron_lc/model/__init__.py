"""The Llama / GPT model, built from parts the spec hands out (``compose/spec.py``) -- no parallel logic and
no choice of technique here:

    transformer.py   GPTModel, TransformerLayer (pre_attention / core attention / post_attention, residual)
    attention.py     AttentionProjections, SelfAttention (QKV + RoPE -> core attention -> out-proj)
    mlp.py, head.py  MLP (SwiGLU / GeLU), LM head + cross entropy
    norm.py, rope.py RMSNorm / LayerNorm, RoPE with its scalings (Llama 3, YaRN, linear)
    init.py          layout-independent initialisation (each full tensor drawn from (seed, name), then cut)
    probe.py         the synthetic layer input the technique calibrations run on
"""
