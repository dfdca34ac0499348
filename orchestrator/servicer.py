"""The Orchestrator service: validates requests, runs generations, streams text, reports stats."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import random
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

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
from orchestrator.proposals import MODEL, NGRAM, Stats
from orchestrator.routing import route_for
from orchestrator.sampler import BatchSampler
from orchestrator.text import TextStream, byte_table
from orchestrator.translation import Translation
from orchestrator.upstream import Dial, DraftAvailability, ReplicaPool, SessionStream
from orchestrator.workers import share, worker_count
from serving.constraints import ConstraintSpec, Grammars, TokenBan
from serving.errors import ServiceError, failed_precondition, invalid_argument
from serving.logits import MAX_TOP_LOGPROBS
from serving.protocol import (
    DRAFT_METHOD_BY_ENUM,
    DRAFT_METHOD_BY_NAME,
    DRAFT_METHODS,
    MAX_PROMPT_CHARS_PER_TOKEN,
    POLICIES,
    POLICY_BY_ENUM,
    POLICY_BY_NAME,
)
from serving.sampling import SamplingParams
from serving.security import channel_credentials
from serving.vocab import tokenizer_fingerprint
from serving.vocab_map import VocabularyError, check_overlap
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
_MAX_STOP_STRINGS = 16
_MAX_STOP_CHARS = 256
MAX_CACHE_SALT_BYTES = 256
MAX_STOP_TOKEN_IDS = 256
_MAX_REQUEST_ID_CHARS = 128
_INFO_POLL_S = 0.5


def check_request_id(request_id: str) -> None:
    """A request id travels in gRPC metadata and logs: printable ASCII, at most 128 characters."""
    if len(request_id) > _MAX_REQUEST_ID_CHARS or not all(" " <= c <= "~" for c in request_id):
        raise invalid_argument(
            f"request_id must be at most {_MAX_REQUEST_ID_CHARS} printable ASCII characters (no control or "
            "non-ASCII characters)"
        )


# Each replica's link: one stream for the steps of every session pinned there.
TARGET_LINK = LinkMessages(lambda stub: stub.Verify(), target_pb2.VerifyStep, target_pb2.VerifyBatch)
DRAFT_LINK = LinkMessages(lambda stub: stub.Draft(), draft_pb2.DraftStep, draft_pb2.DraftBatch, fetches=True)


class PairMismatch(Exception):
    """Draft and target (or the orchestrator's tokenizer) do not share a vocabulary."""


def check_pair(
    target: common_pb2.ModelInfo, draft: common_pb2.ModelInfo, translation: Translation | None = None
) -> None:
    """Refuse a draft whose token ids do not mean what the target's mean. Embedding widths may differ
    when both report the same tokenizer (Qwen pads its embeddings by model size): the ids past the
    tokenizer are padding, and the orchestrator pads or cuts the draft's rows to the target's width.
    With `translation` (--draft-tokenizer), the draft has its own tokenizer and proposes only the
    tokens it shares with the target's (--target-tokenizer on the draft service)."""
    if translation is not None or draft.target_tokenizer_fingerprint:
        _check_translated_pair(target, draft, translation)
        return
    same_tokenizer = bool(draft.tokenizer_fingerprint) and draft.tokenizer_fingerprint == target.tokenizer_fingerprint
    if draft.vocab_size != target.vocab_size and not same_tokenizer:
        raise PairMismatch(
            f"draft model {draft.model!r} has a vocabulary of {draft.vocab_size} tokens but target model "
            f"{target.model!r} has {target.vocab_size}, and they do not both report one tokenizer (a padded "
            "pair must ship the same tokenizer with each checkpoint); choose a draft that shares the target's "
            "tokenizer, or draft across tokenizers (--draft-tokenizer here, --target-tokenizer on the draft)"
        )
    if draft.vocab_size != target.vocab_size:
        log.info(
            "padded_pair",
            draft_vocab_size=draft.vocab_size,
            target_vocab_size=target.vocab_size,
            draft_rows=(
                f"padded with q = 0 for ids {draft.vocab_size}..{target.vocab_size - 1}"
                if draft.vocab_size < target.vocab_size
                else f"cut: the draft proposes below {target.vocab_size} only, q renormalised over those ids"
            ),
        )
    if (
        draft.tokenizer_fingerprint
        and target.tokenizer_fingerprint
        and (draft.tokenizer_fingerprint != target.tokenizer_fingerprint)
    ):
        raise PairMismatch(
            f"draft model {draft.model!r} and target model {target.model!r} have different tokenizers "
            f"(fingerprints {draft.tokenizer_fingerprint[:12]} and {target.tokenizer_fingerprint[:12]}); "
            "choose a draft that shares the target's tokenizer, or draft across tokenizers (--draft-tokenizer "
            "here, --target-tokenizer on the draft service)"
        )


def _check_translated_pair(
    target: common_pb2.ModelInfo, draft: common_pb2.ModelInfo, translation: Translation | None
) -> None:
    """A draft with another tokenizer: the orchestrator holds its tokenizer, and the draft proposes
    the target's shared tokens alone."""
    if translation is None:
        raise PairMismatch(
            f"draft service {draft.model!r} drafts for a target with another tokenizer (--target-tokenizer); "
            "start the orchestrator with --draft-tokenizer naming the draft's tokenizer"
        )
    if not draft.target_tokenizer_fingerprint:
        raise PairMismatch(
            f"--draft-tokenizer is set, but draft service {draft.model!r} proposes over its whole vocabulary: "
            "start it with --target-tokenizer naming the target's tokenizer"
        )
    if draft.tokenizer_fingerprint != translation.draft_fingerprint:
        raise PairMismatch(
            f"--draft-tokenizer {translation.pair.draft_name} is not draft model {draft.model!r}'s tokenizer "
            f"(fingerprints {translation.draft_fingerprint[:12]} and {draft.tokenizer_fingerprint[:12]}); "
            "name the draft checkpoint's tokenizer"
        )
    if target.tokenizer_fingerprint and draft.target_tokenizer_fingerprint != target.tokenizer_fingerprint:
        raise PairMismatch(
            f"draft service {draft.model!r} proposes the tokens it shares with another tokenizer than target model "
            f"{target.model!r}'s (fingerprints {draft.target_tokenizer_fingerprint[:12]} and "
            f"{target.tokenizer_fingerprint[:12]}); start it with --target-tokenizer naming the target's tokenizer"
        )


def translation_for(target: PreTrainedTokenizerBase, config: OrchestratorConfig) -> Translation:
    """The map between the target's ids and those of --draft-tokenizer, its overlap checked against
    --min-vocab-overlap and logged. Raises PairMismatch naming both tokenizers."""
    draft = AutoTokenizer.from_pretrained(config.draft_tokenizer)
    try:
        translation = Translation(target, draft)
        overlap = check_overlap(translation.pair, target, config.min_vocab_overlap)
    except VocabularyError as exc:
        raise PairMismatch(str(exc)) from None
    log.info(
        "cross_tokenizer_draft",
        draft_tokenizer=config.draft_tokenizer,
        shared_tokens=len(translation.to_target),
        overlap=round(overlap, 4),
        overlap_floor=config.min_vocab_overlap,
        greedy_rule=config.cross_greedy,
    )
    return translation


async def fetch_model_info(pool: ReplicaPool, timeout_s: float) -> common_pb2.ModelInfo:
    """GetModelInfo from the first replica that answers, waiting up to timeout_s."""
    deadline = time.monotonic() + timeout_s
    last_error = "no replicas"
    while True:
        for replica in pool.replicas:
            try:
                info: common_pb2.ModelInfo = await replica.stub.GetModelInfo(
                    common_pb2.GetModelInfoRequest(), timeout=5.0
                )
                return info
            except grpc.aio.AioRpcError as exc:
                last_error = f"{replica.address}: {exc.code().name} {exc.details()}"
        if time.monotonic() >= deadline:
            raise ConnectionError(f"{pool.name} service did not answer within {timeout_s:.0f} s ({last_error})")
        await asyncio.sleep(_INFO_POLL_S)


def one_host(config: OrchestratorConfig) -> bool:
    """Whether every target and draft replica is at one address (`dns:///` names: never known)."""
    hosts = {address.strip().rpartition(":")[0] for address in f"{config.target},{config.draft}".split(",") if address}
    return bool(config.draft) and len(hosts) == 1 and not any(h.startswith("dns:") for h in hosts)


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
        # Structured outputs: the orchestrator checks every committed token with a matcher of its own.
        self.grammars: Grammars | None = None
        if target_info.structured_output_kinds:
            self.grammars = Grammars.for_tokenizer(
                tokenizer, target_info.vocab_size, target_info.eos_token_ids, "orchestrator"
            )
        self._compiler = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="compile")

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
        self._compiler.shutdown(wait=False, cancel_futures=True)

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

    async def _prompt_ids(self, request: orchestrator_pb2.GenerateRequest) -> list[int]:
        which = request.WhichOneof("prompt")
        context = self.target_info.max_context
        if which == "text":
            most = context * MAX_PROMPT_CHARS_PER_TOKEN
            if len(request.text) > most:
                raise invalid_argument(
                    f"the prompt text has {len(request.text)} characters; at most {most} are accepted for a "
                    f"context of {context} tokens"
                )
            # Tokenizing is CPU work: off the event loop, so other streams keep moving.
            ids = list((await asyncio.to_thread(self.tokenizer, request.text))["input_ids"]) if request.text else []
        elif which == "token_ids":
            ids = list(request.token_ids.ids)
            vocab = self.target_info.vocab_size
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise invalid_argument(f"token_ids holds {bad[0]}, outside the vocabulary [0, {vocab})")
        else:
            ids = []
        if not ids:
            raise invalid_argument("the prompt is empty: set `text` or `token_ids` to at least one token")
        if len(ids) >= context:
            raise invalid_argument(
                f"the prompt has {len(ids)} tokens but the target model's context is {context}; "
                f"shorten it to at most {context - 1} tokens"
            )
        return ids

    async def validate(self, request: orchestrator_pb2.GenerateRequest) -> tuple[GenerationRequest, str]:
        """A GenerationRequest and the policy name, or INVALID_ARGUMENT naming the field and range.

        Everything a request can get wrong is checked here, before any service sees it."""
        cfg = self.config
        check_request_id(request.request_id)
        prompt = await self._prompt_ids(request)
        if not 1 <= request.max_new_tokens <= cfg.max_new_tokens_cap:
            raise invalid_argument(
                f"max_new_tokens must be in [1, {cfg.max_new_tokens_cap}]; got {request.max_new_tokens}"
            )
        sampling = SamplingParams(
            temperature=request.temperature,
            top_k=request.top_k,
            top_p=request.top_p if request.HasField("top_p") else 1.0,
        ).validated()
        if request.speculation_policy and request.speculation_policy not in POLICY_BY_ENUM:
            raise invalid_argument(
                f"speculation_policy {request.speculation_policy} is unknown; use one of {', '.join(POLICIES)}"
            )
        policy = POLICY_BY_ENUM.get(request.speculation_policy, cfg.speculation_policy)
        if request.draft_method and request.draft_method not in DRAFT_METHOD_BY_ENUM:
            raise invalid_argument(
                f"draft_method {request.draft_method} is unknown; use one of {', '.join(DRAFT_METHODS)}"
            )
        method = DRAFT_METHOD_BY_ENUM.get(request.draft_method, cfg.draft_method)
        can_draft = self.draft is not None or method != MODEL  # the lookup needs no draft service
        # Under load_aware, K is an upper bound, by default the server's cap.
        default_k = cfg.max_speculative_tokens if policy == "load_aware" else cfg.num_speculative_tokens
        k = request.num_speculative_tokens if request.HasField("num_speculative_tokens") else default_k * can_draft
        if not 0 <= k <= cfg.max_speculative_tokens:
            raise invalid_argument(f"num_speculative_tokens must be in [0, {cfg.max_speculative_tokens}]; got {k}")
        if k > 0 and not can_draft:
            raise failed_precondition(
                "num_speculative_tokens > 0 with the model draft method needs a draft service, and this "
                "orchestrator has none (start it with --draft HOST:PORT, use draft_method NGRAM, or send "
                "num_speculative_tokens = 0)"
            )
        if len(request.stop) > _MAX_STOP_STRINGS or any(not 0 < len(s) <= _MAX_STOP_CHARS for s in request.stop):
            raise invalid_argument(
                f"stop takes at most {_MAX_STOP_STRINGS} non-empty strings of at most {_MAX_STOP_CHARS} characters"
            )
        seed = request.seed if request.HasField("seed") else random.getrandbits(64)
        overlap = request.overlap_drafting if request.HasField("overlap_drafting") else cfg.overlap_drafting
        tree = request.speculation_tree if request.HasField("speculation_tree") else cfg.speculation_tree == "auto"
        request_id = request.request_id or uuid.uuid4().hex
        salt = request.cache_salt.encode()
        if len(salt) > MAX_CACHE_SALT_BYTES:
            raise invalid_argument(f"cache_salt has {len(salt)} bytes; at most {MAX_CACHE_SALT_BYTES} are accepted")
        constraint, template = await self._constraint(request)
        extras = self._vllm_extras(request, len(prompt), constraint is not None)
        generation_request = GenerationRequest(
            request_id=request_id,
            prompt_token_ids=prompt,
            max_new_tokens=request.max_new_tokens,
            sampling=sampling,
            seed=seed,
            num_speculative_tokens=k,
            overlap_drafting=overlap and k > 0,
            min_confidence=cfg.min_confidence,
            draft_method=method,
            ngram_min=cfg.ngram_min,
            ngram_max=cfg.ngram_max,
            cache_salt=salt,
            constraint=constraint,
            constraint_template=template,
            tree=tree and k > 0,
            **extras,
        )
        return generation_request, policy

    def _vllm_extras(
        self, request: orchestrator_pb2.GenerateRequest, prompt_tokens: int, constrained: bool
    ) -> dict[str, Any]:
        """ignore_eos, min_tokens, stop_token_ids and the logprobs fields, checked (INVALID_ARGUMENT naming
        the field and its range), as GenerationRequest's fields."""
        vocab = self.target_info.vocab_size
        stop_ids = frozenset(request.stop_token_ids)
        if len(stop_ids) > MAX_STOP_TOKEN_IDS or any(not 0 <= t < vocab for t in stop_ids):
            raise invalid_argument(f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids, each in [0, {vocab})")
        if request.ignore_eos and constrained:
            raise invalid_argument(
                "ignore_eos cannot be combined with structured_output: a constrained output ends at EOS once "
                "it is complete"
            )
        if request.min_tokens > request.max_new_tokens:
            raise invalid_argument(
                f"min_tokens must be in [0, max_new_tokens = {request.max_new_tokens}]; got {request.min_tokens}"
            )
        banned = stop_ids | (frozenset() if request.ignore_eos else frozenset(self.target_info.eos_token_ids))
        ban = None
        if request.min_tokens and banned:
            ban = TokenBan(tuple(sorted(banned)), prompt_tokens + request.min_tokens)
        for name in ("top_logprobs", "prompt_logprobs"):
            if getattr(request, name) > MAX_TOP_LOGPROBS:
                raise invalid_argument(f"{name} must be in [0, {MAX_TOP_LOGPROBS}]; got {getattr(request, name)}")
        if request.top_logprobs and not request.logprobs:
            raise invalid_argument("top_logprobs needs logprobs = true")
        prompt_logprobs = request.prompt_logprobs if request.HasField("prompt_logprobs") else None
        if prompt_logprobs is not None and prompt_tokens > self.target_info.max_batch_tokens:
            raise invalid_argument(
                f"prompt_logprobs scores the whole prompt in one forward: at most the target's max_batch_tokens = "
                f"{self.target_info.max_batch_tokens} prompt tokens; got {prompt_tokens}"
            )
        return {
            "ignore_eos": request.ignore_eos,
            "stop_token_ids": stop_ids,
            "ban": ban,
            "logprobs": request.logprobs,
            "top_logprobs": request.top_logprobs,
            "prompt_logprobs": prompt_logprobs,
        }

    async def _constraint(self, request: orchestrator_pb2.GenerateRequest) -> tuple[ConstraintSpec | None, Any]:
        """The request's structured output, compiled (off the event loop), or None; INVALID_ARGUMENT with
        the compiler's message when it does not compile."""
        if not request.HasField("structured_output"):
            return None, None
        spec = ConstraintSpec.from_proto(request.structured_output)
        if spec is None:
            return None, None
        if self.grammars is None or spec.kind not in self.target_info.structured_output_kinds:
            raise failed_precondition(
                f"structured_output.{spec.kind} is not supported by this server's target service "
                f"(it supports: {', '.join(self.target_info.structured_output_kinds) or 'none'})"
            )
        if not self.target_info.eos_token_ids:
            raise failed_precondition("structured_output needs an EOS token to end on, and the target model has none")
        template = self.grammars.cached(spec)
        if template is None:
            template = await asyncio.get_running_loop().run_in_executor(self._compiler, self.grammars.compile, spec)
        metrics.STRUCTURED_OUTPUT_REQUESTS.labels(spec.kind).inc()
        return spec, template

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
        generation_request, policy = await self.validate(request)
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
