"""What the gateway bounds before a request reaches its handlers: connections, reads and bodies.

uvicorn alone holds a connection that sends its headers slowly for as long as the client likes (its
keep-alive timer runs only between requests), so a few hundred slow clients hold as many descriptors
until the process limit. `BoundedH11Protocol` closes a connection whose request headers have not
arrived within the read timeout, answers JSON when the headers are malformed or too large, and turns
connections beyond the cap away at once with a JSON 429. Bodies are bounded by Starlette's body
limit (the app's `max_body_size`, checked against Content-Length before reading and while reading)
and read by the handlers within the same timeout (`read_body`).
"""

from __future__ import annotations

import asyncio
import json
import math
import resource
from collections.abc import AsyncIterator
from typing import Any

import h11
from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.h11_impl import H11Protocol

from http_gateway.openai_api import ApiError
from serving.protocol import MAX_PROMPT_CHARS_PER_TOKEN

# A character of a prompt takes at most 12 bytes of JSON (a UTF-16 surrogate pair written as two
# \uXXXX escapes).
_JSON_BYTES_PER_CHAR = 12
_BODY_SLACK_BYTES = 64 * 1024  # every field but the prompt
MAX_JSON_DEPTH = 32  # an OpenAI body nests about 5 deep (messages, content parts, response formats)
_REFUSED_LINGER_S = 1.0


def default_max_body_bytes(max_context: int) -> int:
    """The longest body the orchestrator could accept: a prompt at its limit, written at JSON's most
    verbose, and room for the other fields."""
    return max_context * MAX_PROMPT_CHARS_PER_TOKEN * _JSON_BYTES_PER_CHAR + _BODY_SLACK_BYTES


def default_max_connections() -> int:
    """Half the process's open-file limit: each connection is a descriptor, and the rest (the gRPC
    channel, the tokenizer's files, logs) needs some too."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(16, soft // 2) if soft != resource.RLIM_INFINITY else 4096


def _response(status: int, reason: str, error: ApiError, headers: dict[str, str] | None = None) -> bytes:
    body = json.dumps(error.body()).encode()
    lines = [f"HTTP/1.1 {status} {reason}", "content-type: application/json", "connection: close"]
    lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
    lines.append(f"content-length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


class BoundedH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a header read timeout and a connection cap.

    `read_timeout_s` and `max_connections` are set on a subclass by `bounded_protocol`."""

    read_timeout_s: float = 30.0
    max_connections: int = 1024

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._header_deadline: asyncio.TimerHandle | None = None
        self._refused = False
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            self._refuse(transport)
            return
        self._arm()

    def _refuse(self, transport: asyncio.Transport) -> None:
        """A JSON 429 at once, then the connection lingers, reading and dropping what the client sends,
        for up to a second: closing it at once would make the client's request meet a reset instead of
        the answer."""
        self._refused = True
        message = (
            f"the gateway holds its maximum of {self.max_connections} connections; retry shortly, or raise "
            "--max-connections"
        )
        transport.write(
            _response(
                429, "Too Many Requests", ApiError(429, message, code="too_many_connections"), {"retry-after": "1"}
            )
        )
        if transport.can_write_eof():
            transport.write_eof()
        self.loop.call_later(_REFUSED_LINGER_S, transport.close)

    def _arm(self) -> None:
        if self._header_deadline is None:
            self._header_deadline = self.loop.call_later(self.read_timeout_s, self._headers_too_slow)

    def _disarm(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _headers_too_slow(self) -> None:
        self._header_deadline = None
        if self.cycle is None or self.cycle.response_complete:  # still no whole request header
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        super().data_received(data)
        if self.transport.is_closing():
            self._disarm()
        elif self.cycle is None or self.cycle.response_complete:
            self._arm()  # bytes of a request whose headers are not complete yet
        else:
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """Malformed or oversized request headers, answered in the API's JSON shape."""
        limit = self.config.h11_max_incomplete_event_size or 16 * 1024  # h11's default
        if len(self.conn.trailing_data[0]) > limit:
            status, reason = 431, "Request Header Fields Too Large"
            error = ApiError(
                status, f"the request's headers exceed {limit} bytes; send smaller headers", code="headers_too_large"
            )
        else:
            status, reason = 400, "Bad Request"
            error = ApiError(status, "the request is not valid HTTP/1.1", code="invalid_http")
        body = json.dumps(error.body()).encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        for event in (h11.Response(status_code=status, headers=headers, reason=reason), h11.Data(data=body)):
            self.transport.write(self.conn.send(event))
        self.transport.write(self.conn.send(h11.EndOfMessage()))
        self.transport.close()


def bounded_protocol(read_timeout_s: float, max_connections: int) -> type[BoundedH11Protocol]:
    """The protocol class to hand uvicorn (`Config(http=...)`), with these bounds."""
    return type(
        "GatewayH11Protocol",
        (BoundedH11Protocol,),
        {"read_timeout_s": read_timeout_s, "max_connections": max_connections},
    )


async def read_body(chunks: AsyncIterator[bytes], timeout_s: float) -> bytes:
    """The request body, or a 408 when it has not arrived within `timeout_s`. (Its size is bounded by
    the app's `max_body_size`, Starlette's body limit, before and while it is read.)"""
    received = bytearray()
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in chunks:
                received += chunk
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout_s:g} s", code="read_timeout") from None
    except ClientDisconnect:
        raise ApiError(400, "the client closed the connection before its body arrived", code="disconnected") from None
    return bytes(received)


