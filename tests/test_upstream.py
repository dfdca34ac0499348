"""Which failed steps the orchestrator retries on another replica, and which it reports as they are."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator

import grpc
import pytest
from prometheus_client import REGISTRY

from orchestrator.context import Context
from orchestrator.goodput import StepTimes
from orchestrator.link import LinkMessages
from orchestrator.step_timing import StepClock
from orchestrator.upstream import ReplicaPool, SessionStream
from serving.errors import HANDLER_INTERNAL_PREFIX, ServiceError
from specdec.v1 import common_pb2, target_pb2

Stream = SessionStream[target_pb2.VerifyRequest, target_pb2.VerifyResponse]
LINK = LinkMessages(lambda stub: stub(), target_pb2.VerifyStep, target_pb2.VerifyBatch)


class _Call:
    """A link stream that answers every step it is sent: with `error` raised as the stream's own (a
    lost stream), with `error` as that step's result (a StepError), or OK."""

    def __init__(self, error: grpc.aio.AioRpcError | common_pb2.StepError | str | None):
        self.error = error
        self.cancelled = False
        self.cancelled_before_close = False
        self.timing: common_pb2.Timing | None = None  # what each OK answer reports, if anything
        self._sessions: asyncio.Queue[tuple[int, int]] = asyncio.Queue()  # (session, tokens it holds)

    async def write(self, batch: target_pb2.VerifyBatch) -> None:
        for step in batch.steps:
            if not step.close:
                self._sessions.put_nowait((step.session, step.step.keep + len(step.step.append_token_ids)))

    def __aiter__(self) -> AsyncIterator[target_pb2.VerifyResults]:
        return self._answers()

    async def _answers(self) -> AsyncIterator[target_pb2.VerifyResults]:
        while True:
            session, held = await self._sessions.get()
            if self.error == "hang":
                continue  # a hung replica: the step is never answered
            if isinstance(self.error, grpc.aio.AioRpcError):
                raise self.error
            result = target_pb2.VerifyResult(session=session)
            if isinstance(self.error, common_pb2.StepError):
                result.error.CopyFrom(self.error)
            else:
                result.response.result = common_pb2.SESSION_RESULT_OK
                result.response.cached_tokens = held
                if self.timing is not None:
                    result.response.timing.CopyFrom(self.timing)
            yield target_pb2.VerifyResults(results=[result])

    def cancel(self) -> None:
        self.cancelled = True


def _error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


def _step_error(code: grpc.StatusCode, details: str) -> common_pb2.StepError:
    return common_pb2.StepError(code=code.value[0], message=details)


def _step(errors: list, backoff_s: float = 0.0) -> tuple[Stream, list[_Call], int]:
    """Run one step over two replicas; replica i's link answers with errors[i]. Also returns the
    tokens the answered step fed."""
    opened: list[_Call] = []

    def open_link() -> _Call:
        opened.append(_Call(errors[len(opened)]))
        return opened[-1]

    async def run() -> tuple[Stream, int]:
        pool = ReplicaPool(
            "target", "127.0.0.1:1,127.0.0.1:2", lambda channel: open_link, LINK, resolve_interval_s=60.0
        )
        await pool.start()
        stream: Stream = SessionStream(pool, request_id="r1", attempts=2, backoff_s=backoff_s)
        try:
            stepped = await stream.step(Context([1, 2]), lambda keep: target_pb2.VerifyRequest(keep=keep))
            for call in opened:
                call.cancelled_before_close = call.cancelled
        finally:
            await pool.close()
        return stream, stepped.fed

    stream, fed = asyncio.run(run())
    return stream, opened, fed


LOST = [
    # A replica shutting down resets its streams with an HTTP/2 error; gRPC reports INTERNAL.
    (grpc.StatusCode.INTERNAL, "Internal error from Core"),
    (grpc.StatusCode.INTERNAL, "Received RST_STREAM with error code 2"),
    (grpc.StatusCode.UNAVAILABLE, "Socket closed"),
    (grpc.StatusCode.CANCELLED, "Cancelled"),
]


