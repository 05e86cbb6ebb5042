"""The command-line arguments every tool that reads a training config takes: ``--config X.yaml`` and any number of
``--set section.key=value`` (parsed by ``load_config(args.config, args.overrides)``)."""
from __future__ import annotations

import argparse


def add_config_arguments(p: argparse.ArgumentParser, what: str = "") -> None:
    """``--config`` (required) and ``--set`` (repeatable, into ``overrides``); ``what``: when the overrides apply,
    for the help text (e.g. "before estimating")."""
    p.add_argument("--config", required=True, help="training config (YAML)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help=f"override a config value{' ' + what if what else ''} (repeatable)")
