"""The session cache store: one KV cache per open session, with rollback, limits and idle expiry.

A session lives exactly as long as its gRPC stream. Its cache is soft state: expiry or eviction drops
the cache but keeps the session, whose next step then answers CACHE_MISS so that the orchestrator
reopens it with the full sequence. A session in the middle of a step (from a successful `rollback`
to its `step_done`) keeps its cache: the step is using it, and dropping it then would have the
step compute on an empty cache as if its tokens started the sequence.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from serving.errors import resource_exhausted

if TYPE_CHECKING:
    from serving.constraints import SessionConstraint


class KVCache(Protocol):
    """What the store needs of a session's cache: a lease on an engine slot (model_host/engine.py).
    Rollback needs nothing of it: the next step simply starts at the kept length."""

    @property
    def slot(self) -> int: ...

    @property
    def length(self) -> int: ...  # tokens the slot holds: the block store's record, the one there is

    def release(self) -> None: ...  # the slot may be reused


@dataclass
class Session:
    """One generation's cache on this service."""

    session_id: str
    request_id: str
    cache: KVCache | None = None  # None until the first step, and after expiry or eviction
    last_used: float = field(default=0.0)
    stepping: bool = False  # between a successful rollback and step_done: the cache is in use
    constraint: SessionConstraint | None = None  # structured output: set by the session's first step
    # A fork branch answered this session's step and is to become its cache (an engine command not run
    # yet): the length it holds (draft_service/speculation.py). `lost`: it did not (the branch was
    # dropped), so the cache no longer holds what the last answer said: the next step is a cache miss.
    resolving: int | None = None
    lost: bool = False

    @property
    def held(self) -> bool:
        return self.cache is not None

    @property
    def length(self) -> int:
        """Tokens its cache holds (read between its steps: a step under way changes it)."""
        if self.resolving is not None:
            return self.resolving
        return self.cache.length if self.cache is not None else 0


class SessionStore:
    """Thread-safe registry of sessions; bounds their number (RESOURCE_EXHAUSTED beyond). The blocks
    their caches take are the block store's to admit (model_host/kv_blocks.py, on the engine's thread)."""

    def __init__(
        self,
        new_cache: Callable[[], KVCache],
        max_sessions: int,
        idle_timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._new_cache = new_cache
        self.max_sessions = max_sessions
        self.idle_timeout_s = idle_timeout_s
        self._clock = clock
        self._lock = threading.Lock()
        self._sessions: dict[str, Session] = {}
        self._ids = itertools.count(1)
        self.opened = 0  # sessions opened since start

    def open(self, request_id: str) -> Session:
        with self._lock:
            self._expire_idle_locked()
            if len(self._sessions) >= self.max_sessions:
                raise resource_exhausted(
                    f"this service holds its maximum of {self.max_sessions} sessions; retry later, "
                    "add replicas, or raise --max-sessions"
                )
            session = Session(session_id=f"s{next(self._ids)}", request_id=request_id, last_used=self._clock())
            self._sessions[session.session_id] = session
            self.opened += 1
            return session

    def close(self, session: Session) -> None:
        """Free the session's cache at once; safe to call twice."""
        with self._lock:
            self._sessions.pop(session.session_id, None)
            _drop(session)

    def rollback(self, session: Session, keep: int) -> bool:
        """Crop the cache to its first `keep` tokens. False (a cache miss) when it holds fewer."""
        with self._lock:
            session.last_used = self._clock()
            if session.lost:
                session.lost = False
                _drop(session)
            if keep == 0:
                _drop(session)
                session.cache = self._new_cache()
            elif session.cache is None or keep > session.length:
                return False
            session.stepping = True  # the engine crops the slot to `keep` when the step enters
            return True

    def step_done(self, session: Session) -> None:
        with self._lock:
            session.last_used = self._clock()
            session.stepping = False

    def step_failed(self, session: Session) -> None:
        """The step under way failed: its reservation ends and its cache cannot be trusted."""
        with self._lock:
            session.stepping = False
            _drop(session)

    def evict_all(self) -> int:
        """Drop every cache not in use by a step (those sessions' next steps answer CACHE_MISS); returns how many."""
        with self._lock:
            return self._drop_caches(lambda session: True)

    def expire_idle(self) -> int:
        with self._lock:
            return self._expire_idle_locked()

    def _expire_idle_locked(self) -> int:
        deadline = self._clock() - self.idle_timeout_s
        return self._drop_caches(lambda session: session.last_used < deadline)

    def _drop_caches(self, chosen: Callable[[Session], bool]) -> int:
        dropped = [s for s in self._sessions.values() if s.held and not s.stepping and chosen(s)]
        for session in dropped:
            _drop(session)
        return len(dropped)

    @property
    def open_sessions(self) -> int:
        with self._lock:
            return len(self._sessions)


def _drop(session: Session) -> None:
    """Give the session's slot back; its next step is a cache miss unless it starts over (keep = 0)."""
    if session.cache is not None:
        session.cache.release()
    session.cache = None
