"""TargetService: crop to `keep`, feed the block, return argmax ids or probability rows."""

from __future__ import annotations

from collections.abc import Iterator

import grpc

from model_host.logits import logits_to_probs
from model_host.session_servicer import SessionServicer
from model_host.sessions import Session
from serving.errors import invalid_argument
from serving.sampling import SamplingParams
from serving.tensors import encode_prob_rows
from specdec.v1 import common_pb2, target_pb2, target_pb2_grpc

SERVICE_NAME = "specdec.v1.TargetService"


class TargetServicer(
    SessionServicer[target_pb2.VerifyRequest, target_pb2.VerifyResponse], target_pb2_grpc.TargetServiceServicer
):
    role = "target"
    response_type = target_pb2.VerifyResponse

    def Verify(
        self, request_iterator: Iterator[target_pb2.VerifyRequest], context: grpc.ServicerContext
    ) -> Iterator[target_pb2.VerifyResponse]:
        return self.serve_session(request_iterator, context)

    def check_step(self, request: target_pb2.VerifyRequest) -> None:
        most = min(len(request.append_token_ids), self.config.max_speculative_tokens + 1)
        if not 1 <= request.num_rows <= most:
            raise invalid_argument(
                f"num_rows must be in [1, min(len(append_token_ids), --max-speculative-tokens + 1) = {most}]; "
                f"got {request.num_rows}"
            )
        SamplingParams.from_proto(request.sampling)

    def step(self, session: Session, request: target_pb2.VerifyRequest) -> tuple[target_pb2.VerifyResponse, int]:
        params = SamplingParams.from_proto(request.sampling)
        logits = self.feed(session, request.append_token_ids, request.num_rows)  # [num_rows, vocab]
        response = target_pb2.VerifyResponse(result=common_pb2.SESSION_RESULT_OK)
        if params.greedy:
            response.argmax_token_ids.extend(logits.argmax(dim=-1).tolist())
        else:
            response.target_probs.CopyFrom(encode_prob_rows(logits_to_probs(logits, params)))
        length = request.keep + len(request.append_token_ids)
        response.cached_tokens = length
        return response, length


def register(servicer: TargetServicer, server: grpc.Server) -> None:
    target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, server)
