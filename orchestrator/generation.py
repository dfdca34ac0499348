"""One request's speculative decoding loop: the orchestrator owns the canonical sequence.

Each round: the draft proposes k tokens, the target scores the k + 1 positions in one forward pass,
the pure accept/reject step decides, and both services are told through `keep` how much of what they
last saw is still valid. The draft never saw its last token, and never sees the recovered or bonus
token until the next round appends it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

import grpc
import structlog
import torch

from orchestrator.goodput import StepTimes
from orchestrator.k_policy import KPolicy
from orchestrator.logprobs import entries_from_wire, entry_from_row
from orchestrator.metrics import CHOSEN_K, CONSTRAINT_VIOLATIONS, DRAFT_ROWS, TARGET_DISAGREEMENTS
from orchestrator.ngram import NgramIndex
from orchestrator.proposals import (
    FORCED,
    MODEL,
    NGRAM,
    NO_DRAFT,
    POINT_MASS_PROPOSERS,
    Draft,
    RowsAt,
    Stats,
    point_masses,
)
from orchestrator.rejection import CompactRound, Verdict, acceptance_probability, draw_uniforms, verify_greedy
from orchestrator.sampler import BatchSampler
from orchestrator.upstream import SessionStream
from serving.constraints import ConstraintSpec, SessionConstraint, TokenBan
from serving.errors import ServiceError, unavailable
from serving.logits import first_rejection, rows_from_wire
from serving.sampling import SamplingParams, seeded_generator
from serving.tensors import WireFormatError
from specdec.v1 import common_pb2, draft_pb2, orchestrator_pb2, target_pb2

log = structlog.get_logger(__name__)

_SEED_MIX = 0x9E3779B97F4A7C15
_U64 = (1 << 64) - 1


@dataclass(frozen=True)
class GenerationRequest:
    """A validated Generate request."""

    request_id: str
    prompt_token_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    seed: int
    num_speculative_tokens: int  # K to start with; 0 is the target alone
    overlap_drafting: bool
    min_confidence: float
    draft_method: str = MODEL  # MODEL, NGRAM, or "hybrid" (the lookup when it matches, else the model)
    ngram_min: int = 2
    ngram_max: int = 4
    cache_salt: bytes = b""  # sent on each session's first step (keep = 0)
    constraint: ConstraintSpec | None = None  # structured output, sent on each session's first step
    # The constraint compiled (an llguidance matcher in its initial state): the orchestrator's own copy
    # checks every committed token.
    constraint_template: Any = field(default=None, compare=False, repr=False)
    ignore_eos: bool = False  # EOS tokens are ordinary tokens: no end there
    stop_token_ids: frozenset[int] = frozenset()  # generation ends after any of these (finish STOP)
    ban: TokenBan | None = None  # min_tokens: EOS and stop tokens masked below a sequence length
    logprobs: bool = False  # the target's logprob of each generated token
    top_logprobs: int = 0  # alternatives per generated token
    prompt_logprobs: int | None = None  # the prompt's logprobs with this many alternatives; None: none


@dataclass(frozen=True)
class Checked:
    """The target's answer to one step: the round's verdict, the target's forward seconds, (when
    sampling) its row at the first rejection, or the bonus row, [vocab], and (when asked) the logprob
    entry of each output token."""

    verdict: Verdict
    target_seconds: float
    target_row: torch.Tensor | None = None
    logprobs: list[orchestrator_pb2.TokenLogprob] = field(default_factory=list)


@dataclass(frozen=True)
class ModelLimits:
    """What the pair allows, from the services' ModelInfo."""

    vocab_size: int
    target_max_context: int
    draft_max_context: int
    eos_token_ids: frozenset[int]
    draft_max_speculative_tokens: int = 16  # the draft service's cap on one step's K
    draft_vocab_size: int = 0  # the draft's row width (0: the target's); a padded pair's may differ
    draft_constrains: bool = False  # the draft applies structured outputs (ModelInfo.structured_output_kinds)


