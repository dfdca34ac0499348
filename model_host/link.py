"""What a link holds: one stream to a model service that carries the steps of many sessions, and
the records a step and a session keep while they are served (model_host/session_servicer.py serves
them)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

from model_host.engine import Engine
from model_host.job import Job
from model_host.sessions import Session
from serving.server import MESSAGE_BUDGET_BYTES
from specdec.v1 import common_pb2


class StepRequest(Protocol):
    """The fields every session step carries."""

    @property
    def request_id(self) -> str: ...
    @property
    def keep(self) -> int: ...
    @property
    def append_token_ids(self) -> Sequence[int]: ...
    @property
    def structured_output(self) -> common_pb2.StructuredOutput: ...
    @property
    def constraint_start(self) -> int: ...
    def HasField(self, name: str) -> bool: ...


@dataclass(eq=False)
class SlotLease:
    """A session's engine slot; released once when its cache is dropped."""

    slot: int
    engine: Engine
    released: bool = False

    @property
    def length(self) -> int:
        """Read on the event loop, between the session's steps: only its own step changes its slot."""
        return 0 if self.released else self.engine.store.length(self.slot)

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.engine.release(self.slot)


@dataclass(eq=False)
class Pending:
    """One session's step in the engine: what its answer needs."""

    session: Session
    request: Any
    job: Job
    started: float
    ended: Future[Any] | None = None  # what ends the step, when not its job's future (work done ahead)

    @property
    def outcome(self) -> Future[Any]:
        return self.ended if self.ended is not None else self.job.future


class Link:
    """One open link stream: its sessions by the client's ids, and the steps the engine has finished.

    Everything but `_finished` belongs to the server's event loop. The engine's thread appends to
    `_finished` and wakes the loop once for every batch of steps it ends (`on_done`), so that one
    answer carries a forward's results."""

    def __init__(self, peer: str) -> None:
        self.peer = peer
        self.loop = asyncio.get_running_loop()
        self.loop_thread = threading.get_ident()
        self.sessions: dict[int, Session] = {}
        self.running: dict[int, Pending] = {}  # session id -> its step in the engine
        self.compiling: dict[int, asyncio.Task[None]] = {}  # session id -> its first step, compiling its constraint
        self.results: list[Any] = []  # answers ready to send
        self.wake = asyncio.Event()
        self.ended = False  # the client closed its side
        self.last_active = time.monotonic()
        self.idle_closed = False
        self._finished: list[tuple[int, Pending]] = []
        self._finished_lock = threading.Lock()

    def on_done(self, session_id: int, pending: Pending) -> bool:
        """Called from the engine's thread (or at once) when a step's job ends; whether the link needs
        waking (it had nothing finished waiting)."""
        with self._finished_lock:
            first = not self._finished
            self._finished.append((session_id, pending))
        return first

    def take_finished(self) -> list[tuple[int, Pending]]:
        with self._finished_lock:
            finished, self._finished = self._finished, []
        return finished

    def close_idle(self) -> None:
        """Called from another thread: end the stream (its handler answers CANCELLED)."""
        self.idle_closed = True
        self.loop.call_soon_threadsafe(self.wake.set)


def answers(results: list[Any], results_type: type[Any]) -> Iterator[Any]:
    """The link's answers carrying `results`: as few as fit under the message limit."""
    batch: list[Any] = []
    size = 0
    for result in results:
        result_size = result.ByteSize()
        if batch and size + result_size > MESSAGE_BUDGET_BYTES:
            yield results_type(results=batch)
            batch, size = [], 0
        batch.append(result)
        size += result_size
    if batch:
        yield results_type(results=batch)
