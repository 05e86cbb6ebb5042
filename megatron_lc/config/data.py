"""`data:` section."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from .base import check


@dataclass
class DataConfig:
    seq_length: int = 512
    data_path: Optional[str] = None  # prefix of a Megatron .bin/.idx pair
    tokenizer_type: Literal["SentencePieceTokenizer", "NullTokenizer"] = "SentencePieceTokenizer"  # Megatron names
    tokenizer_model: Optional[str] = None  # SentencePiece .model file
    mock_data: bool = False  # random tokens, no files (Megatron's --mock-data)
    prepare_demo_data: bool = False  # build tokenizer + .bin/.idx from the Python stdlib sources if missing

    def __post_init__(self) -> None:
        check(self.seq_length >= 2, f"data.seq_length ({self.seq_length}) must be >= 2")
