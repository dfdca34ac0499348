"""DraftService: crop to `keep`, feed the new tokens, draft up to K tokens autoregressively (one per
engine iteration, batched with every other drafting session)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import structlog
import torch

from draft_service.lean import LeanDraft
from model_host.config import ModelServiceConfig
from model_host.engine import Job
from model_host.forward import Forward
from model_host.loading import LoadedModel
from model_host.logits import logits_to_probs
from model_host.session_servicer import SessionServicer
from serving.errors import invalid_argument
from serving.sampling import SamplingParams, seeded_generator
from serving.tensors import encode_prob_rows
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc

SERVICE_NAME = "specdec.v1.DraftService"
log = structlog.get_logger(__name__)


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
    token = int(torch.multinomial(probs, 1, generator=generator))
    return token, probs, float(probs[token])


@dataclass(eq=False)
class DraftJob(Job):
    """Feed the new tokens, then draft: each engine iteration samples one token and feeds it back,
    until K tokens (the last is never fed) or the draft's confidence falls below min_confidence."""

    params: SamplingParams = field(default_factory=SamplingParams)
    num_speculative_tokens: int = 1
    min_confidence: float = 0.0
    generator: torch.Generator | None = None
    token_ids: list[int] = field(default_factory=list)  # [k] drafted so far
    rows: list[torch.Tensor] = field(default_factory=list)  # k rows of [vocab]; sampling only

    def advance(self, logits: torch.Tensor) -> list[int] | None:
        assert self.generator is not None
        token, probs, confidence = choose_token(logits[-1], self.params, self.generator, self.min_confidence > 0)
        self.token_ids.append(token)
        if probs is not None:
            self.rows.append(probs)
        if len(self.token_ids) == self.num_speculative_tokens or confidence < self.min_confidence:
            return None
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
        super().__init__(loaded, config)

    def make_forward(self) -> Forward:
        if self.config.lean_draft:
            self.lean = LeanDraft.attach(self.loaded.model, self.slot_store, self.config.prefill_chunk_tokens)
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
        if not 1 <= request.num_speculative_tokens <= cap:
            raise invalid_argument(
                f"num_speculative_tokens must be in [1, {cap}]; got {request.num_speculative_tokens}"
            )
        if not 0.0 <= request.min_confidence <= 1.0:
            raise invalid_argument(f"min_confidence must be in [0, 1]; got {request.min_confidence}")
        SamplingParams.from_proto(request.sampling)

    def make_job(self, slot: int, request: draft_pb2.DraftRequest) -> Job:
        return DraftJob(
            slot,
            request.keep,
            list(request.append_token_ids),
            num_logits=1,
            params=SamplingParams.from_proto(request.sampling),
            num_speculative_tokens=request.num_speculative_tokens,
            min_confidence=request.min_confidence,
            generator=seeded_generator(request.seed, self.loaded.input_device),
        )

    def respond(self, job: Job, request: draft_pb2.DraftRequest) -> draft_pb2.DraftResponse:
        assert isinstance(job, DraftJob)
        response = draft_pb2.DraftResponse(
            result=common_pb2.SESSION_RESULT_OK, draft_token_ids=job.token_ids, cached_tokens=job.start
        )
        if job.rows:
            response.draft_probs.CopyFrom(encode_prob_rows(torch.stack(job.rows)))
        return response


def register(servicer: DraftServicer, server: grpc.aio.Server) -> None:
    draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, server)
