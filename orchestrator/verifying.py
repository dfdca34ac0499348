"""One request's side of the target service: a block's verify step and its verdict, by the pure
accept/reject step (greedy: the target's argmax; sampling: the round's uniforms, checked against the
target's own decision), and the target's logprobs when asked."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import grpc
import structlog
import torch

from orchestrator.context import Context
from orchestrator.drafting import Drafter
from orchestrator.goodput import StepTimes
from orchestrator.logprobs import entries_from_wire, entry_from_row
from orchestrator.metrics import DRAFT_ROWS, TARGET_DISAGREEMENTS
from orchestrator.proposals import NO_DRAFT, Draft, Stats
from orchestrator.rejection import CompactRound, Verdict, draw_uniforms, verify_greedy
from orchestrator.requests import StepFields
from orchestrator.sampler import BatchSampler
from orchestrator.tree import verify_tree_greedy
from orchestrator.upstream import SessionStream
from orchestrator.verdicts import TargetDisagreement, check_sampled
from serving.errors import ServiceError
from serving.sampling import seeded_generator
from serving.tensors import WireFormatError
from serving.trees import DraftTree
from specdec.v1 import common_pb2, orchestrator_pb2, target_pb2

log = structlog.get_logger(__name__)

TargetStream = SessionStream[target_pb2.VerifyRequest, target_pb2.VerifyResponse]


@dataclass(frozen=True)
class Checked:
    """The target's answer to one step: the round's verdict, the target's forward seconds, (when
    sampling) its row at the first rejection, or the bonus row, [vocab], and (when asked) the logprob
    entry of each output token."""

    verdict: Verdict
    target_seconds: float
    target_row: torch.Tensor | None = None
    logprobs: list[orchestrator_pb2.TokenLogprob] = field(default_factory=list)
    fetch_seconds: float = 0.0  # the wait for the draft's row at a sampled rejection (fetched or recomputed)


class Verifier:
    """The target's session for one request, and the round's verdict from its answer."""

    def __init__(
        self,
        target: TargetStream,
        fields: StepFields,
        stats: Stats,
        times: StepTimes | None,
        sampler: BatchSampler,
        drafter: Drafter,
    ) -> None:
        self.target = target
        self.fields = fields
        self.request, self.limits = fields.request, fields.limits
        self.stats = stats
        self.times = times
        self.sampler = sampler
        self.drafter = drafter
        self.generator = seeded_generator(self.request.seed)
        # The prompt's (None until the target's first step answers them; a one-token prompt has none).
        self.prompt_logprobs: list[orchestrator_pb2.TokenLogprob] | None = None
        if self.request.prompt_logprobs is not None and len(self.request.prompt_token_ids) == 1:
            self.prompt_logprobs = []

    async def verify(self, sequence: list[int], block: Draft, side: asyncio.Task[Draft] | None) -> Checked:
        """The target's verdict on a block, its forward seconds and, sampling, its row for the last
        token (`side`: the draft's step beside this one, on the same session as the block's rows)."""
        context = Context(sequence, block.token_ids)
        k = len(block.token_ids)
        rows = k + 1
        fields = self.fields
        # Drawn before the step is sent: a resend after a cache miss or a failover decides with the same.
        uniforms = None if self.request.sampling.greedy else draw_uniforms(k, self.generator)
        sampled: dict[str, Any] = {}
        if uniforms is not None:
            sampled = {"draft_token_probs": block.token_probs or [], "uniforms": uniforms[:k].tolist()}
        ban = fields.ban(len(sequence), self.limits.vocab_size)
        try:  # a step unanswered for --target-timeout-s raises TimeoutError (its link's timer)
            stepped = await self.target.step(
                context,
                lambda keep: target_pb2.VerifyRequest(
                    request_id=self.request.request_id,
                    keep=keep,
                    append_token_ids=context[keep:],
                    num_rows=rows,
                    sampling=fields.sampling,
                    cache_salt=self.request.cache_salt if keep == 0 else b"",
                    **(fields.constraint if keep == 0 else {}),
                    **ban,
                    **fields.logprobs(keep, self.prompt_logprobs is None),
                    **sampled,
                    tree_parents=block.parents,
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
        if self.request.sampling.greedy and block.parents:
            return Checked(self._tree_verdict(block, list(response.argmax_token_ids)), target_seconds)
        if self.request.sampling.greedy:
            verdict = verify_greedy(block.token_ids, response.argmax_token_ids)
            return Checked(verdict, target_seconds, logprobs=self._wire_logprobs(response, verdict.output_token_ids))
        assert uniforms is not None
        if not self.drafter.reachable(block):
            # The draft replica holding the block's rows is gone. Decided before the verdict is read, so
            # that dropping the round cannot favour any outcome: the target decides the round alone.
            log.info("round_redone_without_draft", request_id=self.request.request_id)
            DRAFT_ROWS.labels("redone").inc()
            return await self.verify(sequence, NO_DRAFT, None)
        try:
            num_accepted, target_row = check_sampled(
                block, response, uniforms, self.request.sampling, self.limits.vocab_size
            )
        except (WireFormatError, ValueError) as exc:
            self.target.reset()  # the replica is avoided for a while
            log.error("target_rows_refused", request_id=self.request.request_id, error=str(exc))
            if isinstance(exc, TargetDisagreement):
                TARGET_DISAGREEMENTS.inc()
            raise ServiceError(grpc.StatusCode.INTERNAL, f"the target replica sent unusable rows: {exc}") from exc
        draft_row, fetch_seconds = None, 0.0
        if num_accepted < k:
            fetch_started = time.perf_counter()
            draft_row = await self.drafter.row(block, num_accepted, side, sequence)
            fetch_seconds = time.perf_counter() - fetch_started
        uniform = float(uniforms[k])
        verdict = await self.sampler.verdict(
            CompactRound(block.token_ids, num_accepted, target_row, draft_row, uniform)
        )
        logprobs = []
        if self.request.logprobs:
            logprobs = self._wire_logprobs(response, block.token_ids[:num_accepted])
            logprobs.append(entry_from_row(target_row, verdict.output_token_ids[-1], self.request.top_logprobs))
        return Checked(verdict, target_seconds, target_row, logprobs, fetch_seconds)

    def _tree_verdict(self, block: Draft, argmax: list[int]) -> Verdict:
        """Greedy down a token tree: the path of the target's own tokens, and its token after it."""
        if len(argmax) != len(block.token_ids) + 1:
            self.target.reset()  # the replica is avoided for a while
            raise ServiceError(
                grpc.StatusCode.INTERNAL,
                f"the target replica answered {len(argmax)} rows for a tree of {len(block.token_ids)} nodes",
            )
        walked = verify_tree_greedy(DraftTree(block.token_ids, block.parents), argmax)
        return Verdict(walked.output_token_ids, walked.num_accepted, len(block.token_ids))

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
