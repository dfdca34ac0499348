"""Every valid JSON Schema gets an answer: a schema of each keyword family (the JSON-Schema-Test-Suite's
families, draft 2020-12) either compiles and a walk through its matcher ends in a value the schema
validates, or is refused with INVALID_ARGUMENT naming the keyword. Never INTERNAL, never a Python error.
Boolean schemas and `oneOf` (coerced to `anyOf` where provably exact) are held to their meanings."""

from __future__ import annotations

import json
import random
from typing import Any

import grpc
import jsonschema  # type: ignore[import-untyped]
import pytest
import torch

from serving.constraints import ConstraintSpec, Grammars
from serving.errors import ServiceError
from serving.json_schema import disjoint_branches, prepared_schema
from tests.tiny_models import byte_tokenizer

EOS = 256
VOCAB = 264

# (family, schema, the keyword a refusal must name, or None when the schema must compile)
FAMILIES: list[tuple[str, Any, str | None]] = [
    ("boolean true", True, None),
    ("type", {"type": ["integer", "string"]}, None),
    ("const", {"const": {"a": [1, 2]}}, None),
    ("enum", {"enum": ["red", 7, None]}, None),
    ("properties", {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, None),
    (
        "false property",
        {"type": "object", "properties": {"a": False, "b": {"type": "boolean"}}, "required": ["b"]},
        None,
    ),
    (
        "additionalProperties",
        {"type": "object", "properties": {"x": {"type": "null"}}, "additionalProperties": False},
        None,
    ),
    (
        "patternProperties",
        {"type": "object", "patternProperties": {"^n_": {"type": "integer"}}, "additionalProperties": False},
        None,
    ),
    ("min/maxProperties", {"type": "object", "maxProperties": 1}, None),
    ("items", {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3}, None),
    ("prefixItems", {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "items": False}, None),
    ("string lengths", {"type": "string", "minLength": 2, "maxLength": 4}, None),
    ("pattern", {"type": "string", "pattern": "^[a-c]{3}$"}, None),
    ("format", {"type": "string", "format": "date"}, None),
    ("number bounds", {"type": "integer", "minimum": 3, "exclusiveMaximum": 9}, None),
    ("anyOf", {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 2}]}, None),
    ("allOf", {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}, {"required": ["a"]}]}, None),
    ("$ref and $defs", {"$defs": {"n": {"type": "integer"}}, "type": "array", "items": {"$ref": "#/$defs/n"}}, None),
    ("oneOf by type", {"oneOf": [{"type": "string"}, {"type": "boolean"}]}, None),
    (
        "oneOf by $ref",
        {
            "oneOf": [{"$ref": "#/$defs/a"}, {"$ref": "#/$defs/b"}],
            "$defs": {"a": {"type": "null"}, "b": {"type": "integer"}},
        },
        None,
    ),
    (
        "oneOf discriminator",
        {
            "oneOf": [
                {
                    "type": "object",
                    "properties": {"kind": {"const": "a"}, "n": {"type": "integer"}},
                    "required": ["kind"],
                },
                {"type": "object", "properties": {"kind": {"const": "b"}}, "required": ["kind"]},
            ]
        },
        None,
    ),
    ("oneOf overlapping", {"oneOf": [{"type": "number"}, {"type": "integer"}]}, "oneOf"),
    ("boolean false", False, "false"),
    ("if/then/else", {"if": {"type": "integer"}, "then": {"minimum": 1}}, "if"),
    ("not", {"not": {"type": "string"}}, "not"),
    ("contains", {"type": "array", "contains": {"type": "integer"}}, "contains"),
    ("uniqueItems", {"type": "array", "uniqueItems": True}, "uniqueItems"),
    ("unevaluatedProperties", {"type": "object", "unevaluatedProperties": False}, "unevaluatedProperties"),
    ("propertyNames", {"type": "object", "propertyNames": {"maxLength": 3}}, "propertyNames"),
    ("remote $ref", {"$ref": "https://example.com/schema.json"}, "https://example.com/schema.json"),
]


@pytest.fixture(scope="module")
def grammars() -> Grammars:
    built = Grammars.for_tokenizer(byte_tokenizer(), VOCAB, [EOS], "test")
    assert built is not None
    return built


