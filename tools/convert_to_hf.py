"""Export a megatron_lc checkpoint to a Hugging Face Llama directory (``config.json`` + safetensors).

    python tools/convert_to_hf.py runs/tiny_cpu OUT/                 # newest complete checkpoint of a save dir
    python tools/convert_to_hf.py runs/tiny_cpu/iter_0000100 OUT/ --dtype bfloat16
    # then: transformers.LlamaForCausalLM.from_pretrained("OUT/")

What it does:
- merges the tp shards ``model_tp00.pt ... model_tp{tp-1}.pt`` with ``merge_shards`` and each parameter's
  ``partition = (dim, stride)`` (read off the model built on the meta device, so the layout has one source);
- splits the fused QKV weight, whose full layout is grouped by kv head ``[g: q_0..q_{r-1}, k, v]`` (r = heads per
  kv head), into ``q_proj`` (query head ``g*r + j``, the order HF's ``repeat_kv`` expects), ``k_proj``, ``v_proj``;
- splits the SwiGLU ``fc1`` weight ``[gate; up]`` into ``gate_proj`` and ``up_proj``;
- drops the vocabulary padding rows (``model.make_vocab_size_divisible_by``) unless ``--keep-padded-vocab``;
- tied embeddings -> ``tie_word_embeddings: true`` and no ``lm_head.weight``;
- RoPE needs no permutation: the model rotates halves (``rotate_half``), as HF Llama does;
- copies the SentencePiece tokenizer (``data.tokenizer_model`` of the checkpoint, or ``--tokenizer``) when found.
Only Llama-style models export (RMSNorm, SwiGLU, RoPE); anything else is refused with a one-line error (exit 2).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import re
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megatron_lc.config import Config, ConfigError, ParallelConfig, resolve_layout  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def partitions(cfg: Config, tp: int) -> dict:
    """``{parameter name: (dim, stride) or None}`` of the plain model for ``tp`` (built on the meta device)."""
    from megatron_lc.model.transformer import GPTModel
    from megatron_lc.parallel.parallelize import ModelParts
    from megatron_lc.parallel.topology import Topology

    plain = copy.deepcopy(cfg)  # only tp shapes the parameters; cp, SP and memory features do not
    plain.parallel = ParallelConfig(tensor_model_parallel_size=tp)
    topo = Topology(world_size=tp, rank=0, tp=tp)
    with torch.device("meta"):  # the default spec: the plain model's classes
        model = GPTModel(plain.model, ModelParts(plain, resolve_layout(plain, tp), topo))
    return {n: (p.partition if getattr(p, "tensor_model_parallel", False) else None)
            for n, p in model.named_parameters()}


def load_full_state(ckpt_dir: str, cfg: Config, tp: int) -> dict:
    """The full (unsharded) state dict of the checkpoint: tp shards merged along each parameter's partition."""
    from megatron_lc.parallel.tensor_parallel import merge_shards

    shards = []
    for r in range(tp):
        path = os.path.join(ckpt_dir, f"model_tp{r:02d}.pt")
        if not os.path.isfile(path):
            raise ConfigError(f"{path} not found (the checkpoint has tp={tp} shards)")
        shards.append(torch.load(path, map_location="cpu", weights_only=True))
    parts = partitions(cfg, tp)
    unknown = sorted(set(shards[0]) - set(parts))
    if unknown:
        raise ConfigError(f"checkpoint keys not in the model: {unknown[:5]}")
    return {name: merge_shards([s[name] for s in shards], parts[name]).float() for name in shards[0]}


def check_exportable(m) -> None:
    problems = []
    if m.normalization != "RMSNorm":
        problems.append(f"model.normalization={m.normalization}")
    if not m.swiglu:
        problems.append("model.swiglu=false")
    if m.position_embedding_type != "rope":
        problems.append(f"model.position_embedding_type={m.position_embedding_type}")
    if problems:
        raise ConfigError(f"only Llama-style models (RMSNorm, SwiGLU, RoPE) export to LlamaForCausalLM; this "
                          f"checkpoint has {', '.join(problems)}")


