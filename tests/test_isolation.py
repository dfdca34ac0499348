"""Isolation: no request changes another request's behaviour. Each case below once switched speculation
off for every client (or failed a healthy replica); after it, a plain request must still draft."""

from __future__ import annotations

import math

import grpc
import pytest

from specdec.v1 import orchestrator_pb2
from tests.conftest import collect, still_speculates
from tests.servers import OrchestratorThread, orchestrator_config

Request = orchestrator_pb2.GenerateRequest
FIXED = orchestrator_pb2.SPECULATION_POLICY_FIXED
LOAD_AWARE = orchestrator_pb2.SPECULATION_POLICY_LOAD_AWARE


def _ids(prompt: list[int], **fields) -> Request:
    return Request(token_ids=orchestrator_pb2.TokenIds(ids=prompt), **fields)


_still_speculates = still_speculates


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"temperature": math.inf}, "temperature must be in [0, 100]"),
        ({"temperature": 3e38}, "temperature must be in [0, 100]"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": 1.0, "top_p": math.nan}, "top_p"),
        ({"request_id": "caf\u00e9"}, "request_id"),
        ({"request_id": "a\nb"}, "request_id"),
        ({"request_id": "x" * 20_000}, "request_id"),
        ({"stop": ["y" * 300]}, "stop"),
        ({"stop": ["s"] * 17}, "stop"),
    ],
)
def test_bad_request_fails_alone(orchestrators, fields, words):
    stub = orchestrators["close"].stub
    with pytest.raises(grpc.RpcError) as error:
        collect(stub, _ids([1, 2], max_new_tokens=5, num_speculative_tokens=2, **fields))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in error.value.details()
    _still_speculates(stub)


def test_tiny_temperature_is_greedy(orchestrators):
    """Below 1e-5 a temperature counts as greedy (it once crashed the draft's multinomial)."""
    stub = orchestrators["close"].stub
    greedy, _, _ = collect(stub, _ids([7, 8], max_new_tokens=10, num_speculative_tokens=2))
    tiny, _, last = collect(stub, _ids([7, 8], max_new_tokens=10, num_speculative_tokens=2, temperature=1e-40))
    assert tiny == greedy and last.stats.draft_fallback_rounds == 0
    _still_speculates(stub)


def test_oversized_text_prompt_is_refused_before_tokenizing(orchestrators):
    stub = orchestrators["close"].stub
    with pytest.raises(grpc.RpcError) as error:
        collect(stub, Request(text="w1 " * 20_000, max_new_tokens=5))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "characters" in error.value.details()
    _still_speculates(stub)


@pytest.mark.parametrize("policy", [FIXED, orchestrator_pb2.SPECULATION_POLICY_HEURISTIC])
def test_overlap_at_the_cap_stays_within_the_drafts_limit(orchestrators, policy):
    """Overlapped drafting drafts K + 1 tokens ahead; at K = the cap that once exceeded the draft's
    limit, the draft refused, and every request stopped drafting."""
    stub = orchestrators["close"].stub
    _, _, last = collect(
        stub,
        _ids([5, 6], max_new_tokens=60, num_speculative_tokens=16, speculation_policy=policy, overlap_drafting=True),
    )
    assert last.stats.draft_fallback_rounds == 0
    _still_speculates(stub)


def test_an_explicit_k_bounds_every_load_aware_round(target_server, close_draft_server):
    """Under load_aware a request's num_speculative_tokens is an upper bound on every round's K. The
    policy once ranged up to the server's cap (16) whatever the request asked, blocks drafted ahead
    during verification included."""
    orchestrator = OrchestratorThread(orchestrator_config(target_server, close_draft_server))  # its own step times
    try:
        unbounded: list[orchestrator_pb2.GenerationStats] = []
        bounded: list[orchestrator_pb2.GenerationStats] = []
        for _ in range(3):
            for k, stats in ((16, unbounded), (1, bounded)):
                request = _ids([5, 6], max_new_tokens=60, num_speculative_tokens=k, speculation_policy=LOAD_AWARE)
                stats.append(collect(orchestrator.stub, request)[2].stats)
        # The bound binds: unbounded, the policy drafts blocks longer than one token here.
        assert any(s.draft_tokens > s.draft_rounds for s in unbounded), [
            (s.draft_tokens, s.draft_rounds) for s in unbounded
        ]
        assert sum(s.draft_rounds for s in bounded) > 0
        for s in bounded:
            assert s.draft_tokens <= s.draft_rounds and len(s.accepted_per_position) <= 1, s
    finally:
        orchestrator.stop()