@pytest.mark.parametrize("code, details", LOST)
def test_a_lost_link_is_reopened_on_the_other_replica(code, details):
    stream, opened, _ = _step([_error(code, details), None])
    assert len(opened) == 2 and opened[0].cancelled_before_close
    assert stream.reopens == 1
    assert stream.replica is not None and stream.replica.failed_at < 0  # the second replica answered


def test_a_draining_replica_sends_the_session_elsewhere():
    """A draining replica refuses a new session with UNAVAILABLE in that step's result alone."""
    error = _step_error(grpc.StatusCode.UNAVAILABLE, "the service is draining; open the session on another replica")
    stream, opened, _ = _step([error, None])
    assert len(opened) == 2 and not opened[0].cancelled_before_close  # the link itself is fine: other sessions go on
    assert stream.reopens == 1


def test_a_step_a_replica_never_answers_times_out():
    """A hung replica: the link's timer fails the step with TimeoutError after the pool's step timeout
    (the orchestrator turns it into DEADLINE_EXCEEDED and avoids the replica)."""

    async def run() -> float:
        pool = ReplicaPool(
            "target", "127.0.0.1:1", lambda channel: lambda: _Call("hang"), LINK, 60.0, step_timeout_s=0.3
        )
        await pool.start()
        stream: Stream = SessionStream(pool, request_id="r1")
        started = time.monotonic()
        try:
            with pytest.raises(TimeoutError):
                await stream.step(Context([1, 2]), lambda keep: target_pb2.VerifyRequest(keep=keep))
        finally:
            await pool.close()
        return time.monotonic() - started

    assert 0.3 <= asyncio.run(run()) < 1.5


def test_a_retried_step_counts_the_whole_context_as_fed():
    """A step answered after a lost link fed the whole context to the new replica, and says so: the
    load-aware policy's shared draft price leaves out steps that fed more than a round commits, so one
    request's failed attempt and backoff price nobody else's rounds."""
    calls = [_Call(None), _Call(None)]

    async def run() -> list[int]:
        opened = iter(calls)
        pool = ReplicaPool("target", "127.0.0.1:1,127.0.0.1:2", lambda channel: lambda: next(opened), LINK, 60.0)
        await pool.start()
        stream: Stream = SessionStream(pool, request_id="r1", attempts=2, backoff_s=0.01)

        sequence = [1, 2, 3]

        async def step() -> int:
            context = Context(sequence)
            build = lambda keep: target_pb2.VerifyRequest(keep=keep, append_token_ids=context[keep:])  # noqa: E731
            return (await stream.step(context, build)).fed

        try:
            fed = [await step()]
            sequence.append(4)
            fed.append(await step())
            calls[0].error = _error(grpc.StatusCode.UNAVAILABLE, "Socket closed")
            sequence.append(5)
            fed.append(await step())
        finally:
            await pool.close()
        return fed

    assert asyncio.run(run()) == [3, 1, 5]


@pytest.mark.parametrize(
    "code, details",
    [
        (grpc.StatusCode.INTERNAL, f"{HANDLER_INTERNAL_PREFIX}/specdec.v1.TargetService/Verify: RuntimeError: boom"),
        (grpc.StatusCode.INVALID_ARGUMENT, "keep 9 exceeds the 3 tokens held"),
    ],
)
@pytest.mark.parametrize("where", [_error, _step_error])
def test_a_handler_error_is_reported_not_retried(code, details, where):
    with pytest.raises(ServiceError) as raised:
        _step([where(code, details), None])
    assert raised.value.code == code and details in raised.value.message


