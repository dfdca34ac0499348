"""The OpenAI-compatible HTTP gateway: a FastAPI app that is a gRPC client of the orchestrator.

POST /v1/completions, POST /v1/chat/completions (streamed as server-sent events, or not),
GET /v1/models, GET /health (liveness), GET /ready (readiness: the orchestrator answers its health
check). A client that disconnects cancels its gRPC call, so the services free the session at once.

Every error, expected or not, is an OpenAI-style JSON body (`{"error": {...}}`) with the status
that names its cause; bodies are bounded and parsed off the event loop (http_gateway/limits.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import jinja2
import structlog
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from grpc_health.v1 import health_pb2, health_pb2_grpc
from starlette.exceptions import HTTPException as StarletteHTTPException
from transformers import PreTrainedTokenizerBase

from http_gateway import logprobs as logprob_api
from http_gateway.limits import body_too_large, parse_json, read_body
from http_gateway.openai_api import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    EXTENSION_FIELDS,
    FINISH_REASONS,
    ApiError,
    Parsed,
    build_request,
    cache_salt,
    check_fields,
    completion_prompt,
    envelope,
    invalid,
    stats_extension,
    usage,
)
from http_gateway.structured import FIELDS as STRUCTURED_FIELDS
from http_gateway.structured import structured_output
from serving.protocol import MAX_PROMPT_CHARS_PER_TOKEN
from serving.security import ApiKeys
from specdec.v1 import orchestrator_pb2, orchestrator_pb2_grpc

log = structlog.get_logger(__name__)

REQUEST_ID_HEADER = "x-request-id"
_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
_DISCONNECT_POLL_S = 0.1
_READY_TIMEOUT_S = 1.0  # an orchestrator that takes longer to answer its health check is not ready
# gRPC refuses metadata beyond 8 KiB in all; the Authorization header is the gateway's only forwarded one.
MAX_AUTHORIZATION_BYTES = 4096
_COMMON_FIELDS = {
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    *EXTENSION_FIELDS,
    *STRUCTURED_FIELDS,
    *logprob_api.LOGPROB_FIELDS,
}


@dataclass
class Upstream:
    """The orchestrator: its stubs (one per channel, taken in turn) and what GetInfo said."""

    stubs: list[orchestrator_pb2_grpc.OrchestratorStub]
    info: orchestrator_pb2.GetInfoResponse
    tokenizer: PreTrainedTokenizerBase
    health: health_pb2_grpc.HealthStub | None = None
    _turn: int = 0

    @property
    def stub(self) -> orchestrator_pb2_grpc.OrchestratorStub:
        """The next channel's stub: an orchestrator with --workers balances by connection."""
        self._turn = (self._turn + 1) % len(self.stubs)
        return self.stubs[self._turn]

    @property
    def model(self) -> str:
        return self.info.target.model


@dataclass(frozen=True)
class RequestLimits:
    """How much of a request the gateway reads, and for how long."""

    max_body_bytes: int
    read_timeout_s: float


def _api_error(exc: grpc.aio.AioRpcError) -> ApiError:
    status = _HTTP_STATUS.get(exc.code(), 500)
    return ApiError(status, exc.details() or exc.code().name, code=exc.code().name.lower())


