"""A Hugging Face model directory -> a megatron_lc checkpoint, its ``model.yaml`` and its tokenizer files
(``tools/convert_from_hf.py``), and the check that the import computes what transformers computes (``--verify``).

The tokenizer files are copied byte for byte (the chat template with them: ``tokenizer_config.json``'s
``chat_template`` or ``chat_template.jinja``), so the import directory is the model's tokenizer for the data
pipeline and for chat fine-tuning (``data.tokenizer_model: OUT``), and the export writes the same bytes back."""
from __future__ import annotations

import json
import os
import shutil
from typing import Optional

import torch
import yaml
from safetensors.torch import load_file

from ..compose import build_model
from ..config import Config, ConfigError, resolve_layout
from ..parallel.topology import Topology
from ..training.checkpointing.load import write_model_checkpoint
from ..training.checkpointing.reshard import parameter_shapes
from .configs import model_section_from_hf
from .families import BY_ARCHITECTURE
from .tensors import from_hf, to_hf

# the files of a Hugging Face tokenizer (and its chat template), copied as they are on import and export
TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
                   "generation_config.json")
IGNORED = ("rotary_emb.inv_freq",)  # buffers some older exports carry
VERIFY_RTOL = 1e-4  # --verify: max |ours - transformers| logits over max |transformers| logits


def read_hf_dir(hf_dir: str) -> tuple[dict, dict]:
    """(``config.json``, all tensors) of a Hugging Face model directory: ``model.safetensors``, or the shards of
    ``model.safetensors.index.json``."""
    cfg_path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(cfg_path):
        raise ConfigError(f"{hf_dir} is not a Hugging Face model directory (no config.json)")
    with open(cfg_path) as f:
        hf_cfg = json.load(f)
    single, index = os.path.join(hf_dir, "model.safetensors"), os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(single):
        files = [single]
    elif os.path.isfile(index):
        with open(index) as f:
            files = [os.path.join(hf_dir, n) for n in sorted(set(json.load(f)["weight_map"].values()))]
    else:
        raise ConfigError(f"{hf_dir}: no model.safetensors or model.safetensors.index.json (PyTorch .bin weights: "
                          f"save them as safetensors first)")
    tensors = {}
    for path in files:
        if not os.path.isfile(path):
            raise ConfigError(f"{path} is listed in the safetensors index but missing")
        tensors.update(load_file(path))
    return hf_cfg, tensors


def imported_state(hf_dir: str, tp: int = 1) -> tuple[Config, dict]:
    """(the config of the model section, the full fp32 state dict) of the Hugging Face directory ``hf_dir``,
    checked: every tensor used, none missing, the model divisible over ``tp``."""
    hf_cfg, tensors = read_hf_dir(hf_dir)
    generation = os.path.join(hf_dir, "generation_config.json")
    files = {"config": hf_cfg}  # what the export writes back (model.hf_import)
    if os.path.isfile(generation):
        with open(generation) as f:
            files["generation_config"] = json.load(f)
    cfg = Config.from_dict({"model": {**model_section_from_hf(hf_cfg), "hf_import": files},  # (SP: an MoE model
                            "parallel": {"tensor_model_parallel_size": tp, "sequence_parallel": tp > 1}})  # asks)
    resolve_layout(cfg, tp)  # heads / kv heads / ffn / vocab divisible by tp: one line if not
    family = BY_ARCHITECTURE[cfg.model.hf_architecture]
    tensors = {k: v for k, v in tensors.items() if not k.endswith(IGNORED)}
    m = cfg.model
    if not m.untie_embeddings_and_output_weights:
        tensors.pop("lm_head.weight", None)  # tied: HF may store the same tensor twice
    try:
        full = {k: v.float() for k, v in from_hf(tensors, m, family).items()}
    except KeyError as e:
        raise ConfigError(f"{hf_dir}: tensor {e.args[0]} missing for a {m.num_layers}-layer "
                          f"{family.architecture}") from None
    extra = sorted(set(tensors) - set(to_hf(full, m, family)))
    if extra:
        raise ConfigError(f"{hf_dir}: tensors the {family.architecture} import does not know: {extra[:5]}")
    missing = sorted(set(parameter_shapes(cfg)) - set(full))
    if missing:
        raise ConfigError(f"{hf_dir}: no tensor for {missing[:5]}")
    return cfg, full