@pytest.mark.parametrize(
    ("matched", "tail", "sequence", "extra", "min_append", "keep"),
    [
        (0, [], [1, 2, 3], [], 1, 0),  # a new session: feed everything
        (3, [], [1, 2, 3, 4], [], 1, 3),  # the next token
        (3, [9, 9], [1, 2, 3, 4, 5], [], 1, 3),  # a rejected block rolls back
        (3, [4, 9], [1, 2, 3, 4, 5], [], 1, 4),  # a block accepted in part
        (3, [4, 5], [1, 2, 3, 4, 5, 6], [], 1, 5),  # a block accepted in full
        (3, [], [1, 2, 3], [], 1, 2),  # at least one token is fed (a draft continues from it)
        (4, [], [1, 2, 3, 4], [7, 8], 3, 3),  # a verify feeds its rows' tokens: the last committed too
        (3, [4, 7], [1, 2, 3, 4], [7, 8], 1, 5),  # a block drafted ahead, verified with its own tokens
    ],
)
def test_a_step_keeps_what_the_replica_holds_of_its_context(matched, tail, sequence, extra, min_append, keep):
    """The replica holds the sequence's first `matched` tokens, then `tail`; the sequence has grown
    since. A step keeps their common prefix with the context, comparing the tail alone."""
    stream: Stream = SessionStream(pool=None, request_id="r1")  # type: ignore[arg-type]
    stream._matched, stream._tail = matched, tail
    assert stream._keep(Context(sequence, extra), min_append) == keep


def test_a_context_reads_the_sequence_it_was_made_from():
    """A context is the sequence as it was plus its extra tokens, whatever is appended afterwards."""
    sequence = [1, 2, 3]
    context = Context(sequence, [8, 9])
    sequence.extend([4, 5])
    assert list(context) == [1, 2, 3, 8, 9] and len(context) == 5
    assert context[1:] == [2, 3, 8, 9] and context[3:] == [8, 9] and context[4] == 9 and context[-1] == 9
    assert context[2:4] == [3, 8] and context[5:] == []


def test_a_links_message_is_split_before_the_size_budget(monkeypatch):
    """Steps with dense rows travel in several messages, each under the budget (a single step larger
    than the budget goes alone, within the hard limit); nothing is dropped or reordered."""
    from orchestrator import link

    monkeypatch.setattr(link, "MESSAGE_BUDGET_BYTES", 1000)  # two 480-byte steps a message
    steps = [
        target_pb2.VerifyStep(session=i, step=target_pb2.VerifyRequest(append_token_ids=list(range(300))))
        for i in range(5)
    ]
    big = target_pb2.VerifyStep(session=9, step=target_pb2.VerifyRequest(append_token_ids=list(range(2000))))
    chunks = list(link._by_size([*steps, big]))
    assert [step.session for chunk in chunks for step in chunk] == [0, 1, 2, 3, 4, 9]
    assert all(sum(s.ByteSize() for s in chunk) <= 1000 for chunk in chunks if len(chunk) > 1)
    assert chunks[-1] == [big] and len(chunks) == 4


def _clock(service: str) -> dict[str, float]:
    """The step clock's counters of `service`, by part, and its steps."""
    parts = {part: REGISTRY.get_sample_value("specdec:step_seconds_total", {"service": service, "part": part}) or 0.0
             for part in StepClock.PARTS}  # fmt: skip
    return {**parts, "steps": REGISTRY.get_sample_value("specdec:steps_total", {"service": service}) or 0.0}


def test_a_steps_time_is_split_into_its_parts():
    """The service's forwards, its queue and its other work come from the answer's Timing; the transport
    is the round trip less the service's own time; nothing is counted below zero; the counters move
    at a flush, every StepClock.FLUSH_STEPS steps."""
    clock = StepClock("clock-test")
    timing = common_pb2.Timing(forward_seconds=0.003, queue_seconds=0.001, service_seconds=0.006)
    clock.account(timing, round_trip=0.010, between=0.002)
    assert _clock("clock-test")["steps"] == 0  # summed until a flush: a scrape's means are over whole flushes
    clock.flush()
    parts = _clock("clock-test")
    assert parts == pytest.approx(
        {"forward": 0.003, "queue": 0.001, "service_host": 0.002, "transport": 0.004, "between": 0.002, "steps": 1}
    )
    # A service that reports less time than its forwards and queue (its clock read before them), and a
    # round trip shorter than the service's time (clocks apart): both parts stay at zero.
    clock.account(common_pb2.Timing(forward_seconds=0.003, queue_seconds=-1.0, service_seconds=0.001), 0.002, 0.0)
    clock.flush()
    after = _clock("clock-test")
    assert after["service_host"] == pytest.approx(0.002) and after["transport"] == pytest.approx(0.004)
    assert after["forward"] == pytest.approx(0.006) and after["queue"] == pytest.approx(0.001)
    # A service time of exactly its forward and queue, whose difference rounds below 0 in floating point
    # ((0.3 + 0.4) - 0.3 - 0.4 < 0), and a step sent before the last was answered: nothing negative.
    assert (0.3 + 0.4) - 0.3 - 0.4 < 0
    clock.account(common_pb2.Timing(forward_seconds=0.3, queue_seconds=0.4, service_seconds=0.3 + 0.4), 0.8, -0.001)
    clock.flush()  # a counter raises on a negative increment (it failed a request before the clamp)
    rounded = _clock("clock-test")
    assert rounded["service_host"] == after["service_host"] and rounded["between"] == after["between"]
    for _ in range(StepClock.FLUSH_STEPS):
        clock.account(timing, round_trip=0.010, between=0.002)
    assert _clock("clock-test")["steps"] == 3 + StepClock.FLUSH_STEPS  # flushed without being asked


