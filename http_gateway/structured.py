"""Structured outputs in OpenAI's and vLLM's shapes, as specdec's StructuredOutput.

- `response_format`: `{"type": "text"}` (no constraint), `{"type": "json_object"}`, and
  `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`. With `strict` true a schema
  keyword llguidance cannot enforce is refused (400 naming it); otherwise it is ignored, as OpenAI's
  non-strict mode does not promise it either.
- vLLM's `structured_outputs` extension: one of `json` (a schema, object or string), `json_object`,
  `regex`, `choice`, `grammar` (llguidance's Lark dialect).
- The older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.

At most one of them per request. Compile errors come back from the orchestrator as 400s carrying the
compiler's message.
"""

from __future__ import annotations

import json
from typing import Any

from http_gateway.openai_api import invalid
from specdec.v1 import common_pb2

FIELDS = {"response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar"}
_STRUCTURED_KEYS = {"json", "json_object", "regex", "choice", "grammar"}


def structured_output(body: dict[str, Any]) -> common_pb2.StructuredOutput | None:
    """The request's constraint, None when it asks for none; 400 naming the field for a bad one."""
    found: list[tuple[str, common_pb2.StructuredOutput]] = []
    response_format = body.get("response_format")
    if response_format is not None:
        constraint = _response_format(response_format)
        if constraint is not None:
            found.append(("response_format", constraint))
    extension = body.get("structured_outputs")
    if extension is not None:
        if not isinstance(extension, dict):
            raise invalid("`structured_outputs` must be an object", "structured_outputs")
        asked = [key for key in extension if extension[key] is not None and extension[key] is not False]
        unknown = [key for key in asked if key not in _STRUCTURED_KEYS]
        if unknown:
            keys = ", ".join(sorted(_STRUCTURED_KEYS))
            raise invalid(
                f"`structured_outputs.{unknown[0]}` is not supported; use one of {keys}", "structured_outputs"
            )
        for key in asked:
            found.append((f"structured_outputs.{key}", _kind(key, extension[key], f"structured_outputs.{key}")))
    for key in ("json", "regex", "choice", "grammar"):
        value = body.get(f"guided_{key}")
        if value is not None:
            found.append((f"guided_{key}", _kind(key, value, f"guided_{key}")))
    if len(found) > 1:
        names = ", ".join(f"`{name}`" for name, _ in found)
        raise invalid(f"ask for one structured output, not several: {names}", found[1][0])
    return found[0][1] if found else None


def _response_format(value: Any) -> common_pb2.StructuredOutput | None:
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise invalid("`response_format` must be an object with a `type`", "response_format")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return common_pb2.StructuredOutput(json_object=True)
    if kind != "json_schema":
        raise invalid(
            f"`response_format.type` {kind!r} is not supported; use text, json_object or json_schema",
            "response_format",
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict | bool):
        raise invalid(
            "`response_format.json_schema` must be an object with `name`, `schema` (an object or a boolean) "
            "and `strict`",
            "response_format",
        )
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise invalid("`response_format.json_schema.strict` must be true or false", "response_format")
    return _json_schema(spec.get("schema", {}), strict=bool(strict), param="response_format")


def _kind(key: str, value: Any, param: str) -> common_pb2.StructuredOutput:
    if key == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise invalid(f"`{param}` is not JSON: {exc}", param) from exc
        if not isinstance(value, dict | bool):
            raise invalid(f"`{param}` must be a JSON Schema (an object or a boolean)", param)
        return _json_schema(value, strict=True, param=param)
    if key == "json_object":
        if value is not True:
            raise invalid(f"`{param}` must be true", param)
        return common_pb2.StructuredOutput(json_object=True)
    if key == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(o, str) and o for o in value):
            raise invalid(f"`{param}` must be a non-empty list of non-empty strings", param)
        return common_pb2.StructuredOutput(choice=common_pb2.Choice(options=value))
    if not isinstance(value, str) or not value:
        raise invalid(f"`{param}` must be a non-empty string", param)
    message = common_pb2.StructuredOutput()
    setattr(message, key, value)
    return message


def _json_schema(schema: dict[str, Any] | bool, strict: bool, param: str) -> common_pb2.StructuredOutput:
    """A schema as the gRPC field takes it; not strict, llguidance ignores what it cannot enforce (and
    `oneOf` is served as `anyOf`)."""
    if not strict and isinstance(schema, dict):
        schema = {**schema, "x-guidance": {**schema.get("x-guidance", {}), "lenient": True}}
    return common_pb2.StructuredOutput(json_schema=json.dumps(schema))