def import_hf(hf_dir: str, out: str, tp: int = 1) -> str:
    """Write ``out/iter_0000000`` (a megatron_lc checkpoint of the model's weights; it loads at any tp, cp and dp,
    its optimizer starts afresh; ``tp``: the tensor-parallel degree it is meant for, checked to divide the model),
    ``out/model.yaml`` (the matching ``model:`` section) and the tokenizer files, byte for byte, for the Hugging Face
    directory ``hf_dir`` of any family of ``families.FAMILIES``; the model section keeps the config.json and
    generation_config.json it read (``model.hf_import``: the export writes them back). Returns the checkpoint
    directory. Weights are kept in fp32."""
    cfg, full = imported_state(hf_dir, tp)
    path = write_model_checkpoint(out, cfg, full, {"imported_from": os.path.abspath(hf_dir)})
    with open(os.path.join(out, "model.yaml"), "w") as f:
        f.write(f"# the model section of {hf_dir} ({cfg.model.hf_architecture}), imported by megatron_lc "
                f"(tools/convert_from_hf.py)\n")
        yaml.safe_dump({"model": cfg.to_dict()["model"]}, f, sort_keys=False)
    copy_tokenizer_files(hf_dir, out)
    return path


def copy_tokenizer_files(src: str, dst: str) -> list[str]:
    """Copy the tokenizer files of ``TOKENIZER_FILES`` that ``src`` has into ``dst``, byte for byte; their names."""
    names = [n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(src, n))]
    for name in names:
        shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))
    return names


@torch.no_grad()
def verify(hf_dir: str, tokens: int = 64, batch: int = 2, seed: int = 0) -> tuple[float, float, Optional[dict]]:
    """Run transformers' model of ``hf_dir`` and ours (imported, one process, fp32 on the CPU) on a seeded random
    batch of ``batch`` x ``tokens`` ids; returns (max |ours - transformers| logits, max |transformers| logits, the
    routers': None for a dense model, else ``{"router_logits": (max difference, max |transformers'|), "aux_loss":
    (ours, transformers')}`` -- every MoE layer's router logits, and Hugging Face's load-balancing loss)."""
    # transformers is needed by this check alone; it is installed with the package but heavy to import
    import transformers

    cfg, full = imported_state(hf_dir)
    cfg = Config.from_dict({**cfg.to_dict(), "data": {"seq_length": tokens, "mock_data": True},
                            "train": {"device": "cpu", "micro_batch_size": batch}})
    model, ctx = build_model(cfg, resolve_layout(cfg, 1), Topology())
    model.load_state_dict(full)
    model.eval()
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.model.vocab_size, (batch, tokens), generator=g)
    routers = [layer.mlp.router for layer in model.layers if hasattr(layer.mlp, "router")]
    seen: list = []  # each router's logits [s * b, E], in layer order (an observer: the model is unchanged)
    hooks = [r.register_forward_hook(lambda mod, args, out: seen.append(out)) for r in routers]
    ours = model(ids, torch.arange(tokens).expand(batch, tokens))[..., :cfg.model.vocab_size]
    for h in hooks:
        h.remove()
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
    out = hf.eval()(input_ids=ids, output_router_logits=bool(routers))
    diff, scale = float((ours - out.logits).abs().max()), float(out.logits.abs().max())
    if not routers:
        return diff, scale, None
    # ours are sequence-first (row s * b + i), transformers' batch-first (row i * s + s)
    mine = torch.stack([r.view(tokens, batch, -1).transpose(0, 1).reshape(batch * tokens, -1) for r in seen])
    theirs = torch.stack([r.reshape(batch * tokens, -1) for r in out.router_logits])
    return diff, scale, {"router_logits": (float((mine - theirs).abs().max()), float(theirs.abs().max())),
                         "aux_loss": (float(ctx.routing.aux_loss()), float(out.aux_loss))}