def to_hf(state: dict, m, keep_padded_vocab: bool = False) -> dict:
    """Full framework state dict -> HF Llama tensor names."""
    d, nq, nkv, f = m.kv_channels, m.num_attention_heads, m.num_query_groups, m.ffn_hidden_size
    r = nq // nkv
    vocab = m.padded_vocab_size if keep_padded_vocab else m.vocab_size
    out = {"model.embed_tokens.weight": state["embedding.weight"][:vocab],
           "model.norm.weight": state["final_layernorm.weight"]}
    if m.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = state["head.output_layer.weight"][:vocab]
    for i in range(m.num_layers):
        src, dst = f"layers.{i}.", f"model.layers.{i}."
        out[dst + "input_layernorm.weight"] = state[src + "input_layernorm.weight"]
        out[dst + "post_attention_layernorm.weight"] = state[src + "pre_mlp_layernorm.weight"]
        for kind in ("weight", "bias") if m.add_bias_linear else ("weight",):
            qkv = state[src + f"self_attention.linear_qkv.{kind}"]
            grouped = qkv.view(nkv, r + 2, d, *qkv.shape[1:])  # [g: q_0..q_{r-1}, k, v]
            out[dst + f"self_attn.q_proj.{kind}"] = grouped[:, :r].reshape(nq * d, *qkv.shape[1:])
            out[dst + f"self_attn.k_proj.{kind}"] = grouped[:, r].reshape(nkv * d, *qkv.shape[1:])
            out[dst + f"self_attn.v_proj.{kind}"] = grouped[:, r + 1].reshape(nkv * d, *qkv.shape[1:])
            out[dst + f"self_attn.o_proj.{kind}"] = state[src + f"self_attention.linear_proj.{kind}"]
            fc1 = state[src + f"mlp.linear_fc1.{kind}"]  # [gate; up]
            out[dst + f"mlp.gate_proj.{kind}"], out[dst + f"mlp.up_proj.{kind}"] = fc1[:f], fc1[f:]
            out[dst + f"mlp.down_proj.{kind}"] = state[src + f"mlp.linear_fc2.{kind}"]
    return out


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def hf_config(m, dtype: str, keep_padded_vocab: bool, bos: int | None, eos: int | None,
              trained_length: int = 0) -> dict:
    """The ``config.json`` of model section ``m``; ``max_position_embeddings`` is at least ``trained_length`` (the
    sequence length the checkpoint was trained at, which may exceed the declared value under RoPE)."""
    scaling = dict(m.rope_scaling or {"rope_type": "default"})
    rope = {**scaling, "rope_theta": m.rotary_base}
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": m.padded_vocab_size if keep_padded_vocab else m.vocab_size,
        "hidden_size": m.hidden_size, "intermediate_size": m.ffn_hidden_size, "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_attention_heads, "num_key_value_heads": m.num_query_groups,
        "head_dim": m.kv_channels, "hidden_act": "silu",
        "max_position_embeddings": max(m.max_position_embeddings, trained_length),
        "rms_norm_eps": m.norm_epsilon,
        # transformers < 5 reads rope_theta and rope_scaling, >= 5 rope_parameters
        "rope_theta": m.rotary_base, "rope_scaling": m.rope_scaling, "rope_parameters": rope,
        "tie_word_embeddings": not m.untie_embeddings_and_output_weights,
        "attention_bias": m.add_bias_linear, "mlp_bias": m.add_bias_linear, "attention_dropout": 0.0,
        "initializer_range": m.init_method_std, "bos_token_id": bos, "eos_token_id": eos, "use_cache": True,
        "torch_dtype": dtype, "dtype": dtype,
    }