@dataclass
class Generation:
    """One Generate call, gathered or streamed."""

    text: str = ""
    token_ids: int = 0
    finish_reason: str | None = None
    stats: orchestrator_pb2.GenerationStats | None = None
    request_id: str = ""
    logprobs: list[orchestrator_pb2.TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[orchestrator_pb2.TokenLogprob] = field(default_factory=list)


@dataclass(frozen=True)
class Echo:
    """What a request's logprobs and echo need of its prompt: its text and token ids."""

    wanted: logprob_api.LogprobRequest
    text: str = ""
    token_ids: tuple[int, ...] = ()

    def formatter(self, tokenizer: PreTrainedTokenizerBase) -> logprob_api.Formatter:
        return logprob_api.Formatter(tokenizer, self.wanted)

    def extend(
        self,
        choice: dict[str, Any],
        formatter: logprob_api.Formatter,
        message: orchestrator_pb2.GenerateResponse,
        chat: bool,
    ) -> None:
        """Put a message's logprobs (and, on the first, the echoed prompt and vLLM's prompt_logprobs) into a
        choice or chunk."""
        wanted = self.wanted
        first = bool(message.request_id)
        if not chat and first and wanted.echo:
            choice["text"] = self.text + choice.get("text", "")
        if first and wanted.prompt_top is not None:
            choice["prompt_logprobs"] = formatter.prompt(self.token_ids, message.prompt_logprobs)
        if wanted.shape == "chat":
            choice["logprobs"] = formatter.chat(message.logprobs)
        elif wanted.shape == "completions":
            entries = list(message.logprobs)
            lead = None
            if first and wanted.echo:
                entries = list(message.prompt_logprobs) + entries
                lead = self.token_ids[0] if self.token_ids else None
            choice["logprobs"] = formatter.completions(entries, lead)


def create_app(
    upstream: Upstream, limits: RequestLimits, api_keys: ApiKeys | None = None, salt_secret: bytes | None = None
) -> FastAPI:
    """The gateway's FastAPI app over a connected orchestrator. The interactive docs and the OpenAPI
    schema are not served: they would be the one unauthenticated description of the API.

    With `salt_secret` (--cache-salt-per-key), every request's cache salt is derived from its API key."""
    app = FastAPI(
        title="specdec OpenAI-compatible gateway",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        max_body_size=limits.max_body_bytes,
    )
    context = upstream.info.target.max_context

    def metadata_of(request: Request) -> tuple[tuple[str, str], ...]:
        authorization = request.headers.get("authorization", "")
        if len(authorization) > MAX_AUTHORIZATION_BYTES:
            raise ApiError(
                431,
                f"the Authorization header has {len(authorization)} bytes; at most "
                f"{MAX_AUTHORIZATION_BYTES} are accepted",
                "authorization",
                "header_too_large",
            )
        if not all(" " <= c <= "~" for c in authorization):
            raise ApiError(
                400,
                "the Authorization header must be printable ASCII: `Bearer <key>`",
                "authorization",
                "invalid_header",
            )
        if api_keys is not None and not api_keys.accepts((("authorization", authorization),)):
            raise ApiError(401, "a valid API key is required: send the header `Authorization: Bearer <key>`")
        return (("authorization", authorization),) if authorization else ()

    def check_model(body: dict[str, Any]) -> None:
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise invalid("`model` must be a string", "model")
        if model is not None and model != upstream.model:
            raise ApiError(
                404,
                f"The model `{model}` does not exist; this server serves `{upstream.model}`",
                "model",
                "model_not_found",
            )

    async def run(
        request: Request, parsed: Parsed, metadata: tuple[tuple[str, str], ...]
    ) -> AsyncGenerator[tuple[orchestrator_pb2.GenerateResponse, Generation], None]:
        """The gRPC stream's messages; the call is cancelled when the client goes away."""
        call = upstream.stub.Generate(parsed.request, metadata=metadata)
        gathered = Generation()

        async def watch() -> None:
            while not await request.is_disconnected():
                await asyncio.sleep(_DISCONNECT_POLL_S)
            call.cancel()

        watcher = asyncio.create_task(watch())
        try:
            async for message in call:
                gathered.request_id = gathered.request_id or message.request_id
                gathered.text += message.text
                gathered.token_ids += len(message.token_ids)
                gathered.logprobs.extend(message.logprobs)
                gathered.prompt_logprobs.extend(message.prompt_logprobs)
                if message.finish_reason:
                    gathered.finish_reason = FINISH_REASONS.get(message.finish_reason, "stop")
                    gathered.stats = message.stats
                yield message, gathered
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                raise _api_error(exc) from exc
        finally:
            watcher.cancel()
            call.cancel()

    async def respond(
        request: Request, parsed: Parsed, chat: bool, metadata: tuple[tuple[str, str], ...], echo: Echo
    ) -> Any:
        kind = "chat.completion" if chat else "text_completion"
        if parsed.stream:
            stream = run(request, parsed, metadata)
            try:  # the first message (or the error) before the response starts
                first = await anext(stream)
            except StopAsyncIteration:
                first = None
            return StreamingResponse(
                _events(stream, first, parsed, chat, upstream.model, echo, echo.formatter(upstream.tokenizer)),
                media_type="text/event-stream",
                headers={REQUEST_ID_HEADER: parsed.request.request_id},
            )
        gathered = Generation()
        async for _, gathered in run(request, parsed, metadata):  # noqa: B007 - the last state is the result
            pass
        stats = gathered.stats or orchestrator_pb2.GenerationStats()
        body = envelope(kind, parsed.request.request_id, upstream.model)
        choice: dict[str, Any] = {"index": 0, "finish_reason": gathered.finish_reason, "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": gathered.text}
        else:
            choice["text"] = gathered.text
        whole = orchestrator_pb2.GenerateResponse(
            request_id=parsed.request.request_id, logprobs=gathered.logprobs, prompt_logprobs=gathered.prompt_logprobs
        )
        echo.extend(choice, echo.formatter(upstream.tokenizer), whole, chat)
        if chat and "prompt_logprobs" in choice:  # vLLM's place for it on chat completions
            body["prompt_logprobs"] = choice.pop("prompt_logprobs")
        body.update(choices=[choice], usage=usage(stats))
        body["specdec"] = stats_extension(stats)
        return JSONResponse(body, headers={REQUEST_ID_HEADER: parsed.request.request_id})

    async def body_of(request: Request) -> dict[str, Any]:
        """The JSON object of the body: its type, size and read time bounded, parsed off the event loop."""
        content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if content_type != "application/json" and not content_type.endswith("+json"):
            got = content_type or "no Content-Type"
            message = f"the request body must be JSON, sent with `Content-Type: application/json`; got {got!r}"
            raise ApiError(415, message, "content-type", "unsupported_media_type")
        raw = await read_body(request.stream(), limits.read_timeout_s)
        body = await asyncio.to_thread(parse_json, raw)
        if not isinstance(body, dict):
            raise invalid("the request body must be a JSON object")
        return body

    def request_id(request: Request) -> str:
        return request.headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        headers = {"retry-after": "1"} if exc.status in (429, 503) else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """Routing's own answers (an unknown path, a wrong method) in the same JSON shape."""
        if exc.status_code == 413:  # Starlette's body limit, on a body without a Content-Length
            error = body_too_large(limits.max_body_bytes)
        else:
            error = ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")
        return JSONResponse(error.body(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        """A bug, never a client's fault: logged with the request id, answered in the same shape."""
        rid = request.headers.get(REQUEST_ID_HEADER, "")
        log.error("unexpected_error", request_id=rid, path=request.url.path, exc_info=exc)
        error = ApiError(500, f"internal error in the gateway, logged under request id {rid!r}", code="internal")
        return JSONResponse(error.body(), status_code=500)

    @app.get("/health")
    async def health() -> dict[str, str]:
        """Liveness: the gateway's own loop answers."""
        return {"status": "ok", "model": upstream.model}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        """Readiness: the orchestrator answers its health check as SERVING."""
        serving = False
        if upstream.health is not None:
            with contextlib.suppress(grpc.aio.AioRpcError):
                answer = await upstream.health.Check(health_pb2.HealthCheckRequest(), timeout=_READY_TIMEOUT_S)
                serving = answer.status == health_pb2.HealthCheckResponse.SERVING
        if serving:
            return JSONResponse({"status": "ready", "model": upstream.model})
        error = ApiError(
            503,
            "the orchestrator does not answer its health check; requests would fail with 503",
            code="orchestrator_unavailable",
        )
        return JSONResponse(error.body(), status_code=503)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        metadata_of(request)
        draft = upstream.info.draft.model if upstream.info.HasField("draft") else None
        card = {"id": upstream.model, "object": "model", "created": 0, "owned_by": "specdec"}
        card["specdec"] = {"draft_model": draft, "max_context": context}
        return {"object": "list", "data": [card]}

    async def accepted(request: Request, prompt_field: str) -> tuple[tuple[tuple[str, str], ...], dict[str, Any]]:
        """The call's metadata (its key checked) and its body (the model and the fields checked)."""
        metadata = metadata_of(request)
        body = await body_of(request)
        check_model(body)
        check_fields(body, {prompt_field, *_COMMON_FIELDS})
        return metadata, body

    def completed(
        parsed: Parsed, body: dict[str, Any], metadata: tuple[tuple[str, str], ...], wanted: logprob_api.LogprobRequest
    ) -> Parsed:
        """What both endpoints add to the common fields: the cache salt, the structured output, the logprobs."""
        parsed.request.cache_salt = cache_salt(body, metadata, salt_secret)
        constraint = structured_output(body)
        if constraint is not None:
            parsed.request.structured_output.CopyFrom(constraint)
        logprob_api.apply(wanted, parsed.request)
        return parsed

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        metadata, body = await accepted(request, "prompt")
        wanted = logprob_api.parse(body, chat=False)
        prompt = completion_prompt(body, upstream.info.target.vocab_size, context)
        echo = Echo(wanted)
        if wanted.echo or wanted.wants_prompt:
            # The prompt's ids, tokenized here as the orchestrator would, so that its tokens can be echoed.
            if prompt.WhichOneof("prompt") == "text":
                ids = (await asyncio.to_thread(upstream.tokenizer, prompt.text))["input_ids"]
                text = prompt.text
                prompt = orchestrator_pb2.GenerateRequest(token_ids=orchestrator_pb2.TokenIds(ids=ids))
            else:
                ids = list(prompt.token_ids.ids)
                text = await asyncio.to_thread(upstream.tokenizer.decode, ids, skip_special_tokens=True)
            echo = Echo(wanted, text, tuple(ids))
        parsed = build_request(body, prompt, COMPLETIONS_DEFAULT_MAX_TOKENS, request_id(request))
        return await respond(
            request, completed(parsed, body, metadata, wanted), chat=False, metadata=metadata, echo=echo
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        metadata, body = await accepted(request, "messages")
        messages = check_messages(body.get("messages"), context * MAX_PROMPT_CHARS_PER_TOKEN)
        prompt_ids = await asyncio.to_thread(render_chat, upstream.tokenizer, messages)
        room = context - len(prompt_ids)
        if room < 1:
            raise invalid(f"the messages take {len(prompt_ids)} tokens; the context holds {context}", "messages")
        default = min(upstream.info.max_new_tokens_cap, room)
        prompt = orchestrator_pb2.GenerateRequest(token_ids=orchestrator_pb2.TokenIds(ids=prompt_ids))
        parsed = build_request(body, prompt, default, request_id(request))
        wanted = logprob_api.parse(body, chat=True)
        echo = Echo(wanted, "", tuple(prompt_ids))
        return await respond(
            request, completed(parsed, body, metadata, wanted), chat=True, metadata=metadata, echo=echo
        )

    return app


def check_messages(messages: Any, max_chars: int) -> list[dict[str, str]]:
    """Chat messages of text, within the characters the gRPC API accepts for a text prompt (checked
    before rendering and tokenizing, which cost time in proportion)."""
    if not isinstance(messages, list) or not messages:
        raise invalid("`messages` must be a non-empty list of {role, content} objects", "messages")
    total = 0
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise invalid(f"`messages[{index}]` needs a string `role` and a `content`", f"messages[{index}]")
        if not isinstance(message.get("content"), str):
            raise invalid(
                f"`messages[{index}].content` must be text (only text content is supported)",
                f"messages[{index}].content",
            )
        total += len(message["content"]) + len(message["role"])
        if total > max_chars:
            raise invalid(
                f"the messages have more than {max_chars} characters, the most a prompt may have for a "
                "context of this model",
                "messages",
            )
    return messages


def render_chat(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> list[int]:
    """Messages as token ids by the model's own chat template, ready for the assistant's turn. A
    template that refuses the conversation is a 400 naming the first message it refuses."""
    if not getattr(tokenizer, "chat_template", None):
        raise invalid("this model has no chat template: use /v1/completions with a prompt", "messages")
    try:
        # The template writes any BOS itself; the ids go to the orchestrator as they are (no second BOS).
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    except jinja2.TemplateError as exc:
        index = _first_refused(tokenizer, messages)
        where = f"`messages[{index}]` (role {messages[index]['role']!r})" if index is not None else "the conversation"
        raise invalid(
            f"the model's chat template refuses {where}: {exc}",
            f"messages[{index}]" if index is not None else "messages",
        ) from None
    if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]


_MAX_MESSAGES_SEARCHED = 64  # rendering every prefix of a longer conversation would cost its square


def _first_refused(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> int | None:
    """The first message whose conversation prefix the template refuses (None: only the whole one)."""
    if len(messages) > _MAX_MESSAGES_SEARCHED:
        return None
    for end in range(1, len(messages) + 1):
        try:
            tokenizer.apply_chat_template(messages[:end], add_generation_prompt=True, tokenize=False)
        except jinja2.TemplateError:
            return end - 1
    return None


async def _events(
    stream: AsyncGenerator[tuple[orchestrator_pb2.GenerateResponse, Generation], None],
    first: tuple[orchestrator_pb2.GenerateResponse, Generation] | None,
    parsed: Parsed,
    chat: bool,
    model: str,
    echo: Echo,
    formatter: logprob_api.Formatter,
) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's chunk format, then `data: [DONE]`."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    base = envelope(kind, parsed.request.request_id, model)

    def chunk(
        delta: str | None,
        finish: str | None,
        role: bool = False,
        message: orchestrator_pb2.GenerateResponse | None = None,
    ) -> str:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
        if chat:
            content: dict[str, Any] = {} if delta is None else {"content": delta}
            if role:
                content["role"] = "assistant"
            choice["delta"] = content
        else:
            choice["text"] = delta or ""
        if message is not None:
            echo.extend(choice, formatter, message, chat)
        return f"data: {json.dumps({**base, 'choices': [choice]})}\n\n"

    if chat:
        yield chunk("", None, role=True)
    gathered = Generation()
    try:
        pending = [first] if first is not None else []
        async for item in _chain(pending, stream):
            message, gathered = item
            if (
                message.text
                or message.logprobs
                or (message.request_id and (echo.wanted.echo or echo.wanted.wants_prompt))
            ):
                yield chunk(message.text, None, message=message)
        yield chunk(None if chat else "", gathered.finish_reason)
        stats = gathered.stats or orchestrator_pb2.GenerationStats()
        if parsed.include_usage:
            tail = {**base, "choices": [], "usage": usage(stats)}
            tail["specdec"] = stats_extension(stats)
            yield f"data: {json.dumps(tail)}\n\n"
    except ApiError as exc:  # after the response started: the error travels as an event
        yield f"data: {json.dumps(exc.body())}\n\n"
    except Exception as exc:  # a bug: logged, and the client still gets a JSON error event
        log.error("unexpected_error", request_id=parsed.request.request_id, exc_info=exc)
        error = ApiError(500, f"internal error in the gateway, logged under request id {parsed.request.request_id!r}")
        yield f"data: {json.dumps(error.body())}\n\n"
    finally:
        await stream.aclose()  # cancels the gRPC call if the client went away mid-stream
    yield "data: [DONE]\n\n"


async def _chain(first: list[Any], rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    for item in first:
        yield item
    async for item in rest:
        yield item
