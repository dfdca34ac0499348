"""DraftService: crop to `keep`, feed the new tokens, draft up to K tokens autoregressively (one per
engine iteration, batched with every other drafting session).

A sampling step answers each draft token's q(x) only; the rows the tokens were sampled from stay here,
the last two steps' of each session (the step verified and the one drafted beside it), until the
orchestrator fetches the one a rejection needs (`RowFetch`, answered at once on the event loop)."""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import structlog
import torch

from draft_service.lean import LeanDraft
from model_host.config import ModelServiceConfig
from model_host.engine import Job
from model_host.forward import Forward
from model_host.loading import LoadedModel
from model_host.session_servicer import SessionServicer
from model_host.sessions import Session
from serving.constraints import SessionConstraint, TokenBan, mask_logits
from serving.errors import invalid_argument
from serving.logits import logits_to_probs, rows_to_wire, sample_index
from serving.sampling import SamplingParams, seeded_generator
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc

SERVICE_NAME = "specdec.v1.DraftService"
log = structlog.get_logger(__name__)
# A fetch asks for a row of the step just verified, while the step drafted beside it may have ended.
_STEPS_HELD = 2


def choose_token(
    logits: torch.Tensor,  # [vocab]
    params: SamplingParams,
    generator: torch.Generator,
    need_confidence: bool,
) -> tuple[int, torch.Tensor | None, float]:
    """The draft's next token, the exact row it was sampled from ([vocab]; None for greedy), and the
    draft's probability of it (1.0 for greedy unless `need_confidence`)."""
    if params.greedy:
        token = int(logits.argmax())
        confidence = float(logits.float().softmax(-1)[token]) if need_confidence else 1.0
        return token, None, confidence
    probs = logits_to_probs(logits[None], params)[0]  # [vocab]
    # Inverse CDF: torch.multinomial costs 4.8 ms a token over 128k tokens on one core (this, 0.7 ms with
    # the softmax), which was most of a sampled draft's time per token at Llama 3's vocabulary.
    uniform = torch.rand(1, generator=generator, dtype=torch.float64, device=generator.device)
    token = int(sample_index(probs, uniform))
    return token, probs, float(probs[token])


@dataclass(eq=False)
class DraftJob(Job):
    """Feed the new tokens, then draft: each engine iteration samples one token and feeds it back,
    until K tokens (the last is never fed), an EOS, or the draft's confidence falls below
    min_confidence. K = 0 keeps the next token's logits and drafts nothing. Under a structured output
    each row is masked by the session's constraint, advanced by each token drafted."""

    params: SamplingParams = field(default_factory=SamplingParams)
    num_speculative_tokens: int = 1
    min_confidence: float = 0.0
    generator: torch.Generator | None = None
    constraint: SessionConstraint | None = None
    ban: TokenBan | None = None  # min_tokens' masks, as the target applies them
    position: int = 0  # the sequence position the next row scores
    vocab_limit: int = 0  # propose only ids below this (a draft wider than its target); 0: all
    token_ids: list[int] = field(default_factory=list)  # [k] drafted so far
    token_probs: list[float] = field(default_factory=list)  # [k] q(x); sampling only
    rows: list[torch.Tensor] = field(default_factory=list)  # k logit rows of [vocab]; sampling only

    def advance(self, logits: torch.Tensor) -> list[int] | None:
        assert self.generator is not None
        row = logits[-1]  # [vocab]
        constraint = self.constraint
        allowed = constraint.allowed()[None] if constraint is not None else None  # [1, vocab]
        if self.ban is not None:
            allowed = self.ban.restrict(allowed, [self.position], row.shape[-1])
        if 0 < self.vocab_limit < row.shape[-1]:
            if allowed is None:
                allowed = torch.ones((1, row.shape[-1]), dtype=torch.bool)
            allowed[:, self.vocab_limit :] = False
        self.position += 1
        if allowed is not None:
            row = mask_logits(row[None], allowed)[0]  # a new tensor: no clone needed
        elif not self.params.greedy:
            row = row.clone()  # a view would keep the whole batch's logits alive
        if not self.params.greedy:
            self.rows.append(row)
        if self.num_speculative_tokens == 0:
            return None
        token, probs, confidence = choose_token(row, self.params, self.generator, self.min_confidence > 0)
        self.token_ids.append(token)
        if probs is not None:
            self.token_probs.append(float(probs[token]))
        if len(self.token_ids) == self.num_speculative_tokens or confidence < self.min_confidence:
            return None
        if constraint is not None:
            if constraint.is_eos(token):
                return None  # the generation would end here: nothing to draft past it
            constraint.consume(token)
        return [token]