def write_safetensors(tensors: dict, out: str, max_shard_bytes: int) -> list[str]:
    """``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``; files get
    the permissions of their siblings (safetensors writes through a private 0600 temporary file)."""
    from safetensors.torch import save_file as _save_file

    mode = 0o666 & ~_umask()

    def save_file(tensors_, path, metadata):
        _save_file(tensors_, path, metadata=metadata)
        os.chmod(path, mode)

    shards, current, size = [], {}, 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = t.contiguous().clone()  # no shared storage (views of one fused tensor)
        size += nbytes
    shards.append(current)
    if len(shards) == 1:
        save_file(shards[0], os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
        return ["model.safetensors"]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for fname, shard in zip(names, shards):
        save_file(shard, os.path.join(out, fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    return names


def copy_tokenizer(path: str, out: str) -> tuple[int, int]:
    """Copy a SentencePiece model as ``tokenizer.model`` with a LlamaTokenizer config; returns (bos, eos) ids."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor()
    sp.Load(path)
    shutil.copyfile(path, os.path.join(out, "tokenizer.model"))
    special = {k: sp.IdToPiece(i) for k, i in (("bos_token", sp.bos_id()), ("eos_token", sp.eos_id()),
                                                ("unk_token", sp.unk_id()), ("pad_token", sp.pad_id())) if i >= 0}
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "LlamaTokenizer", "add_bos_token": False, "add_eos_token": False,
                   "legacy": True, "model_max_length": None, **special}, f, indent=1)
    return sp.bos_id(), sp.eos_id()


def _size(text: str) -> int:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMG]?)B?", text.strip().upper())
    if not m:
        raise ConfigError(f"--max-shard-size {text!r}: use e.g. 5GB, 500MB, 1000000")
    return int(float(m.group(1)) * {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}[m.group(2)])


def convert(checkpoint: str, out: str, dtype: str = "float32", keep_padded_vocab: bool = False,
            max_shard_size: str = "5GB", tokenizer: str | None = None) -> str:
    """Write the HF directory ``out`` for ``checkpoint`` (a save dir or one ``iter_N`` dir); returns the iter dir."""
    from megatron_lc.training.checkpoint import find_latest, read_meta

    path = find_latest(checkpoint) if os.path.isdir(checkpoint) else None
    if path is None:
        raise ConfigError(f"no complete checkpoint (a directory with meta.json) at {checkpoint}")
    meta = read_meta(path)
    saved = meta["config"]
    data = saved.get("data", {})
    if data.get("prepare_demo_data") and (data.get("data_path") or data.get("tokenizer_model")):
        # checkpoints from before the demo files were keyed by vocabulary name both: those paths are the files
        saved = dict(saved, data=dict(data, prepare_demo_data=False))
    cfg = Config.from_dict(saved)
    check_exportable(cfg.model)
    state = to_hf(load_full_state(path, cfg, meta["tp"]), cfg.model, keep_padded_vocab)
    os.makedirs(out, exist_ok=True)
    bos = eos = None
    tok = tokenizer or cfg.data.files(cfg.model.vocab_size)[1]
    if tok and os.path.isfile(tok):
        bos, eos = copy_tokenizer(tok, out)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(hf_config(cfg.model, dtype, keep_padded_vocab, bos, eos, cfg.data.seq_length), f, indent=1)
    write_safetensors({k: v.to(DTYPES[dtype]) for k, v in state.items()}, out, _size(max_shard_size))
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", help="a checkpoint.save directory (newest complete checkpoint) or an iter_N dir")
    p.add_argument("out", help="output directory for config.json + safetensors")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--keep-padded-vocab", action="store_true", help="export the padded vocabulary rows too")
    p.add_argument("--max-shard-size", default="5GB")
    p.add_argument("--tokenizer", help="SentencePiece .model to copy (default: the checkpoint's data.tokenizer_model)")
    a = p.parse_args(argv)
    try:
        path = convert(a.checkpoint, a.out, a.dtype, a.keep_padded_vocab, a.max_shard_size, a.tokenizer)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported {path} -> {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
