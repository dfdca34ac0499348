"""A link: one stream to a replica of a model service that carries the steps of every session
pinned there, one message per turn of the event loop each way (docs/design.md, "Links")."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc

from serving.server import MESSAGE_BUDGET_BYTES


class LinkLost(Exception):
    """A link's stream ended or broke: every step on it is to be resent (on a reopened session)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


@dataclass(frozen=True)
class LinkMessages:
    """A service's link messages: `open(stub)` starts the stream; `step` and `batch` build its entries
    (VerifyStep, VerifyBatch or DraftStep, DraftBatch)."""

    open: Callable[[Any], Any]
    step: Callable[..., Any]
    batch: Callable[..., Any]
    fetches: bool = False  # the draft's link: a result may answer a row fetch (its `fetched` field)


class Link:
    """One stream to a replica that carries the steps of every session pinned there.

    A step waits in `_entries` until the writer runs, after every request that is ready in the same
    turn of the event loop has added its own; so each message holds every step ready at that moment,
    and no request waits for another: one whose answer comes back sends its next step in the next
    message. Answers come one message per engine iteration of the service; each resolves its
    sessions' futures."""

    def __init__(self, call: Any, messages: LinkMessages, timeout_s: float) -> None:
        self._call = call
        self._messages = messages
        self.timeout_s = timeout_s  # a step unanswered this long fails with TimeoutError
        self._entries: list[Any] = []
        self._waiting: dict[int, tuple[asyncio.Future[Any], float]] = {}  # session -> (its step, when sent)
        self._fetching: dict[int, tuple[asyncio.Future[Any], float]] = {}  # session -> (its row fetch, when sent)
        self._wake = asyncio.Event()
        self._ids = itertools.count(1)
        self.lost: LinkLost | None = None
        self._writer = asyncio.create_task(self._write())
        self._reader = asyncio.create_task(self._read())
        self._expiry = asyncio.create_task(self._expire())

    def new_session(self) -> int:
        return next(self._ids)

    def step(self, session: int, request: Any) -> asyncio.Future[Any]:
        """Send one session's step; the future resolves to its result (response or error)."""
        return self._send(self._waiting, session, step=request)

    def fetch(self, session: int, fetch: Any) -> asyncio.Future[Any]:
        """Send a draft session's row fetch, beside its step under way; the future resolves to its result."""
        return self._send(self._fetching, session, fetch=fetch)

    def _send(
        self, waiting: dict[int, tuple[asyncio.Future[Any], float]], session: int, **entry: Any
    ) -> asyncio.Future[Any]:
        if self.lost is not None:
            raise self.lost
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        waiting[session] = (future, loop.time())
        self._entries.append(self._messages.step(session=session, **entry))
        self._wake.set()
        return future

    def close_session(self, session: int) -> None:
        """End a session on the replica (its cache is freed; a step under way is cancelled)."""
        self._waiting.pop(session, None)
        self._fetching.pop(session, None)
        if self.lost is None:
            self._entries.append(self._messages.step(session=session, close=True))
            self._wake.set()

    async def _write(self) -> None:
        try:
            while True:
                await self._wake.wait()
                await asyncio.sleep(0)  # one more turn: requests woken by the last answer add their steps
                self._wake.clear()
                entries, self._entries = self._entries, []
                for chunk in _by_size(entries):
                    await self._call.write(self._messages.batch(steps=chunk))
        except grpc.aio.AioRpcError as exc:
            self._lose(exc.code(), exc.details() or "")
        except (asyncio.InvalidStateError, grpc.aio.UsageError) as exc:
            self._lose(grpc.StatusCode.UNAVAILABLE, f"the stream ended ({type(exc).__name__})")

    async def _read(self) -> None:
        try:
            async for message in self._call:
                for result in message.results:
                    fetched = self._messages.fetches and result.HasField("fetched")
                    answered = self._fetching if fetched else self._waiting
                    waiting = answered.pop(result.session, None)
                    if waiting is not None and not waiting[0].done():
                        waiting[0].set_result(result)
            self._lose(grpc.StatusCode.UNAVAILABLE, "the replica ended the stream")
        except grpc.aio.AioRpcError as exc:
            self._lose(exc.code(), exc.details() or "")

    def _lose(self, code: grpc.StatusCode, details: str) -> None:
        if self.lost is not None:
            return
        self.lost = LinkLost(code, details)
        self._writer.cancel()
        waiting = [*self._waiting.values(), *self._fetching.values()]
        self._waiting, self._fetching = {}, {}
        for future, _ in waiting:
            if not future.done():
                future.set_exception(self.lost)
        self._expiry.cancel()
        self._call.cancel()

    async def _expire(self) -> None:
        """Fail the steps left unanswered for `timeout_s` (a hung replica): one timer per link, rather
        than one per step, which cost the orchestrator about 5% of its time at 64 streams."""
        while True:
            await asyncio.sleep(min(1.0, self.timeout_s / 4))
            deadline = asyncio.get_running_loop().time() - self.timeout_s
            for waiting in (self._waiting, self._fetching):
                for session, (future, sent) in list(waiting.items()):
                    if sent < deadline:
                        del waiting[session]
                        if not future.done():
                            future.set_exception(TimeoutError(f"no answer within {self.timeout_s:g} s"))

    async def close(self) -> None:
        self._lose(grpc.StatusCode.CANCELLED, "closed")
        for task in (self._writer, self._reader, self._expiry):
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


def _by_size(entries: list[Any]) -> Iterator[list[Any]]:
    """`entries` in messages under MESSAGE_BUDGET_BYTES (a step with dense rows is large)."""
    chunk: list[Any] = []
    size = 0
    for entry in entries:
        entry_size = entry.ByteSize()
        if chunk and size + entry_size > MESSAGE_BUDGET_BYTES:
            yield chunk
            chunk, size = [], 0
        chunk.append(entry)
        size += entry_size
    if chunk:
        yield chunk


def result_failure(result: Any) -> LinkLost | None:
    """A result's error, in the shape of a lost link's (None when it carries a response)."""
    if not result.HasField("error"):
        return None
    code = _CODES.get(result.error.code, grpc.StatusCode.UNKNOWN)
    return LinkLost(code, result.error.message)


_CODES = {code.value[0]: code for code in grpc.StatusCode}
