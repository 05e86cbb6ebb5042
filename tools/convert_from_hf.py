"""Import a Hugging Face model directory (``config.json`` + safetensors, single file or sharded) of Llama, Mistral,
Qwen2 / 2.5, Qwen3, Gemma 3 (text), Qwen3-MoE, Qwen2-MoE or Mixtral as a megatron_lc checkpoint, its ``model:``
section and its tokenizer files.

    .venv/bin/python tools/convert_from_hf.py ~/Qwen3-8B runs/qwen3_8b_import [--tp 2] [--verify]
    # then, in a config: the model section of runs/qwen3_8b_import/model.yaml, and
    #   checkpoint.load: runs/qwen3_8b_import   checkpoint.finetune: true   (weights only, step 0)
    #   data.tokenizer_type: HuggingFaceTokenizer   data.tokenizer_model: runs/qwen3_8b_import

The checkpoint holds the fp32 weights (torch.distributed.checkpoint); it loads at any tp, cp and dp, and its
optimizer starts afresh; ``--tp`` checks that the model divides over that many tensor-parallel ranks. The tokenizer
files (the chat template with them) are copied byte for byte; ``model.yaml`` keeps the ``config.json`` and
``generation_config.json`` it read (``model.hf_import``), which ``tools/convert_to_hf.py`` writes back. ``--verify``
then runs transformers' model and the imported one on a seeded random batch (fp32, CPU), prints the largest logit
difference and exits 1 when it is above 1e-4 of the largest logit (an MoE model: its routers' logits and Hugging
Face's load-balancing loss too). A field the framework does not implement is one line naming it (exit 2). Library
call: ``megatron_lc.hf.import_hf(hf_dir, out, tp)``; the families and their mapping: ``megatron_lc/hf/``."""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_lc.config import ConfigError  # noqa: E402
from megatron_lc.hf import VERIFY_RTOL, import_hf, verify  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("hf_dir", help="a Hugging Face model directory (config.json + safetensors)")
    p.add_argument("out", help="output directory: iter_0000000/ (the checkpoint), model.yaml, the tokenizer files")
    p.add_argument("--tp", type=int, default=1,
                   help="check the model divides over this tp (any tp loads the checkpoint)")
    p.add_argument("--verify", action="store_true", help="compare the logits with transformers' on a random batch")
    p.add_argument("--verify-tokens", type=int, default=64, help="tokens per sample of --verify's batch of 2")
    a = p.parse_args(argv)
    try:
        path = import_hf(a.hf_dir, a.out, a.tp)
        print(f"imported {a.hf_dir} -> {path} (model section: {os.path.join(a.out, 'model.yaml')})")
        if a.verify:
            diff, scale, routers = verify(a.hf_dir, a.verify_tokens)
            ok = diff <= VERIFY_RTOL * scale
            print(f"verify: max |logits - transformers' logits| = {diff:.3e} (largest logit {scale:.3e}; "
                  f"{diff / scale:.2e} relative, limit {VERIFY_RTOL:g}): {'ok' if ok else 'FAILED'}")
            if routers is not None:  # an MoE model: its routers' logits and load-balancing loss too
                (rdiff, rscale), (aux, aux_hf) = routers["router_logits"], routers["aux_loss"]
                rel = abs(aux - aux_hf) / abs(aux_hf)
                routers_ok = rdiff <= VERIFY_RTOL * rscale and rel <= VERIFY_RTOL
                print(f"verify: max |router logits - transformers'| = {rdiff:.3e} (largest {rscale:.3e}); "
                      f"load-balancing loss {aux:.6g} vs transformers' {aux_hf:.6g} ({rel:.2e} relative): "
                      f"{'ok' if routers_ok else 'FAILED'}")
                ok = ok and routers_ok
            return 0 if ok else 1
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
