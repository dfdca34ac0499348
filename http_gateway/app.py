"""The OpenAI-compatible HTTP gateway: a FastAPI app that is a gRPC client of the orchestrator.

POST /v1/completions, POST /v1/chat/completions (streamed as server-sent events, or not),
GET /v1/models, GET /health. A client that disconnects cancels its gRPC call, so the services free
the session at once.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
import structlog
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from transformers import PreTrainedTokenizerBase

from http_gateway.openai_api import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    EXTENSION_FIELDS,
    FINISH_REASONS,
    ApiError,
    Parsed,
    build_request,
    check_fields,
    completion_prompt,
    envelope,
    invalid,
    stats_extension,
    usage,
)
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
_COMMON_FIELDS = {"max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stop", *EXTENSION_FIELDS}


@dataclass
class Upstream:
    """The orchestrator: its stub and what GetInfo said."""

    stub: orchestrator_pb2_grpc.OrchestratorStub
    info: orchestrator_pb2.GetInfoResponse
    tokenizer: PreTrainedTokenizerBase

    @property
    def model(self) -> str:
        return self.info.target.model


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


def create_app(upstream: Upstream, api_keys: ApiKeys | None = None) -> FastAPI:
    """The gateway's FastAPI app over a connected orchestrator."""
    app = FastAPI(title="specdec OpenAI-compatible gateway", docs_url=None, redoc_url=None)

    def metadata_of(request: Request) -> tuple[tuple[str, str], ...]:
        authorization = request.headers.get("authorization", "")
        if api_keys is not None and not api_keys.accepts((("authorization", authorization),)):
            raise ApiError(401, "a valid API key is required: send the header `Authorization: Bearer <key>`")
        return (("authorization", authorization),) if authorization else ()

    def check_model(body: dict[str, Any]) -> None:
        model = body.get("model")
        if model is not None and model != upstream.model:
            raise ApiError(404, f"The model `{model}` does not exist; this server serves `{upstream.model}`",
                           "model", "model_not_found")  # fmt: skip

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

    async def respond(request: Request, parsed: Parsed, chat: bool, metadata: tuple[tuple[str, str], ...]) -> Any:
        kind = "chat.completion" if chat else "text_completion"
        if parsed.stream:
            stream = run(request, parsed, metadata)
            try:  # the first message (or the error) before the response starts
                first = await anext(stream)
            except StopAsyncIteration:
                first = None
            return StreamingResponse(
                _events(stream, first, parsed, chat, upstream.model),
                media_type="text/event-stream",
                headers={REQUEST_ID_HEADER: parsed.request.request_id},
            )
        gathered = Generation()
        async for _, gathered in run(request, parsed, metadata):  # noqa: B007 - the last state is the result
            pass
        stats = gathered.stats or orchestrator_pb2.GenerationStats()
        body = envelope(kind, parsed.request.request_id, upstream.model)
        choice: dict[str, Any] = {"index": 0, "finish_reason": gathered.finish_reason}
        if chat:
            choice["message"] = {"role": "assistant", "content": gathered.text}
        else:
            choice.update(text=gathered.text, logprobs=None)
        body.update(choices=[choice], usage=usage(stats.prompt_tokens, stats.output_tokens))
        body["specdec"] = stats_extension(stats)
        return JSONResponse(body, headers={REQUEST_ID_HEADER: parsed.request.request_id})

    async def body_of(request: Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except ValueError as exc:
            raise invalid(f"the request body is not JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise invalid("the request body must be a JSON object")
        return body

    def request_id(request: Request) -> str:
        return request.headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok", "model": upstream.model}

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        metadata_of(request)
        draft = upstream.info.draft.model if upstream.info.HasField("draft") else None
        card = {"id": upstream.model, "object": "model", "created": 0, "owned_by": "specdec"}
        card["specdec"] = {"draft_model": draft, "max_context": upstream.info.target.max_context}
        return {"object": "list", "data": [card]}

    async def accepted(request: Request, prompt_field: str) -> tuple[tuple[tuple[str, str], ...], dict[str, Any]]:
        """The call's metadata (its key checked) and its body (the model and the fields checked)."""
        metadata = metadata_of(request)
        body = await body_of(request)
        check_model(body)
        check_fields(body, {prompt_field, *_COMMON_FIELDS})
        return metadata, body

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        metadata, body = await accepted(request, "prompt")
        parsed = build_request(body, completion_prompt(body), COMPLETIONS_DEFAULT_MAX_TOKENS, request_id(request))
        return await respond(request, parsed, chat=False, metadata=metadata)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        metadata, body = await accepted(request, "messages")
        prompt_ids = await asyncio.to_thread(render_chat, upstream.tokenizer, body.get("messages"))
        room = upstream.info.target.max_context - len(prompt_ids)
        if room < 1:
            raise invalid(f"the messages take {len(prompt_ids)} tokens; the context holds {room + len(prompt_ids)}")
        default = min(upstream.info.max_new_tokens_cap, room)
        prompt = orchestrator_pb2.GenerateRequest(token_ids=orchestrator_pb2.TokenIds(ids=prompt_ids))
        parsed = build_request(body, prompt, default, request_id(request))
        return await respond(request, parsed, chat=True, metadata=metadata)

    return app


def render_chat(tokenizer: PreTrainedTokenizerBase, messages: Any) -> list[int]:
    """Messages as token ids by the model's own chat template, ready for the assistant's turn."""
    if not isinstance(messages, list) or not messages:
        raise invalid("`messages` must be a non-empty list of {role, content} objects", "messages")
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise invalid("every message needs a `role` and a `content`", "messages")
        if not isinstance(message.get("content"), str):
            raise invalid("only text `content` is supported", "messages")
    if not getattr(tokenizer, "chat_template", None):
        raise invalid("this model has no chat template: use /v1/completions with a prompt", "messages")
    # The template writes any BOS itself; the ids go to the orchestrator as they are (no second BOS).
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]


async def _events(
    stream: AsyncGenerator[tuple[orchestrator_pb2.GenerateResponse, Generation], None],
    first: tuple[orchestrator_pb2.GenerateResponse, Generation] | None,
    parsed: Parsed,
    chat: bool,
    model: str,
) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's chunk format, then `data: [DONE]`."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    base = envelope(kind, parsed.request.request_id, model)

    def chunk(delta: str | None, finish: str | None, role: bool = False) -> str:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
        if chat:
            content: dict[str, Any] = {} if delta is None else {"content": delta}
            if role:
                content["role"] = "assistant"
            choice["delta"] = content
        else:
            choice.update(text=delta or "", logprobs=None)
        return f"data: {json.dumps({**base, 'choices': [choice]})}\n\n"

    if chat:
        yield chunk("", None, role=True)
    gathered = Generation()
    try:
        pending = [first] if first is not None else []
        async for item in _chain(pending, stream):
            message, gathered = item
            if message.text:
                yield chunk(message.text, None)
        yield chunk(None if chat else "", gathered.finish_reason)
        stats = gathered.stats or orchestrator_pb2.GenerationStats()
        if parsed.include_usage:
            tail = {**base, "choices": [], "usage": usage(stats.prompt_tokens, stats.output_tokens)}
            tail["specdec"] = stats_extension(stats)
            yield f"data: {json.dumps(tail)}\n\n"
    except ApiError as exc:  # after the response started: the error travels as an event
        yield f"data: {json.dumps(exc.body())}\n\n"
    finally:
        await stream.aclose()  # cancels the gRPC call if the client went away mid-stream
    yield "data: [DONE]\n\n"


async def _chain(first: list[Any], rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    for item in first:
        yield item
    async for item in rest:
        yield item
