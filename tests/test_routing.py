"""Cache-aware routing: the same prompt start ranks replicas alike on every orchestrator, a prompt
follows the replica holding its longest prefix, and load wins past the slack."""

from __future__ import annotations

import random

from orchestrator.routing import PrefixIndex, preferred, route_for
from orchestrator.upstream import Replica, ReplicaPool


def _tokens(seed: int, count: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(count)]


ADDRESSES = [f"10.0.0.{i}:50051" for i in range(4)]


def test_orchestrators_without_shared_state_choose_alike_and_spread_distinct_prompts():
    chosen = [preferred(route_for(b"", _tokens(seed, 40)), PrefixIndex(), ADDRESSES) for seed in range(200)]
    again = [preferred(route_for(b"", _tokens(seed, 40)), PrefixIndex(), ADDRESSES[::-1]) for seed in range(200)]
    assert chosen == again  # another orchestrator, another order of replicas: the same choices
    counts = [chosen.count(address) for address in ADDRESSES]
    assert min(counts) > 25, counts  # distinct prompts spread over every replica
    # A shared first chunk (a system prompt) ranks alike whatever follows; a salt ranks apart.
    shared = _tokens(1, 16)
    assert len({preferred(route_for(b"", shared + _tokens(s, 30)), PrefixIndex(), ADDRESSES) for s in range(20)}) == 1
    salted = {preferred(route_for(f"t{s}".encode(), shared), PrefixIndex(), ADDRESSES) for s in range(40)}
    assert len(salted) > 1


def test_the_index_sends_a_prompt_where_its_longest_prefix_went():
    index = PrefixIndex()
    conversation = _tokens(2, 64)
    shared_start = route_for(b"", conversation[:16])
    other = next(a for a in ADDRESSES if a != preferred(shared_start, index, ADDRESSES))
    index.record(route_for(b"", conversation), other)  # this conversation's history went elsewhere
    assert preferred(route_for(b"", [*conversation, *_tokens(3, 20)]), index, ADDRESSES) == other
    index.forget(other)  # the replica left: its prefixes say nothing any more
    later = route_for(b"", [*conversation, 1])
    assert preferred(later, index, ADDRESSES) == preferred(later, PrefixIndex(), ADDRESSES)
    small = PrefixIndex(entries=3)
    small.record(route_for(b"", _tokens(4, 160)), ADDRESSES[0])
    assert len(small._where) == 3  # bounded


def _pool(slack: int | None) -> ReplicaPool:
    pool = ReplicaPool.__new__(ReplicaPool)
    pool.name = "target"
    pool.route_load_slack = slack
    pool.index = PrefixIndex()
    pool._replicas = {a: Replica(a, None, None) for a in ADDRESSES[:2]}  # type: ignore[arg-type]
    return pool


def test_load_wins_over_locality_past_the_slack():
    pool = _pool(slack=2)
    route = route_for(b"", _tokens(5, 48))
    best = pool.pick(route=route)
    other = next(r for r in pool.replicas if r is not best)
    best.active = 2
    assert pool.pick(route=route) is best  # two sessions more than the least loaded: still preferred
    best.active = 3
    assert pool.pick(route=route) is other
    assert _pool(slack=None).pick(route=route).address in ADDRESSES  # routing off: the least loaded
