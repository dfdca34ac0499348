"""The OpenAI-compatible gateway in the orchestrator's own process (`orchestrator --http-port P`).

The same app as `python -m http_gateway`, on the orchestrator's event loop, calling its servicer
directly: no gRPC hop, no second process, the same bounds on bodies, reads and connections. An error
of the servicer reaches the app as the status a gRPC client would see, so every answer is the
separate gateway's. Body parsing and chat-template rendering run off the loop already (a thread, as
in the separate gateway); parsing JSON and writing events run on it, between rounds.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import structlog
import uvicorn
from grpc_health.v1 import health_pb2

from http_gateway.__main__ import GatewayConfig, server_config
from http_gateway.app import Upstream
from serving.errors import HANDLER_INTERNAL_PREFIX, ServiceError
from specdec.v1 import orchestrator_pb2

log = structlog.get_logger(__name__)

_END = object()


class _Context:
    """What the servicers read of a ServicerContext when called in-process: only `abort` (the
    health servicer's, for a service it does not know). API keys are the app's to check."""

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise ServiceError(code, details)


def _rpc_error(exc: ServiceError) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(exc.code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=exc.message)


class InProcessCall:
    """A Generate call as grpc.aio's streaming call offers it (iterate, cancel), over the servicer's
    Generate running in a task of its own: cancelling it ends the generation, as a client that goes
    away does."""

    def __init__(self, servicer: Any, request: orchestrator_pb2.GenerateRequest) -> None:
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._task = asyncio.create_task(self._pump(servicer, request, _Context()))

    async def _pump(self, servicer: Any, request: orchestrator_pb2.GenerateRequest, context: _Context) -> None:
        try:
            async for message in servicer.Generate(request, context):
                self._queue.put_nowait(message)
            self._queue.put_nowait(_END)
        except ServiceError as exc:
            self._queue.put_nowait(_rpc_error(exc))
        except Exception as exc:  # a bug: the client gets INTERNAL, as over gRPC, never a hang
            log.exception("generate_failed")
            self._queue.put_nowait(
                _rpc_error(ServiceError(grpc.StatusCode.INTERNAL, f"{HANDLER_INTERNAL_PREFIX}{exc!r}"))
            )

    def __aiter__(self) -> AsyncIterator[orchestrator_pb2.GenerateResponse]:
        return self

    async def __anext__(self) -> orchestrator_pb2.GenerateResponse:
        item = await self._queue.get()
        if item is _END:
            raise StopAsyncIteration
        if isinstance(item, grpc.aio.AioRpcError):
            raise item
        return item  # type: ignore[no-any-return]

    def cancel(self) -> bool:
        return self._task.cancel()


class InProcessStub:
    """The orchestrator calls the gateway makes, answered by the servicer in this process."""

    def __init__(self, servicer: Any) -> None:
        self.servicer = servicer

    def Generate(self, request: orchestrator_pb2.GenerateRequest, metadata: Any = ()) -> InProcessCall:
        """`metadata` (the caller's API key) is the gRPC stub's signature; the app checked the key."""
        return InProcessCall(self.servicer, request)

    async def GetInfo(
        self, request: orchestrator_pb2.GetInfoRequest, metadata: Any = (), timeout: float | None = None
    ) -> orchestrator_pb2.GetInfoResponse:
        try:
            return await self.servicer.GetInfo(request, _Context())  # type: ignore[no-any-return]
        except ServiceError as exc:
            raise _rpc_error(exc) from exc


class InProcessHealth:
    """The readiness check's health call, answered by the orchestrator's health servicer."""

    def __init__(self, health: Any) -> None:
        self.health = health

    async def Check(
        self, request: health_pb2.HealthCheckRequest, timeout: float | None = None
    ) -> health_pb2.HealthCheckResponse:
        try:
            return await self.health.Check(request, _Context())  # type: ignore[no-any-return]
        except ServiceError as exc:
            raise _rpc_error(exc) from exc


async def in_process_upstream(servicer: Any, health: Any) -> Upstream:
    """The gateway's view of the orchestrator in this process: its info, tokenizer and health."""
    stub = InProcessStub(servicer)
    info = await stub.GetInfo(orchestrator_pb2.GetInfoRequest())
    return Upstream([stub], info, servicer.tokenizer, InProcessHealth(health))  # type: ignore[list-item]


class _Server(uvicorn.Server):
    """uvicorn without its own signal handlers: the orchestrator's drain stops it."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@dataclass
class HttpServer:
    """The in-process gateway, serving until `stop`."""

    server: uvicorn.Server
    task: asyncio.Task[None]
    upstream: Upstream

    async def stop(self) -> None:
        """Stop taking connections; open requests finish within the grace given at start."""
        self.server.should_exit = True
        await self.task


async def start_http(
    servicer: Any, health: Any, host: str, port: int, api_key_file: str = "", grace_s: float = 30.0
) -> HttpServer:
    """The gateway on this event loop (open requests get `grace_s` to finish when it stops). Its
    socket is bound with SO_REUSEPORT, as gRPC binds the orchestrator's port, so that every worker
    of `--workers` serves it."""
    upstream = await in_process_upstream(servicer, health)
    gateway = GatewayConfig(orchestrator="in-process", host=host, port=port, api_key_file=api_key_file)
    config = server_config(gateway, upstream)
    config.timeout_graceful_shutdown = max(1, int(grace_s))
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise SystemExit(f"cannot listen on {host}:{port} for HTTP: {exc}; choose another --http-port") from exc
    server = _Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.01)
    if task.done():
        task.result()
    return HttpServer(server, task, upstream)
