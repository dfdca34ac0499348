"""One exception type carrying a gRPC status, and the interceptors that turn any exception into one."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
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


class ErrorInterceptor(grpc.ServerInterceptor):
    """Synchronous servers: any exception from a handler becomes a status; the server keeps serving."""

    def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler], details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        handler = continuation(details)
        if handler is None:
            return handler
        method = details.method

        def unary(behaviour: Callable[..., Any]) -> Callable[..., Any]:
            def wrapped(request: Any, context: grpc.ServicerContext) -> Any:
                started, code = time.perf_counter(), grpc.StatusCode.OK
                try:
                    return behaviour(request, context)
                except Exception as exc:  # noqa: BLE001 - this is the one place that catches all
                    code, message = _status_of(exc, method)
                    context.abort(code, message)
                finally:
                    RPC_LATENCY.labels(method, code.name).observe(time.perf_counter() - started)

            return wrapped

        def streaming(behaviour: Callable[..., Iterator[Any]]) -> Callable[..., Iterator[Any]]:
            def wrapped(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                started, code = time.perf_counter(), grpc.StatusCode.OK
                try:
                    yield from behaviour(request, context)
                except grpc.RpcError:
                    code = grpc.StatusCode.CANCELLED
                    if context.is_active():
                        raise
                    # The client cancelled or went away: reading its stream raised; nothing to report.
                except Exception as exc:  # noqa: BLE001
                    code, message = _status_of(exc, method)
                    context.abort(code, message)
                finally:
                    RPC_LATENCY.labels(method, code.name).observe(time.perf_counter() - started)

            return wrapped

        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                unary(handler.unary_unary), handler.request_deserializer, handler.response_serializer
            )
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                unary(handler.stream_unary), handler.request_deserializer, handler.response_serializer
            )
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                streaming(handler.unary_stream), handler.request_deserializer, handler.response_serializer
            )
        return grpc.stream_stream_rpc_method_handler(
            streaming(handler.stream_stream), handler.request_deserializer, handler.response_serializer
        )


class AsyncErrorInterceptor(grpc.aio.ServerInterceptor):
    """Asyncio servers: the same contract as ErrorInterceptor."""

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
            stream_behaviour = handler.unary_stream

            async def streaming(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                started, code = time.perf_counter(), grpc.StatusCode.OK
                try:
                    async for item in stream_behaviour(request, context):
                        yield item
                except asyncio.CancelledError:
                    code = grpc.StatusCode.CANCELLED
                    raise
                except Exception as exc:  # noqa: BLE001
                    code, message = _status_of(exc, method)
                    await context.abort(code, message)
                finally:
                    RPC_LATENCY.labels(method, code.name).observe(time.perf_counter() - started)

            return grpc.unary_stream_rpc_method_handler(
                streaming, handler.request_deserializer, handler.response_serializer
            )
        return handler
