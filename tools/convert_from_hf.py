"""Import a Hugging Face Llama directory (``config.json`` + safetensors, single file or sharded) as a megatron_lc
checkpoint and its ``model:`` section.

    python tools/convert_from_hf.py ~/Llama-3.2-1B runs/llama32_1b_import [--tp 2]
    # then, in a config: the model section of runs/llama32_1b_import/model.yaml, and
    #   checkpoint.load: runs/llama32_1b_import   checkpoint.finetune: true   (weights only, step 0)

The checkpoint holds the fp32 weights (torch.distributed.checkpoint); it loads at any tp, cp and dp, and its
optimizer starts afresh; ``--tp`` checks that the model divides over that many tensor-parallel ranks. Library
call: ``megatron_lc.hf.import_hf(hf_dir, out, tp)``. The mapping and what is supported: ``megatron_lc/hf.py``."""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_lc.config import ConfigError  # noqa: E402
from megatron_lc.hf import import_hf  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("hf_dir", help="a Hugging Face model directory (config.json + safetensors)")
    p.add_argument("out", help="output directory: iter_0000000/ (the checkpoint) and model.yaml")
    p.add_argument("--tp", type=int, default=1, 
                   help="check the model divides over this tp (any tp loads the checkpoint)")
    a = p.parse_args(argv)
    try:
        path = import_hf(a.hf_dir, a.out, a.tp)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"imported {a.hf_dir} -> {path} (model section: {os.path.join(a.out, 'model.yaml')})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
