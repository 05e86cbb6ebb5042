"""Export a megatron_lc checkpoint to a Hugging Face directory (``config.json`` + safetensors) of its family:
Llama, Mistral, Qwen2, Qwen3 or Gemma 3 (``model.hf_architecture``, set by the importer; else the first family whose
switches the model has: ``megatron_lc/hf/families.py``).

    .venv/bin/python tools/convert_to_hf.py runs/tiny_cpu OUT/        # newest complete checkpoint of a save dir
    .venv/bin/python tools/convert_to_hf.py runs/tiny_cpu/iter_0000100 OUT/ --dtype bfloat16
    # then: transformers.AutoModelForCausalLM.from_pretrained("OUT/")

What it does:
- an imported model (``tools/convert_from_hf.py``) goes back with the ``config.json`` and ``generation_config.json``
  it was imported from, every field as it was but those the run changed (``model.hf_import``; a context
  extension's RoPE, a length trained past ``max_position_embeddings``): export what was imported, plus the trained
  weights; a model made here gets its family's config.json from its model keys;
- reads the full weights whatever the layout they were saved at (torch.distributed.checkpoint; format-2
  checkpoints: merges the tp shards ``model_tp00.pt ...`` along each parameter's ``partition = (dim, stride)``);
- splits the fused QKV weight, whose full layout is grouped by kv head ``[g: q_0..q_{r-1}, k, v]`` (r = heads per
  kv head), into ``q_proj`` (query head ``g*r + j``, the order HF's ``repeat_kv`` expects), ``k_proj``, ``v_proj``;
- splits the SwiGLU ``fc1`` weight ``[gate; up]`` into ``gate_proj`` and ``up_proj``;
- drops the vocabulary padding rows (``model.make_vocab_size_divisible_by``) unless ``--keep-padded-vocab``;
- tied embeddings -> ``tie_word_embeddings: true`` and no ``lm_head.weight``;
- RoPE needs no permutation: the model rotates halves (``rotate_half``), as Hugging Face does;
- the family's norms (Gemma's four a layer, q/k norms) under its names; windows, per-layer RoPE and the query scale
  as the family's config fields;
- writes the run's tokenizer (``data.tokenizer_model`` of the checkpoint, or ``--tokenizer``): a Hugging Face
  directory's tokenizer files byte for byte (an import's, with its chat template), a tokenizer.json as transformers
  saves it, a SentencePiece model as ``tokenizer.model`` with a LlamaTokenizer config; ``bos_token_id`` /
  ``eos_token_id`` in config.json are the tokenizer's (``AutoTokenizer`` loads the export). A run's tokenizer whose
  files are gone is said and left out; a ``--tokenizer`` that does not load is an error before anything is written.
A model no family fits (LayerNorm, learned positions, ...) is refused with a one-line error (exit 2).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megatron_lc.config import Config, ConfigError, DataConfig  # noqa: E402
from megatron_lc.data import DataError, build_tokenizer  # noqa: E402
from megatron_lc.data.tokenizer import HuggingFaceTokenizer, SentencePieceTokenizer, tokenizer_type_of  # noqa: E402
from megatron_lc.hf import copy_tokenizer_files, export_config, export_family, to_hf  # noqa: E402
from megatron_lc.training.checkpointing.load import full_weights  # noqa: E402

log = logging.getLogger("megatron_lc")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_full_state(ckpt_dir: str, cfg: Config, meta: dict) -> dict:
    """The full (unsharded) fp32 state dict of the checkpoint (its files checked against meta.json first)."""
    return {k: v.float() for k, v in full_weights(ckpt_dir, meta, cfg).items()}


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


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


def run_tokenizer(cfg: Config, path: str | None):
    """(the tokenizer to export, the file or directory it was read from): ``path`` (its type from the name:
    ``tokenizer_type_of``), else the run's (``data.tokenizer_type`` / ``tokenizer_model``; (None, None) for mock
    data, or when its files are gone -- said)."""
    if path is not None:
        return build_tokenizer(DataConfig(tokenizer_type=tokenizer_type_of(path), tokenizer_model=path), None), path
    d = cfg.data
    if d.tokenizer_type == "NullTokenizer":
        return (build_tokenizer(d, cfg.model.vocab_size) if d.vocab_size is not None else None), None
    model = d.files(cfg.model.vocab_size)[1]
    if model is None:
        return None, None
    if not os.path.exists(model):
        log.warning("the run's tokenizer %s is not there any more: exported without a tokenizer (pass --tokenizer)",
                    model)
        return None, None
    return build_tokenizer(d, cfg.model.vocab_size), model


def write_tokenizer(tok, out: str, path: str | None = None) -> tuple[int | None, int]:
    """Write ``tok`` (read from ``path``) into ``out`` for ``AutoTokenizer``; returns its (bos, eos) ids for
    config.json. A Hugging Face tokenizer directory's files are copied byte for byte (its chat template kept);
    NullTokenizer: nothing to write, its end-of-document id is the eos."""
    if isinstance(tok, HuggingFaceTokenizer) and path is not None and os.path.isdir(path):
        copy_tokenizer_files(path, out)
    elif isinstance(tok, HuggingFaceTokenizer):
        tok.tok.save_pretrained(out)  # megatron-core's: transformers' tokenizer.json + tokenizer_config.json
    elif isinstance(tok, SentencePieceTokenizer):
        copy_tokenizer(tok.path, out)
    return tok.bos, tok.eod


def _size(text: str) -> int:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMG]?)B?", text.strip().upper())
    if not m:
        raise ConfigError(f"--max-shard-size {text!r}: use e.g. 5GB, 500MB, 1000000")
    return int(float(m.group(1)) * {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}[m.group(2)])


def convert(checkpoint: str, out: str, dtype: str = "float32", keep_padded_vocab: bool = False,
            max_shard_size: str = "5GB", tokenizer: str | None = None, trust_pickle: bool = False) -> str:
    """Write the HF directory ``out`` for ``checkpoint`` (a save dir or one ``iter_N`` dir); returns the iter dir.
    The checkpoint is read as data (``training/checkpointing/data_only.py``); ``trust_pickle`` is this call's alone,
    never the checkpoint's own config (its meta.json could say anything)."""
    from megatron_lc.training.checkpointing.directory import find_latest, read_meta

    path = find_latest(checkpoint) if os.path.isdir(checkpoint) else None
    if path is None:
        raise ConfigError(f"no complete checkpoint (a directory with meta.json) at {checkpoint}")
    meta = read_meta(path)
    saved = meta["config"]
    data = saved.get("data", {})
    if data.get("prepare_demo_data") and (data.get("data_path") or data.get("tokenizer_model")):
        # checkpoints from before the demo files were keyed by vocabulary name both: those paths are the files
        saved = dict(saved, data=dict(data, prepare_demo_data=False))
    cfg = Config.from_dict(dict(saved, checkpoint=dict(saved.get("checkpoint", {}), trust_pickle=trust_pickle)))
    family = export_family(cfg.model)
    tok, tok_path = run_tokenizer(cfg, tokenizer)  # before anything is written
    state = to_hf(load_full_state(path, cfg, meta), cfg.model, family, keep_padded_vocab)
    os.makedirs(out, exist_ok=True)
    bos, eos = write_tokenizer(tok, out, tok_path) if tok is not None else (None, None)
    with open(os.path.join(out, "config.json"), "w") as f:
        trained = cfg.data.seq_length if meta.get("iteration", 0) > 0 else 0  # an import's own checkpoint: none
        json.dump(export_config(cfg.model, dtype, keep_padded_vocab, bos, eos, trained), f, indent=1)
    generation = (cfg.model.hf_import or {}).get("generation_config")
    if generation is not None:  # the imported model's, whatever tokenizer the run had
        with open(os.path.join(out, "generation_config.json"), "w") as f:
            json.dump(generation, f, indent=2)
    write_safetensors({k: v.to(DTYPES[dtype]) for k, v in state.items()}, out, _size(max_shard_size))
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="a checkpoint.save directory (newest complete checkpoint) or an iter_N dir")
    p.add_argument("out", help="output directory for config.json + safetensors")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="the weights' dtype (default float32)")
    p.add_argument("--keep-padded-vocab", action="store_true", help="export the padded vocabulary rows too")
    p.add_argument("--max-shard-size", default="5GB", help="safetensors shards up to this size (default 5GB)")
    p.add_argument("--tokenizer", help="a Hugging Face tokenizer directory or tokenizer.json, or a SentencePiece "
                   ".model (default: the checkpoint's data.tokenizer_model)")
    p.add_argument("--trust-pickle", action="store_true", help="also unpickle checkpoint files that hold more than "
                   "data (an older format): only for a checkpoint you trust (checkpoint.trust_pickle)")
    a = p.parse_args(argv)
    try:
        path = convert(a.checkpoint, a.out, a.dtype, a.keep_padded_vocab, a.max_shard_size, a.tokenizer,
                       a.trust_pickle)
    except (ConfigError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported {path} -> {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
