"""Queueing, not refusing: at most `max_running` requests generate at once; up to `max_queued` more
wait in arrival order, each at most `max_wait_s`, and only then is a request refused
(RESOURCE_EXHAUSTED), as users of vLLM expect."""

from __future__ import annotations

import asyncio
import time
from collections import deque

from orchestrator.metrics import QUEUE_SECONDS
from serving.errors import resource_exhausted


class Admission:
    """A first-come, first-served gate in front of Generate (one event loop)."""

    def __init__(self, max_running: int, max_queued: int, max_wait_s: float) -> None:
        self.max_running = max_running
        self.max_queued = max_queued
        self.max_wait_s = max_wait_s
        self.running = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def queued(self) -> int:
        return len(self._waiters)

    async def acquire(self) -> None:
        """Wait for a place; RESOURCE_EXHAUSTED when the queue is full or the wait runs out."""
        if self.running < self.max_running and not self._waiters:
            self.running += 1
            QUEUE_SECONDS.observe(0.0)
            return
        if len(self._waiters) >= self.max_queued:
            raise resource_exhausted(
                f"the server is full: {self.running} requests running and {len(self._waiters)} queued; retry later"
            )
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        started = time.monotonic()
        try:
            await asyncio.wait_for(asyncio.shield(waiter), self.max_wait_s)
        except BaseException as exc:
            if waiter.done() and not waiter.cancelled():
                self.release()  # a place was handed over just as this request gave up: pass it on
            else:
                waiter.cancel()
                self._waiters.remove(waiter)
            if isinstance(exc, TimeoutError):
                raise resource_exhausted(
                    f"the server is busy: the request waited {self.max_wait_s:g} s for a place; retry later"
                ) from exc
            raise
        QUEUE_SECONDS.observe(time.monotonic() - started)

    def release(self) -> None:
        """A request ended: its place goes to the longest waiter, if any."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self.running -= 1
