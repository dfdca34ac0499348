"""The session store: rollback, the session bound, expiry, and a cache in use by a step never dropped
under it."""

from __future__ import annotations

import grpc
import pytest

from model_host.sessions import Session, SessionStore
from serving.errors import ServiceError

RELEASED: list[int] = []


class _Lease:
    """A slot: its length is what the engine's block store says (set by `_step` here)."""

    def __init__(self) -> None:
        self.slot = len(RELEASED) + 1000
        self.length = 0

    def release(self) -> None:
        RELEASED.append(self.slot)


def _step(store: SessionStore, session: Session, length: int) -> None:
    """The engine ran the session's step: its slot holds `length` tokens."""
    assert isinstance(session.cache, _Lease)
    session.cache.length = length
    store.step_done(session)


def _store(**overrides) -> tuple[SessionStore, list[float]]:
    now = [0.0]
    settings = {"max_sessions": 4, "idle_timeout_s": 10.0, **overrides}
    return SessionStore(_Lease, clock=lambda: now[0], **settings), now


def test_a_session_mid_step_keeps_its_cache_through_expiry_and_eviction():
    store, now = _store()
    busy, idle = store.open("busy"), store.open("idle")
    for session in (busy, idle):
        assert store.rollback(session, 0)
        _step(store, session, 5)
    assert store.rollback(busy, 5)  # busy's step begins and runs long
    now[0] = 60.0
    assert store.expire_idle() == 1 and not idle.held
    assert store.evict_all() == 0
    assert busy.held and busy.length == 5  # the step's cache and length are as it left them
    _step(store, busy, 7)  # the step ends
    assert store.evict_all() == 1 and not busy.held and busy.length == 0
    assert not store.rollback(busy, 7)  # its next step is a cache miss


def test_rollback_misses_beyond_what_the_slot_holds():
    store, _ = _store()
    session = store.open("r")
    assert not store.rollback(session, 3)  # nothing held yet
    assert store.rollback(session, 0)
    _step(store, session, 10)
    assert store.rollback(session, 4) and session.stepping
    _step(store, session, 6)  # the engine cropped it to 4 and fed 2
    assert session.length == 6 and not store.rollback(session, 7)


def test_dropping_a_cache_releases_its_slot_once():
    store, _ = _store()
    session = store.open("d")
    store.rollback(session, 0)
    assert session.cache is not None
    slot = session.cache.slot
    _step(store, session, 3)
    store.close(session)
    store.close(session)
    assert RELEASED.count(slot) == 1


def test_sessions_are_bounded():
    """The store bounds sessions; the tokens their caches hold are the block store's to admit
    (tests/test_kv_blocks.py: reservations against one budget)."""
    store, _ = _store(max_sessions=2)
    store.open("a"), store.open("b")
    with pytest.raises(ServiceError) as error:
        store.open("c")
    assert error.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-sessions" in error.value.message
