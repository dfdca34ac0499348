"""OpenAI's request and response shapes, converted to and from specdec's gRPC API at the edge.

A field specdec does not support is accepted at its neutral value (`n: 1`, `presence_penalty: 0`,
which many clients always send) and refused with 400 naming it when it asks for something. vLLM's
sampling extras (`ignore_eos`, `min_tokens`, `stop_token_ids`), which benchmark tools send, have vLLM's
meanings. specdec's own settings travel as extension fields (a client's `extra_body`), and a
response's generation statistics come back in the `specdec` field.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from dataclasses import dataclass
from typing import Any

from google.protobuf.json_format import MessageToDict

from serving.protocol import DRAFT_METHOD_BY_NAME, MAX_PROMPT_CHARS_PER_TOKEN, POLICY_BY_NAME
from specdec.v1 import orchestrator_pb2

# OpenAI's default for completions; chat defaults to the room left in the context.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
FINISH_REASONS = {
    orchestrator_pb2.FINISH_REASON_LENGTH: "length",
    orchestrator_pb2.FINISH_REASON_EOS: "stop",
    orchestrator_pb2.FINISH_REASON_STOP: "stop",
}
# Fields that are accepted only at these neutral values.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "n": (None, 1),
    "best_of": (None, 1),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "suffix": (None, ""),
    "tools": (None, []),
    "tool_choice": (None, "none"),
}
_IGNORED = {"model", "user", "stream", "stream_options", "metadata", "store", "service_tier", "parallel_tool_calls"}


class ApiError(Exception):
    """An error answered as an OpenAI-style JSON body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        if self.status == 401:
            kind = "authentication_error"
        elif self.status == 429:
            kind = "rate_limit_error"
        elif self.status < 500:
            kind = "invalid_request_error"
        else:
            kind = "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param, "invalid_request_error")


def _number(body: dict[str, Any], name: str, kind: type, default: Any) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or (kind is int and not isinstance(value, int)):
        raise invalid(f"`{name}` must be {'an integer' if kind is int else 'a number'}; got {value!r}", name)
    return value


def _count(body: dict[str, Any], name: str, default: Any) -> Any:
    """A non-negative integer that fits the API's 32-bit fields."""
    value = _number(body, name, int, default)
    if value is not None and not 0 <= value < 1 << 32:
        raise invalid(f"`{name}` must be between 0 and {(1 << 32) - 1}; got {value}", name)
    return value


@dataclass(frozen=True)
class Parsed:
    """A validated OpenAI request, as specdec's GenerateRequest plus what the response needs."""

    request: orchestrator_pb2.GenerateRequest
    stream: bool
    include_usage: bool


def check_fields(body: dict[str, Any], known: set[str]) -> None:
    """400 for an unsupported field that asks for something, or an unknown one."""
    for name, value in body.items():
        if name in _NEUTRAL:
            if value not in _NEUTRAL[name]:
                raise invalid(f"`{name}` = {value!r} is not supported by specdec; leave it unset", name)
        elif name not in known and name not in _IGNORED:
            raise invalid(f"unknown field `{name}`", name)


EXTENSION_FIELDS = {
    "num_speculative_tokens",
    "speculation_policy",
    "overlap_drafting",
    "speculation_tree",
    "draft_method",
    "top_k",
    "cache_salt",
    "ignore_eos",
    "min_tokens",
    "stop_token_ids",
}