class DraftServicer(
    SessionServicer[draft_pb2.DraftRequest, draft_pb2.DraftResponse], draft_pb2_grpc.DraftServiceServicer
):
    role = "draft"
    response_type = draft_pb2.DraftResponse
    result_type = draft_pb2.DraftResult
    results_type = draft_pb2.DraftResults

    def __init__(self, loaded: LoadedModel, config: ModelServiceConfig) -> None:
        self.lean: LeanDraft | None = None
        # session id -> (its steps so far, its last steps' (step number, params, [k, vocab] logit rows))
        self._rows: dict[str, tuple[int, deque[tuple[int, SamplingParams, torch.Tensor]]]] = {}
        super().__init__(loaded, config)

    def make_forward(self) -> Forward:
        if self.config.lean_draft:
            self.lean = LeanDraft.attach(self.loaded.model, self.block_store, self.config.prefill_chunk_tokens)
        log.info("draft_forward", lean=self.lean is not None)
        return self.lean or super().make_forward()

    def Draft(
        self, request_iterator: AsyncIterator[draft_pb2.DraftBatch], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[draft_pb2.DraftResults]:
        return self.serve_link(request_iterator, context)

    def tokens_fed_by(self, request: draft_pb2.DraftRequest) -> int:
        # Every draft token but the last is fed back through the model.
        return request.keep + len(request.append_token_ids) + max(0, request.num_speculative_tokens - 1)

    def check_step(self, request: draft_pb2.DraftRequest) -> None:
        if not request.append_token_ids:
            raise invalid_argument("append_token_ids must hold at least one token (drafting continues from the last)")
        cap = self.config.max_speculative_tokens
        if not 0 <= request.num_speculative_tokens <= cap:
            raise invalid_argument(
                f"num_speculative_tokens must be in [0, {cap}]; got {request.num_speculative_tokens}"
            )
        if request.num_speculative_tokens == 0 and SamplingParams.from_proto(request.sampling).greedy:
            raise invalid_argument("num_speculative_tokens = 0 returns a row, which greedy steps have none of")
        if not 0.0 <= request.min_confidence <= 1.0:
            raise invalid_argument(f"min_confidence must be in [0, 1]; got {request.min_confidence}")
        SamplingParams.from_proto(request.sampling)
        TokenBan.from_proto(request.ban, self.loaded.vocab_size)

    def make_job(self, slot: int, request: draft_pb2.DraftRequest, constraint: SessionConstraint | None) -> Job:
        if constraint is not None:
            constraint.feed(request.append_token_ids, request.keep)  # committed tokens: allowed
        return DraftJob(
            slot,
            request.keep,
            list(request.append_token_ids),
            num_logits=1,
            params=SamplingParams.from_proto(request.sampling),
            num_speculative_tokens=request.num_speculative_tokens,
            min_confidence=request.min_confidence,
            generator=seeded_generator(request.seed, self.loaded.input_device),
            constraint=constraint,
            ban=TokenBan.from_proto(request.ban, self.loaded.vocab_size),
            position=request.keep + len(request.append_token_ids),
            vocab_limit=request.vocab_limit,
        )

    def respond(self, job: Job, request: draft_pb2.DraftRequest, session: Session) -> draft_pb2.DraftResponse:
        assert isinstance(job, DraftJob)
        response = draft_pb2.DraftResponse(
            result=common_pb2.SESSION_RESULT_OK,
            draft_token_ids=job.token_ids,
            draft_token_probs=job.token_probs,
            cached_tokens=job.start,
        )
        if not job.rows:
            return response
        rows = torch.stack(job.rows)  # [k, vocab]
        if job.num_speculative_tokens == 0:
            response.row.CopyFrom(rows_to_wire(rows, job.params))
            return response
        steps, held = self._rows.get(session.session_id) or (0, deque(maxlen=_STEPS_HELD))
        held.append((steps + 1, job.params, rows))
        self._rows[session.session_id] = (steps + 1, held)
        response.step_number = steps + 1
        return response

    def answer_at_once(self, session: Session | None, entry: Any) -> Any | None:
        if not entry.HasField("fetch"):
            return None
        result = draft_pb2.DraftResult(session=entry.session)
        result.fetched.held = False
        _, held = self._rows.get(session.session_id, (0, ())) if session is not None else (0, ())
        for step_number, params, rows in held:
            if step_number == entry.fetch.step_number and entry.fetch.index < rows.shape[0]:
                index = entry.fetch.index
                try:
                    result.fetched.row.CopyFrom(rows_to_wire(rows[index : index + 1], params))
                    result.fetched.held = True
                except Exception:
                    log.exception("row_fetch_failed", request_id=session.request_id if session else "")
        return result

    def forget(self, session: Session) -> None:
        self._rows.pop(session.session_id, None)


def register(servicer: DraftServicer, server: grpc.aio.Server) -> None:
    draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, server)
