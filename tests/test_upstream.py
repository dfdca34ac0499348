"""Which failed steps the orchestrator retries on another replica, and which it reports as they are."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from orchestrator.upstream import ReplicaPool, SessionStream
from serving.errors import HANDLER_INTERNAL_PREFIX, ServiceError
from specdec.v1 import common_pb2, target_pb2

Stream = SessionStream[target_pb2.VerifyRequest, target_pb2.VerifyResponse]


class _Stream:
    """A bidi stream whose first read either answers or fails with `error`."""

    def __init__(self, error: grpc.aio.AioRpcError | None):
        self.error = error
        self.cancelled = False

    async def write(self, request: target_pb2.VerifyRequest) -> None:
        pass

    async def read(self) -> target_pb2.VerifyResponse:
        if self.error is not None:
            raise self.error
        return target_pb2.VerifyResponse(result=common_pb2.SESSION_RESULT_OK)

    def cancel(self) -> None:
        self.cancelled = True


def _error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


def _step(errors: list[grpc.aio.AioRpcError | None], backoff_s: float = 0.0) -> tuple[Stream, list[_Stream]]:
    """Run one step over two replicas; stream i fails with errors[i]."""
    opened: list[_Stream] = []

    def open_call(stub: object, metadata: tuple[tuple[str, str], ...]) -> _Stream:
        opened.append(_Stream(errors[len(opened)]))
        return opened[-1]

    async def run() -> Stream:
        pool = ReplicaPool("target", "127.0.0.1:1,127.0.0.1:2", lambda channel: None, resolve_interval_s=60.0)
        await pool.start()
        stream: Stream = SessionStream(pool, open_call, request_id="r1", attempts=2, backoff_s=backoff_s)
        try:
            await stream.step([1, 2], lambda keep: target_pb2.VerifyRequest(keep=keep))
        finally:
            await pool.close()
        return stream

    return asyncio.run(run()), opened


@pytest.mark.parametrize(
    "code, details",
    [
        # A replica shutting down resets its streams with an HTTP/2 error; gRPC reports INTERNAL.
        (grpc.StatusCode.INTERNAL, "Internal error from Core"),
        (grpc.StatusCode.INTERNAL, "Received RST_STREAM with error code 2"),
        (grpc.StatusCode.UNAVAILABLE, "Socket closed"),
        (grpc.StatusCode.CANCELLED, "Cancelled"),
    ],
)
def test_a_lost_stream_is_reopened_on_the_other_replica(code, details):
    stream, opened = _step([_error(code, details), None])
    assert len(opened) == 2 and opened[0].cancelled
    assert stream.reopens == 1
    assert stream.replica is not None and stream.replica.failed_at < 0  # the second replica answered


def test_a_steps_time_is_its_answering_attempt_alone():
    """The step time the load-aware price learns from (shared by every request) leaves out a lost
    stream's failed attempt and the backoff before the retry: one request's bad luck is no load."""
    stream, opened = _step([_error(grpc.StatusCode.UNAVAILABLE, "Socket closed"), None], backoff_s=0.2)
    assert len(opened) == 2
    assert 0 < stream.last_seconds < 0.05  # the backoff slept at least 0.1 s


@pytest.mark.parametrize(
    "code, details",
    [
        (grpc.StatusCode.INTERNAL, f"{HANDLER_INTERNAL_PREFIX}/specdec.v1.TargetService/Verify: RuntimeError: boom"),
        (grpc.StatusCode.INVALID_ARGUMENT, "keep 9 exceeds the 3 tokens held"),
    ],
)
def test_a_handler_error_is_reported_not_retried(code, details):
    with pytest.raises(ServiceError) as raised:
        _step([_error(code, details), None])
    assert raised.value.code == code and details in raised.value.message


@pytest.mark.parametrize(
    ("held", "context", "min_append", "keep"),
    [
        ([], [1, 2, 3], 1, 0),  # a new session: feed everything
        ([1, 2, 3], [1, 2, 3, 4], 1, 3),  # the next token
        ([1, 2, 3, 9, 9], [1, 2, 3, 4, 5], 1, 3),  # a rejected block rolls back
        ([1, 2, 3], [1, 2, 3], 1, 2),  # at least one token is fed (a draft continues from it)
        ([1, 2, 3, 4], [1, 2, 3, 4, 7, 8], 3, 3),  # a verify feeds its rows' tokens: the last committed too
        ([5, 2, 3], [1, 2, 3, 4], 1, 0),  # nothing shared
        (list(range(500)), [*range(100), 7, *range(101, 400)], 1, 100),  # a difference far from the end
    ],
)
def test_reusable_prefix(held, context, min_append, keep):
    from orchestrator.upstream import reusable_prefix

    assert reusable_prefix(held, context, min_append) == keep
