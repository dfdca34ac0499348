"""The session store: rollback, the token budget and its reservations, expiry, and a cache in use by a
step never dropped under it."""

from __future__ import annotations

import threading

import grpc
import pytest

from model_host.sessions import SessionStore
from serving.errors import ServiceError

RELEASED: list[int] = []


class _Lease:
    def __init__(self) -> None:
        self.slot = len(RELEASED) + 1000

    def release(self) -> None:
        RELEASED.append(self.slot)


def _store(**overrides) -> tuple[SessionStore, list[float]]:
    now = [0.0]
    settings = {"max_sessions": 4, "max_cached_tokens": 100, "idle_timeout_s": 10.0, **overrides}
    return SessionStore(_Lease, clock=lambda: now[0], **settings), now


def test_a_session_mid_step_keeps_its_cache_through_expiry_and_eviction():
    store, now = _store()
    busy, idle = store.open("busy"), store.open("idle")
    for session in (busy, idle):
        assert store.rollback(session, 0)
        store.record_length(session, 5)
    assert store.rollback(busy, 5)  # busy's step begins and runs long
    now[0] = 60.0
    assert store.expire_idle() == 1 and not idle.held
    assert store.evict_all() == 0
    assert busy.held and busy.length == 5  # the step's cache and length are as it left them
    store.record_length(busy, 7)  # the step ends
    assert store.evict_all() == 1 and not busy.held and busy.length == 0
    assert not store.rollback(busy, 7)  # its next step is a cache miss


def test_rollback_sets_the_length_and_misses_beyond_it():
    store, _ = _store()
    session = store.open("r")
    assert not store.rollback(session, 3)  # nothing held yet
    assert store.rollback(session, 0)
    store.record_length(session, 10)
    assert store.rollback(session, 4) and session.length == 4
    store.record_length(session, 6)
    assert not store.rollback(session, 7)


def test_dropping_a_cache_releases_its_slot_once():
    store, _ = _store()
    session = store.open("d")
    store.rollback(session, 0)
    assert session.cache is not None
    slot = session.cache.slot
    store.record_length(session, 3)
    store.close(session)
    store.close(session)
    assert RELEASED.count(slot) == 1


def test_sessions_and_tokens_are_bounded():
    store, _ = _store(max_sessions=2, max_cached_tokens=50)
    first, second = store.open("a"), store.open("b")
    with pytest.raises(ServiceError) as error:
        store.open("c")
    assert error.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-sessions" in error.value.message
    store.rollback(first, 0)
    store.reserve(first, 30)
    store.rollback(second, 0)
    with pytest.raises(ServiceError) as error:
        store.reserve(second, 30)  # 30 are reserved for `first`, although it holds nothing yet
    assert "--max-cached-tokens" in error.value.message


def test_concurrent_reservations_never_exceed_the_budget():
    """Eight concurrent 250-token prefills against a budget of 300: at most one is admitted."""
    store, _ = _store(max_sessions=8, max_cached_tokens=300)
    sessions = [store.open(str(i)) for i in range(8)]
    admitted: list[int] = []
    barrier = threading.Barrier(8)

    def prefill(index: int) -> None:
        store.rollback(sessions[index], 0)
        barrier.wait()
        try:
            store.reserve(sessions[index], 250)
            admitted.append(index)
        except ServiceError:
            store.step_failed(sessions[index])

    threads = [threading.Thread(target=prefill, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(admitted) == 1


def test_the_running_totals_match_the_sessions_through_any_sequence_of_operations():
    """The budget and the cached-token gauge are kept as sessions change (O(1) a step, not O(sessions));
    after every operation of a random run they equal the sums they stand for."""
    import random

    rng = random.Random(3)
    store, now = _store(max_sessions=6, max_cached_tokens=400)
    sessions: list = []
    for _ in range(3000):
        now[0] += rng.random()
        operation = rng.randrange(8)
        if operation == 0 and len(sessions) < 6:
            sessions.append(store.open("r"))
        elif sessions:
            session = rng.choice(sessions)
            if operation == 1:
                store.close(session)
                sessions.remove(session)
            elif operation == 2:
                if store.rollback(session, rng.choice([0, session.length, max(0, session.length - 3)])):
                    try:
                        store.reserve(session, session.length + rng.randrange(1, 80))
                    except ServiceError:
                        store.step_failed(session)
                        continue
                    if rng.random() < 0.8:
                        store.record_length(session, session.reserved)
                    else:
                        store.step_failed(session)
            elif operation == 3:
                store.expire_idle()
            elif operation == 4 and rng.random() < 0.1:
                store.evict_all()
        held = list(store._sessions.values())
        assert store._footprint == sum(max(s.length, s.reserved) for s in held)
        assert store.cached_tokens == sum(s.length for s in held)
        assert store._footprint <= 400
