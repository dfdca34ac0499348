"""Prompt lookup: the index, the point-mass acceptance rule, and exact outputs over gRPC in the ngram
and hybrid modes (the ngram mode with no draft service at all)."""

from __future__ import annotations

import pytest
import torch

from orchestrator.ngram import NgramIndex
from orchestrator.proposals import point_masses
from specdec.v1 import orchestrator_pb2
from tests.conftest import collect, hf_greedy
from tests.test_greedy_exactness import _explain
from tests.test_rejection import verify_seeded

NGRAM = orchestrator_pb2.DRAFT_METHOD_NGRAM
HYBRID = orchestrator_pb2.DRAFT_METHOD_HYBRID


@pytest.mark.parametrize(
    ("sequence", "k", "expected"),
    [
        ([1, 2, 3, 9, 1, 2, 3], 3, [9, 1, 2]),  # the longest suffix [1, 2, 3] matched, then what followed
        ([1, 2, 3, 9, 1, 2, 3], 1, [9]),  # at most k
        ([5, 6, 7, 5, 6, 8, 5, 6], 2, [8, 5]),  # the most recent occurrence wins
        ([4, 4, 4], 5, [4]),  # overlapping occurrences: only what exists
        ([1, 2, 3, 4], 3, []),  # nothing repeats
        ([7], 2, []),
        ([1, 2, 9, 2], 2, [9, 2]),  # a 1-token suffix, with ngram_min 1
    ],
)
def test_lookup_table(sequence, k, expected):
    index = NgramIndex(ngram_min=1, ngram_max=3)
    index.extend(sequence)
    assert index.propose(k) == expected


def test_lookup_grows_with_committed_tokens_and_respects_ngram_min():
    index = NgramIndex(ngram_min=2, ngram_max=4)
    index.extend([3, 1, 4, 1, 5])
    assert index.propose(2) == []  # only [5] would match a 1-token suffix
    index.extend([9, 3, 1])
    assert index.propose(3) == [4, 1, 5]
    with pytest.raises(ValueError):
        NgramIndex(ngram_min=3, ngram_max=2)


def test_a_point_mass_proposal_is_accepted_with_the_targets_probability():
    """q(x) = 1: accept with probability p(x); on rejection, sample p with x removed."""
    target_probs = torch.tensor([[0.3, 0.5, 0.2], [0.1, 0.1, 0.8]])
    draft_probs = point_masses([1], 3)
    generator = torch.Generator().manual_seed(0)
    trials, accepted, recovered = 20_000, 0, torch.zeros(3)
    for _ in range(trials):
        verdict = verify_seeded(torch.tensor([1]), draft_probs, target_probs, generator)
        accepted += verdict.num_accepted
        if not verdict.num_accepted:
            recovered[verdict.output_token_ids[0]] += 1
    assert abs(accepted / trials - 0.5) < 0.02
    assert recovered[1] == 0  # the rejected token itself never comes back
    assert abs(float(recovered[0] / recovered.sum()) - 0.6) < 0.03  # 0.3 / (0.3 + 0.2)


def _prompts() -> list[list[int]]:
    # Prompts that repeat themselves, so that lookups find matches early.
    return [[5, 9, 13, 7, 5, 9, 13], [20, 21, 22, 23, 20, 21], [2, 4, 6, 8, 2, 4, 6, 8, 2], [30, 31, 30, 31, 30]]


@pytest.mark.parametrize(("orchestrator", "method"), [("none", NGRAM), ("close", NGRAM), ("close", HYBRID)])
def test_lookup_modes_are_exact_and_really_propose(orchestrators, target_model, orchestrator, method):
    stub = orchestrators[orchestrator].stub
    drafted = model_drafted = 0
    model_per_request = []
    for prompt in _prompts():
        expected = hf_greedy(target_model, prompt, 30)
        request = orchestrator_pb2.GenerateRequest(
            token_ids=orchestrator_pb2.TokenIds(ids=prompt), max_new_tokens=30, num_speculative_tokens=3,
            draft_method=method,
            # Fixed K: hybrid must ask the model where the lookup misses (load_aware may choose K = 0
            # there on these tiny models, whose draft costs about what the target does).
            speculation_policy=orchestrator_pb2.SPECULATION_POLICY_FIXED,
        )  # fmt: skip
        got, _, last = collect(stub, request)
        assert got == expected, _explain(target_model, prompt, expected, got)
        drafted += last.stats.ngram_draft_tokens
        model_per_request.append(last.stats.draft_tokens - last.stats.ngram_draft_tokens)
        model_drafted += model_per_request[-1]
        assert last.stats.ngram_accepted_tokens <= last.stats.ngram_draft_tokens
    assert drafted > 0  # the lookup really proposed
    if method == NGRAM:
        assert model_drafted == 0
    else:
        # Where the lookup finds nothing, hybrid asks the draft model (at the K its policy chooses).
        assert model_drafted > 0, model_per_request


def test_ngram_needs_no_draft_service_but_model_does(orchestrators):
    import grpc

    stub = orchestrators["none"].stub
    with pytest.raises(grpc.RpcError) as error:
        collect(stub, orchestrator_pb2.GenerateRequest(text="w1 w2", max_new_tokens=3, num_speculative_tokens=2))
    assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "NGRAM" in error.value.details()
    with pytest.raises(grpc.RpcError) as error:
        collect(stub, orchestrator_pb2.GenerateRequest(text="w1", max_new_tokens=3, draft_method=7))  # type: ignore[arg-type]
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "draft_method" in error.value.details()
