"""One request's side of the draft service: whether it may draft, its blocks, and the draft's row at
a rejected token (fetched from the session that drafted it, or recomputed)."""

from __future__ import annotations

import asyncio

import grpc
import structlog
import torch

from orchestrator.context import Context
from orchestrator.goodput import StepTimes
from orchestrator.metrics import DRAFT_ROWS
from orchestrator.proposals import NO_DRAFT, POINT_MASS_PROPOSERS, Draft, RowsAt, Stats, point_masses
from orchestrator.requests import StepFields
from orchestrator.translation import DraftContext
from orchestrator.upstream import DraftAvailability, SessionStream, is_draft_fault
from orchestrator.verdicts import draft_row_from
from serving.errors import ServiceError, unavailable
from serving.tensors import WireFormatError
from specdec.v1 import common_pb2, draft_pb2

log = structlog.get_logger(__name__)

DraftStream = SessionStream[draft_pb2.DraftRequest, draft_pb2.DraftResponse]


class Drafter:
    """The draft's session for one request (None: the request does not draft), and what its failures
    decide: a fault of the draft service marks it unavailable for every request (`availability`); the
    request's own error stops this request drafting (`refused`), and it goes on with the target alone."""

    def __init__(
        self,
        stream: DraftStream | None,
        availability: DraftAvailability,
        fields: StepFields,
        stats: Stats,
        times: StepTimes | None,
    ) -> None:
        self.stream = stream
        self.availability = availability
        self.fields = fields
        self.request, self.limits = fields.request, fields.limits
        self.stats = stats
        self.times = times
        self.refused = False
        # A draft with another tokenizer: the request's sequence in its ids (orchestrator/translation.py).
        translation = self.limits.translation
        self.spelled = DraftContext(translation) if translation is not None else None

    def in_draft_ids(self, context: Context) -> Context:
        """`context` as the draft's session holds it: itself, or spelled in the draft's tokens."""
        return context if self.spelled is None else self.spelled.of(context)

    def extra_tokens(self, sequence: list[int]) -> int:
        """How many more tokens the draft's context holds than `sequence` (a target token the draft
        does not share may take several of its tokens)."""
        return 0 if self.spelled is None else len(self.spelled.of(Context(sequence))) - len(sequence)

    @property
    def usable(self) -> bool:
        return self.stream is not None and not self.refused and self.availability.usable

    def reachable(self, block: Draft) -> bool:
        """Whether the draft replica that drafted a sampled block still stands (its rows with it)."""
        return block.rows_at is None or self.stream is None or self.stream.reachable(block.rows_at.session)

    def check_width(self, token_ids: list[int]) -> None:
        """A narrower draft (a padded pair) has no embedding for the target's padding ids: once the
        sequence holds one, this request drafts no more (K = 0, the target alone, still exact)."""
        width = self.limits.draft_vocab_size
        if width and self.spelled is None and not self.refused and any(t >= width for t in token_ids):
            log.info("drafting_stopped", request_id=self.request.request_id, reason="a token past the draft's width")
            self.refused = True

    async def propose(self, context: Context, k: int, ahead_k: tuple[int, int] = (0, 0), tree: bool = False) -> Draft:
        """The draft's block of k tokens (capped by `round_plan.cap`) continuing `context` (the committed
        sequence, or it plus a block under verification), or NO_DRAFT (the target alone, still exact)
        when the draft fails. `ahead_k`: the K of the blocks the draft drafts ahead for the verdicts;
        `tree`: a token tree of at most k nodes instead of a chain."""
        assert self.stream is not None and k >= 1
        draft = self.stream
        fed = self.in_draft_ids(context)
        try:  # a step unanswered for --draft-timeout-s raises TimeoutError (its link's timer)
            stepped = await draft.step(
                fed,
                lambda keep: self.fields.draft(fed, keep, k, ahead_k, tree),
                fed_beyond=lambda response: response.draft_token_ids,  # all but the last are fed
            )
            response = stepped.response
            token_ids = list(response.draft_token_ids)
            drafted = len(token_ids)  # the draft's forwards, one a token in its own ids
            translation = self.limits.translation
            if translation is not None and token_ids:
                if self.fields.string_match:  # SLEM: the text re-tokenized, as many tokens as K allows
                    token_ids = translation.retokenized(token_ids)[:k]
                    if not token_ids:  # no whole character drafted: this round verifies nothing drafted
                        self._account(response.timing, drafted)
                        return NO_DRAFT
                else:
                    token_ids = translation.target_ids(token_ids)
            probs = None if self.request.sampling.greedy else list(response.draft_token_probs)
            if not 1 <= len(token_ids) <= k:
                raise WireFormatError(f"draft returned {len(token_ids)} tokens for k = {k}")
            if max(token_ids) >= self.limits.vocab_size or min(token_ids) < 0:
                raise WireFormatError(f"draft returned a token outside the target's vocabulary: {token_ids}")
            parents = tuple(response.tree_parents)
            if tree and (len(parents) != len(token_ids) or any(not -1 <= p < i for i, p in enumerate(parents))):
                raise WireFormatError(f"draft returned a tree of {len(token_ids)} tokens with parents {list(parents)}")
            if parents and not tree:
                raise WireFormatError("draft returned a tree for a chain's step")
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
                self.refused = True  # this request's own problem: it alone stops drafting
            self.stats.draft_fallback_rounds += 1
            draft.reset()
            return NO_DRAFT
        self._account(response.timing, drafted)
        return Draft(
            token_ids=token_ids,
            token_probs=probs,
            rows_at=RowsAt(draft.where, response.step_number) if probs is not None else None,
            forward_seconds=response.timing.forward_seconds,
            fed=stepped.fed,
            forward_seconds_per_token=response.timing.forward_seconds / drafted,
            speculated=response.speculated,
            parents=parents,
        )

    def _account(self, timing: common_pb2.Timing, drafted: int) -> None:
        """A draft step that answered: its forwards' time in the request's stats, and in the step times
        every request prices drafting by, per forward (`drafted`, the draft's own tokens: a block
        re-tokenized for SLEM may hold more or fewer of the target's)."""
        self.stats.draft_seconds += timing.forward_seconds
        if self.times is not None:
            self.times.draft.observe(timing, drafted)

    async def row(
        self, block: Draft, index: int, side: asyncio.Task[Draft] | None, sequence: list[int]
    ) -> torch.Tensor:
        """q at a block's first rejection, [vocab]: a point mass for a lookup's token; the draft's row,
        fetched from the session that drafted it, or recomputed by the draft when that session no longer
        holds it (a reopen, a lost replica). Recomputing gives the same row (up to float rounding
        between devices), so the round's outcome never depends on which way the row came; a round whose
        row can be had neither way fails the request, since no exact verdict is left."""
        if block.proposer in POINT_MASS_PROPOSERS:
            return point_masses([block.token_ids[index]], self.limits.vocab_size)[0]
        assert self.stream is not None and block.rows_at is not None
        rows_at = block.rows_at
        fetch = draft_pb2.RowFetch(step_number=rows_at.step_number, index=rows_at.offset + index)
        fetched = await self.stream.fetch(rows_at.session, fetch)
        try:
            if fetched is not None and fetched.held:
                DRAFT_ROWS.labels("fetched").inc()
                return draft_row_from(fetched.row, self.request.sampling, self.limits)
            log.info("draft_row_recomputed", request_id=self.request.request_id)
            DRAFT_ROWS.labels("recomputed").inc()
            if side is not None:  # the session's step beside this one ends first (a rejection made it moot)
                await asyncio.wait([side])
            context = self.in_draft_ids(Context(sequence, block.token_ids[:index]))
            stepped = await self.stream.step(context, lambda keep: self.fields.draft(context, keep, 0))
            return draft_row_from(stepped.response.row, self.request.sampling, self.limits)
        except (ServiceError, TimeoutError, WireFormatError) as exc:
            DRAFT_ROWS.labels("missing").inc()
            if is_draft_fault(exc):
                self.availability.failed()
            raise unavailable(
                f"the draft's row for this round's rejected token could be neither fetched nor recomputed ({exc}); "
                "the round has no exact outcome without it: retry the request"
            ) from exc
