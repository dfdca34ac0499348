"""The session stream both model services run: validate, roll back to `keep`, submit the step to the
engine, answer.

Subclasses say what a step is (`make_job`: the target feeds its block and keeps the rows' logits; the
draft feeds its new tokens and then one drafted token per engine iteration) and how its response
reads (`respond`).
"""

from __future__ import annotations

import abc
import asyncio
import threading
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import grpc
import structlog

from model_host.config import ModelServiceConfig
from model_host.engine import DEFAULT_OVERHEAD_TOKENS, Engine, EngineLimits, Job
from model_host.forward import Forward, choose_forward
from model_host.kv_slots import SlotStore
from model_host.loading import LoadedModel
from model_host.metrics import CACHED_TOKENS, FED_TOKENS, FORWARD_SECONDS, OPEN_SESSIONS, STEPS
from model_host.profile import forward_costs, overhead_tokens
from model_host.sessions import Session, SessionStore
from serving.errors import ServiceError, invalid_argument
from serving.protocol import REQUEST_ID_METADATA
from specdec.v1 import common_pb2

log = structlog.get_logger(__name__)


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


def request_id_from(context: grpc.aio.ServicerContext) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == REQUEST_ID_METADATA:
            return str(value)
    return ""


@dataclass(eq=False)
class SlotLease:
    """A session's engine slot; released once when its cache is dropped."""

    slot: int
    engine: Engine
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.engine.slots.release(self.slot)


@dataclass(eq=False)
class _Stream:
    """An open session stream, for idle closing: its handler's task, on the server's event loop."""

    task: asyncio.Task[object]
    last_active: float
    job: Job | None = None  # the step in the engine now
    idle_closed: bool = False

    def close_idle(self) -> None:
        """Called from another thread: end the stream (its handler answers CANCELLED)."""
        self.idle_closed = True
        self.task.get_loop().call_soon_threadsafe(self.task.cancel)


