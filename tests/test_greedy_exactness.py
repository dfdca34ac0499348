"""Greedy exactness: through all three services, output ids equal the target's own generate()."""

from __future__ import annotations

import random

import pytest
import torch

from model_host.loading import LoadedModel
from specdec.v1 import orchestrator_pb2
from tests.conftest import collect, hf_greedy

NUM_PROMPTS = 20
MAX_NEW_TOKENS = 24


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(1234)
    return [[rng.randrange(1, vocab) for _ in range(rng.randrange(1, 14))] for _ in range(NUM_PROMPTS)]


@pytest.fixture(scope="module")
def references(target_model: LoadedModel) -> dict[tuple[int, ...], list[int]]:
    return {tuple(p): hf_greedy(target_model, p, MAX_NEW_TOKENS) for p in _prompts(target_model.vocab_size)}


def logit_gap(model: LoadedModel, sequence: list[int]) -> float:
    """Gap between the top two next-token logits: tiny gaps are float near-ties, not bugs."""
    with torch.no_grad():
        top = model.model(torch.tensor([sequence])).logits[0, -1].topk(2).values
    return float(top[0] - top[1])


def _explain(model: LoadedModel, prompt: list[int], expected: list[int], got: list[int]) -> str:
    first = next(i for i, (a, b) in enumerate(zip(expected, got, strict=False)) if a != b)
    gap = logit_gap(model, prompt + expected[:first])
    return f"first difference at output {first}: expected {expected[first]}, got {got[first]}; logit gap {gap:.3g}"


def _draft_and_k() -> list:
    """Every K with each draft; the unrelated draft's longest blocks (mostly rejected, the slowest
    cases) run in make test-long."""
    return [
        pytest.param(draft, k, marks=pytest.mark.slow if draft == "random" and k >= 4 else (), id=f"{k}-{draft}")
        for draft in ("close", "random")
        for k in (1, 2, 4, 8)
    ]


@pytest.mark.parametrize(("draft", "k"), _draft_and_k())
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_identical_to_target_generate(orchestrators, target_model, references, draft, k, overlap):
    stub = orchestrators[draft].stub
    first_position_trials = first_position_accepted = overlapped = 0
    for prompt, expected in references.items():
        request = orchestrator_pb2.GenerateRequest(
            token_ids=orchestrator_pb2.TokenIds(ids=list(prompt)),
            max_new_tokens=MAX_NEW_TOKENS,
            num_speculative_tokens=k,
            speculation_policy=orchestrator_pb2.SPECULATION_POLICY_FIXED,
            overlap_drafting=overlap,
        )
        got, _, last = collect(stub, request)
        assert got == expected, _explain(target_model, list(prompt), expected, got)
        first_position_trials += last.stats.draft_rounds
        overlapped += last.stats.overlapped_rounds
        first_position_accepted += last.stats.accepted_per_position[0] if last.stats.accepted_per_position else 0
    # The two drafts really differ: one agrees with the target often, the other almost never
    # (acceptance at the first draft position, which does not depend on K).
    rate = first_position_accepted / first_position_trials
    assert rate > 0.6 if draft == "close" else rate < 0.2, rate
    if overlap and draft == "close":
        assert overlapped > 0  # blocks drafted during verification were used


@pytest.mark.parametrize(
    "policy", [orchestrator_pb2.SPECULATION_POLICY_HEURISTIC, orchestrator_pb2.SPECULATION_POLICY_COST_MODEL]
)
def test_adaptive_policies_stay_exact(orchestrators, target_model, references, policy):
    for prompt, expected in list(references.items())[:8]:
        request = orchestrator_pb2.GenerateRequest(
            token_ids=orchestrator_pb2.TokenIds(ids=list(prompt)),
            max_new_tokens=MAX_NEW_TOKENS,
            num_speculative_tokens=3,
            speculation_policy=policy,
        )
        got, _, _ = collect(orchestrators["close"].stub, request)
        assert got == expected, _explain(target_model, list(prompt), expected, got)


def test_load_aware_drafts_beside_the_targets_prefill(orchestrators, target_model, references):
    """load_aware's first round is the target's prefill alone, the draft prefilling beside it and
    drafting the next block; the second round verifies that block when its first token guessed the
    prefill's token. Overlapped drafting is off here, so only those blocks count as overlapped."""
    beside = 0
    for prompt, expected in list(references.items())[:8]:
        request = orchestrator_pb2.GenerateRequest(
            token_ids=orchestrator_pb2.TokenIds(ids=list(prompt)),
            max_new_tokens=MAX_NEW_TOKENS,
            num_speculative_tokens=2,
            speculation_policy=orchestrator_pb2.SPECULATION_POLICY_LOAD_AWARE,
            overlap_drafting=False,
        )
        got, _, last = collect(orchestrators["close"].stub, request)
        assert got == expected, _explain(target_model, list(prompt), expected, got)
        assert last.stats.overlapped_rounds <= 1
        beside += last.stats.overlapped_rounds
    assert beside > 0


def test_target_alone_is_exact(orchestrators, target_model, references):
    for prompt, expected in list(references.items())[:5]:
        request = orchestrator_pb2.GenerateRequest(
            token_ids=orchestrator_pb2.TokenIds(ids=list(prompt)), max_new_tokens=MAX_NEW_TOKENS
        )
        got, _, last = collect(orchestrators["none"].stub, request)
        assert got == expected
        assert last.stats.draft_tokens == 0 and last.stats.rounds == len(got)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_load_aware_probes_an_unrelated_draft_beside_the_targets_steps(orchestrators, target_model, sampled):
    """With a draft that never agrees, load_aware falls to K = 0 and keeps asking the draft for one
    token now and then, beside the target's step: the output stays the target's own."""
    probes = drafted = 0
    for prompt in _prompts(target_model.vocab_size)[:3]:
        request = orchestrator_pb2.GenerateRequest(
            token_ids=orchestrator_pb2.TokenIds(ids=prompt),
            max_new_tokens=64,
            num_speculative_tokens=2,
            speculation_policy=orchestrator_pb2.SPECULATION_POLICY_LOAD_AWARE,
        )
        if sampled:  # cold enough that the two random models' rows are peaked, and mostly disagree
            request.temperature, request.seed = 0.3, 7
        got, _, last = collect(orchestrators["random"].stub, request)
        if not sampled:
            expected = hf_greedy(target_model, prompt, 64)
            assert got == expected, _explain(target_model, prompt, expected, got)
        assert len(got) == 64 or got[-1] in target_model.eos_token_ids
        probes += last.stats.probe_rounds
        drafted += last.stats.draft_tokens
    if sampled:
        # Sampled, the random draft still agrees now and then, so speculation is off for fewer rounds;
        # the probes' scoring from the target's one row still ran.
        assert probes >= 1, (probes, drafted)
    else:
        assert probes >= 3, (probes, drafted)  # about one K = 0 round in eight asked the draft
        assert drafted < 3 * 64 // 4, drafted  # and speculation stayed mostly off
