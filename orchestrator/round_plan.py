"""What a round will do, decided before it runs: `plan_round` is a function of plain values (and the
K policies, each asked once).

A round proposes one block, from the first of:
- the tokens a structured output forces next (a key, punctuation): a point mass, no draft step;
- the prompt lookup's continuation (the ngram and hybrid methods): a point mass, no draft step;
- the draft model: K tokens, drafted now or taken from a block drafted beside the last step.

Beside the target's step the draft may work (`RoundPlan.side_k` and `side_k_for`): the next block as
if this one were all accepted (its first token guesses the bonus token); in the first round, the
same beside the target's prefill; at K = 0, a probe (one token for the position the step decides, for
the policy to learn from at no cost to the round's time). A draft service with a speculation cache
drafts the next block itself, for each likely verdict (draft_service/speculation.py): a model block
then asks for it (`RoundPlan.ahead_k`) and has no side step. A request that drafts token trees
(`RoundState.tree`) drafts a tree of K nodes after its first round, with nothing beside it.

Every K is capped by one function, `cap`, so that no round overshoots max_new_tokens, a context, or
the draft's own bound on a step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from orchestrator.k_policy import KPolicy
from orchestrator.proposals import FORCED, MODEL, NGRAM, NO_DRAFT, Draft
from orchestrator.requests import ModelLimits


@dataclass(frozen=True)
class RoundState:
    """A request before a round, as plain values."""

    produced: int  # tokens generated so far
    length: int  # the sequence's length (prompt included)
    max_new_tokens: int
    request_k: int  # the request's K (0: the target alone, which no block changes)
    greedy: bool
    drafting: bool  # the draft model may be asked (there is one, it is up, and it took this request's steps)
    overlap: bool  # the request drafts the next block beside each step
    constrained: bool  # a structured output checks every token
    forced: Sequence[int] = ()  # the tokens a structured output forces next
    lookup: Sequence[int] | None = None  # the prompt lookup's continuation (None: no lookup)
    probe_pending: bool = False  # a probe beside the last step has not been scored yet
    speculation_cache: bool = False  # the draft service drafts the next blocks itself (with overlap only)
    tree: bool = False  # a model block may be a token tree (greedy, unconstrained, no ban or logprobs)
    draft_extra: int = 0  # tokens the draft's context holds beyond the sequence (a draft with another tokenizer)


@dataclass(frozen=True)
class RoundPlan:
    """One round, decided: the block (None: the draft model's, `k` tokens, drafted now or taken from
    the block drafted ahead), what the draft does beside the step, and what the policies learn."""

    state: RoundState  # what it was planned from
    block: Draft | None
    k: int = 0
    next_k: int = 0  # the policy's K for the next round, for the block drafted ahead beside this one
    side_k: int = 0  # tokens drafted beside the step, known before the block (prefill or probe)
    probe: bool = False  # side_k is a probe's one token, at K = 0
    beside_prefill: bool = False  # side_k is the block drafted beside the target's prefill
    lookup_idle: bool = False  # the lookup's policy chose K = 0: the round counts for its probes
    # The K of the blocks the draft's speculation cache drafts ahead after a rejection and after the
    # whole block (0: none).
    ahead_k: tuple[int, int] = (0, 0)
    tree: bool = False  # the model block is a token tree of k nodes (nothing is drafted beside it)

    @property
    def scored(self) -> bool:
        """The side step's first token guesses the token the step decides, and is scored as a probe."""
        return self.probe or self.beside_prefill


def cap(k: int, state: RoundState, limits: ModelLimits, drafted: bool, after: int = 0, guess: int = 0) -> int:
    """K for a block that starts `after` tokens past the state's sequence: a round commits at most
    K + 1 tokens. A drafted block (`drafted`) also fits the draft's context and its bound on a step,
    which drafts `guess` tokens before the block (the guess of the bonus token)."""
    produced, length = state.produced + after, state.length + after
    bounds = [k, state.max_new_tokens - produced - 1, limits.target_max_context - length - 1]
    if drafted:
        bounds += [limits.draft_max_speculative_tokens - guess, limits.draft_max_context - length - state.draft_extra]
    return max(0, min(bounds))


def _point_masses(token_ids: Sequence[int], proposer: str, greedy: bool) -> Draft:
    """A deterministic block: q(x) = 1 for each token (None when greedy)."""
    return Draft(list(token_ids), None if greedy else [1.0] * len(token_ids), proposer=proposer)


