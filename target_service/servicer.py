"""TargetService: crop to `keep`, feed the block, return argmax ids or probability rows."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import torch

from model_host.engine import Job
from model_host.logits import logits_to_probs
from model_host.session_servicer import SessionServicer
from serving.errors import invalid_argument
from serving.sampling import SamplingParams
from serving.tensors import encode_prob_rows
from specdec.v1 import common_pb2, target_pb2, target_pb2_grpc

SERVICE_NAME = "specdec.v1.TargetService"


@dataclass(eq=False)
class VerifyJob(Job):
    """Feed the block; keep the logits of its last num_logits positions."""

    params: SamplingParams = field(default_factory=SamplingParams)
    logits: torch.Tensor | None = None  # [num_rows, vocab]
    argmax: list[int] | None = None  # greedy: the rows' argmax ids (TargetServicer.before_responding)

    def advance(self, logits: torch.Tensor) -> list[int] | None:
        self.logits = logits
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
        SamplingParams.from_proto(request.sampling)

    def make_job(self, slot: int, request: target_pb2.VerifyRequest) -> Job:
        # After a block's verify the session drafts before it verifies again: no batch waits for it.
        ids = list(request.append_token_ids)
        params = SamplingParams.from_proto(request.sampling)
        return VerifyJob(
            slot, request.keep, ids, request.num_rows, comes_straight_back=request.num_rows == 1, params=params
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

    def respond(self, job: Job, request: target_pb2.VerifyRequest) -> target_pb2.VerifyResponse:
        assert isinstance(job, VerifyJob) and job.logits is not None
        response = target_pb2.VerifyResponse(result=common_pb2.SESSION_RESULT_OK, cached_tokens=job.start)
        if job.params.greedy:
            argmax = job.argmax if job.argmax is not None else job.logits.argmax(dim=-1).tolist()
            response.argmax_token_ids.extend(argmax)
        else:
            response.target_probs.CopyFrom(encode_prob_rows(logits_to_probs(job.logits, job.params)))
        return response


def register(servicer: TargetServicer, server: grpc.aio.Server) -> None:
    target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, server)
