"""Typed, strict configuration: YAML file + ``--set section.key=value`` overrides -> ``Config``.

    cfg = load_config("configs/tiny_cpu.yaml", ["train.train_iters=5", "parallel.context_parallel_size=2"])
    layout = resolve_layout(cfg, world_size=2)   # one-line ConfigError naming the numbers when impossible
    execution = resolve_execution(cfg, device)   # the device, the autocast and residual dtypes
    techniques = resolve_techniques(cfg, layout)  # which technique fills each slot of a layer

One dataclass per section (``model.py``, ``parallel.py``, ``memory.py``, ``data.py``, ``train.py``,
``checkpoint.py``, ``logging.py``; the strict loader in ``base.py``), and what the config resolves to once:
``layout.py`` (every layout rule; the refused feature pairs of ``combinations.py``), ``execution.py`` and
``techniques.py`` (which technique fills each slot of a layer: the key of the model spec and of the estimator).
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

import yaml

from .base import ConfigError, build_section, field_types, read_yaml_mapping
from .checkpoint import CheckpointConfig
from .data import DataConfig
from .execution import Execution, resolve_execution
from .layout import Layout, resolve_layout
from .logging import LoggingConfig
from .memory import MemoryConfig
from .model import ModelConfig
from .parallel import ParallelConfig
from .techniques import Techniques, resolve_techniques
from .train import TrainConfig

__all__ = ["Config", "ConfigError", "load_config", "Layout", "resolve_layout", "Execution",
           "resolve_execution", "Techniques", "resolve_techniques", "ModelConfig", "ParallelConfig",
           "MemoryConfig",
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

    def __post_init__(self) -> None:
        # model.vocab_size unset: NullTokenizer's size is in the config, a tokenizer file's is read when the run
        # starts (data.with_tokenizer_vocab), and without a tokenizer to follow it is 32000
        d, m = self.data, self.model
        if m.vocab_size is None and not d.follows_tokenizer:
            nulltok = d.tokenizer_type == "NullTokenizer" and d.vocab_size is not None and not d.prepare_demo_data
            self.model = dataclasses.replace(m, vocab_size=d.vocab_size + 1 if nulltok else 32000)

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