def parse_json(raw: bytes) -> Any:
    """The body as JSON: valid UTF-8, finite numbers, at most MAX_JSON_DEPTH deep, and every string
    valid Unicode (no lone surrogates), or a 400 naming what is wrong."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"the request body is not UTF-8: {exc}", code="invalid_json") from None
    try:
        body = json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise ApiError(
            400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels", code="invalid_json"
        ) from None
    except ValueError as exc:
        raise ApiError(400, f"the request body is not JSON: {exc}", code="invalid_json") from None
    _check_values(body)
    return body


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def _check_values(body: Any) -> None:
    """Depth, finite floats and valid strings, walked without recursion."""
    stack: list[tuple[Any, str, int]] = [(body, "", 1)]
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise ApiError(
                400,
                f"the request body nests deeper than {MAX_JSON_DEPTH} levels (at `{path}`)",
                path or None,
                "invalid_json",
            )
        if isinstance(value, dict):
            for key, item in value.items():
                _check_string(key, f"{path}.{key}" if path else "a field name")
                stack.append((item, f"{path}.{key}" if path else str(key), depth + 1))
        elif isinstance(value, list):
            stack.extend((item, f"{path}[{i}]", depth + 1) for i, item in enumerate(value))
        elif isinstance(value, str):
            _check_string(value, path)
        elif isinstance(value, float) and not math.isfinite(value):
            raise ApiError(400, f"`{path}` must be a finite number", path, "invalid_json")


def _check_string(value: str, path: str) -> None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(
            400, f"`{path}` is not valid Unicode (a lone surrogate such as \\ud800)", path or None, "invalid_json"
        ) from None


def body_too_large(max_bytes: int) -> ApiError:
    message = (
        f"the request body exceeds {max_bytes} bytes, the most a prompt at this model's context needs; send a "
        "shorter prompt (or raise --max-body-bytes)"
    )
    return ApiError(413, message, code="body_too_large")


class RequestBounds:
    """An ASGI wrapper that refuses, before the app sees them, a request whose headers together exceed
    `max_header_bytes` (431; h11 bounds only a header section that arrives in pieces) or whose
    Content-Length exceeds `max_body_bytes` (413; Starlette's own limit would answer in plain text)."""

    def __init__(self, app: Any, max_header_bytes: int, max_body_bytes: int) -> None:
        self.app = app
        self.max_header_bytes = max_header_bytes
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            error = self._refusal(scope["headers"])
            if error is not None:
                body = json.dumps(error.body()).encode()
                headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
                await send({"type": "http.response.start", "status": error.status, "headers": headers})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)

    def _refusal(self, headers: list[tuple[bytes, bytes]]) -> ApiError | None:
        size = sum(len(name) + len(value) + 4 for name, value in headers)
        if size > self.max_header_bytes:
            message = f"the request's headers take {size} bytes; at most {self.max_header_bytes} are accepted"
            return ApiError(431, message, code="headers_too_large")
        for name, value in headers:
            if name == b"content-length" and value.isdigit() and int(value) > self.max_body_bytes:
                return body_too_large(self.max_body_bytes)
        return None
