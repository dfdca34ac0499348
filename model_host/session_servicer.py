"""The link both model services run: one stream carries the steps of many sessions. Each step is
validated, rolled back to `keep` and submitted to the engine; each answer carries every result the
engine has ready, so a link costs one message per engine iteration each way, not one per session.

Subclasses say what a step is (`make_job`: the target feeds its block and keeps the rows' logits; the
draft feeds its new tokens and then one drafted token per engine iteration) and how its response
reads (`respond`).
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Generic, TypeVar

import grpc
import structlog

from model_host.config import ModelServiceConfig
from model_host.forward import Forward, choose_forward
from model_host.job import Job
from model_host.link import Link, Pending, SlotLease, StepRequest, answers
from model_host.loading import LoadedModel
from model_host.metrics import FED_TOKENS, FORWARD_SECONDS, OPEN_SESSIONS, STEPS
from model_host.sessions import Session, SessionStore
from model_host.simulated import SimulatedForward
from model_host.startup import open_block_store, start_engine
from model_host.step_constraints import first_step_constraint, spec_to_compile
from serving.constraints import KINDS, ConstraintSpec, Grammars, SessionConstraint
from serving.errors import HANDLER_INTERNAL_PREFIX, ServiceError, invalid_argument, resource_exhausted
from specdec.v1 import common_pb2

log = structlog.get_logger(__name__)

RequestT = TypeVar("RequestT", bound=StepRequest)
ResponseT = TypeVar("ResponseT")


class SessionServicer(abc.ABC, Generic[RequestT, ResponseT]):
    """Runs session streams over one model; the engine batches their steps."""

    role: str = "model"
    response_type: type[ResponseT]  # the service's response message (has `result` and `timing`)
    result_type: type[Any]  # one session's answer on a link (session, response, error)
    results_type: type[Any]  # a link's answer message (results)

    def __init__(self, loaded: LoadedModel, config: ModelServiceConfig) -> None:
        self.loaded = loaded
        self.config = config
        self.block_store, pool = open_block_store(loaded, config, self.role)
        self.max_cached_tokens = pool.tokens
        self.engine, self.forward_costs = start_engine(
            self.make_forward(), self.block_store, pool, loaded, config, self.role
        )
        self.store = SessionStore(self.new_cache, config.max_sessions, config.session_idle_timeout_s)
        self._links: set[Link] = set()
        self._links_lock = threading.Lock()
        # Structured outputs: the tokenizer's view for llguidance, built once; constraints compile on a
        # thread of their own, neither the event loop's nor the engine's.
        self.grammars = Grammars.for_tokenizer(loaded.tokenizer, loaded.vocab_size, loaded.eos_token_ids, self.role)
        self._compiler = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"{self.role}-compile")
        self.draining = False  # new sessions are refused (UNAVAILABLE); links end once their sessions have
        self._to_wake: set[Link] = set()
        self.engine.after_group = self._wake_answered
        # Labelled once: a label lookup costs more than the update, at every session step.
        self._fed_tokens = FED_TOKENS.labels(self.role)
        self._forward_seconds = FORWARD_SECONDS.labels(self.role)
        self._steps_ok = STEPS.labels(self.role, "ok")
        self._open_sessions = OPEN_SESSIONS.labels(self.role)

    # --- what subclasses provide -------------------------------------------------------------

    @abc.abstractmethod
    def check_step(self, request: RequestT) -> None:
        """Raise INVALID_ARGUMENT for a malformed request (token ids are checked here already)."""

    @abc.abstractmethod
    def make_job(self, slot: int, request: RequestT, constraint: SessionConstraint | None) -> Job:
        """The engine job for a step on a session rolled back to request.keep (`constraint`: the
        session's structured output, to advance over the step's tokens and mask its rows with)."""

    def before_responding(self, jobs: list[Job]) -> None:
        """Work over every job one wake answers, done once for all of them (the target's argmax)."""

    @abc.abstractmethod
    def respond(self, job: Job, request: RequestT, session: Session) -> ResponseT:
        """The response to a finished job (`job.start` is the session's new cached length)."""

    def answer_at_once(self, session: Session | None, entry: Any) -> Any | None:
        """The result of a link entry answered without the engine (the draft's row fetch), or None for a
        step or a close."""
        return None

    def forget(self, session: Session) -> None:
        """Drop what the subclass keeps for a session that closed."""

    def drafted_ahead(self, session: Session, request: RequestT) -> tuple[Job, concurrent.futures.Future[Any]] | None:
        """A step answered by work done ahead (the draft's speculation cache): its job, and the future
        that ends the step (the job's result, or its error); None to run the step as usual."""
        return None

    def make_forward(self) -> Forward:
        """The batched forward pass of this service's model (or its serial fallback)."""
        return choose_forward(self.loaded.model, self.block_store, self.config.prefill_chunk_tokens)

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
            max_cached_tokens=self.max_cached_tokens,
            open_sessions=self.store.open_sessions,
            max_speculative_tokens=config.max_speculative_tokens,
            max_batch_size=config.max_batch_size,
            max_batch_tokens=config.max_batch_tokens,
            prefill_chunk_tokens=config.prefill_chunk_tokens,
            batched=self.engine.forward.batched,
            forward_costs=[
                common_pb2.ForwardCost(batch_tokens=tokens, seconds=seconds) for tokens, seconds in self.forward_costs
            ],
            structured_output_kinds=KINDS if self.grammars is not None else (),
            simulated_device=self._simulated_device(),
        )

    def _simulated_device(self) -> common_pb2.SimulatedDevice | None:
        forward = self.engine.forward
        if not isinstance(forward, SimulatedForward):
            return None
        return common_pb2.SimulatedDevice(
            profile=forward.profile.name,
            kernels_per_layer=forward.kernels.per_layer,
            kernels_outside_layers=forward.kernels.outside,
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

    def peer_of(self, context: grpc.aio.ServicerContext) -> str:
        """Who a stream comes from, for its stream budget: the client certificate's name under mutual
        TLS, else its address without the port."""
        auth = context.auth_context() or {}
        for key in ("x509_common_name", "x509_subject_alternative_name"):
            if auth.get(key):
                return f"{key.removeprefix('x509_')}:{auth[key][0].decode(errors='replace')}"
        return context.peer().rpartition(":")[0] or context.peer()

    async def serve_link(self, batches: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        """One link: the steps of many sessions in, their results out, each answer holding every result
        ready. Every session the link opened is closed when it ends, however it ends (a client that goes
        away cancels this handler's task)."""
        link = Link(self.peer_of(context))
        with self._links_lock:
            held = sum(1 for other in self._links if other.peer == link.peer)
            if held >= self.config.max_streams_per_peer:
                raise resource_exhausted(
                    f"{link.peer} holds {held} streams to this service, its limit (--max-streams-per-peer); "
                    "close idle ones: one stream carries the steps of every session"
                )
            self._links.add(link)
        reader = asyncio.create_task(self._read_link(link, batches))
        try:
            while True:
                await link.wake.wait()
                link.wake.clear()
                if link.idle_closed:
                    raise ServiceError(
                        grpc.StatusCode.CANCELLED,
                        f"the stream sent nothing for {self.config.session_idle_timeout_s:g} s "
                        "(--session-idle-timeout-s) and held no session; it was closed",
                    )
                self._answer_finished(link)
                # Taken before writing: steps read while a message is written add results of their own.
                results, link.results = link.results, []
                for message in answers(results, self.results_type):
                    yield message
                if reader.done() and not link.running and not link.compiling:
                    reader.result()  # a broken stream raises here
                    if link.ended:
                        return
                if self.draining and not link.sessions and not link.running and not link.compiling:
                    return  # a draining service lets the link end once its sessions have
        finally:
            reader.cancel()
            for task in link.compiling.values():
                task.cancel()
            with self._links_lock:
                self._links.discard(link)
            for session_id in list(link.sessions):
                self._close_session(link, session_id)

    async def _read_link(self, link: Link, batches: AsyncIterator[Any]) -> None:
        try:
            async for batch in batches:
                link.last_active = time.monotonic()
                closes = False
                for entry in batch.steps:
                    closes |= entry.close
                    spec = self._spec_to_compile(link, entry)
                    if spec is None:
                        self._entry(link, entry)
                    else:  # the other sessions' steps do not wait for this one's compile
                        link.compiling[entry.session] = asyncio.create_task(self._compile_then_enter(link, entry, spec))
                # Steps the engine took wake the answering side when they end: only what else changes the
                # link (answers, closes) wakes it here, which saves a turn of the loop a step. (A drain
                # wakes every link itself.)
                if link.results or closes:
                    link.wake.set()
        finally:
            link.ended = True
            link.wake.set()

    def _spec_to_compile(self, link: Link, entry: Any) -> ConstraintSpec | None:
        """The constraint of a session's first step that is not compiled yet; None for every other
        entry, and for a malformed one (`_entry` answers it)."""
        if (
            entry.close
            or not entry.HasField("step")
            or entry.session in link.running
            or entry.session in link.compiling
        ):
            return None
        return spec_to_compile(self.grammars, entry.step)

    async def _compile_then_enter(self, link: Link, entry: Any, spec: ConstraintSpec) -> None:
        assert self.grammars is not None
        try:
            await asyncio.get_running_loop().run_in_executor(self._compiler, self.grammars.compile, spec)
        except Exception as exc:  # noqa: BLE001 - this session's failure
            link.compiling.pop(entry.session, None)
            link.results.append(self._result(entry.session, error=self._as_service_error(exc)))
        else:
            link.compiling.pop(entry.session, None)
            self._entry(link, entry)
        link.wake.set()

    def _constraint(self, session: Session, request: RequestT) -> SessionConstraint | None:
        """The session's constraint: set anew by its first step (keep = 0), kept by the others."""
        if not request.keep:
            session.constraint = first_step_constraint(self.grammars, request)
        return session.constraint

    def _entry(self, link: Link, entry: Any) -> None:
        """Start one session's step (or close it); its answer, or its error, goes to `link.results`."""
        session_id = entry.session
        if entry.close:
            self._close_session(link, session_id)
            return
        answered = self.answer_at_once(link.sessions.get(session_id), entry)
        if answered is not None:
            link.results.append(answered)
            return
        request = entry.step
        try:
            if session_id in link.running or session_id in link.compiling:
                raise invalid_argument(f"session {session_id} sent a step before its last one was answered")
            self._check_common(request)
            session = link.sessions.get(session_id)
            if session is None:
                if request.keep:  # closed, expired or never opened here: resend the whole sequence
                    link.results.append(self._result(session_id, response=self.cache_miss()))
                    return
                if self.draining:
                    raise ServiceError(
                        grpc.StatusCode.UNAVAILABLE, "the service is draining; open the session on another replica"
                    )
                session = self.store.open(request.request_id or uuid.uuid4().hex)
                link.sessions[session_id] = session
                self._publish_gauges()
            if not self.store.rollback(session, request.keep):
                STEPS.labels(self.role, "cache_miss").inc()
                log.info("cache_miss", request_id=session.request_id, keep=request.keep, held=session.length)
                link.results.append(self._result(session_id, response=self.cache_miss()))
                return
            ahead = self.drafted_ahead(session, request)
            if ahead is not None:
                job, outcome = ahead
                pending = Pending(session, request, job, time.perf_counter(), outcome)
                link.running[session_id] = pending
                outcome.add_done_callback(lambda _: self._on_done(link, session_id, pending))
                return
        except Exception as exc:  # noqa: BLE001 - one session's failure, never the link's
            link.results.append(self._result(session_id, error=self._as_service_error(exc)))
            self._close_session(link, session_id)
            return
        self._submit(link, session_id, session, request)

    def _submit(self, link: Link, session_id: int, session: Session, request: Any) -> None:
        """Run a step, its session rolled back, in the engine."""
        try:
            assert session.cache is not None
            job = self.make_job(session.cache.slot, request, self._constraint(session, request))
            job.cache_salt = request.cache_salt
            job.max_length = self.tokens_fed_by(request)  # the blocks it reserves (model_host/kv_blocks.py)
            pending = Pending(session, request, job, time.perf_counter())
            future = self.engine.submit(pending.job)
        except Exception as exc:  # noqa: BLE001 - one session's failure, never the link's
            link.results.append(self._result(session_id, error=self._as_service_error(exc)))
            self._close_session(link, session_id)
            return
        link.running[session_id] = pending
        future.add_done_callback(lambda _: self._on_done(link, session_id, pending))

    def _on_done(self, link: Link, session_id: int, pending: Pending) -> None:
        if not link.on_done(session_id, pending):
            return
        if threading.get_ident() == link.loop_thread:  # failed or cancelled on the event loop itself
            link.wake.set()
        else:  # the engine's thread: woken after the forward, with every other link it answered
            with self._links_lock:
                self._to_wake.add(link)

    def _wake_answered(self) -> None:
        """The engine ended a forward's jobs: wake each link they belong to, once."""
        with self._links_lock:
            links, self._to_wake = self._to_wake, set()
        for link in links:
            link.loop.call_soon_threadsafe(link.wake.set)

    def _answer_finished(self, link: Link) -> None:
        with self.engine.forward.answering():  # the logits are read off the forwards' stream
            self._answer_each(link)

    def _answer_each(self, link: Link) -> None:
        finished = [
            (i, p, p.outcome.exception()) for i, p in link.take_finished() if link.running.get(i) is p
        ]  # not closed meanwhile
        try:
            self.before_responding([p.job for _, p, error in finished if error is None])
        except Exception:  # each answer then does its own share (respond)
            log.exception("before_responding_failed")
        for session_id, pending, error in finished:
            del link.running[session_id]
            job, session = pending.job, pending.session
            if error is not None and pending.ended is not None:  # the work done ahead was lost: as usual
                log.info("drafted_ahead_lost", request_id=session.request_id, reason=str(error))
                self._submit(link, session_id, session, pending.request)
                continue
            if error is None:
                try:
                    response = self.respond(job, pending.request, session)
                except Exception as exc:  # noqa: BLE001 - this session's answer alone
                    error = exc
            if error is not None:
                link.results.append(self._result(session_id, error=self._as_service_error(error)))
                self._close_session(link, session_id)
                continue
            self.store.step_done(session)
            self._fed_tokens.inc(len(pending.request.append_token_ids))
            self._forward_seconds.observe(job.forward_seconds)
            self._steps_ok.inc()
            timing = response.timing  # type: ignore[attr-defined]
            timing.forward_seconds = job.forward_seconds
            timing.queue_seconds = max(0.0, job.queue_seconds)
            timing.batch_size = job.batch_size
            timing.batch_tokens = job.batch_tokens
            timing.reused_tokens = job.reused
            timing.service_seconds = time.perf_counter() - pending.started
            link.results.append(self._result(session_id, response=response))
        self._publish_gauges()

    def _as_service_error(self, error: BaseException) -> ServiceError:
        """A step's failure as the status its session sees; anything but a ServiceError is a bug, logged."""
        if isinstance(error, ServiceError):
            return error
        log.error("step_failed", error=repr(error), exc_info=error)
        return ServiceError(grpc.StatusCode.INTERNAL, f"{HANDLER_INTERNAL_PREFIX}{self.role} step: {error!r}")

    def _result(self, session_id: int, response: Any = None, error: ServiceError | None = None) -> Any:
        result = self.result_type(session=session_id)
        if error is not None:
            result.error.code = error.code.value[0]
            result.error.message = error.message
        else:
            result.response.CopyFrom(response)
        return result

    def _close_session(self, link: Link, session_id: int) -> None:
        """End one session of a link: its step still in the engine is cancelled, its cache freed."""
        compiling = link.compiling.pop(session_id, None)
        if compiling is not None:
            compiling.cancel()
        pending = link.running.pop(session_id, None)
        if pending is not None:
            pending.job.future.cancel()  # the engine drops it before its next forward
            self.store.step_failed(pending.session)
        session = link.sessions.pop(session_id, None)
        if session is not None:
            log.info("session_closed", request_id=session.request_id, cached_tokens=session.length)
            self.forget(session)
            self.store.close(session)
            self._publish_gauges()

    def close_idle_streams(self, idle_timeout_s: float) -> int:
        """End links that sent nothing for `idle_timeout_s` and hold no session: a silent client must
        not hold a stream forever. Sessions idle that long lose their caches (SessionStore.expire_idle)
        and, on a link, are closed. Returns how many links were closed."""
        deadline = time.monotonic() - idle_timeout_s
        with self._links_lock:
            links = list(self._links)
        closed = 0
        for link in links:
            if link.last_active >= deadline:
                continue
            if link.sessions or link.running:
                link.loop.call_soon_threadsafe(self._close_idle_sessions, link, deadline)
            else:
                link.close_idle()
                closed += 1
        return closed

    def _close_idle_sessions(self, link: Link, deadline: float) -> None:
        for session_id, session in list(link.sessions.items()):
            if session_id not in link.running and session.last_used < deadline:
                self._close_session(link, session_id)

    def start_draining(self) -> None:
        """Refuse new sessions; each link ends once its sessions have (callable from any thread)."""
        self.draining = True
        with self._links_lock:
            for link in self._links:
                link.loop.call_soon_threadsafe(link.wake.set)

    def stop(self) -> None:
        self.engine.stop()
        self._compiler.shutdown(wait=False, cancel_futures=True)

    def _publish_gauges(self) -> None:
        self._open_sessions.set(self.store.open_sessions)
