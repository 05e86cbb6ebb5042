"""Typed, strict configuration: YAML file + ``--set section.key=value`` overrides -> ``Config``.

    cfg = load_config("configs/tiny_cpu.yaml", ["train.train_iters=5", "parallel.context_parallel_size=2"])
    cfg.check_layout(world_size=2)   # one-line ConfigError naming the numbers when the layout is impossible
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

import yaml

from .base import ConfigError, build_section, check, coerce, field_types, read_yaml_mapping
from .checkpoint import CheckpointConfig
from .data import DataConfig
from .logging import LoggingConfig
from .memory import MemoryConfig
from .model import ModelConfig
from .parallel import ParallelConfig
from .train import TrainConfig

__all__ = ["Config", "ConfigError", "load_config", "ModelConfig", "ParallelConfig", "MemoryConfig",
           "DataConfig", "TrainConfig", "CheckpointConfig", "LoggingConfig"]


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    SECTIONS = ("model", "parallel", "memory", "data", "train", "checkpoint", "logging")

    @classmethod
    def from_dict(cls, raw: Any) -> "Config":
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise ConfigError(f"a config must be a mapping of sections, got {type(raw).__name__}")
        unknown = [k for k in raw if k not in cls.SECTIONS]
        if unknown:
            raise ConfigError(f"unknown section '{unknown[0]}'; valid sections: {', '.join(cls.SECTIONS)}")
        types_ = field_types(cls)
        sections = {name: build_section(types_[name], raw.get(name), name) for name in cls.SECTIONS}
        return cls(**sections)

    def to_dict(self) -> dict:
        return {name: dataclasses.asdict(getattr(self, name)) for name in self.SECTIONS}

    # ---- layout -------------------------------------------------------------------------------------------
    def data_parallel_size(self, world_size: int) -> int:
        p = self.parallel
        denom = p.tensor_model_parallel_size * p.context_parallel_size
        check(world_size % denom == 0,
              f"world size ({world_size}) must be divisible by tp ({p.tensor_model_parallel_size}) x "
              f"cp ({p.context_parallel_size}) = {denom}")
        return world_size // denom

    def seq_multiple(self) -> int:
        """The sequence length must be a multiple of this for the chosen layout.

        p2p/a2a+p2p: 2*ring chunks per ulysses group (zigzag) times ulysses; a2a: cp; fpdt: cp*chunks;
        times tp with sequence parallel (each cp shard is split again over tp)."""
        p = self.parallel
        cp, tp = p.context_parallel_size, p.tensor_model_parallel_size
        m = 1
        if cp > 1:
            if p.cp_comm_type in ("p2p", "a2a+p2p"):
                m = 2 * cp if p.ring_size > 1 else cp
            else:
                m = cp
        if p.sequence_parallel and tp > 1:
            m *= tp
        return m

    def check_layout(self, world_size: int) -> int:
        """Validate the parallel layout against the model and data; return dp."""
        p, m = self.parallel, self.model
        tp = p.tensor_model_parallel_size
        dp = self.data_parallel_size(world_size)
        check(m.num_attention_heads % tp == 0,
              f"model.num_attention_heads ({m.num_attention_heads}) must be divisible by tp ({tp})")
        check(m.num_query_groups % tp == 0,
              f"model.num_query_groups ({m.num_query_groups}) must be divisible by tp ({tp})")
        check(m.ffn_hidden_size % tp == 0, f"model.ffn_hidden_size ({m.ffn_hidden_size}) must be divisible by tp ({tp})")
        check(m.padded_vocab_size % tp == 0,
              f"padded vocab ({m.padded_vocab_size}) must be divisible by tp ({tp}); "
              f"set model.make_vocab_size_divisible_by to a multiple of {tp}")
        heads_per_tp = m.num_attention_heads // tp
        if p.ulysses_size > 1:
            check(heads_per_tp % p.ulysses_size == 0,
                  f"attention heads per tp rank ({heads_per_tp}) must be divisible by ulysses size ({p.ulysses_size})")
        mult = self.seq_multiple()
        check(self.data.seq_length % mult == 0,
              f"data.seq_length ({self.data.seq_length}) must be divisible by {mult} for cp "
              f"({p.context_parallel_size}, {p.cp_comm_type}) x tp ({tp}, sequence_parallel={p.sequence_parallel})")
        if p.cp_comm_type == "fpdt":  # FPDT chunk rules (issue 4): chunk divides the sequence and cp x sp-tp
            from ..attention.fpdt_layout import check_fpdt_layout

            check_fpdt_layout(self)
        check(self.data.seq_length <= m.max_position_embeddings or m.position_embedding_type == "rope",
              f"data.seq_length ({self.data.seq_length}) exceeds model.max_position_embeddings "
              f"({m.max_position_embeddings})")
        t = self.train
        if t.global_batch_size is None:
            t.global_batch_size = t.micro_batch_size * dp
        check(t.global_batch_size % (t.micro_batch_size * dp) == 0,
              f"train.global_batch_size ({t.global_batch_size}) must be divisible by micro_batch_size "
              f"({t.micro_batch_size}) x dp ({dp})")
        return dp


def _apply_override(raw: dict, item: str) -> None:
    if "=" not in item:
        raise ConfigError(f"override '{item}' must look like section.key=value")
    key, value = item.split("=", 1)
    parts = key.strip().split(".")
    if len(parts) != 2:
        raise ConfigError(f"override key '{key}' must look like section.key (e.g. train.lr=1e-4)")
    section, name = parts
    if section not in Config.SECTIONS:
        raise ConfigError(f"unknown section '{section}' in override '{item}'; valid sections: "
                          f"{', '.join(Config.SECTIONS)}")
    sec = raw.setdefault(section, {}) or {}
    raw[section] = sec
    sec[name] = yaml.safe_load(value) if value.strip() != "" else None


def load_config(path: Optional[str], overrides: Iterable[str] = ()) -> Config:
    """Read ``path`` (YAML) and apply ``section.key=value`` overrides; raise ConfigError on any mistake."""
    raw: dict = {}
    if path is not None:
        if not os.path.isfile(path):
            raise ConfigError(f"config file not found: {path}")
        raw = read_yaml_mapping(path, "a config must be a mapping of sections")
    for item in overrides:
        _apply_override(raw, item)
    return Config.from_dict(raw)
