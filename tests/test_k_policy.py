"""K policies: Hugging Face's heuristic schedule and the cost model's choice."""

from __future__ import annotations

from orchestrator.k_policy import CostModelK, FixedK, HeuristicK, best_k, expected_tokens
from orchestrator.rejection import Verdict


def _verdict(accepted: int, drafted: int) -> Verdict:
    return Verdict(output_token_ids=[0] * (accepted + 1), num_accepted=accepted, num_drafted=drafted)


def test_fixed():
    policy = FixedK(3, 8)
    policy.observe(_verdict(0, 3))
    assert policy.next_k() == 3


def test_heuristic_schedule():
    policy = HeuristicK(4, 8)
    policy.observe(_verdict(4, 4))
    assert policy.next_k() == 6
    policy.observe(_verdict(6, 6))
    assert policy.next_k() == 8  # capped
    policy.observe(_verdict(2, 8))
    assert policy.next_k() == 7
    for _ in range(10):
        policy.observe(_verdict(0, 1))
    assert policy.next_k() == 1  # never below 1


def test_expected_tokens_formula():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert abs(expected_tokens(0.5, 2) - 1.75) < 1e-12


def test_best_k_grows_with_acceptance_and_shrinks_with_cost():
    assert best_k(0.9, 0.05, 16) > best_k(0.5, 0.05, 16)
    assert best_k(0.8, 0.5, 16) < best_k(0.8, 0.02, 16)
    assert best_k(0.1, 0.5, 16) == 1


def test_cost_model_learns_from_rounds():
    policy = CostModelK(4, 12)
    for _ in range(30):
        policy.observe(_verdict(4, 4), draft_seconds=0.004, target_seconds=0.05)
    assert policy.next_k() > 4
    for _ in range(60):
        policy.observe(_verdict(0, 4), draft_seconds=0.004, target_seconds=0.05)
    assert policy.next_k() == 1
