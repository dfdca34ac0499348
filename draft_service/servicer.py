"""DraftService: crop to `keep`, feed the new tokens, draft up to K tokens autoregressively."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import grpc
import structlog
import torch

from draft_service.lean import LeanCache, LeanDraft
from model_host.config import ModelServiceConfig
from model_host.loading import LoadedModel
from model_host.logits import logits_to_probs
from model_host.session_servicer import SessionServicer
from model_host.sessions import KVCache, Session
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


class DraftServicer(
    SessionServicer[draft_pb2.DraftRequest, draft_pb2.DraftResponse], draft_pb2_grpc.DraftServiceServicer
):
    role = "draft"
    response_type = draft_pb2.DraftResponse

    def __init__(self, loaded: LoadedModel, config: ModelServiceConfig) -> None:
        self.lean = LeanDraft.attach(loaded.model) if config.lean_draft else None
        log.info("draft_forward", lean=self.lean is not None)
        super().__init__(loaded, config)

    def new_cache(self) -> KVCache:
        return self.lean.new_cache() if self.lean else super().new_cache()

    def forward(self, session: Session, token_ids: Sequence[int], rows: int) -> torch.Tensor:
        if self.lean is None or rows != 1:
            return super().forward(session, token_ids, rows)
        assert isinstance(session.cache, LeanCache)
        return self.lean.forward(list(token_ids), session.cache)[None]

    def Draft(
        self, request_iterator: Iterator[draft_pb2.DraftRequest], context: grpc.ServicerContext
    ) -> Iterator[draft_pb2.DraftResponse]:
        return self.serve_session(request_iterator, context)

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

    def step(self, session: Session, request: draft_pb2.DraftRequest) -> tuple[draft_pb2.DraftResponse, int]:
        params = SamplingParams.from_proto(request.sampling)
        logits = self.feed(session, request.append_token_ids, 1)[-1]  # [vocab]
        generator = seeded_generator(request.seed, logits.device)
        draft_token_ids: list[int] = []
        draft_probs: list[torch.Tensor] = []  # k rows of [vocab]
        for position in range(request.num_speculative_tokens):
            token, probs, confidence = choose_token(logits, params, generator, request.min_confidence > 0)
            if probs is not None:
                draft_probs.append(probs)
            draft_token_ids.append(token)
            last = position == request.num_speculative_tokens - 1
            if last or confidence < request.min_confidence:
                break
            logits = self.feed(session, [token], 1)[-1]
        response = draft_pb2.DraftResponse(result=common_pb2.SESSION_RESULT_OK, draft_token_ids=draft_token_ids)
        if draft_probs:
            response.draft_probs.CopyFrom(encode_prob_rows(torch.stack(draft_probs)))
        # The last draft token was sampled but never fed.
        length = request.keep + len(request.append_token_ids) + len(draft_token_ids) - 1
        response.cached_tokens = length
        return response, length


def register(servicer: DraftServicer, server: grpc.Server) -> None:
    draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, server)