def test_a_session_counts_the_time_between_its_answer_and_its_next_step():
    """Answered steps are counted, with the wait between a session's answer and its next step (none for
    its first); a step lost with its link counts only as resent."""
    opened: list[_Call] = []

    def open_link() -> _Call:
        opened.append(_Call(_error(grpc.StatusCode.UNAVAILABLE, "Socket closed") if not opened else None))
        return opened[-1]

    async def run() -> None:
        pool = ReplicaPool("clocked", "127.0.0.1:1,127.0.0.1:2", lambda channel: open_link, LINK, 60.0)
        await pool.start()
        stream: Stream = SessionStream(pool, request_id="r1", attempts=2, backoff_s=0.0)
        try:
            await stream.step(Context([1, 2]), lambda keep: target_pb2.VerifyRequest(keep=keep))
            pool.clock.flush()
            first = _clock("clocked")
            assert first["steps"] == 1 and first["between"] == 0.0  # the lost attempt is not a step
            await asyncio.sleep(0.05)
            await stream.step(Context([1, 2, 3]), lambda keep: target_pb2.VerifyRequest(keep=keep))
            pool.clock.flush()
        finally:
            await pool.close()

    asyncio.run(run())
    parts = _clock("clocked")
    assert parts["steps"] == 2 and parts["between"] >= 0.05
    assert parts["transport"] > 0.0 and parts["forward"] == 0.0  # the fake replica reports no Timing


@pytest.mark.parametrize("figure", ["forward_seconds", "service_seconds", "queue_seconds"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_timing_that_is_not_finite_is_cleared_before_anything_shared_reads_it(figure, value):
    """The step times every request's K reads, and the step clock, are shared running means: one
    answer's NaN would stay in them for every later request. Such a timing is cleared where the answer
    arrives, and the request goes on."""
    call = _Call(None)
    call.timing = common_pb2.Timing(forward_seconds=0.004, service_seconds=0.005, batch_size=2, batch_tokens=2)
    setattr(call.timing, figure, value)

    async def run() -> target_pb2.VerifyResponse:
        pool = ReplicaPool(f"finite-{figure}-{value}", "127.0.0.1:1", lambda channel: lambda: call, LINK, 60.0)
        await pool.start()
        stream: Stream = SessionStream(pool, request_id="r1")
        try:
            stepped = await stream.step(Context([1, 2]), lambda keep: target_pb2.VerifyRequest(keep=keep))
            pool.clock.flush()
        finally:
            await pool.close()
        return stepped.response

    response = asyncio.run(run())
    assert response.result == common_pb2.SESSION_RESULT_OK and not response.HasField("timing")
    parts = _clock(f"finite-{figure}-{value}")
    assert parts["steps"] == 1 and all(math.isfinite(seconds) for seconds in parts.values())
    times = StepTimes(common_pb2.ModelInfo(forward_costs=[common_pb2.ForwardCost(batch_tokens=1, seconds=0.004)]), None)
    times.target.observe(response.timing)
    assert math.isfinite(times.target.stretch) and math.isfinite(times.target.others)