def build_request(
    body: dict[str, Any], prompt: orchestrator_pb2.GenerateRequest, max_tokens_default: int, request_id: str
) -> Parsed:
    """The common fields: sampling, stop strings, streaming, and specdec's extension fields."""
    request = prompt
    max_tokens = _count(body, "max_tokens", None)
    if max_tokens is None:
        max_tokens = _count(body, "max_completion_tokens", max_tokens_default)
    if max_tokens < 1:
        raise invalid(f"`max_tokens` must be at least 1; got {max_tokens}", "max_tokens")
    request.max_new_tokens = max_tokens
    request.temperature = float(_number(body, "temperature", float, 1.0))
    if body.get("top_p") is not None:
        request.top_p = float(_number(body, "top_p", float, 1.0))
    if body.get("seed") is not None:
        seed = _number(body, "seed", int, 0)
        request.seed = seed % (1 << 64)
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise invalid("`stop` must be a string or a list of strings", "stop")
        request.stop.extend(stops)
    if body.get("top_k") is not None:
        request.top_k = _count(body, "top_k", 0)
    if body.get("ignore_eos") is not None:
        if not isinstance(body["ignore_eos"], bool):
            raise invalid("`ignore_eos` must be true or false", "ignore_eos")
        request.ignore_eos = body["ignore_eos"]
    request.min_tokens = _count(body, "min_tokens", 0)
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None:
        if not isinstance(stop_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 31 for t in stop_ids
        ):
            raise invalid("`stop_token_ids` must be a list of token ids (non-negative integers)", "stop_token_ids")
        request.stop_token_ids.extend(stop_ids)
    if body.get("num_speculative_tokens") is not None:
        request.num_speculative_tokens = _count(body, "num_speculative_tokens", 0)
    if body.get("speculation_policy") is not None:
        request.speculation_policy = POLICY_BY_NAME[_choice(body, "speculation_policy", POLICY_BY_NAME)]
    if body.get("draft_method") is not None:
        request.draft_method = DRAFT_METHOD_BY_NAME[_choice(body, "draft_method", DRAFT_METHOD_BY_NAME)]
    for flag in ("overlap_drafting", "speculation_tree"):
        if body.get(flag) is not None:
            if not isinstance(body[flag], bool):
                raise invalid(f"`{flag}` must be true or false", flag)
            setattr(request, flag, body[flag])
    request.request_id = request_id
    stream = body.get("stream")
    stream = False if stream is None else stream
    if not isinstance(stream, bool):
        raise invalid("`stream` must be true or false", "stream")
    options = body.get("stream_options")
    options = {} if options is None else options
    if not isinstance(options, dict):
        raise invalid("`stream_options` must be an object", "stream_options")
    return Parsed(request, stream, bool(options.get("include_usage")))


def _choice(body: dict[str, Any], name: str, allowed: dict[str, Any]) -> str:
    value = body[name]
    if not isinstance(value, str) or value not in allowed:
        raise invalid(f"`{name}` must be one of {', '.join(allowed)}; got {value!r}", name)
    return value


def completion_prompt(body: dict[str, Any], vocab_size: int, max_context: int) -> orchestrator_pb2.GenerateRequest:
    """The prompt of /v1/completions: a string (of at most 64 characters per context token, as the gRPC
    API accepts), or token ids (one prompt only), each checked against the vocabulary and their count
    against the context."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        most = max_context * MAX_PROMPT_CHARS_PER_TOKEN
        if len(prompt) > most:
            raise invalid(
                f"`prompt` has {len(prompt)} characters; at most {most} are accepted for a context of "
                f"{max_context} tokens",
                "prompt",
            )
        return orchestrator_pb2.GenerateRequest(text=prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if len(prompt) >= max_context:
            raise invalid(f"`prompt` has {len(prompt)} token ids; the context holds {max_context}", "prompt")
        bad = next((t for t in prompt if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise invalid(f"`prompt` holds the token id {bad}; ids must be in [0, {vocab_size})", "prompt")
        return orchestrator_pb2.GenerateRequest(token_ids=orchestrator_pb2.TokenIds(ids=prompt))
    raise invalid("`prompt` must be a non-empty string or list of token ids (one prompt per request)", "prompt")


def stats_extension(stats: orchestrator_pb2.GenerationStats) -> dict[str, Any]:
    """The `specdec` extension field: the generation's statistics, acceptance rate included."""
    fields = MessageToDict(stats, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    drafted = stats.draft_tokens
    fields["acceptance_rate"] = stats.accepted_tokens / drafted if drafted else None
    return fields


def usage(stats: orchestrator_pb2.GenerationStats) -> dict[str, Any]:
    """OpenAI's usage object; cached_tokens are the prompt tokens the target's prefix cache held."""
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.output_tokens,
        "total_tokens": stats.prompt_tokens + stats.output_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.target_reused_prompt_tokens},
    }


MAX_CACHE_SALT_CHARS = 256


def cache_salt(body: dict[str, Any], metadata: tuple[tuple[str, str], ...], secret: bytes | None) -> str:
    """The request's cache salt: the body's `cache_salt` (vLLM's field), or with a server secret
    (--cache-salt-per-key) an HMAC of the API key and that field, so that no two keys share cached
    prefixes whatever they send."""
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not 0 < len(salt) <= MAX_CACHE_SALT_CHARS):
        raise invalid(
            f"`cache_salt` must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters", "cache_salt"
        )
    if secret is None:
        return salt or ""
    key = next((value.removeprefix("Bearer ").strip() for name, value in metadata if name == "authorization"), "")
    return hmac.new(secret, key.encode() + b"\0" + (salt or "").encode(), hashlib.sha256).hexdigest()


def envelope(kind: str, request_id: str, model: str) -> dict[str, Any]:
    prefix = "chatcmpl" if kind.startswith("chat") else "cmpl"
    return {"id": f"{prefix}-{request_id}", "object": kind, "created": int(time.time()), "model": model}
