"""The fine-tuning recipe's two ends keep a chat model's template (docs/finetune.md): the import copies it beside the
checkpoint (where tools/preprocess_data.py --chat renders with it), and tools/convert_to_hf.py writes it with the
tokenizer, so the exported model is prompted through transformers' ``apply_chat_template``."""
import os
import sys

import transformers

from megatron_lc.hf import import_hf
from tests.support.data_util import tiny_llama3_chat

sys.path.insert(0, os.path.join(os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")), "tools"))
import convert_to_hf  # noqa: E402


def test_import_and_export_keep_the_chat_template(tmp_path):
    hf = tiny_llama3_chat(tmp_path / "hf", vocab_size=300)
    template = transformers.AutoTokenizer.from_pretrained(hf).chat_template
    assert template and "<|eot_id|>" in template
    import_hf(hf, str(tmp_path / "import"))
    assert transformers.AutoTokenizer.from_pretrained(str(tmp_path / "import")).chat_template == template
    convert_to_hf.convert(str(tmp_path / "import"), str(tmp_path / "out"), tokenizer=str(tmp_path / "import"))
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    assert tok.chat_template == template and tok.eos_token == "<|eot_id|>"
    chat = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False).endswith(
        "<|start_header_id|>assistant<|end_header_id|>\n\n")