def plan_round(state: RoundState, policy: KPolicy, lookup_policy: KPolicy | None, limits: ModelLimits) -> RoundPlan:
    """The round's block and the draft's work beside it (see the module's docstring)."""
    if state.forced and state.request_k:
        k = cap(state.request_k, state, limits, drafted=False)
        if k:
            return RoundPlan(state, _point_masses(state.forced[:k], FORCED, state.greedy))
    lookup_idle = False
    if state.lookup is not None and lookup_policy is not None:
        k = cap(lookup_policy.next_k(), state, limits, drafted=False)
        if k and state.lookup:
            return RoundPlan(state, _point_masses(state.lookup[:k], NGRAM, state.greedy))
        lookup_idle = k == 0
    if not state.drafting:
        return RoundPlan(state, NO_DRAFT, lookup_idle=lookup_idle)
    next_k = policy.next_k()
    k = cap(next_k, state, limits, drafted=True)
    if k and not state.produced and (state.overlap or policy.drafts_beside_prefill):
        # The target prefills the prompt alone (K = 0) while the draft prefills it beside and drafts the
        # next block, rather than first prefilling and drafting while the target waits: the first token
        # comes when the target alone gives it (overlapped drafting's idea, for the prefill).
        side_k = _ahead(k, state, 0, limits)
        if side_k:
            return RoundPlan(state, NO_DRAFT, side_k=side_k, beside_prefill=True, lookup_idle=lookup_idle)
    if k and state.tree and state.produced:  # after the prefill round: its prompt is fed as a chain
        return RoundPlan(state, None, k=k, next_k=next_k, lookup_idle=lookup_idle, tree=True)
    if k:
        ahead = (0, 0)
        if state.speculation_cache:  # after a rejection at least 1 token is committed, after a whole block k + 1
            ahead = (
                cap(policy.most_next_k(k, whole=False), state, limits, drafted=True, after=1),
                cap(policy.most_next_k(k, whole=True), state, limits, drafted=True, after=k + 1),
            )
        return RoundPlan(state, None, k=k, next_k=next_k, lookup_idle=lookup_idle, ahead_k=ahead)
    room = cap(1, state, limits, drafted=True)  # a probe drafts one token
    probe = room > 0 and not state.probe_pending and policy.probe_due()
    return RoundPlan(state, NO_DRAFT, side_k=int(probe), probe=probe, lookup_idle=lookup_idle)


def side_k_for(plan: RoundPlan, block: Draft, limits: ModelLimits) -> int:
    """Tokens the draft drafts beside the step that verifies `block`: the plan's (prefill, probe), or
    for a model block with overlap the guess of the bonus token plus the next round's K; 0 when no
    next round could use them."""
    state = plan.state
    if plan.side_k or not state.overlap or not block.token_ids or block.proposer != MODEL:
        return plan.side_k
    if block.parents:
        return 0  # a tree's verdict is no chain's: nothing drafted ahead guesses it
    if state.speculation_cache:
        return 0  # the draft service drafts ahead itself
    if state.constrained and any(t in limits.eos_token_ids for t in block.token_ids):
        return 0  # a block that may end the generation: a constrained draft cannot feed past its EOS
    return _ahead(plan.next_k, state, len(block.token_ids), limits)


def _ahead(next_k: int, state: RoundState, block: int, limits: ModelLimits) -> int:
    """A guess at the step's last token plus `next_k`, for a step verifying `block` tokens (0 when the
    next round could not use them)."""
    k = cap(next_k, state, limits, drafted=True, after=block + 1, guess=1)  # all accepted, plus the bonus
    return k + 1 if k >= 1 else 0


def still_valid(
    ahead: Draft, output_token_ids: Sequence[int], all_accepted: bool, committed: Sequence[int]
) -> Draft | None:
    """The rest of a block drafted ahead when its first token guessed the step's last token, else None.

    Its tokens were sampled from the draft given exactly the sequence now committed, so they are as
    valid a proposal as a block drafted now; otherwise it is dropped (the draft's next step keeps only
    what it shares with the sequence)."""
    if (
        len(ahead.token_ids) < 2
        or not all_accepted
        or len(committed) != len(output_token_ids)  # cut at EOS
        or ahead.token_ids[0] != committed[-1]
    ):
        return None
    return ahead.rest()
