"""One request's speculative decoding loop: the orchestrator owns the canonical sequence.

Each round is planned, run and applied:
- `plan_round` (orchestrator/round_plan.py) decides the block's proposer and K, and the draft's work
  beside the step, from plain values;
- `run_round` does the RPCs: the draft's block (unless one drafted ahead is still valid), the target's
  verify of the k + 1 positions in one forward, the draft's work beside it left running;
- `apply_round` commits the tokens the pure accept/reject step kept, and the policies learn.

Both services are told through `keep` how much of what they last saw is still valid. The draft never
saw its last token, and never sees the recovered or bonus token until the next round appends it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

import grpc
import structlog

from orchestrator.context import Context
from orchestrator.drafting import Drafter, DraftStream
from orchestrator.goodput import StepTimes
from orchestrator.k_policy import KPolicy
from orchestrator.metrics import CHOSEN_K, CONSTRAINT_VIOLATIONS
from orchestrator.ngram import NgramIndex
from orchestrator.proposals import (
    FORCED,
    MODEL,
    NGRAM,
    Draft,
    Stats,
)
from orchestrator.rejection import Verdict, acceptance_probability
from orchestrator.requests import GenerationRequest, ModelLimits, StepFields, finish_of
from orchestrator.round_plan import RoundPlan, RoundState, plan_round, side_k_for, still_valid
from orchestrator.sampler import BatchSampler
from orchestrator.upstream import DraftAvailability
from orchestrator.verifying import Checked, TargetStream, Verifier
from serving.constraints import SessionConstraint
from serving.errors import ServiceError
from specdec.v1 import orchestrator_pb2

log = structlog.get_logger(__name__)

__all__ = ["DraftStream", "Generation", "GenerationRequest", "ModelLimits", "TargetStream"]


@dataclass(frozen=True)
class Ahead:
    """The draft's work beside a target step, with what judging it needs."""

    task: asyncio.Task[Draft]
    checked: Checked  # the step's answer
    tokens: list[int]  # what the step committed
    scored: bool  # a probe's token, or a block drafted beside the prefill: its first token is scored
    after_prefill: bool  # beside the first round: waiting for it is no round's cost


@dataclass(frozen=True)
class RoundOutcome:
    """What a round's RPCs returned."""

    block: Draft  # the block verified
    checked: Checked
    side: asyncio.Task[Draft] | None  # the draft's work beside the step, left running
    probed: tuple[Draft, Checked] | None  # the last round's scored side draft and that round's answer
    seconds: float  # the round's wall time
    draft_wait: float  # of it, waiting for the draft before the step
    overlapped: bool  # the block was drafted beside the last step


