"""One exception type carrying a gRPC status, and the interceptors that turn any exception into one."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import structlog

from serving.metrics import RPC_LATENCY

log = structlog.get_logger(__name__)


class ServiceError(Exception):
    """An error with the gRPC status code the client should see and a message saying what to change."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def invalid_argument(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.INVALID_ARGUMENT, message)


def failed_precondition(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.FAILED_PRECONDITION, message)


def resource_exhausted(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, message)


def unavailable(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.UNAVAILABLE, message)


# Every INTERNAL a handler returns starts with this; an INTERNAL without it came from the gRPC stack.
HANDLER_INTERNAL_PREFIX = "internal error in "


def _status_of(exc: BaseException, method: str) -> tuple[grpc.StatusCode, str]:
    """Handlers raise ServiceError and never call context.abort themselves."""
    if isinstance(exc, ServiceError):
        return exc.code, exc.message
    log.exception("unhandled_error", method=method)
    return grpc.StatusCode.INTERNAL, f"{HANDLER_INTERNAL_PREFIX}{method}: {type(exc).__name__}: {exc}"


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Any exception from a handler becomes a status (ServiceError carries its own; anything else is
    INTERNAL, logged); the server keeps serving."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return handler
        method = details.method

        if handler.unary_unary:
            behaviour = handler.unary_unary

            async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                started, code = time.perf_counter(), grpc.StatusCode.OK
                try:
                    return await behaviour(request, context)
                except Exception as exc:  # noqa: BLE001
                    code, message = _status_of(exc, method)
                    await context.abort(code, message)
                finally:
                    RPC_LATENCY.labels(method, code.name).observe(time.perf_counter() - started)

            return grpc.unary_unary_rpc_method_handler(unary, handler.request_deserializer, handler.response_serializer)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                _async_streaming(handler.unary_stream, method),
                handler.request_deserializer,
                handler.response_serializer,
            )
        if handler.stream_stream:
            return grpc.stream_stream_rpc_method_handler(
                _async_streaming(handler.stream_stream, method),
                handler.request_deserializer,
                handler.response_serializer,
            )
        return handler


def _async_streaming(
    behaviour: Callable[[Any, grpc.aio.ServicerContext], AsyncIterator[Any]], method: str
) -> Callable[[Any, grpc.aio.ServicerContext], AsyncIterator[Any]]:
    """A response-streaming handler (its request a message or a stream) whose exceptions become
    statuses; a cancelled call (the client went away) is only counted."""

    async def streaming(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        started, code = time.perf_counter(), grpc.StatusCode.OK
        try:
            async for item in behaviour(request, context):
                yield item
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        except Exception as exc:  # noqa: BLE001
            code, message = _status_of(exc, method)
            await context.abort(code, message)
        finally:
            RPC_LATENCY.labels(method, code.name).observe(time.perf_counter() - started)

    return streaming