class SessionServicer(abc.ABC, Generic[RequestT, ResponseT]):
    """Runs session streams over one model; the engine batches their steps."""

    role: str = "model"
    response_type: type[ResponseT]  # the service's response message (has `result` and `timing`)

    def __init__(self, loaded: LoadedModel, config: ModelServiceConfig) -> None:
        self.loaded = loaded
        self.config = config
        self.slot_store = SlotStore(loaded.input_device, loaded.dtype, loaded.max_context)
        forward = self.make_forward()
        log.info("engine_forward", forward=forward.name, role=self.role)
        limits = EngineLimits(
            max_batch_size=config.max_batch_size,
            max_batch_tokens=config.max_batch_tokens,
            prefill_chunk_tokens=config.prefill_chunk_tokens,
            max_queue_wait_s=config.max_queue_wait_s,
            batch_hold_fraction=config.batch_hold_fraction,
        )
        widths = (1,) if self.role == "draft" else (1, 3, 5)  # a draft step feeds one token per forward
        self.forward_costs = forward_costs(forward, loaded.vocab_size, config.max_batch_size, widths)
        overhead = overhead_tokens(self.forward_costs, DEFAULT_OVERHEAD_TOKENS)
        log.info("engine_forward_overhead", tokens=round(overhead, 1), role=self.role)
        self.engine = Engine(forward, limits, self.role, overhead)
        self.store = SessionStore(
            self.new_cache, config.max_sessions, config.max_cached_tokens, config.session_idle_timeout_s
        )
        self._streams: dict[int, _Stream] = {}
        self._streams_lock = threading.Lock()

    # --- what subclasses provide -------------------------------------------------------------

    @abc.abstractmethod
    def check_step(self, request: RequestT) -> None:
        """Raise INVALID_ARGUMENT for a malformed request (token ids are checked here already)."""

    @abc.abstractmethod
    def make_job(self, slot: int, request: RequestT) -> Job:
        """The engine job for a step on a session rolled back to request.keep."""

    @abc.abstractmethod
    def respond(self, job: Job, request: RequestT) -> ResponseT:
        """The response to a finished job (`job.start` is the session's new cached length)."""

    def make_forward(self) -> Forward:
        """The batched forward pass of this service's model (or its serial fallback)."""
        return choose_forward(self.loaded.model, self.slot_store, self.config.prefill_chunk_tokens)

    def cache_miss(self) -> ResponseT:
        """The response that says: resend with keep = 0 and the full sequence."""
        return self.response_type(result=common_pb2.SESSION_RESULT_CACHE_MISS)  # type: ignore[call-arg]

    def tokens_fed_by(self, request: RequestT) -> int:
        """Upper bound on the cache length after the step, for the token budget."""
        return request.keep + len(request.append_token_ids)

    # --- shared machinery --------------------------------------------------------------------

    def new_cache(self) -> SlotLease:
        """A slot for a new or reopened session."""
        return SlotLease(self.engine.slots.lease(), self.engine)

    async def GetModelInfo(
        self, request: common_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.ModelInfo:
        return self.model_info()

    def model_info(self) -> common_pb2.ModelInfo:
        loaded, config = self.loaded, self.config
        return common_pb2.ModelInfo(
            model=loaded.model_id,
            vocab_size=loaded.vocab_size,
            tokenizer_fingerprint=loaded.tokenizer_fingerprint,
            max_context=loaded.max_context,
            eos_token_ids=list(loaded.eos_token_ids),
            device=loaded.device_name,
            dtype=str(loaded.dtype).removeprefix("torch."),
            max_sessions=config.max_sessions,
            max_cached_tokens=config.max_cached_tokens,
            open_sessions=self.store.open_sessions,
            max_speculative_tokens=config.max_speculative_tokens,
            max_batch_size=config.max_batch_size,
            max_batch_tokens=config.max_batch_tokens,
            prefill_chunk_tokens=config.prefill_chunk_tokens,
            batched=self.engine.forward.batched,
            forward_costs=[
                common_pb2.ForwardCost(batch_tokens=tokens, seconds=seconds) for tokens, seconds in self.forward_costs
            ],
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

    async def serve_session(
        self, requests: AsyncIterator[RequestT], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[ResponseT]:
        """One stream, one session, opened by its first message; the session's cache is freed when the
        stream ends, however it ends (a client that goes away cancels this handler's task, and with it
        a step still queued in the engine)."""
        task = asyncio.current_task()
        assert task is not None
        stream = _Stream(task, time.monotonic())
        with self._streams_lock:
            self._streams[id(stream)] = stream
        session: Session | None = None
        steps = misses = 0
        request_id = request_id_from(context)
        structlog.contextvars.bind_contextvars(request_id=request_id)
        try:
            async for request in requests:
                steps += 1
                started = time.perf_counter()
                stream.last_active = time.monotonic()
                self._check_common(request)
                if session is None:
                    session = self.store.open(request_id or request.request_id or uuid.uuid4().hex)
                    structlog.contextvars.bind_contextvars(session=session.session_id)
                    self._publish_gauges()
                if not self.store.rollback(session, request.keep):
                    STEPS.labels(self.role, "cache_miss").inc()
                    misses += 1
                    log.info("cache_miss", keep=request.keep, held=session.length)
                    yield self.cache_miss()
                    continue
                response = await self._step(session, stream, request)
                response.timing.service_seconds = time.perf_counter() - started  # type: ignore[attr-defined]
                stream.last_active = time.monotonic()
                yield response
        except asyncio.CancelledError:
            if not stream.idle_closed:
                raise  # the client went away
            raise ServiceError(
                grpc.StatusCode.CANCELLED,
                f"the stream sent nothing for {self.config.session_idle_timeout_s:g} s "
                "(--session-idle-timeout-s); its session was closed",
            ) from None
        finally:
            with self._streams_lock:
                self._streams.pop(id(stream), None)
            if session is not None:
                log.info("session_closed", steps=steps, cache_misses=misses, cached_tokens=session.length)
                self._close(session)
            # By name, not by the binding's tokens: a stream the server drops while its handler waits at
            # a `yield` is closed by the event loop in another task, whose context holds no such tokens.
            structlog.contextvars.unbind_contextvars("request_id", "session")

    async def _step(self, session: Session, stream: _Stream, request: RequestT) -> ResponseT:
        assert session.cache is not None
        try:
            self.store.reserve(session, self.tokens_fed_by(request))
            stream.job = self.make_job(session.cache.slot, request)
            # Cancelling this await (the client went away) cancels the job: the engine drops it.
            job = await asyncio.wrap_future(self.engine.submit(stream.job))
        except BaseException:
            self.store.step_failed(session)
            raise
        finally:
            stream.job = None
        self.store.record_length(session, job.start)
        self._publish_gauges()
        FED_TOKENS.labels(self.role).inc(len(request.append_token_ids))
        FORWARD_SECONDS.labels(self.role).observe(job.forward_seconds)
        STEPS.labels(self.role, "ok").inc()
        response = self.respond(job, request)
        timing = response.timing  # type: ignore[attr-defined]
        timing.forward_seconds = job.forward_seconds
        timing.queue_seconds = max(0.0, job.queue_seconds)
        timing.batch_size = job.batch_size
        timing.batch_tokens = job.batch_tokens
        return response

    def close_idle_streams(self, idle_timeout_s: float) -> int:
        """Cancel streams that sent nothing for `idle_timeout_s` and have no step under way: a silent
        client must not hold a session or capacity forever. Returns how many."""
        deadline = time.monotonic() - idle_timeout_s
        with self._streams_lock:
            idle = [s for s in self._streams.values() if s.job is None and s.last_active < deadline]
        for stream in idle:
            stream.close_idle()
        return len(idle)

    def stop(self) -> None:
        self.engine.stop()

    def _close(self, session: Session) -> None:
        self.store.close(session)
        self._publish_gauges()

    def _publish_gauges(self) -> None:
        OPEN_SESSIONS.labels(self.role).set(self.store.open_sessions)
        CACHED_TOKENS.labels(self.role).set(self.store.cached_tokens)
