"""TargetService: crop to `keep`, feed the block, return argmax ids or, sampling, the round's material:
the draft tokens' p(x), the first rejection, and the one row the round's last token is sampled from."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import torch

from model_host.job import Job
from model_host.session_servicer import SessionServicer
from model_host.sessions import Session
from serving.constraints import SessionConstraint, TokenBan, block_masks, mask_logits
from serving.errors import invalid_argument
from serving.logits import (
    MAX_TOP_LOGPROBS,
    first_rejection,
    logits_to_probs,
    processed_scores,
    rows_to_wire,
    token_logprobs,
)
from serving.sampling import SamplingParams
from specdec.v1 import common_pb2, target_pb2, target_pb2_grpc

SERVICE_NAME = "specdec.v1.TargetService"


def answer_sampled(
    response: target_pb2.VerifyResponse, logits: torch.Tensor, params: SamplingParams, request: target_pb2.VerifyRequest
) -> None:
    """Fill a sampled step's answer from the block's logits ([K + 1, vocab], the model's dtype): p(x) of
    each draft token, the first rejection by the acceptance function the orchestrator applies too, and
    that position's logits (the recovered token's row, or the bonus token's)."""
    k = len(request.draft_token_probs)
    probs = logits_to_probs(logits[:k], params)  # [K, vocab] float32: the bonus row's travels as logits
    ids = request.append_token_ids
    draft_ids = torch.tensor(ids[len(ids) - k :], dtype=torch.long)  # the last K fed: the draft tokens
    target_token_probs = probs[torch.arange(k), draft_ids.to(probs.device)].cpu()  # [K]
    draft_token_probs = torch.tensor(list(request.draft_token_probs), dtype=torch.float32)
    j = first_rejection(
        target_token_probs, draft_token_probs, torch.tensor(list(request.uniforms), dtype=torch.float64)
    )
    response.draft_token_target_probs.extend(target_token_probs.tolist())
    response.num_accepted = j
    response.row.CopyFrom(rows_to_wire(logits[j : j + 1], params))
    if request.logprobs:  # the accepted draft tokens' rows; the last token's row is `row`
        response.logprobs.CopyFrom(
            token_logprobs(processed_scores(logits[:j], params), draft_ids[:j].tolist(), request.top_logprobs)
        )


def answer_logprobs_greedy(
    response: target_pb2.VerifyResponse,
    logits: torch.Tensor,
    argmax: list[int],
    k: int,
    request: target_pb2.VerifyRequest,
) -> None:
    """Greedy logprobs of the tokens the round commits: each row's argmax up to the first row whose
    argmax differs from the draft token it scores (the recovered token), or through the bonus row."""
    ids = request.append_token_ids
    draft_ids = ids[len(ids) - k :]
    j = next((row for row in range(k) if argmax[row] != draft_ids[row]), k)
    response.logprobs.CopyFrom(token_logprobs(logits[: j + 1].float(), argmax[: j + 1], request.top_logprobs))


def check_tree(request: target_pb2.VerifyRequest) -> None:
    """A tree step's own faults, named: its parents, and what a tree step does not serve yet."""
    nodes = request.num_rows - 1
    if len(request.tree_parents) != nodes:
        raise invalid_argument(
            f"tree_parents must hold num_rows - 1 = {nodes} parents; got {len(request.tree_parents)}"
        )
    if any(not -1 <= parent < node for node, parent in enumerate(request.tree_parents)):
        raise invalid_argument("tree_parents must name an earlier node of the tree, or -1, for each node")
    unserved = [
        name
        for name, present in (
            ("sampling", not SamplingParams.from_proto(request.sampling).greedy),
            ("structured_output", request.HasField("structured_output")),
            ("ban", request.HasField("ban")),
            ("logprobs", request.logprobs),
            ("prompt_logprobs", request.prompt_logprobs),
        )
        if present
    ]
    if unserved:
        raise invalid_argument(
            f"a tree step is greedy and plain in this version; drop {', '.join(unserved)} or the tree"
        )


def tree_job(slot: int, request: target_pb2.VerifyRequest) -> VerifyJob:
    """Feed the tokens before the tree as a chain that stays, and the tree after them, in one row."""
    ids = list(request.append_token_ids)
    chain = len(ids) - (request.num_rows - 1)  # at least one: the row that scores the first node
    parents = (*range(-1, chain - 1), *[chain - 1 if p < 0 else chain + p for p in request.tree_parents])
    return VerifyJob(
        slot,
        request.keep,
        ids,
        request.num_rows,
        comes_straight_back=False,
        parents=parents,
        kept=chain,
        max_length=request.keep + len(ids),
        params=SamplingParams.from_proto(request.sampling),
        num_rows=request.num_rows,
    )


@dataclass(eq=False)
class VerifyJob(Job):
    """Feed the block; keep the logits of its last num_logits positions."""

    params: SamplingParams = field(default_factory=SamplingParams)
    num_rows: int = 1  # the rows the step answers: the last num_rows of the logits
    # [num_rows, vocab] bool: structured output's and min_tokens' masks, else None
    allowed: torch.Tensor | None = None
    logits: torch.Tensor | None = None  # [num_rows, vocab]
    prompt_logits: torch.Tensor | None = None  # [fed - num_rows, vocab]: prompt_logprobs steps only
    argmax: list[int] | None = None  # greedy: the rows' argmax ids (TargetServicer.before_responding)

    def advance(self, logits: torch.Tensor) -> list[int] | None:
        if logits.shape[0] > self.num_rows:  # prompt logprobs: every fed position's row
            self.prompt_logits, logits = logits[: -self.num_rows], logits[-self.num_rows :]
        # The constrained distribution is the target's: every row is masked before anything reads it.
        self.logits = logits if self.allowed is None else mask_logits(logits, self.allowed)
        return None


class TargetServicer(
    SessionServicer[target_pb2.VerifyRequest, target_pb2.VerifyResponse], target_pb2_grpc.TargetServiceServicer
):
    role = "target"
    response_type = target_pb2.VerifyResponse
    result_type = target_pb2.VerifyResult
    results_type = target_pb2.VerifyResults

    def Verify(
        self, request_iterator: AsyncIterator[target_pb2.VerifyBatch], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[target_pb2.VerifyResults]:
        return self.serve_link(request_iterator, context)

    def check_step(self, request: target_pb2.VerifyRequest) -> None:
        most = min(len(request.append_token_ids), self.config.max_speculative_tokens + 1)
        if not 1 <= request.num_rows <= most:
            raise invalid_argument(
                f"num_rows must be in [1, min(len(append_token_ids), --max-speculative-tokens + 1) = {most}]; "
                f"got {request.num_rows}"
            )
        if request.top_logprobs > MAX_TOP_LOGPROBS:
            raise invalid_argument(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]; got {request.top_logprobs}")
        if request.prompt_logprobs:
            if request.keep:
                raise invalid_argument("prompt_logprobs is only read on a session's first step (keep = 0)")
            if len(request.append_token_ids) > self.config.max_batch_tokens:
                raise invalid_argument(
                    f"prompt_logprobs computes every prompt row in one forward: at most --max-batch-tokens = "
                    f"{self.config.max_batch_tokens} tokens; got {len(request.append_token_ids)}"
                )
        TokenBan.from_proto(request.ban, self.loaded.vocab_size)
        if request.tree_parents:
            check_tree(request)
        if SamplingParams.from_proto(request.sampling).greedy:
            return
        k = request.num_rows - 1
        for name in ("draft_token_probs", "uniforms"):
            if len(getattr(request, name)) != k:
                raise invalid_argument(f"{name} must hold num_rows - 1 = {k} values; got {len(getattr(request, name))}")
        if not all(0.0 < q <= 1.0 for q in request.draft_token_probs):  # also rejects NaN
            raise invalid_argument("draft_token_probs must be in (0, 1]: each draft token was sampled from its row")
        if not all(0.0 <= u < 1.0 for u in request.uniforms):
            raise invalid_argument("uniforms must be in [0, 1)")

    def make_job(self, slot: int, request: target_pb2.VerifyRequest, constraint: SessionConstraint | None) -> Job:
        if request.tree_parents:
            return tree_job(slot, request)
        # After a block's verify the session drafts before it verifies again: no batch waits for it.
        ids = list(request.append_token_ids)
        params = SamplingParams.from_proto(request.sampling)
        # The masks depend on the tokens alone: computed here, on the event loop, while the engine runs.
        allowed = block_masks(constraint, ids, request.keep, request.num_rows) if constraint is not None else None
        ban = TokenBan.from_proto(request.ban, self.loaded.vocab_size)
        if ban is not None:
            first = request.keep + len(ids) - request.num_rows + 1  # the position the first row scores
            positions = range(first, first + request.num_rows)
            allowed = ban.restrict(allowed, positions, self.loaded.vocab_size)
        return VerifyJob(
            slot,
            request.keep,
            ids,
            # Prompt logprobs want every fed position's row, so nothing comes from the prefix cache.
            len(ids) if request.prompt_logprobs else request.num_rows,
            comes_straight_back=request.num_rows == 1,
            params=params,
            num_rows=request.num_rows,
            allowed=allowed,
        )

    def before_responding(self, jobs: list[Job]) -> None:
        """The argmax of every greedy row a wake answers, in one operation rather than one a session."""
        greedy = [
            (job, job.logits)
            for job in jobs
            if isinstance(job, VerifyJob) and job.params.greedy and job.logits is not None
        ]
        if not greedy:
            return
        ids = torch.cat([logits for _, logits in greedy]).argmax(dim=-1).tolist()  # [rows over all jobs]
        start = 0
        for job, logits in greedy:
            job.argmax = ids[start : start + logits.shape[0]]
            start += logits.shape[0]

    def respond(self, job: Job, request: target_pb2.VerifyRequest, session: Session) -> target_pb2.VerifyResponse:
        assert isinstance(job, VerifyJob) and job.logits is not None
        response = target_pb2.VerifyResponse(result=common_pb2.SESSION_RESULT_OK, cached_tokens=job.start)
        if job.params.greedy:
            argmax = job.argmax if job.argmax is not None else job.logits.argmax(dim=-1).tolist()
            response.argmax_token_ids.extend(argmax)
            if request.logprobs:
                answer_logprobs_greedy(response, job.logits, argmax, request.num_rows - 1, request)
        else:
            answer_sampled(response, job.logits, job.params, request)
        if job.prompt_logits is not None:
            scored = list(request.append_token_ids[1 : job.prompt_logits.shape[0] + 1])
            response.prompt_logprobs.CopyFrom(token_logprobs(job.prompt_logits, scored, request.top_logprobs))
        return response


def register(servicer: TargetServicer, server: grpc.aio.Server) -> None:
    target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, server)
