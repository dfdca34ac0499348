"""DraftService: crop to `keep`, feed the new tokens, draft up to K tokens autoregressively (one per
engine iteration, batched with every other drafting session).

A sampling step answers each draft token's q(x) only; the rows the tokens were sampled from stay here,
the last two steps' of each session (the step verified and the one drafted beside it), until the
orchestrator fetches the one a rejection needs (`RowFetch`, answered at once on the event loop)."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from concurrent.futures import Future
from typing import Any

import grpc
import structlog
import torch
from transformers import AutoTokenizer

from draft_service.jobs import DraftJob, GuessingDraftJob, TreeDraftJob, read_rows
from draft_service.lean import LeanDraft
from draft_service.speculation import SpeculationCache
from draft_service.tree import Calibration, TreeBuilder
from model_host.config import ModelServiceConfig
from model_host.forward import Forward, ModelNotServable
from model_host.job import Job
from model_host.loading import LoadedModel
from model_host.session_servicer import SessionServicer
from model_host.sessions import Session
from serving.constraints import SessionConstraint, TokenBan
from serving.errors import invalid_argument
from serving.logits import rows_to_wire
from serving.sampling import SamplingParams, seeded_generator
from serving.trees import DraftTree
from serving.vocab import tokenizer_fingerprint
from serving.vocab_map import VocabularyError, intersect
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc

SERVICE_NAME = "specdec.v1.DraftService"
log = structlog.get_logger(__name__)
# A fetch asks for a row of the step just verified, while the step drafted beside it may have ended.
_STEPS_HELD = 2


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
        # A GPU of its own, or a modeled one standing for it: the model's inputs live off the host's CPU.
        on_device = torch.device(loaded.input_device).type != "cpu" or bool(config.simulated_device)
        if on_device:
            # A forward's plain greedy rows, read together: on a device each row's read waits for a copy
            # to the host. Not on a CPU, where they cost as much or more together (docs/design.md).
            self.engine.before_advance = read_rows
        # Token trees: how often a node's child at each rank is kept, learnt from every session's verdicts,
        # and each session's last tree (its length before it, the tree, the rows it grew from).
        self.tree_calibration = Calibration(config.max_speculative_tokens)
        self._trees: dict[str, tuple[int, DraftTree, dict[int, torch.Tensor]]] = {}
        # A target with another tokenizer: the draft proposes the tokens both share alone.
        self.shared: torch.Tensor | None = None
        self.target_tokenizer_fingerprint = ""
        if config.target_tokenizer:
            self.shared, self.target_tokenizer_fingerprint = shared_tokens(loaded, config.target_tokenizer)
        self.speculation: SpeculationCache | None = None  # blocks drafted ahead (draft_service/speculation.py)
        if config.speculation_cache_tokens and self.engine.forward.batched and self.shared is None:
            self.speculation = SpeculationCache(
                self.engine,
                config.speculation_cache_tokens,
                config.max_batch_size,
                self.draft_job,
                config.max_speculative_tokens,
                loaded.max_context,
                fans_out=on_device,
            )

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
        if request.tree_budget:  # the tree is written after the sequence, every node, then dropped
            return request.keep + len(request.append_token_ids) + request.tree_budget
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
        params = SamplingParams.from_proto(request.sampling)
        TokenBan.from_proto(request.ban, self.loaded.vocab_size)
        if request.whole_vocabulary and not params.greedy:
            raise invalid_argument(
                "whole_vocabulary (string-level exact match) serves greedy steps only: a sampled step's q must be "
                "over the tokens the target shares; drop whole_vocabulary or the sampling"
            )
        if request.tree_budget:
            self._check_tree(request)

    def _check_tree(self, request: draft_pb2.DraftRequest) -> None:
        if request.tree_budget != request.num_speculative_tokens:
            raise invalid_argument(
                f"tree_budget must equal num_speculative_tokens; got {request.tree_budget} and "
                f"{request.num_speculative_tokens}"
            )
        if not self.engine.forward.batched:
            raise invalid_argument(f"the {self.engine.forward.name} forward serves chains only: no token trees")
        if self.shared is not None:
            raise invalid_argument("a draft for a target with another tokenizer drafts chains only: no token trees")
        unserved = [
            name
            for name, present in (
                ("sampling", not SamplingParams.from_proto(request.sampling).greedy),
                ("structured_output", request.HasField("structured_output")),
                ("ban", request.HasField("ban")),
                ("vocab_limit", request.vocab_limit > 0),
                ("speculate", request.HasField("speculate")),
            )
            if present
        ]
        if unserved:
            raise invalid_argument(
                f"a tree step is greedy and plain in this version; drop {', '.join(unserved)} or the tree"
            )

    def make_job(self, slot: int, request: draft_pb2.DraftRequest, constraint: SessionConstraint | None) -> Job:
        if request.tree_budget:
            builder = TreeBuilder(
                None, request.tree_budget, seeded_generator(request.seed), calibration=self.tree_calibration
            )
            return TreeDraftJob(slot, request.keep, list(request.append_token_ids), 1, builder=builder)
        return self.draft_job(slot, request, constraint)

    def draft_job(
        self,
        slot: int,
        request: draft_pb2.DraftRequest,
        constraint: SessionConstraint | None,
        guessing: bool = False,
    ) -> DraftJob:
        """The step's job; `guessing`: a block drafted ahead for a whole block accepted, which guesses
        the bonus token before drafting (draft_service/speculation.py)."""
        if constraint is not None:
            constraint.feed(request.append_token_ids, request.keep)  # committed tokens: allowed
        job_type = GuessingDraftJob if guessing else DraftJob
        job = job_type(
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
            shared=None if request.whole_vocabulary else self.shared,
        )
        cache = self.speculation
        if cache is not None and _speculates(request):
            # Its session's next step follows the target's verify, not this answer: the engine does not
            # hold a forward for it. The cache needs each position's likeliest tokens when it fans out.
            job.comes_straight_back = False
            job.alternatives = cache.alternatives
        return job

    def drafted_ahead(self, session: Session, request: draft_pb2.DraftRequest) -> tuple[Job, Future[Any]] | None:
        last_tree = self._trees.pop(session.session_id, None)
        if last_tree is not None and request.keep == last_tree[0]:  # the step names the tree's verdict
            _, tree, rows = last_tree
            self.tree_calibration.learn_from_tokens(tree, rows, list(request.append_token_ids))
        if self.speculation is None:
            return None
        entry = self.speculation.take(session, request)
        if entry is None:
            return None
        return entry.job, self.speculation.settle(session, entry)

    def respond(self, job: Job, request: draft_pb2.DraftRequest, session: Session) -> draft_pb2.DraftResponse:
        if isinstance(job, TreeDraftJob):
            assert job.builder is not None
            tree = job.builder.tree()
            self._trees[session.session_id] = (job.start, tree, job.rows)
            return draft_pb2.DraftResponse(
                result=common_pb2.SESSION_RESULT_OK,
                draft_token_ids=tree.token_ids,
                tree_parents=tree.parents,
                cached_tokens=job.start,
            )
        assert isinstance(job, DraftJob)
        speculated = job.speculative
        k = request.num_speculative_tokens
        if speculated:
            # Its forwards' time for the tokens it answers with, as a step drafting them would report:
            # not its guess's forward, nor those of tokens past this step's K.
            job.forward_seconds *= min(k, len(job.token_ids)) / max(1, job.rows_scored)
        if speculated and len(job.token_ids) > k:  # drafted ahead with a larger K: its first k are this step's
            job.start -= len(job.token_ids) - k  # the tokens past them stay cached, as a rollback would crop
            for drafted in (job.token_ids, job.token_probs, job.rows, job.confidences, job.likely):
                del drafted[k:]
        response = draft_pb2.DraftResponse(
            result=common_pb2.SESSION_RESULT_OK,
            draft_token_ids=job.token_ids,
            draft_token_probs=job.token_probs,
            cached_tokens=job.start,
            speculated=speculated,
        )
        if self.speculation is not None and _speculates(request):
            # After this answer is on its way: launching forks and submits jobs, none of the step's work.
            asyncio.get_running_loop().call_soon(self.speculation.launch, session, request, job)
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
                    with self.engine.forward.answering():  # not behind the draft's next forward
                        result.fetched.row.CopyFrom(rows_to_wire(rows[index : index + 1], params))
                    result.fetched.held = True
                except Exception:
                    log.exception("row_fetch_failed", request_id=session.request_id if session else "")
        return result

    def forget(self, session: Session) -> None:
        self._rows.pop(session.session_id, None)
        self._trees.pop(session.session_id, None)
        if self.speculation is not None:
            self.speculation.forget(session)

    def model_info(self) -> common_pb2.ModelInfo:
        info = super().model_info()
        # Offered where it fans out (a GPU, or a modeled one): on a CPU, drafting ahead for a whole block
        # alone is what the orchestrator's step beside the verify does, without a round trip for a hit.
        cache = self.speculation
        info.speculation_cache_tokens = self.config.speculation_cache_tokens if cache and cache.fans_out else 0
        info.target_tokenizer_fingerprint = self.target_tokenizer_fingerprint
        return info


def shared_tokens(loaded: LoadedModel, target_tokenizer: str) -> tuple[torch.Tensor, str]:
    """The draft ids that `target_tokenizer` shares by bytes (its EOS mapped to the draft's), as a mask
    over the draft's rows, and that tokenizer's fingerprint. Raises ModelNotServable naming what to change."""
    if loaded.tokenizer is None:
        raise ModelNotServable("--target-tokenizer needs the draft's own tokenizer, and this checkpoint ships none")
    try:
        target = AutoTokenizer.from_pretrained(target_tokenizer)
    except (OSError, ValueError) as exc:
        raise ModelNotServable(f"--target-tokenizer {target_tokenizer!r} cannot be loaded: {exc}") from exc
    try:
        pair = intersect(target, loaded.tokenizer)
    except VocabularyError as exc:
        raise ModelNotServable(f"--target-tokenizer: {exc}") from exc
    ids = [d for d in pair.proposable if d < loaded.vocab_size]
    shared = torch.zeros(loaded.vocab_size, dtype=torch.bool, device=loaded.model.get_output_embeddings().weight.device)
    shared[ids] = True
    log.info(
        "cross_tokenizer_draft",
        target_tokenizer=target_tokenizer,
        shared_tokens=len(ids),
        draft_vocab_size=loaded.vocab_size,
        detail="drafts propose the shared tokens alone; no speculation cache or token trees",
    )
    return shared, tokenizer_fingerprint(target)


def _speculates(request: draft_pb2.DraftRequest) -> bool:
    return request.HasField("speculate") and request.speculate.next_k > 0 and request.num_speculative_tokens > 0


def register(servicer: DraftServicer, server: grpc.aio.Server) -> None:
    draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, server)
