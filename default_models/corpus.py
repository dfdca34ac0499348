"""The training and evaluation text: the Python standard library's own source.

Every machine with Python has it, so the default pair can be retrained anywhere without a download.
A fixed set of modules is held out for evaluation and never seen in training.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

# Modules held out for evaluation: small, self-contained, typical library code.
HELD_OUT_MODULES: tuple[str, ...] = (
    "bisect",
    "calendar",
    "colorsys",
    "csv",
    "dataclasses",
    "fractions",
    "heapq",
    "json",
    "shlex",
    "statistics",
    "textwrap",
    "wave",
)

# Test suites are mostly generated data and would swamp the library code.
_SKIPPED_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "lib2to3"}


@dataclass(frozen=True)
class Corpus:
    """Source files of the standard library, split into training and held-out sets."""

    train_files: list[Path]
    held_out_files: list[Path]


def _module_name(stdlib: Path, path: Path) -> str:
    return path.relative_to(stdlib).parts[0].removesuffix(".py")


def load_corpus(stdlib: Path | None = None) -> Corpus:
    """List the standard library's `.py` files, sorted, with the held-out modules set apart."""
    root = stdlib or Path(sysconfig.get_paths()["stdlib"])
    train: list[Path] = []
    held_out: list[Path] = []
    for path in sorted(root.rglob("*.py")):
        if _SKIPPED_DIRS.intersection(path.relative_to(root).parts):
            continue
        (held_out if _module_name(root, path) in HELD_OUT_MODULES else train).append(path)
    return Corpus(train_files=train, held_out_files=held_out)


def read_text(path: Path) -> str:
    """Read a source file, replacing the rare undecodable byte instead of failing."""
    return path.read_text(encoding="utf-8", errors="replace")
