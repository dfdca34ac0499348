"""Configuration objects from flags and SPECDEC_* environment variables, one flag per field."""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any


def env_name(field: str) -> str:
    return "SPECDEC_" + field.upper()


def add_config_arguments(parser: argparse.ArgumentParser, config_type: type[Any], helps: dict[str, str]) -> None:
    """One flag per dataclass field; a SPECDEC_<FIELD> environment variable overrides the default."""
    for field in dataclasses.fields(config_type):
        default = os.environ.get(env_name(field.name), field.default)
        flag = "--" + field.name.replace("_", "-")
        kind: Any = type(field.default)
        if kind is bool:
            parser.add_argument(
                flag,
                default=str(default).lower() in ("1", "true", "yes"),
                action=argparse.BooleanOptionalAction,
                help=helps.get(field.name),
            )
        else:
            parser.add_argument(flag, type=kind, default=kind(default), help=helps.get(field.name))
