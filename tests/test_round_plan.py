"""plan_round on plain values: which block a round proposes, its K, and the draft's work beside it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from orchestrator.k_policy import FixedK, KPolicy
from orchestrator.proposals import FORCED, MODEL, NGRAM, Draft
from orchestrator.requests import ModelLimits
from orchestrator.round_plan import RoundState, cap, plan_round, side_k_for, still_valid

LIMITS = ModelLimits(
    vocab_size=64, target_max_context=1000, draft_max_context=1000, eos_token_ids=frozenset({2}),
    draft_max_speculative_tokens=8,
)  # fmt: skip
STATE = RoundState(
    produced=10, length=50, max_new_tokens=100, request_k=4, greedy=True, drafting=True, overlap=True,
    constrained=False,
)  # fmt: skip


class Counting(FixedK):
    """A fixed K that counts how often it is asked, and probes when told to."""

    def __init__(self, k: int, probe: bool = False) -> None:
        super().__init__(k, 16)
        self.asked = 0
        self.probe = probe

    def next_k(self) -> int:
        self.asked += 1
        return super().next_k()

    def probe_due(self) -> bool:
        return self.probe


def test_a_model_round_asks_the_policy_once_and_drafts_ahead_with_its_k():
    policy = Counting(4)
    plan = plan_round(STATE, policy, None, LIMITS)
    assert (plan.block, plan.k, plan.next_k, plan.side_k) == (None, 4, 4, 0) and policy.asked == 1
    block = Draft([5, 6, 7, 8], None)
    assert side_k_for(plan, block, LIMITS) == 5  # the bonus guess, then the next round's K
    no_overlap = plan_round(replace(STATE, overlap=False), policy, None, LIMITS)
    assert side_k_for(no_overlap, block, LIMITS) == 0


def test_with_a_speculation_cache_the_draft_drafts_ahead_itself():
    """A draft service with a speculation cache drafts the next blocks for the verdicts itself: the
    model block's step asks for them with the K the next round may choose (fixed: K; load_aware: K + 1
    after a whole block), and no step goes beside the verify."""
    state = replace(STATE, speculation_cache=True)
    block = Draft([5, 6, 7, 8], None)
    fixed = plan_round(state, Counting(4), None, LIMITS)
    assert fixed.ahead_k == (4, 4) and side_k_for(fixed, block, LIMITS) == 0
    rising = plan_round(state, _Rising(4, 16), None, LIMITS)
    assert rising.ahead_k == (4, 5)  # a rise only after a whole block
    near_the_end = plan_round(replace(state, produced=90), _Rising(4, 16), None, LIMITS)
    assert near_the_end.ahead_k == (4, 4)  # 10 left: after a whole block 5 are committed, 5 left: K + 1
    assert plan_round(STATE, Counting(4), None, LIMITS).ahead_k == (0, 0)  # no cache: the side step instead


class _Rising(KPolicy):
    """A policy that may rise a step a round (most_next_k's default, load_aware's)."""

    def next_k(self) -> int:
        return self.initial_k


@pytest.mark.parametrize(
    ("produced", "length", "k"),
    [
        (95, 50, 4),  # 5 tokens left: a round commits at most K + 1
        (97, 50, 2),
        (99, 50, 0),  # one token left: the target alone
        (10, 997, 2),  # the target's context
    ],
)
def test_k_is_capped_so_no_round_overshoots(produced, length, k):
    plan = plan_round(replace(STATE, produced=produced, length=length), Counting(4), None, LIMITS)
    assert plan.k == k and (plan.block is None) == (k > 0)


def test_the_one_cap_holds_the_drafts_bounds():
    assert cap(12, STATE, LIMITS, drafted=True) == 8  # the draft's bound on a step
    assert cap(12, STATE, LIMITS, drafted=False) == 12  # a lookup's or grammar's block has no draft step
    assert cap(12, STATE, LIMITS, drafted=True, guess=1) == 7  # the guess is drafted in the same step
    assert cap(12, replace(STATE, length=995), replace(LIMITS, draft_max_context=998), drafted=True) == 3
    # A draft with another tokenizer holds the sequence in more tokens (split ones): its context binds first.
    assert cap(12, replace(STATE, length=990, draft_extra=5), replace(LIMITS, draft_max_context=998), drafted=True) == 3
    assert cap(4, STATE, LIMITS, drafted=True) == 4
    assert cap(12, STATE, LIMITS, drafted=False, after=85) == 4  # 5 tokens left after those 85


def test_forced_tokens_come_first_and_cost_no_policy_call():
    policy = Counting(4)
    plan = plan_round(replace(STATE, forced=[7, 8, 9, 10, 11], greedy=False), policy, None, LIMITS)
    assert plan.block is not None and plan.block.proposer == FORCED
    assert plan.block.token_ids == [7, 8, 9, 10] and plan.block.token_probs == [1.0] * 4
    assert policy.asked == 0 and side_k_for(plan, plan.block, LIMITS) == 0


def test_the_lookup_proposes_before_the_model_and_counts_its_idle_rounds():
    lookup_policy = Counting(3)
    plan = plan_round(replace(STATE, lookup=[4, 5, 6, 7]), Counting(4), lookup_policy, LIMITS)
    assert plan.block is not None and plan.block.proposer == NGRAM and plan.block.token_ids == [4, 5, 6]
    no_match = plan_round(replace(STATE, lookup=[]), Counting(4), lookup_policy, LIMITS)
    assert no_match.block is None and no_match.k == 4 and not no_match.lookup_idle
    idle = plan_round(replace(STATE, lookup=[4, 5]), Counting(4), Counting(0), LIMITS)
    assert idle.lookup_idle and idle.block is None  # K = 0 for the lookup: the model's round


def test_the_first_round_drafts_beside_the_prefill():
    plan = plan_round(replace(STATE, produced=0), Counting(4), None, LIMITS)
    assert plan.block is not None and not plan.block.token_ids
    assert plan.side_k == 5 and plan.beside_prefill and plan.scored and not plan.probe


class NoOverlapBesidePrefill(Counting):
    drafts_beside_prefill = True


def test_without_overlap_only_a_policy_that_asks_drafts_beside_the_prefill():
    state = replace(STATE, produced=0, overlap=False)
    assert plan_round(state, Counting(4), None, LIMITS).k == 4
    assert plan_round(state, NoOverlapBesidePrefill(4), None, LIMITS).side_k == 5


def test_k_0_probes_when_due_and_not_while_a_probe_is_pending():
    plan = plan_round(STATE, Counting(0, probe=True), None, LIMITS)
    assert plan.probe and plan.side_k == 1 and plan.block is not None and not plan.block.token_ids
    assert not plan_round(replace(STATE, probe_pending=True), Counting(0, probe=True), None, LIMITS).probe
    assert not plan_round(STATE, Counting(0), None, LIMITS).probe
    assert not plan_round(replace(STATE, drafting=False), Counting(4, probe=True), None, LIMITS).side_k


def test_no_drafting_asks_no_policy():
    policy: KPolicy = Counting(4)
    plan = plan_round(replace(STATE, drafting=False), policy, None, LIMITS)
    assert plan.block is not None and not plan.block.token_ids and policy.asked == 0  # type: ignore[attr-defined]


def test_a_constrained_block_that_may_end_is_not_drafted_past():
    plan = plan_round(replace(STATE, constrained=True), Counting(4), None, LIMITS)
    assert side_k_for(plan, Draft([5, 2, 6], None), LIMITS) == 0
    assert side_k_for(plan, Draft([5, 6, 7], None, proposer=MODEL), LIMITS) == 5


def test_a_block_drafted_ahead_is_used_only_when_its_guess_was_right():
    ahead = Draft([9, 10, 11], [0.5, 0.6, 0.7])
    assert still_valid(ahead, [4, 9], True, [4, 9]) == Draft([10, 11], [0.6, 0.7])
    assert still_valid(ahead, [4, 8], True, [4, 8]) is None  # another bonus token
    assert still_valid(ahead, [4, 9], False, [4, 9]) is None  # a rejection
    assert still_valid(ahead, [4, 9], True, [4]) is None  # cut at EOS
    assert still_valid(Draft([9], None), [9], True, [9]) is None  # nothing after the guess


def test_a_tree_request_drafts_a_tree_of_k_nodes_after_its_first_round_with_nothing_beside_it():
    state = replace(STATE, tree=True, speculation_cache=True)
    plan = plan_round(state, Counting(4), None, LIMITS)
    assert (plan.block, plan.k, plan.tree, plan.ahead_k) == (None, 4, True, (0, 0))
    assert side_k_for(plan, Draft([5, 6, 7, 8], None, parents=(-1, 0, -1, 2)), LIMITS) == 0
    first = plan_round(replace(state, produced=0, overlap=False, speculation_cache=False), Counting(4), None, LIMITS)
    assert first.k == 4 and not first.tree  # the prompt goes to both services as a chain's step
    assert not plan_round(STATE, Counting(4), None, LIMITS).tree
