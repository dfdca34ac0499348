"""The session stream both model services run: validate, roll back to `keep`, feed, answer.

Subclasses implement `step` (one forward pass for the target, a K-token loop for the draft) and the
conversion of their own request and response messages.
"""

from __future__ import annotations

import abc
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Generic, Protocol, TypeVar

import grpc
import structlog
import torch
from transformers import DynamicCache

from model_host.config import ModelServiceConfig
from model_host.loading import LoadedModel
from model_host.metrics import CACHED_TOKENS, FED_TOKENS, FORWARD_SECONDS, OPEN_SESSIONS, STEPS
from model_host.sessions import KVCache, Session, SessionStore
from serving.errors import invalid_argument
from specdec.v1 import common_pb2

log = structlog.get_logger(__name__)

REQUEST_ID_METADATA = "x-request-id"


class StepRequest(Protocol):
    """The fields every session step carries."""

    @property
    def request_id(self) -> str: ...
    @property
    def keep(self) -> int: ...
    @property
    def append_token_ids(self) -> Sequence[int]: ...


RequestT = TypeVar("RequestT", bound=StepRequest)
ResponseT = TypeVar("ResponseT")


def request_id_from(context: grpc.ServicerContext) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == REQUEST_ID_METADATA:
            return str(value)
    return ""


class SessionServicer(abc.ABC, Generic[RequestT, ResponseT]):
    """Runs session streams over one model; forward passes are serialised by a lock."""

    role: str = "model"
    response_type: type[ResponseT]  # the service's response message (has `result` and `timing`)

    def __init__(self, loaded: LoadedModel, config: ModelServiceConfig) -> None:
        self.loaded = loaded
        self.config = config
        self.store = SessionStore(
            self.new_cache, config.max_sessions, config.max_cached_tokens, config.session_idle_timeout_s
        )
        self._model_lock = threading.Lock()

    # --- what subclasses provide -------------------------------------------------------------

    @abc.abstractmethod
    def check_step(self, request: RequestT) -> None:
        """Raise INVALID_ARGUMENT for a malformed request (token ids are checked here already)."""

    @abc.abstractmethod
    def step(self, session: Session, request: RequestT) -> tuple[ResponseT, int]:
        """Run the model on a rolled-back session; returns the response and the new cached length."""

    def cache_miss(self) -> ResponseT:
        """The response that says: resend with keep = 0 and the full sequence."""
        return self.response_type(result=common_pb2.SESSION_RESULT_CACHE_MISS)  # type: ignore[call-arg]

    def tokens_fed_by(self, request: RequestT) -> int:
        """Upper bound on the cache length after the step, for the token budget."""
        return request.keep + len(request.append_token_ids)

    # --- shared machinery --------------------------------------------------------------------

    def new_cache(self) -> KVCache:
        """An empty KV cache for a new or reopened session."""
        return DynamicCache(config=self.loaded.model.config)  # type: ignore[no-any-return]

    def feed(self, session: Session, token_ids: Sequence[int], rows: int) -> torch.Tensor:
        """Feed tokens through the model on the session's cache; logits of the last `rows`. [rows, vocab]"""
        FED_TOKENS.labels(self.role).inc(len(token_ids))
        return self.forward(session, token_ids, rows)

    def forward(self, session: Session, token_ids: Sequence[int], rows: int) -> torch.Tensor:
        """The model's own forward pass. [rows, vocab]"""
        input_ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self.loaded.input_device)
        output = self.loaded.model(input_ids=input_ids, cache=session.cache, use_cache=True, logits_to_keep=rows)
        return output.logits[0, -rows:]

    def GetModelInfo(
        self, request: common_pb2.GetModelInfoRequest, context: grpc.ServicerContext
    ) -> common_pb2.ModelInfo:
        return self.model_info()

    def model_info(self) -> common_pb2.ModelInfo:
        loaded = self.loaded
        return common_pb2.ModelInfo(
            model=loaded.model_id,
            vocab_size=loaded.vocab_size,
            tokenizer_fingerprint=loaded.tokenizer_fingerprint,
            max_context=loaded.max_context,
            eos_token_ids=list(loaded.eos_token_ids),
            device=loaded.device_name,
            dtype=str(loaded.dtype).removeprefix("torch."),
            max_sessions=self.config.max_sessions,
            max_cached_tokens=self.config.max_cached_tokens,
            open_sessions=self.store.open_sessions,
            max_speculative_tokens=self.config.max_speculative_tokens,
        )

    def _check_common(self, request: RequestT) -> None:
        ids = request.append_token_ids
        vocab = self.loaded.vocab_size
        if ids and (min(ids) < 0 or max(ids) >= vocab):
            bad = next(t for t in ids if not 0 <= t < vocab)
            raise invalid_argument(f"append_token_ids holds {bad}, outside the vocabulary [0, {vocab})")
        total = self.tokens_fed_by(request)
        if total > self.loaded.max_context:
            raise invalid_argument(
                f"keep + append_token_ids = {total} tokens exceeds the model's context of "
                f"{self.loaded.max_context}; shorten the sequence"
            )
        self.check_step(request)

    def serve_session(self, requests: Iterator[RequestT], context: grpc.ServicerContext) -> Iterator[ResponseT]:
        """One stream, one session: its cache is freed when the stream ends, however it ends."""
        session = self.store.open(request_id_from(context) or uuid.uuid4().hex)
        context.add_callback(lambda: self._close(session))
        self._publish_gauges()
        bound = structlog.contextvars.bind_contextvars(request_id=session.request_id, session=session.session_id)
        steps = misses = 0
        try:
            for request in requests:
                steps += 1
                started = time.perf_counter()
                self._check_common(request)
                if request.request_id and session.request_id != request.request_id:
                    session.request_id = request.request_id
                if not self.store.rollback(session, request.keep):
                    STEPS.labels(self.role, "cache_miss").inc()
                    misses += 1
                    log.info("cache_miss", keep=request.keep, held=session.length)
                    yield self.cache_miss()
                    continue
                self.store.reserve(session, self.tokens_fed_by(request))
                with self._model_lock, torch.inference_mode():
                    forward_started = time.perf_counter()
                    response, length = self.step(session, request)
                    forward_seconds = time.perf_counter() - forward_started
                self.store.record_length(session, length)
                self._publish_gauges()
                FORWARD_SECONDS.labels(self.role).observe(forward_seconds)
                STEPS.labels(self.role, "ok").inc()
                response.timing.forward_seconds = forward_seconds  # type: ignore[attr-defined]
                response.timing.service_seconds = time.perf_counter() - started  # type: ignore[attr-defined]
                yield response
        finally:
            log.info("session_closed", steps=steps, cache_misses=misses, cached_tokens=session.length)
            self._close(session)
            structlog.contextvars.reset_contextvars(**bound)

    def _close(self, session: Session) -> None:
        self.store.close(session)
        self._publish_gauges()

    def _publish_gauges(self) -> None:
        OPEN_SESSIONS.labels(self.role).set(self.store.open_sessions)
        CACHED_TOKENS.labels(self.role).set(self.store.cached_tokens)
