"""The Orchestrator service: connects to its services, runs generations (each request checked first,
`validation.py`), streams text, reports stats."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import structlog
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from orchestrator import metrics
from orchestrator.admission import Admission
from orchestrator.config import OrchestratorConfig
from orchestrator.generation import DraftStream, Generation, GenerationRequest, ModelLimits, TargetStream
from orchestrator.goodput import StepTimes, make_policy
from orchestrator.link import LinkMessages
from orchestrator.outbox import Outbox
from orchestrator.pair import PairMismatch, check_pair, fetch_model_info, one_host, translation_for
from orchestrator.proposals import MODEL, NGRAM, Stats
from orchestrator.routing import route_for
from orchestrator.sampler import BatchSampler
from orchestrator.text import TextStream, byte_table
from orchestrator.translation import Translation
from orchestrator.upstream import Dial, DraftAvailability, ReplicaPool, SessionStream
from orchestrator.validation import RequestCheck
from orchestrator.workers import share, worker_count
from serving.errors import ServiceError
from serving.protocol import DRAFT_METHOD_BY_NAME, POLICY_BY_NAME
from serving.security import channel_credentials
from serving.vocab import tokenizer_fingerprint
from specdec.v1 import (
    common_pb2,
    draft_pb2,
    draft_pb2_grpc,
    orchestrator_pb2,
    orchestrator_pb2_grpc,
    target_pb2,
    target_pb2_grpc,
)

log = structlog.get_logger(__name__)

SERVICE_NAME = "specdec.v1.Orchestrator"
# Each replica's link: one stream for the steps of every session pinned there.
TARGET_LINK = LinkMessages(lambda stub: stub.Verify(), target_pb2.VerifyStep, target_pb2.VerifyBatch)
DRAFT_LINK = LinkMessages(lambda stub: stub.Draft(), draft_pb2.DraftStep, draft_pb2.DraftBatch, fetches=True)


@dataclass
class DraftSide:
    """The draft replicas, and what is known of them (None until one has answered and matched)."""

    pool: ReplicaPool
    info: common_pb2.ModelInfo | None = None
    translation: Translation | None = None  # a draft with another tokenizer (--draft-tokenizer)


class OrchestratorServicer(orchestrator_pb2_grpc.OrchestratorServicer):
    """Serves Generate and GetInfo over a connected target (and, optionally, draft) service."""

    def __init__(
        self,
        config: OrchestratorConfig,
        target_pool: ReplicaPool,
        target_info: common_pb2.ModelInfo,
        draft: DraftSide | None,
        tokenizer: PreTrainedTokenizerBase,
    ) -> None:
        self.config = config
        self.target_pool = target_pool
        self.target_info = target_info
        self.draft = draft
        self.tokenizer = tokenizer
        self.byte_table = byte_table(tokenizer)  # byte-level BPE: text in constant time per token
        log.info("detokenizer", byte_table=self.byte_table is not None)
        self.availability = DraftAvailability(config.draft_retry_after_s)
        self.times = StepTimes(target_info, draft.info if draft else None, one_host(config))
        self.sampler = BatchSampler()
        # With --workers, each worker admits its share.
        running = config.max_running_requests or target_info.max_sessions * max(1, len(target_pool.replicas))
        workers = worker_count(config.workers)
        self.admission = Admission(
            share(running, workers), share(config.max_queued_requests, workers), config.max_queue_wait_s
        )
        self._draft_watch: asyncio.Task[None] | None = None
        self.requests = RequestCheck(config, target_info, tokenizer, has_draft=draft is not None)

    @classmethod
    async def connect(cls, config: OrchestratorConfig) -> OrchestratorServicer:
        """Reach the services, check the pair, load the tokenizer. Raises PairMismatch or ConnectionError."""
        credentials = channel_credentials(config.upstream_tls_ca, config.upstream_tls_cert, config.upstream_tls_key)
        if credentials is None:
            log.warning(
                "plaintext_upstream", detail="no --upstream-tls-ca: connections to the services are unencrypted"
            )
        dial = Dial(credentials, config.upstream_tls_server_name)
        slack = config.route_load_slack if config.cache_aware_routing else None
        target_pool = ReplicaPool(
            "target",
            config.target,
            target_pb2_grpc.TargetServiceStub,
            TARGET_LINK,
            config.resolve_interval_s,
            dial,
            step_timeout_s=config.target_timeout_s,
            route_load_slack=slack,
        )
        await target_pool.start()
        target_info = await fetch_model_info(target_pool, config.startup_timeout_s)
        name = config.tokenizer or target_info.model
        tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, name)
        fingerprint = tokenizer_fingerprint(tokenizer)
        if target_info.tokenizer_fingerprint and fingerprint != target_info.tokenizer_fingerprint:
            raise PairMismatch(
                f"tokenizer {name!r} differs from target model {target_info.model!r}'s tokenizer; "
                "pass --tokenizer naming the target's tokenizer"
            )
        translation = None
        if config.draft_tokenizer and config.draft:
            translation = await asyncio.to_thread(translation_for, tokenizer, config)
        draft: DraftSide | None = None
        if config.draft:
            pool = ReplicaPool(
                "draft",
                config.draft,
                draft_pb2_grpc.DraftServiceStub,
                DRAFT_LINK,
                config.resolve_interval_s,
                dial,
                step_timeout_s=config.draft_timeout_s,
                route_load_slack=slack,
            )
            await pool.start()
            draft = DraftSide(pool, translation=translation)
            try:
                draft.info = await fetch_model_info(pool, min(config.startup_timeout_s, config.draft_retry_after_s))
                check_pair(target_info, draft.info, translation)
            except ConnectionError as exc:
                log.warning("draft_unreachable_at_startup", error=str(exc), fallback="target alone until it answers")
        servicer = cls(config, target_pool, target_info, draft, tokenizer)
        if draft is not None and draft.info is None:
            servicer._draft_watch = asyncio.create_task(servicer._watch_draft())
        return servicer

    async def _watch_draft(self) -> None:
        """Keep asking an unreachable draft for its info; start drafting once it answers and matches."""
        assert self.draft is not None
        while self.draft.info is None:
            try:
                info = await fetch_model_info(self.draft.pool, self.config.draft_retry_after_s)
            except ConnectionError:
                continue
            try:
                check_pair(self.target_info, info, self.draft.translation)
            except PairMismatch as exc:
                log.error("draft_mismatch", error=str(exc), fallback="target alone")
                return
            self.draft.info = info
            self.times.set_draft(info)
            log.info("draft_available", model=info.model)

    async def close(self) -> None:
        if self._draft_watch:
            self._draft_watch.cancel()
        await self.target_pool.close()
        if self.draft:
            await self.draft.pool.close()
        self.requests.close()

    # --- GetInfo -------------------------------------------------------------------------------

    async def GetInfo(
        self, request: orchestrator_pb2.GetInfoRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.GetInfoResponse:
        response = orchestrator_pb2.GetInfoResponse(
            target=self.target_info,
            max_new_tokens_cap=self.config.max_new_tokens_cap,
            num_speculative_tokens_cap=self.config.max_speculative_tokens,
            default_num_speculative_tokens=self.config.num_speculative_tokens if self.draft else 0,
            default_speculation_policy=POLICY_BY_NAME[self.config.speculation_policy],
            default_overlap_drafting=self.config.overlap_drafting,
            default_draft_method=DRAFT_METHOD_BY_NAME[self.config.draft_method],
        )
        if self.draft and self.draft.info:
            response.draft.CopyFrom(self.draft.info)
        return response

    # --- Generate ------------------------------------------------------------------------------

    def _limits(self) -> ModelLimits:
        draft = self.draft.info if self.draft else None
        # A draft with another tokenizer gets no constraint (compiled for the target's tokens), and has
        # no speculation cache or token trees in this version.
        translation = self.draft.translation if self.draft and draft else None
        same_ids = translation is None
        return ModelLimits(
            vocab_size=self.target_info.vocab_size,
            target_max_context=self.target_info.max_context,
            draft_max_context=draft.max_context if draft else 0,
            eos_token_ids=frozenset(self.target_info.eos_token_ids),
            # A draft too old to report its cap is held to the orchestrator's own.
            draft_max_speculative_tokens=(
                draft.max_speculative_tokens or self.config.max_speculative_tokens if draft else 0
            ),
            draft_constrains=bool(draft and draft.structured_output_kinds and same_ids),
            draft_vocab_size=draft.vocab_size if draft else 0,
            draft_speculates=bool(draft and draft.speculation_cache_tokens and same_ids),
            translation=translation,
            string_match=translation is not None and self.config.cross_greedy == "slem",
            trees=bool(draft and draft.batched and self.target_info.batched and same_ids),
        )

    def _generation(self, request: GenerationRequest, policy: str) -> Generation:
        cfg = self.config
        route = route_for(request.cache_salt, request.prompt_token_ids)
        target: TargetStream = SessionStream(
            self.target_pool,
            request.request_id,
            attempts=cfg.target_attempts,
            backoff_s=cfg.target_backoff_s,
            route=route,
        )
        k, method = request.num_speculative_tokens, request.draft_method
        draft: DraftStream | None = None
        if self.draft is not None and self.draft.info is not None and k > 0 and method != NGRAM:
            draft = SessionStream(self.draft.pool, request.request_id, attempts=1, route=route)
        # Under load_aware the request's K is the bound on every round's K; the heuristic grows from it.
        max_k = k if policy == "load_aware" else cfg.max_speculative_tokens
        # load_aware starts from the server's K and moves from it where that clearly pays.
        initial_k = min(k, cfg.num_speculative_tokens or k) if policy == "load_aware" else k
        lookup_policy = None
        if method != MODEL and k > 0:
            lookup_policy = make_policy(policy, initial_k, max_k, self.times, drafts_cost=False)
        limits = self._limits()
        return Generation(
            request,
            limits,
            target,
            draft,
            self.availability,
            make_policy(
                policy,
                initial_k,
                max_k,
                self.times,
                overlaps=request.overlap_drafting,
                speculates=limits.draft_speculates,
            ),
            self.times,
            lookup_policy,
            self.sampler,
        )

    async def Generate(
        self, request: orchestrator_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[orchestrator_pb2.GenerateResponse]:
        generation_request, policy = await self.requests.check(request)
        text = TextStream(self.tokenizer, list(request.stop), self.byte_table)
        await self.admission.acquire()
        generation = self._generation(generation_request, policy)
        metrics.REQUESTS_RUNNING.inc()
        structlog.contextvars.bind_contextvars(request_id=generation_request.request_id)
        first = True
        deadline = time.monotonic() + self.config.request_timeout_s
        outbox = Outbox(self.config.stream_interval, lambda: generation.round_seconds)
        producer = asyncio.create_task(self._produce(generation, text, outbox, deadline))
        try:
            while True:
                chunk = await outbox.take()
                if chunk.text or chunk.token_ids:
                    yield orchestrator_pb2.GenerateResponse(
                        text=chunk.text,
                        token_ids=chunk.token_ids,
                        request_id=generation_request.request_id if first else "",
                        logprobs=chunk.logprobs,
                        prompt_logprobs=(generation.prompt_logprobs or []) if first else [],
                    )
                    first = False
                if chunk.closed:
                    break
            string_stop, streamed = await producer  # raises what ended the rounds
            finish = orchestrator_pb2.FINISH_REASON_STOP if string_stop else generation.finish_reason
            stats = generation.stats
            stats.output_tokens = streamed
            yield orchestrator_pb2.GenerateResponse(
                text="" if string_stop else text.finish(),  # a stop string's held-back text is never released
                finish_reason=finish,  # type: ignore[arg-type]
                stats=stats.to_proto(generation.reopens, generation.wire_bytes, generation.reused),
                request_id=generation_request.request_id if first else "",
                prompt_logprobs=(generation.prompt_logprobs or []) if first else [],
            )
            self._record(generation, finish)
        except ServiceError as exc:
            metrics.REQUESTS_FAILED.labels(exc.code.name).inc()
            log.warning("request_failed", code=exc.code.name, error=exc.message)
            raise
        finally:
            producer.cancel()  # the client went away, or the request failed: no more rounds
            with contextlib.suppress(BaseException):
                await producer
            generation.close()
            self.admission.release()
            metrics.REQUESTS_RUNNING.dec()
            structlog.contextvars.unbind_contextvars("request_id")

    async def _produce(
        self, generation: Generation, text: TextStream, outbox: Outbox, deadline: float
    ) -> tuple[bool, int]:
        """Run the rounds, putting their text in the outbox (never waiting for the client); returns whether
        a stop string ended the generation, and the tokens streamed."""
        string_stop = False
        streamed = 0
        try:
            async with contextlib.aclosing(generation.rounds()) as rounds:
                async for tokens in rounds:
                    if time.monotonic() > deadline:
                        raise ServiceError(
                            grpc.StatusCode.DEADLINE_EXCEEDED,
                            f"the generation ran past the server's limit of {self.config.request_timeout_s:g} s "
                            "(--request-timeout-s); ask for fewer tokens",
                        )
                    delta = text.push(tokens)
                    logprobs = generation.token_logprobs[streamed : streamed + len(delta.token_ids)]
                    streamed += len(delta.token_ids)
                    outbox.put(delta.text, delta.token_ids, logprobs)
                    if delta.stopped:
                        string_stop = True
                        break
        finally:
            outbox.close()
        return string_stop, streamed

    def _record(self, generation: Generation, finish: int) -> None:
        stats: Stats = generation.stats
        reason = orchestrator_pb2.FinishReason.Name(finish).removeprefix("FINISH_REASON_").lower()
        metrics.REQUESTS_FINISHED.labels(reason).inc()
        metrics.PROMPT_TOKENS.inc(stats.prompt_tokens)
        metrics.GENERATION_TOKENS.inc(stats.output_tokens)
        metrics.NUM_DRAFT_TOKENS.inc(stats.draft_tokens)
        metrics.NUM_ACCEPTED_TOKENS.inc(stats.accepted_tokens)
        metrics.NUM_DRAFTS.inc(stats.rounds_with_draft)
        metrics.NGRAM_DRAFT_TOKENS.inc(stats.ngram_draft_tokens)
        metrics.NGRAM_ACCEPTED_TOKENS.inc(stats.ngram_accepted_tokens)
        for position, count in enumerate(stats.accepted_per_position):
            metrics.ACCEPTED_PER_POSITION.labels(str(position)).inc(count)
        metrics.SESSION_REOPENS.inc(generation.reopens)
        metrics.DRAFT_FALLBACK_ROUNDS.inc(stats.draft_fallback_rounds)
        metrics.E2E_LATENCY.observe(stats.total_seconds)
        metrics.TIME_TO_FIRST_TOKEN.observe(stats.time_to_first_token_seconds)
        if stats.output_tokens > 1:
            metrics.TIME_PER_OUTPUT_TOKEN.observe(
                (stats.total_seconds - stats.time_to_first_token_seconds) / (stats.output_tokens - 1)
            )
        log.info(
            "request_done",
            finish=reason,
            prompt_tokens=stats.prompt_tokens,
            output_tokens=stats.output_tokens,
            rounds=stats.rounds,
            draft_tokens=stats.draft_tokens,
            accepted_tokens=stats.accepted_tokens,
            ngram_draft_tokens=stats.ngram_draft_tokens,
            ngram_accepted_tokens=stats.ngram_accepted_tokens,
            acceptance_rate=round(stats.acceptance_rate, 3),
            total_seconds=round(stats.total_seconds, 4),
            tokens_per_second=round(stats.output_tokens / stats.total_seconds, 1) if stats.total_seconds else 0.0,
            session_reopens=generation.reopens,
            draft_fallback_rounds=stats.draft_fallback_rounds,
        )
