"""Hugging Face <-> megatron_lc for the families people extend (Llama, Mistral, Qwen2 / 2.5, Qwen3, Gemma 3 text):
configs, tensor names and layouts, both ways (``tools/convert_from_hf.py``, ``tools/convert_to_hf.py``;
docs/model_families.md).

    families.py   each family as data: its model switches, norm names, windows, activation, biases
    configs.py    config.json <-> the model: section (any unimplemented field refused in one line; an import's
                  config.json exported as it was, but for what the run changed)
    tensors.py    tensors <-> the full state dict (fused QKV grouped by kv head, [gate; up], the family's norms)
    importer.py   import_hf (checkpoint, model.yaml, tokenizer files byte for byte), verify (against transformers)
"""
from .configs import export_config, hf_config, model_section_from_hf
from .families import BY_ARCHITECTURE, FAMILIES, Family, export_family
from .importer import TOKENIZER_FILES, VERIFY_RTOL, copy_tokenizer_files, import_hf, read_hf_dir, verify
from .tensors import from_hf, to_hf

__all__ = ["export_config", "hf_config", "model_section_from_hf", "BY_ARCHITECTURE", "FAMILIES", "Family",
           "export_family", "TOKENIZER_FILES", "VERIFY_RTOL", "copy_tokenizer_files", "import_hf", "read_hf_dir",
           "verify", "from_hf", "to_hf"]