class Generation:
    """Runs one request; `rounds()` yields the tokens each round commits."""

    def __init__(
        self,
        request: GenerationRequest,
        limits: ModelLimits,
        target: TargetStream,
        draft: DraftStream | None,
        availability: DraftAvailability,
        policy: KPolicy,
        times: StepTimes | None = None,
        lookup_policy: KPolicy | None = None,
        sampler: BatchSampler | None = None,
    ) -> None:
        self.request = request
        self.limits = limits
        self.target = target
        self.policy = policy
        self.sequence = list(request.prompt_token_ids)  # only ever grows (context.Context relies on it)
        self.produced = 0
        self.round_seconds = 0.0  # the last round's wall time
        self.lookup: NgramIndex | None = None  # prompt lookup, for the ngram and hybrid methods
        self.lookup_policy = lookup_policy  # K for lookup blocks, which cost nothing to draft
        if request.draft_method != MODEL and lookup_policy is not None:
            self.lookup = NgramIndex(request.ngram_min, request.ngram_max)
            self.lookup.extend(self.sequence)
        self.stats = Stats(prompt_tokens=len(self.sequence))
        self.finish_reason: int = orchestrator_pb2.FINISH_REASON_UNSPECIFIED
        self.token_logprobs: list[orchestrator_pb2.TokenLogprob] = []  # one per committed token, when asked
        # Structured output: the orchestrator's own matcher checks every committed token; the services
        # get the constraint on each session's first step (keep = 0), with where it starts.
        self.constraint: SessionConstraint | None = None
        constraint_fields: dict[str, Any] = {}
        if request.constraint is not None:
            template = request.constraint_template
            self.constraint = SessionConstraint(
                template.deep_copy(), len(self.sequence), limits.vocab_size, sorted(limits.eos_token_ids)
            )
            constraint_fields = {
                "structured_output": request.constraint.to_proto(),
                "constraint_start": len(self.sequence),
            }
        self.fields = StepFields(request, limits, constraint_fields)
        # `times` learns from every step's timing, for the load-aware policy; `sampler` is the
        # orchestrator's, shared: accept/reject over the batch.
        self.drafter = Drafter(draft, availability, self.fields, self.stats, times)
        self.drafter.check_width(self.sequence)
        self.verifier = Verifier(target, self.fields, self.stats, times, sampler or BatchSampler(), self.drafter)
        self._started = 0.0
        self._ahead: Ahead | None = None  # the draft's work beside the last step, awaited when needed

    # --- the loop ----------------------------------------------------------------------------

    async def rounds(self) -> AsyncGenerator[list[int], None]:
        """Yield each round's committed tokens until EOS, max_new_tokens or a full context.

        The caller must close the generator when it stops early (`contextlib.aclosing`): the draft's work
        beside the last step may still be running, and closing cancels it."""
        self._started = time.perf_counter()
        try:
            while self.finish_reason == orchestrator_pb2.FINISH_REASON_UNSPECIFIED:
                plan = plan_round(self.state(), self.policy, self.lookup_policy, self.limits)
                outcome = await self.run_round(plan)
                yield self.apply_round(plan, outcome)
        finally:
            if self._ahead is not None:  # no round needs it any more
                await _cancel(self._ahead.task)

    def state(self) -> RoundState:
        """The request before a round, as plain values."""
        forced: list[int] = []
        if self.constraint is not None and self.request.num_speculative_tokens:
            forced = self.constraint.matcher.compute_ff_tokens()
        lookup = None
        if self.lookup is not None and self.lookup_policy is not None:
            lookup = self.lookup.propose(max(self.lookup_policy.max_k, self.lookup_policy.initial_k))
        return RoundState(
            produced=self.produced,
            length=len(self.sequence),
            max_new_tokens=self.request.max_new_tokens,
            request_k=self.request.num_speculative_tokens,
            greedy=self.request.sampling.greedy,
            drafting=self.drafter.usable,
            overlap=self.request.overlap_drafting,
            speculation_cache=self.request.overlap_drafting and self.limits.draft_speculates,
            tree=self._trees(),
            constrained=self.constraint is not None,
            forced=forced,
            lookup=lookup,
            probe_pending=self._ahead is not None and self._ahead.scored,
            draft_extra=self.drafter.extra_tokens(self.sequence),
        )

    def _trees(self) -> bool:
        """Whether this round may draft a token tree: asked for, served by both models, and a round
        whose step needs nothing a tree step does not carry yet (sampling, a constraint, min_tokens'
        ban, logprobs, the prompt's logprobs still to come)."""
        request = self.request
        return (
            request.tree
            and self.limits.trees
            and request.sampling.greedy
            and self.constraint is None
            and not (request.ban is not None and len(self.sequence) < request.ban.until)
            and not request.logprobs
            and (request.prompt_logprobs is None or self.verifier.prompt_logprobs is not None)
        )

    async def run_round(self, plan: RoundPlan) -> RoundOutcome:
        """The round's RPCs: the block (drafted now, unless the one drafted ahead is still valid), the
        target's verdict on it, and the draft's work beside it (left running)."""
        started = time.perf_counter()
        ahead: Draft | None = None
        probed = None
        previous = self._ahead
        if previous is not None:
            drafted = await previous.task
            self._ahead = None
            if previous.scored:
                probed = (drafted, previous.checked)
            verdict = previous.checked.verdict
            ahead = still_valid(drafted, verdict.output_token_ids, verdict.all_accepted, previous.tokens)
            if previous.after_prefill:  # the draft's prefill, beside the target's, is no round's cost
                started = time.perf_counter()
        block = plan.block
        if block is None:
            block = (
                ahead.first(plan.k)
                if ahead is not None
                else await self.drafter.propose(Context(self.sequence), plan.k, plan.ahead_k, plan.tree)
            )
        draft_wait = time.perf_counter() - started  # what the target's step waited for
        CHOSEN_K.observe(len(block.token_ids))
        checked, side = await self._verify_beside(block, side_k_for(plan, block, self.limits))
        overlapped = plan.block is None and (ahead is not None or block.speculated)
        return RoundOutcome(block, checked, side, probed, time.perf_counter() - started, draft_wait, overlapped)

    def apply_round(self, plan: RoundPlan, outcome: RoundOutcome) -> list[int]:
        """Commit the round's tokens, let the policies learn, account; returns the tokens."""
        try:
            if outcome.probed is not None:
                self._observe_probe(*outcome.probed)
            if plan.lookup_idle and self.lookup_policy is not None:
                self.lookup_policy.observe(Verdict([], 0, 0))  # a round at K = 0, for its probes
            self.stats.overlapped_rounds += outcome.overlapped
            self.stats.probe_rounds += plan.probe
            self._learn(outcome)
            tokens = self._commit(outcome.checked)
        except BaseException:
            if outcome.side is not None:
                outcome.side.cancel()
            raise
        if outcome.side is not None:
            self._ahead = Ahead(outcome.side, outcome.checked, tokens, plan.scored, after_prefill=not self.produced)
        self.produced += len(tokens)
        self.round_seconds = outcome.seconds
        now = time.perf_counter()
        if self.produced == len(tokens):
            self.stats.time_to_first_token_seconds = now - self._started
        self.stats.output_tokens = self.produced
        self.stats.total_seconds = now - self._started
        self._check_finished()
        return tokens

    def _learn(self, outcome: RoundOutcome) -> None:
        """Tell the block's policy how the round went (its verdict; its wall time but for the prefill)."""
        block, checked = outcome.block, outcome.checked
        self.stats.record_round(checked.verdict, block.proposer)
        if block.proposer == FORCED:
            return  # a grammar's tokens say nothing about how well either proposer guesses
        policy = self.policy
        if block.proposer == NGRAM:
            assert self.lookup_policy is not None
            policy = self.lookup_policy
        policy.observe(checked.verdict, block.forward_seconds, checked.target_seconds)
        if self.produced:  # the first round is the prompt's prefill
            policy.observe_wall(
                len(block.token_ids),
                outcome.seconds,
                outcome.draft_wait,
                block.fed,
                block.forward_seconds_per_token,
                outcome.overlapped,
                outcome.checked.fetch_seconds,
            )

    def _observe_probe(self, probe: Draft, checked: Checked) -> None:
        """Tell the policy how likely the probe's token was to be accepted at the position the round's
        step decided: greedy, whether it is the target's token; sampling, min(1, p / q)."""
        if not probe.token_ids:
            self.policy.observe_probe(None)  # the draft failed or was busy
            return
        token = probe.token_ids[0]
        if probe.token_probs is None or checked.target_row is None:
            acceptance = float(token == checked.verdict.output_token_ids[0])
        else:  # the step was at K = 0: its row is the one for the probe's position
            acceptance = acceptance_probability(probe.token_probs[0], float(checked.target_row[token]))
        self.policy.observe_probe(acceptance)

    # --- the RPCs ----------------------------------------------------------------------------

    async def _verify_beside(self, block: Draft, side_k: int) -> tuple[Checked, asyncio.Task[Draft] | None]:
        """The target's check of `block`, and the task drafting `side_k` tokens continuing the sequence
        plus `block` meanwhile (None when side_k is 0), left running: the step's tokens go to the client
        before the next round awaits it."""
        if not side_k:
            return await self.verifier.verify(self.sequence, block, None), None
        side = asyncio.create_task(self.drafter.propose(Context(self.sequence, block.token_ids), side_k))
        try:
            checked = await self.verifier.verify(self.sequence, block, side)
        except BaseException:
            await _cancel(side)
            raise
        return checked, side

    # --- committing --------------------------------------------------------------------------

    def _commit(self, checked: Checked) -> list[int]:
        """Append the round's tokens (cut after an EOS, unless ignore_eos, or a stop token); each service's
        next step keeps what it shares."""
        tokens = checked.verdict.output_token_ids
        for index, token in enumerate(tokens):
            if self.constraint is not None:
                self._check_allowed(token)
            finish = finish_of(token, self.limits, self.request)
            if finish != orchestrator_pb2.FINISH_REASON_UNSPECIFIED:
                self.finish_reason = finish
                tokens = tokens[: index + 1]
                break
        self.token_logprobs.extend(checked.logprobs[: len(tokens)])
        self.drafter.check_width(tokens)
        self.sequence.extend(tokens)
        if self.lookup is not None:
            self.lookup.extend(tokens)
        return tokens

    def _check_allowed(self, token: int) -> None:
        """Advance the request's matcher by a token about to be committed; a token the constraint does
        not allow can only come from a bug or a faulty target replica: INTERNAL, and the replica avoided."""
        constraint = self.constraint
        assert constraint is not None
        if constraint.allows(token):
            if not constraint.is_eos(token):
                constraint.consume(token)
            return
        CONSTRAINT_VIOLATIONS.inc()
        log.error(
            "structured_output_violation",
            request_id=self.request.request_id,
            token=token,
            position=len(self.sequence),
            generated=len(constraint.consumed),
        )
        self.target.reset()
        raise ServiceError(
            grpc.StatusCode.INTERNAL,
            f"the target replica produced token {token}, which the structured_output constraint does not allow "
            "there; the replica is avoided for a while: retry the request",
        )

    def _check_finished(self) -> None:
        if self.finish_reason != orchestrator_pb2.FINISH_REASON_UNSPECIFIED:
            return
        if self.produced >= self.request.max_new_tokens or len(self.sequence) >= self.limits.target_max_context:
            self.finish_reason = orchestrator_pb2.FINISH_REASON_LENGTH

    @property
    def prompt_logprobs(self) -> list[orchestrator_pb2.TokenLogprob] | None:
        return self.verifier.prompt_logprobs

    def close(self) -> None:
        """End both sessions; the services free their caches at once."""
        self.target.close()
        if self.drafter.stream is not None:
            self.drafter.stream.close()

    @property
    def reopens(self) -> int:
        return self.target.reopens + (self.drafter.stream.reopens if self.drafter.stream else 0)

    @property
    def wire_bytes(self) -> int:
        return self.target.wire_bytes + (self.drafter.stream.wire_bytes if self.drafter.stream else 0)

    @property
    def reused(self) -> tuple[int, int]:
        """Tokens the target's and the draft's prefix caches saved this request."""
        draft = self.drafter.stream
        return self.target.reused_tokens, draft.reused_tokens if draft else 0


async def _cancel(task: asyncio.Task[Draft]) -> None:
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
