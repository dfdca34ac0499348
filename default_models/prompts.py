"""Held-out prompts: function headers from the held-out standard-library modules.

A prompt is a function's `def` line (or lines, for a long signature), ending at the signature's colon.
It stops there, not after the newline and the body's indentation, because the tokenizer merges a line
break with the next line's indentation (`"\n   "`, then `" return"`): a prompt that ended inside that
whitespace would hand the model a token sequence it never saw in training.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Iterator
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
    # Methods are dedented to top level, as if the function stood alone.
    offset = node.col_offset
    return "".join(line[offset:] if line[:offset].isspace() else line for line in header).rstrip()


def _functions(files: list[Path]) -> Iterator[tuple[list[str], ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Every function definition in `files` that parse, with its file's lines, in file order."""
    for path in files:
        text = read_text(path)
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        lines = text.splitlines(keepends=True)
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                yield lines, node


def function_headers(files: list[Path]) -> list[str]:
    """Every function header in `files` (20 to 400 characters, undecorated), in file order."""
    headers: list[str] = []
    for lines, node in _functions(files):
        header = _header(lines, node)
        if header and 20 <= len(header) <= 400 and not header.lstrip().startswith("@"):
            headers.append(header)
    return headers


def held_out_prompts(count: int, stdlib: Path | None = None) -> list[str]:
    """`count` prompts spread evenly over all functions of the held-out modules, in a fixed order."""
    headers = function_headers(load_corpus(stdlib).held_out_files)
    if not headers:
        raise RuntimeError("no held-out functions found; is the Python standard library source installed?")
    step = max(1, len(headers) // count)
    return headers[::step][:count]


EDIT_PROMPTS = Path(__file__).resolve().parent.parent / "bench" / "edit_prompts.json"


def make_edit_prompts(count: int, stdlib: Path | None = None) -> list[str]:
    """Edit-style prompts from the held-out modules: a whole function (6 to 15 lines), two blank lines,
    then the same function's header, so that the continuation may copy the body it was shown."""
    prompts: list[str] = []
    for lines, node in _functions(load_corpus(stdlib).held_out_files):
        if not isinstance(node, ast.FunctionDef) or node.decorator_list or node.end_lineno is None:
            continue
        if not 6 <= node.end_lineno - node.lineno <= 15:
            continue
        header = _header(lines, node)
        offset = node.col_offset
        source = "".join(
            line[offset:] if line[:offset].isspace() else line for line in lines[node.lineno - 1 : node.end_lineno]
        ).rstrip()
        if header and header.endswith(":") and len(source) < 900:
            prompts.append(f"{source}\n\n\n{header}")
    step = max(1, len(prompts) // count)
    return prompts[::step][:count]


def edit_prompts(count: int) -> list[str]:
    """The committed edit-style prompt set (`python -m default_models.prompts` wrote it)."""
    return list(json.loads(EDIT_PROMPTS.read_text()))[:count]


if __name__ == "__main__":
    EDIT_PROMPTS.write_text(json.dumps(make_edit_prompts(16), indent=1) + "\n")
    print(f"wrote {EDIT_PROMPTS}")