class DraftAvailability:
    """Shared by all requests: after a fault of the draft service itself (unreachable, too slow, a lost
    stream, rows that are not distributions), nobody drafts until `retry_after_s` has passed. A
    request's own errors never get here (the isolation rule: see `is_draft_fault`)."""

    def __init__(self, retry_after_s: float) -> None:
        self.retry_after_s = retry_after_s
        self._down_until = 0.0

    @property
    def usable(self) -> bool:
        return time.monotonic() >= self._down_until

    def failed(self) -> None:
        self._down_until = time.monotonic() + self.retry_after_s


# Statuses from the draft that say the draft service itself is at fault. Everything else
# (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, FAILED_PRECONDITION, ...) concerns this request or this moment.
_DRAFT_FAULTS = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.DATA_LOSS,
}


def is_draft_fault(exc: BaseException) -> bool:
    """Whether a failed draft step marks the draft unavailable for every request."""
    if isinstance(exc, ServiceError):
        return exc.code in _DRAFT_FAULTS
    return isinstance(exc, TimeoutError | WireFormatError)


class TargetDisagreement(ValueError):
    """The target found a sampled round's first rejection elsewhere than the acceptance function does."""


DraftStream = SessionStream[draft_pb2.DraftRequest, draft_pb2.DraftResponse]
TargetStream = SessionStream[target_pb2.VerifyRequest, target_pb2.VerifyResponse]


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
        self.draft = draft
        self.availability = availability
        self.sampler = sampler or BatchSampler()  # the orchestrator's, shared: accept/reject over the batch
        self.policy = policy
        self.times = times  # learns from every target step's timing, for the load-aware policy
        self.sequence = list(request.prompt_token_ids)
        self.lookup: NgramIndex | None = None  # prompt lookup, for the ngram and hybrid methods
        self.lookup_policy = lookup_policy  # K for lookup blocks, which cost nothing to draft
        if request.draft_method != MODEL and lookup_policy is not None:
            self.lookup = NgramIndex(request.ngram_min, request.ngram_max)
            self.lookup.extend(self.sequence)
        self.generator = seeded_generator(request.seed)
        self.drafting_refused = False  # the draft refused this request's steps: no more drafting for it
        self.sampling_proto = request.sampling.to_proto()  # the same for every round
        self.stats = Stats(prompt_tokens=len(self.sequence))
        self.finish_reason: int = orchestrator_pb2.FINISH_REASON_UNSPECIFIED
        self.token_logprobs: list[orchestrator_pb2.TokenLogprob] = []  # one per committed token, when asked
        # The prompt's (None until the target's first step answers them; a one-token prompt has none).
        self.prompt_logprobs: list[orchestrator_pb2.TokenLogprob] | None = None
        if request.prompt_logprobs is not None and len(self.sequence) == 1:
            self.prompt_logprobs = []
        self._check_draftable(self.sequence)
        # Structured output: the orchestrator's own matcher checks every committed token; the services
        # get the constraint on each session's first step (keep = 0), with where it starts.
        self.constraint: SessionConstraint | None = None
        self.constraint_fields: dict[str, Any] = {}
        if request.constraint is not None:
            template = request.constraint_template
            self.constraint = SessionConstraint(
                template.deep_copy(), len(self.sequence), limits.vocab_size, sorted(limits.eos_token_ids)
            )
            self.constraint_fields = {
                "structured_output": request.constraint.to_proto(),
                "constraint_start": len(self.sequence),
            }

    # --- the loop ----------------------------------------------------------------------------

    async def rounds(self) -> AsyncGenerator[list[int], None]:
        """Yield each round's committed tokens until EOS, max_new_tokens or a full context.

        The caller must close the generator when it stops early (`contextlib.aclosing`): the draft's work
        beside the last step may still be running, and closing cancels it."""
        started = time.perf_counter()
        produced = 0
        beside: Beside | None = None  # the draft's work beside the last step, awaited when needed
        try:
            while self.finish_reason == orchestrator_pb2.FINISH_REASON_UNSPECIFIED:
                round_started = time.perf_counter()
                ready = None
                if beside is not None:
                    ready = await self._settle(beside)
                    if produced == len(beside.tokens):  # the draft's prefill, beside the target's
                        round_started = time.perf_counter()  # is no round's cost, as the prefill is not
                draft, prefill_side_k = await self._block(produced, ready)
                draft_wait = time.perf_counter() - round_started  # what the target's step waited for
                CHOSEN_K.observe(len(draft.token_ids))
                # Beside the target's step the draft may work: drafting the next block as if this one
                # were all accepted (its first token guesses the bonus token; the rest is the next
                # block); in the first round, the same beside the target's prefill; or, at K = 0, a
                # probe: one token for the position the step decides, for the policy to learn from at
                # no cost to the round's time.
                side_k = self._guess_k(produced, draft) or prefill_side_k
                probing = not side_k and not draft.token_ids and self._probe_due()
                if probing:
                    side_k = 1
                    self.stats.probe_rounds += 1
                checked, side = await self._verify_beside(draft, side_k)
                self._learn(draft, checked, produced, time.perf_counter() - round_started, draft_wait)
                tokens = self._commit(checked)
                # A probe's token, and the first token of a block drafted beside the prefill, guessed the
                # token this step decided: the policy learns from them as from a probe.
                beside = Beside(side, checked, tokens, probing or bool(prefill_side_k)) if side else None
                produced += len(tokens)
                self._account(tokens, produced, started)
                yield tokens
        finally:
            if beside is not None:  # no round needs it any more
                await _cancel(beside.task)

    async def _block(self, produced: int, ready: Draft | None) -> tuple[Draft, int]:
        """This round's block (the lookup's, the rest of a block drafted ahead, or the draft's now), and
        how many tokens the draft is to propose beside the target's prefill instead (the first round)."""
        draft = self._forced(produced)
        if draft.token_ids:
            return draft, 0
        draft = self._lookup(produced)
        if draft.token_ids:
            return draft, 0
        k = self._round_k(produced)
        if k and not produced and (self.request.overlap_drafting or self.policy.drafts_beside_prefill):
            # The target prefills the prompt alone (K = 0) while the draft prefills it beside and
            # drafts the next block, rather than first prefilling and drafting while the target waits:
            # the first token comes when the target alone gives it (overlapped drafting's idea, for
            # the prefill).
            beside_k = self._ahead_k(produced, NO_DRAFT, k)
            if beside_k:
                return NO_DRAFT, beside_k
        if ready is not None and k:
            self.stats.overlapped_rounds += 1
            return ready.first(k), 0
        return (await self._propose(self.sequence, k) if k else NO_DRAFT), 0

    def _probe_due(self) -> bool:
        return self._drafting_usable() and self.policy.probe_due()

    def _learn(self, draft: Draft, checked: Checked, produced: int, seconds: float, draft_wait: float) -> None:
        """Tell the block's policy how the round went (its verdict; its wall time but for the prefill)."""
        self.stats.record_round(checked.verdict, draft.proposer)
        if draft.proposer == FORCED:
            return  # a grammar's tokens say nothing about how well either proposer guesses
        policy = self.policy
        if draft.proposer == NGRAM:
            assert self.lookup_policy is not None
            policy = self.lookup_policy
        policy.observe(checked.verdict, draft.forward_seconds, checked.target_seconds)
        if produced:  # the first round is the prompt's prefill
            policy.observe_wall(len(draft.token_ids), seconds, draft_wait, draft.fed, draft.forward_seconds_per_token)

    def _account(self, tokens: list[int], produced: int, started: float) -> None:
        """Statistics after a round committed `tokens`, `produced` in all; whether the generation ended."""
        now = time.perf_counter()
        if produced == len(tokens):
            self.stats.time_to_first_token_seconds = now - started
        self.stats.output_tokens = produced
        self.stats.total_seconds = now - started
        self._check_finished(tokens, produced)

    async def _settle(self, beside: Beside) -> Draft | None:
        """Await the draft's work beside the last step: score it if it was a probe's, and return the rest
        of its block when its first token guessed the step's last token (else None)."""
        side = await beside.task
        if beside.scored:
            self._observe_probe(side, beside.checked)
        return self._still_valid(side, beside.checked.verdict, beside.tokens)

    def _forced(self, produced: int) -> Draft:
        """The tokens a structured output forces next (a key, punctuation), as a block that costs no
        draft step: a point-mass proposal, exact as a lookup's. None at K = 0 (the target alone)."""
        if self.constraint is None or not self.request.num_speculative_tokens:
            return NO_DRAFT
        k = min(self.request.num_speculative_tokens, self._room(produced))
        token_ids = self.constraint.matcher.compute_ff_tokens()[: max(0, k)]
        if not token_ids:
            return NO_DRAFT
        probs = None if self.request.sampling.greedy else [1.0] * len(token_ids)
        return Draft(token_ids=token_ids, token_probs=probs, proposer=FORCED)

    def _lookup(self, produced: int) -> Draft:
        """This round's prompt-lookup block, or NO_DRAFT (no lookup, no match, or K = 0 pays best)."""
        if self.lookup is None or self.lookup_policy is None:
            return NO_DRAFT
        k = max(0, min(self.lookup_policy.next_k(), self._room(produced)))
        token_ids = self.lookup.propose(k)
        if not token_ids:
            if k == 0:
                self.lookup_policy.observe(Verdict([], 0, 0))  # a round at K = 0, for its probes
            return NO_DRAFT
        # A lookup proposes deterministically: q is a point mass on each token, so q(x) = 1.
        probs = None if self.request.sampling.greedy else [1.0] * len(token_ids)
        return Draft(token_ids=token_ids, token_probs=probs, proposer=NGRAM)

    def _room(self, produced: int) -> int:
        """The most tokens a block may propose without a round overshooting a limit."""
        return min(
            self.request.max_new_tokens - produced - 1,  # a round outputs at most k + 1 tokens
            self.limits.target_max_context - len(self.sequence) - 1,
        )

    def _guess_k(self, produced: int, draft: Draft) -> int:
        """Tokens to draft ahead during verification: the bonus guess plus next round's K, or 0 when
        overlap is off, the block is not the model's, or no next round could use them."""
        if not self.request.overlap_drafting or not draft.token_ids or draft.proposer != MODEL:
            return 0
        if self.constraint is not None and any(t in self.limits.eos_token_ids for t in draft.token_ids):
            return 0  # a block that may end the generation: a constrained draft cannot feed past its EOS
        return self._ahead_k(produced, draft, self.policy.next_k())

    def _ahead_k(self, produced: int, draft: Draft, next_k: int) -> int:
        """Tokens to draft during the verification of `draft`: a guess at the step's last token plus
        `next_k`, capped so that the next round cannot overshoot a limit (0 when it could not use them)."""
        after = len(self.sequence) + len(draft.token_ids) + 1  # if all accepted, plus the bonus token
        next_k = min(
            next_k,
            self.request.max_new_tokens - (produced + len(draft.token_ids) + 1) - 1,
            self.limits.target_max_context - after - 1,
            self.limits.draft_max_speculative_tokens - 1,  # the step drafts next_k + 1 tokens
        )
        return next_k + 1 if next_k >= 1 else 0

    def _still_valid(self, speculative: Draft, verdict: Verdict, tokens: list[int]) -> Draft | None:
        """The rest of a speculative block when its first token guessed the bonus token, else None.

        Its tokens were sampled from the draft given exactly the sequence now committed, so they are
        as valid a proposal as a block drafted now; otherwise it is dropped (the draft's next step keeps
        only what it shares with the sequence).
        """
        if (
            len(speculative.token_ids) < 2
            or not verdict.all_accepted
            or len(tokens) != len(verdict.output_token_ids)  # cut at EOS
            or speculative.token_ids[0] != tokens[-1]
        ):
            return None
        return speculative.rest()

    def _drafting_usable(self) -> bool:
        return self.draft is not None and not self.drafting_refused and self.availability.usable

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

    def _round_k(self, produced: int) -> int:
        """This round's K: the policy's choice, capped so no round overshoots a limit."""
        if not self._drafting_usable():
            return 0
        n = len(self.sequence)
        return max(
            0,
            min(
                self.policy.next_k(),
                self.limits.draft_max_speculative_tokens,
                self._room(produced),
                self.limits.draft_max_context - n,
            ),
        )

    def _draft_request(self, context: list[int], keep: int, k: int) -> draft_pb2.DraftRequest:
        n = len(context)
        return draft_pb2.DraftRequest(
            request_id=self.request.request_id,
            keep=keep,
            append_token_ids=context[keep:],
            num_speculative_tokens=k,
            sampling=self.sampling_proto,
            # Seeded by position, so a block drafted again after a lost session is the same block.
            seed=(self.request.seed * _SEED_MIX + n) & _U64,
            min_confidence=self.request.min_confidence,
            cache_salt=self.request.cache_salt if keep == 0 else b"",
            **(self.constraint_fields if keep == 0 and self.limits.draft_constrains else {}),
            **self._ban_fields(n, self.limits.draft_vocab_size or self.limits.vocab_size),
            # A draft wider than the target (a padded pair) proposes over the target's width alone.
            vocab_limit=self.limits.vocab_size if self.limits.draft_vocab_size > self.limits.vocab_size else 0,
        )

    def _ban_fields(self, first_position: int, width: int) -> dict[str, Any]:
        """min_tokens' ban for a step whose first row scores `first_position`, while it still applies
        (ids past a narrower draft's width are left out: it cannot propose them anyway)."""
        ban = self.request.ban
        if ban is None or first_position >= ban.until:
            return {}
        return {"ban": common_pb2.TokenBan(token_ids=[t for t in ban.token_ids if t < width], until=ban.until)}

    def _logprob_fields(self, keep: int) -> dict[str, Any]:
        """What a verify step asks for the request's logprobs: the committed tokens', and on the first
        step (until answered) the prompt's, with the larger count of alternatives."""
        request, fields = self.request, {}
        if request.logprobs:
            fields = {"logprobs": True, "top_logprobs": request.top_logprobs}
        if keep == 0 and request.prompt_logprobs is not None and self.prompt_logprobs is None:
            fields["prompt_logprobs"] = True
            fields["top_logprobs"] = max(request.top_logprobs if request.logprobs else 0, request.prompt_logprobs)
        return fields

    async def _propose(self, context: list[int], k: int) -> Draft:
        """The draft's block continuing `context` (the committed sequence, or it plus a block under
        verification), or NO_DRAFT (the target alone, still exact) when the draft fails."""
        assert self.draft is not None
        draft = self.draft
        k = min(k, self.limits.draft_max_context - len(context))
        if k < 1:
            return NO_DRAFT
        try:  # a step unanswered for --draft-timeout-s raises TimeoutError (its link's timer)
            stepped = await draft.step(
                context,
                lambda keep: self._draft_request(context, keep, k),
                fed_beyond=lambda response: response.draft_token_ids,  # all but the last are fed
            )
            response = stepped.response
            token_ids = list(response.draft_token_ids)
            probs = None if self.request.sampling.greedy else list(response.draft_token_probs)
            if not 1 <= len(token_ids) <= k:
                raise WireFormatError(f"draft returned {len(token_ids)} tokens for k = {k}")
            if max(token_ids) >= self.limits.vocab_size or min(token_ids) < 0:
                raise WireFormatError(f"draft returned a token outside the target's vocabulary: {token_ids}")
            if probs is not None and (len(probs) != len(token_ids) or not all(0.0 < q <= 1.0 for q in probs)):
                raise WireFormatError(
                    f"draft returned {len(probs)} probabilities for {len(token_ids)} tokens, or one outside (0, 1]"
                )
        except (ServiceError, TimeoutError, WireFormatError) as exc:
            fault = is_draft_fault(exc)
            log.warning("draft_step_failed", error=str(exc) or type(exc).__name__, draft_fault=fault)
            if fault:
                self.availability.failed()
            elif isinstance(exc, ServiceError) and exc.code != grpc.StatusCode.RESOURCE_EXHAUSTED:
                self.drafting_refused = True  # this request's own problem: it alone stops drafting
            self.stats.draft_fallback_rounds += 1
            draft.reset()
            return NO_DRAFT
        self.stats.draft_seconds += response.timing.forward_seconds
        if self.times is not None:
            self.times.draft.observe(response.timing, len(token_ids))
        return Draft(
            token_ids=token_ids,
            token_probs=probs,
            rows_at=RowsAt(draft.where, response.step_number) if probs is not None else None,
            forward_seconds=response.timing.forward_seconds,
            fed=stepped.fed,
            forward_seconds_per_token=response.timing.forward_seconds / len(token_ids),
        )

    async def _verify_beside(self, draft: Draft, side_k: int) -> tuple[Checked, asyncio.Task[Draft] | None]:
        """The target's check of `draft`, and the task drafting `side_k` tokens continuing the sequence
        plus `draft` meanwhile (None when side_k is 0), left running: the step's tokens go to the client
        before the next round awaits it."""
        if not side_k:
            return await self._verify(draft, None), None
        side = asyncio.create_task(self._propose(self.sequence + draft.token_ids, side_k))
        try:
            checked = await self._verify(draft, side)
        except BaseException:
            await _cancel(side)
            raise
        return checked, side

    async def _verify(self, draft: Draft, side: asyncio.Task[Draft] | None) -> Checked:
        """The target's verdict on a block, its forward seconds and, sampling, its row for the last
        token (`side`: the draft's step beside this one, on the same session as the block's rows)."""
        context = [*self.sequence, *draft.token_ids]
        k = len(draft.token_ids)
        rows = k + 1
        sampling = self.sampling_proto
        # Drawn before the step is sent: a resend after a cache miss or a failover decides with the same.
        uniforms = None if self.request.sampling.greedy else draw_uniforms(k, self.generator)
        sampled: dict[str, Any] = {}
        if uniforms is not None:
            sampled = {"draft_token_probs": draft.token_probs or [], "uniforms": uniforms[:k].tolist()}
        try:  # a step unanswered for --target-timeout-s raises TimeoutError (its link's timer)
            stepped = await self.target.step(
                context,
                lambda keep: target_pb2.VerifyRequest(
                    request_id=self.request.request_id,
                    keep=keep,
                    append_token_ids=context[keep:],
                    num_rows=rows,
                    sampling=sampling,
                    cache_salt=self.request.cache_salt if keep == 0 else b"",
                    **(self.constraint_fields if keep == 0 else {}),
                    **self._ban_fields(len(self.sequence), self.limits.vocab_size),
                    **self._logprob_fields(keep),
                    **sampled,
                ),
                min_append=rows,  # the rows start at the last committed token
            )
        except TimeoutError as exc:
            self.target.reset()  # the replica is avoided for a while
            raise ServiceError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"the target did not answer a step: {exc} (--target-timeout-s)",
            ) from exc
        response = stepped.response
        target_seconds = response.timing.forward_seconds
        self.stats.target_seconds += target_seconds
        if self.times is not None:
            self.times.target.observe(response.timing)
        self._take_prompt_logprobs(response, len(context) - rows)
        if self.request.sampling.greedy:
            verdict = verify_greedy(draft.token_ids, response.argmax_token_ids)
            return Checked(verdict, target_seconds, logprobs=self._wire_logprobs(response, verdict.output_token_ids))
        assert uniforms is not None
        if draft.rows_at is not None and self.draft is not None and not self.draft.reachable(draft.rows_at.session):
            # The draft replica holding the block's rows is gone. Decided before the verdict is read, so
            # that dropping the round cannot favour any outcome: the target decides the round alone.
            log.info("round_redone_without_draft", request_id=self.request.request_id)
            DRAFT_ROWS.labels("redone").inc()
            return await self._verify(NO_DRAFT, None)
        try:
            num_accepted, target_row = self._check_sampled(draft, response, uniforms)
        except (WireFormatError, ValueError) as exc:
            self.target.reset()  # the replica is avoided for a while
            log.error("target_rows_refused", request_id=self.request.request_id, error=str(exc))
            if isinstance(exc, TargetDisagreement):
                TARGET_DISAGREEMENTS.inc()
            raise ServiceError(grpc.StatusCode.INTERNAL, f"the target replica sent unusable rows: {exc}") from exc
        draft_row = None
        if num_accepted < k:
            draft_row = await self._draft_row(draft, num_accepted, side)
        uniform = float(uniforms[k])
        verdict = await self.sampler.verdict(
            CompactRound(draft.token_ids, num_accepted, target_row, draft_row, uniform)
        )
        logprobs = []
        if self.request.logprobs:
            logprobs = self._wire_logprobs(response, draft.token_ids[:num_accepted])
            logprobs.append(entry_from_row(target_row, verdict.output_token_ids[-1], self.request.top_logprobs))
        return Checked(verdict, target_seconds, target_row, logprobs)

    def _wire_logprobs(
        self, response: target_pb2.VerifyResponse, token_ids: list[int]
    ) -> list[orchestrator_pb2.TokenLogprob]:
        """The target's logprob entries for `token_ids` (none unless asked); a malformed answer is the
        replica's fault: INTERNAL, and the replica avoided."""
        if not self.request.logprobs:
            return []
        top = self.request.top_logprobs
        return self._target_entries(response.logprobs, token_ids, top, top)

    def _target_entries(
        self, message: common_pb2.TokenLogprobs, token_ids: list[int], top: int, sent_top: int
    ) -> list[orchestrator_pb2.TokenLogprob]:
        """`entries_from_wire`, a malformed answer being the target replica's fault."""
        try:
            return entries_from_wire(message, token_ids, top, sent_top)
        except WireFormatError as exc:
            self.target.reset()
            raise ServiceError(grpc.StatusCode.INTERNAL, f"the target replica sent unusable logprobs: {exc}") from exc

    def _take_prompt_logprobs(self, response: target_pb2.VerifyResponse, prompt_rows: int) -> None:
        """Keep the prompt's logprobs from the step that asked for them (the first, keep = 0)."""
        request = self.request
        if request.prompt_logprobs is None or self.prompt_logprobs is not None or not response.prompt_logprobs.logprobs:
            return
        sent_top = max(request.top_logprobs if request.logprobs else 0, request.prompt_logprobs)
        scored = request.prompt_token_ids[1 : prompt_rows + 1]
        self.prompt_logprobs = self._target_entries(response.prompt_logprobs, scored, request.prompt_logprobs, sent_top)

    def _check_sampled(
        self, draft: Draft, response: target_pb2.VerifyResponse, uniforms: torch.Tensor
    ) -> tuple[int, torch.Tensor]:
        """The round's first rejection, decided here from the target's p(x) and the draft's q(x) with the
        round's own uniforms, and the target's row for it; raises ValueError when the target's own
        decision differs (a bug, or a faulty replica) or its material is malformed."""
        k = len(draft.token_ids)
        target_token_probs = list(response.draft_token_target_probs)
        if len(target_token_probs) != k:
            raise ValueError(f"{len(target_token_probs)} target probabilities for {k} draft tokens")
        assert draft.token_probs is not None or k == 0
        num_accepted = first_rejection(
            torch.tensor(target_token_probs, dtype=torch.float32),
            torch.tensor(draft.token_probs or [], dtype=torch.float32),
            uniforms,
        )
        if num_accepted != response.num_accepted:
            raise TargetDisagreement(
                f"the target found the first rejection at {response.num_accepted}, the orchestrator at {num_accepted}"
            )
        row = rows_from_wire(response.row, self.request.sampling, self.limits.vocab_size)  # [1, vocab]
        if row.shape[0] != 1:
            raise ValueError(f"the target sent {row.shape[0]} rows for the last token, not 1")
        return num_accepted, row[0]

    async def _draft_row(self, draft: Draft, index: int, side: asyncio.Task[Draft] | None) -> torch.Tensor:
        """q at a block's first rejection, [vocab]: a point mass for a lookup's token; the draft's row,
        fetched from the session that drafted it, or recomputed by the draft when that session no longer
        holds it (a reopen, a lost replica). Recomputing gives the same row (up to float rounding
        between devices), so the round's outcome never depends on which way the row came; a round whose
        row can be had neither way fails the request, since no exact verdict is left."""
        vocab = self.limits.vocab_size
        if draft.proposer in POINT_MASS_PROPOSERS:
            return point_masses([draft.token_ids[index]], vocab)[0]
        assert self.draft is not None and draft.rows_at is not None
        rows_at = draft.rows_at
        fetch = draft_pb2.RowFetch(step_number=rows_at.step_number, index=rows_at.offset + index)
        fetched = await self.draft.fetch(rows_at.session, fetch)
        try:
            if fetched is not None and fetched.held:
                DRAFT_ROWS.labels("fetched").inc()
                return self._draft_row_from(fetched.row)
            log.info("draft_row_recomputed", request_id=self.request.request_id)
            DRAFT_ROWS.labels("recomputed").inc()
            if side is not None:  # the session's step beside this one ends first (a rejection made it moot)
                await asyncio.wait([side])
            context = [*self.sequence, *draft.token_ids[:index]]
            stepped = await self.draft.step(context, lambda keep: self._draft_request(context, keep, 0))
            return self._draft_row_from(stepped.response.row)
        except (ServiceError, TimeoutError, WireFormatError) as exc:
            DRAFT_ROWS.labels("missing").inc()
            if is_draft_fault(exc):
                self.availability.failed()
            raise unavailable(
                f"the draft's row for this round's rejected token could be neither fetched nor recomputed ({exc}); "
                "the round has no exact outcome without it: retry the request"
            ) from exc

    def _draft_row_from(self, message: common_pb2.LogitRows) -> torch.Tensor:
        """q at the target's width: a narrower draft's row padded with zeros (it cannot propose those ids),
        a wider draft's cut (it masked the ids past the target's width: `vocab_limit`)."""
        vocab, width = self.limits.vocab_size, self.limits.draft_vocab_size or self.limits.vocab_size
        row = rows_from_wire(message, self.request.sampling, width)
        if row.shape[0] != 1:
            raise WireFormatError(f"the draft sent {row.shape[0]} rows for one")
        if width < vocab:
            return torch.nn.functional.pad(row[0], (0, vocab - width))
        if width > vocab and bool(row[0, vocab:].any()):
            raise WireFormatError("the draft's row gives probability to ids past the target's vocabulary")
        return row[0, :vocab]

    def _commit(self, checked: Checked) -> list[int]:
        """Append the round's tokens (cut after an EOS, unless ignore_eos, or a stop token); each service's
        next step keeps what it shares."""
        tokens = checked.verdict.output_token_ids
        for index, token in enumerate(tokens):
            if self.constraint is not None:
                self._check_allowed(token)
            if token in self.limits.eos_token_ids and not self.request.ignore_eos:
                self.finish_reason = orchestrator_pb2.FINISH_REASON_EOS
            elif token in self.request.stop_token_ids:
                self.finish_reason = orchestrator_pb2.FINISH_REASON_STOP
            else:
                continue
            tokens = tokens[: index + 1]
            break
        self.token_logprobs.extend(checked.logprobs[: len(tokens)])
        self._check_draftable(tokens)
        self.sequence.extend(tokens)
        if self.lookup is not None:
            self.lookup.extend(tokens)
        return tokens

    def _check_draftable(self, token_ids: list[int]) -> None:
        """A narrower draft (a padded pair) has no embedding for the target's padding ids: once the
        sequence holds one, this request drafts no more (K = 0, the target alone, still exact)."""
        width = self.limits.draft_vocab_size
        if width and not self.drafting_refused and any(t >= width for t in token_ids):
            log.info("drafting_stopped", request_id=self.request.request_id, reason="a token past the draft's width")
            self.drafting_refused = True

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

    def _check_finished(self, tokens: list[int], produced: int) -> None:
        if self.finish_reason != orchestrator_pb2.FINISH_REASON_UNSPECIFIED:
            return
        if produced >= self.request.max_new_tokens or len(self.sequence) >= self.limits.target_max_context:
            self.finish_reason = orchestrator_pb2.FINISH_REASON_LENGTH

    def close(self) -> None:
        """End both sessions; the services free their caches at once."""
        self.target.close()
        if self.draft is not None:
            self.draft.close()

    @property
    def reopens(self) -> int:
        return self.target.reopens + (self.draft.reopens if self.draft else 0)

    @property
    def wire_bytes(self) -> int:
        return self.target.wire_bytes + (self.draft.wire_bytes if self.draft else 0)

    @property
    def reused(self) -> tuple[int, int]:
        """Tokens the target's and the draft's prefix caches saved this request."""
        return self.target.reused_tokens, self.draft.reused_tokens if self.draft else 0


@dataclass(frozen=True)
class Beside:
    """The draft's work beside a target step (`Generation._verify_beside`), with what judging it needs."""

    task: asyncio.Task[Draft]
    checked: Checked  # the step's answer
    tokens: list[int]  # what the step committed
    scored: bool  # a probe's token, or a block drafted beside the prefill: its first token is scored


async def _cancel(task: asyncio.Task[Draft]) -> None:
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
