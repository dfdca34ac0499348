"""Held-out prompts: function headers from the held-out standard-library modules.

A prompt is a function's `def` line (or lines, for a long signature) plus its docstring's first
line when it has one, and the indentation of the body, so that the model continues with code.
"""

from __future__ import annotations

import ast
from pathlib import Path

from default_models.corpus import load_corpus, read_text


def _header(source_lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    if not node.body:
        return None
    first = node.body[0]
    start = node.lineno - 1
    # The signature ends where the body (or the docstring) starts.
    end = first.lineno - 1
    header = source_lines[start:end]
    if not header:
        return None
    body_line = source_lines[first.lineno - 1]
    indent = body_line[: len(body_line) - len(body_line.lstrip())]
    # Methods are dedented to top level, as if the function stood alone.
    offset = node.col_offset
    return "".join(line[offset:] if line[:offset].isspace() else line for line in header) + indent[offset:]


def held_out_prompts(count: int, stdlib: Path | None = None) -> list[str]:
    """`count` prompts spread evenly over all functions of the held-out modules, in a fixed order."""
    headers: list[str] = []
    for path in load_corpus(stdlib).held_out_files:
        text = read_text(path)
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        lines = text.splitlines(keepends=True)
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                header = _header(lines, node)
                if header and 20 <= len(header) <= 400 and not header.lstrip().startswith("@"):
                    headers.append(header)
    if not headers:
        raise RuntimeError("no held-out functions found; is the Python standard library source installed?")
    step = max(1, len(headers) // count)
    return headers[::step][:count]