def walk(grammars: Grammars, spec: ConstraintSpec, seed: int, most: int = 200) -> str | None:
    """A random path through the constraint's matcher to an EOS (the text generated), or None when it ran
    past `most` tokens. Shorter paths are favoured: EOS whenever allowed, then closing punctuation."""
    constraint = grammars.session(grammars.compile(spec), 0)
    rng = random.Random(seed)
    for _ in range(most):
        allowed = constraint.allowed()
        if bool(allowed[EOS]):
            return bytes(constraint.consumed).decode()
        choices = torch.nonzero(allowed[:256]).flatten().tolist()
        closing = [t for t in choices if chr(t) in ']}"0123456789']
        token = rng.choice(closing if closing and rng.random() < 0.7 else choices)
        constraint.consume(token)
    return None


@pytest.mark.parametrize("family, schema, refused_for", FAMILIES, ids=[f[0] for f in FAMILIES])
def test_each_keyword_family_is_served_or_refused_naming_the_keyword(
    grammars: Grammars, family: str, schema: Any, refused_for: str | None
) -> None:
    spec = ConstraintSpec("json_schema", json.dumps(schema))
    if refused_for is not None:
        with pytest.raises(ServiceError) as failure:
            grammars.compile(spec)
        assert failure.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert refused_for in failure.value.message
        return
    outputs = [walk(grammars, spec, seed) for seed in range(4)]
    finished = [text for text in outputs if text is not None]
    assert finished, f"{family}: no walk reached an end"
    for text in finished:
        jsonschema.validate(json.loads(text), schema)


def test_oneof_is_exact_only_where_branches_are_disjoint(grammars: Grammars) -> None:
    # The overlap's outputs are anyOf's when the schema is lenient (documented: not exact for oneOf).
    overlapping = {"oneOf": [{"type": "integer", "minimum": 0}, {"type": "integer", "maximum": 10}]}
    lenient = ConstraintSpec("json_schema", json.dumps(overlapping), lenient=True)
    text = walk(grammars, lenient, 0)
    assert text is not None
    jsonschema.validate(json.loads(text), {"anyOf": overlapping["oneOf"]})
    # Disjointness, proved or not.
    root: dict[str, Any] = {
        "$defs": {"s": {"type": "string"}, "i": {"type": "integer"}, "loop": {"$ref": "#/$defs/loop"}}
    }
    assert disjoint_branches([{"$ref": "#/$defs/s"}, {"$ref": "#/$defs/i"}], root)
    assert disjoint_branches([{"enum": [1, 2]}, {"const": 3}], root)
    assert not disjoint_branches([{"enum": [1, 2]}, {"const": 2}], root)
    assert not disjoint_branches([{"type": "integer"}, {"type": "number"}], root)
    assert not disjoint_branches([{"$ref": "#/$defs/loop"}, {"type": "string"}], root)
    assert not disjoint_branches([{"$ref": "#/$defs/missing"}, {"type": "string"}], root)
    assert not disjoint_branches([{"properties": {"k": {"const": 1}}}, {"properties": {"k": {"const": 2}}}], root)
    required = {"required": ["k"]}
    assert disjoint_branches(
        [{**required, "properties": {"k": {"const": 1}}}, {**required, "properties": {"k": {"const": 2}}}], root
    )
    # A oneOf nested deep in the schema is found, and data keywords are not read as schemas.
    nested = {"type": "object", "properties": {"v": {"oneOf": [{"type": "number"}, {"minimum": 1}]}}}
    with pytest.raises(ServiceError) as failure:
        prepared_schema(nested)
    assert "#/properties/v" in failure.value.message
    assert "coerce_one_of" not in json.dumps(prepared_schema({"const": {"oneOf": [1, 1]}}))


def test_boolean_schemas() -> None:
    assert prepared_schema(True) == {}
    with pytest.raises(ServiceError) as failure:
        prepared_schema(False)
    assert failure.value.code == grpc.StatusCode.INVALID_ARGUMENT and "unsatisfiable" in failure.value.message
    with pytest.raises(ServiceError) as failure:
        prepared_schema([1])
    assert failure.value.code == grpc.StatusCode.INVALID_ARGUMENT
    # A lenient boolean schema travels as it is (there is nowhere to put the option, nor a need).
    assert ConstraintSpec("json_schema", "true", lenient=True).to_proto().json_schema == "true"
