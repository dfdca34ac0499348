"""The session store: a cache in use by a step is never dropped under it."""

from __future__ import annotations

from model_host.sessions import SessionStore


class _Cache:
    def crop(self, tokens_to_remove: int) -> None:
        pass


def test_a_session_mid_step_keeps_its_cache_through_expiry_and_eviction():
    now = [0.0]
    store = SessionStore(_Cache, max_sessions=4, max_cached_tokens=100, idle_timeout_s=10.0, clock=lambda: now[0])
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
