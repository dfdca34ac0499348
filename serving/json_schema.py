"""A JSON Schema as llguidance takes it: `true` and `false` schemas, and `oneOf`, which llguidance
compiles as `anyOf`, accepted only where that is exact (no value can match two branches) or the schema
is lenient (docs/design.md, "Boolean schemas and oneOf")."""

from __future__ import annotations

import json
from typing import Any

from serving.errors import invalid_argument


def prepared_schema(schema: Any, field: str = "structured_output.json_schema") -> dict[str, Any]:
    """The schema as llguidance takes it. `true` is any JSON value, `false` is INVALID_ARGUMENT (no value
    satisfies it). `oneOf` is compiled as `anyOf` (llguidance's `coerce_one_of`) where that is exact:
    every `oneOf` in the schema has branches no value can match two of (`disjoint_branches`), or the
    schema is lenient; any other `oneOf` is INVALID_ARGUMENT naming its place."""
    if schema is True:
        return {}
    if schema is False:
        raise invalid_argument(f"{field} is `false`, which no value satisfies (unsatisfiable)")
    if not isinstance(schema, dict):
        raise invalid_argument(f"{field} must be a JSON object or a boolean (a schema); got {type(schema).__name__}")
    guidance = schema.get("x-guidance")
    options: dict[str, Any] = guidance if isinstance(guidance, dict) else {}
    places = list(_one_of_places(schema, "#"))
    if not places or options.get("coerce_one_of") is not None:
        return schema
    overlapping = [place for place, branches in places if not disjoint_branches(branches, schema)]
    if overlapping and not options.get("lenient"):
        raise invalid_argument(
            f"{field}: `oneOf` at {overlapping[0]} has branches that one value could match together, which "
            "llguidance cannot enforce; use `anyOf`, give each branch a distinct `type` or `const` (a "
            'discriminator), or make the schema lenient (`"x-guidance": {"lenient": true}`; the gateway\'s '
            "non-strict json_schema) to accept `anyOf`'s outputs"
        )
    return {**schema, "x-guidance": {**options, "coerce_one_of": True}}


# Keywords whose values are data, not schemas: no `oneOf` is looked for inside them.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples", "x-guidance"})


def _one_of_places(node: Any, place: str) -> Any:
    """(JSON pointer, branches) of every `oneOf` in a schema."""
    if isinstance(node, dict):
        if isinstance(node.get("oneOf"), list):
            yield place, node["oneOf"]
        for key, value in node.items():
            if key not in _DATA_KEYWORDS:
                yield from _one_of_places(value, f"{place}/{key}")
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _one_of_places(value, f"{place}/{index}")


def _resolved(node: Any, root: dict[str, Any]) -> Any:
    """A branch with local `$ref`s ("#/...") followed; None for one that cannot be followed."""
    for _ in range(16):  # a chain of refs, bounded against cycles
        if not isinstance(node, dict) or "$ref" not in node:
            return node
        ref = node["$ref"]
        if not isinstance(ref, str) or not ref.startswith("#"):
            return None
        node = root
        for part in filter(None, ref[1:].split("/")):
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(node, dict) or part not in node:
                return None
            node = node[part]
    return None


_JSON_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object"}


def _types(branch: dict[str, Any]) -> set[str] | None:
    """The JSON types a branch admits, None when it does not say."""
    if "const" in branch or isinstance(branch.get("enum"), list):
        values = [branch["const"]] if "const" in branch else branch["enum"]
        return {"null" if v is None else _JSON_TYPES.get(type(v), "") for v in values}
    kind = branch.get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list) and all(isinstance(k, str) for k in kind):
        return set(kind)
    return None


def _values(branch: Any) -> list[Any] | None:
    """The values a branch admits when it lists them (`const`, `enum`), else None."""
    if not isinstance(branch, dict):
        return None
    if "const" in branch:
        return [branch["const"]]
    return branch["enum"] if isinstance(branch.get("enum"), list) else None


def _two_disjoint(a: dict[str, Any], b: dict[str, Any], root: dict[str, Any]) -> bool:
    types_a, types_b = _types(a), _types(b)
    if types_a is not None and types_b is not None:
        widen = {"integer": {"integer", "number"}, "number": {"integer", "number"}}
        if not {t for kind in types_a for t in widen.get(kind, {kind})} & types_b:
            return True
    values_a, values_b = _values(a), _values(b)
    if values_a is not None and values_b is not None:
        return not any(
            json.dumps(x, sort_keys=True) == json.dumps(y, sort_keys=True) for x in values_a for y in values_b
        )
    # A discriminator: a property both require, with listed values that never meet.
    required = set(a.get("required") or []) & set(b.get("required") or [])
    for name in required:
        props_a, props_b = a.get("properties") or {}, b.get("properties") or {}
        x, y = _resolved(props_a.get(name), root), _resolved(props_b.get(name), root)
        if isinstance(x, dict) and isinstance(y, dict) and _two_disjoint(x, y, root):
            return True
    return False


def disjoint_branches(branches: list[Any], root: dict[str, Any]) -> bool:
    """Whether no JSON value can match two of a `oneOf`'s branches, proved from their types, listed
    values or a required discriminator property (local `$ref`s followed); False when unproved."""
    resolved = [_resolved(branch, root) for branch in branches]
    if not all(isinstance(branch, dict) for branch in resolved):
        return False
    return all(
        _two_disjoint(resolved[i], resolved[j], root) for i in range(len(resolved)) for j in range(i + 1, len(resolved))
    )
