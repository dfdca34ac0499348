"""Command-line client: stream a generation to the terminal, or print one JSON object.

python -m tools.client --server HOST:PORT --prompt TEXT [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from serving.protocol import POLICY_BY_NAME
from serving.security import channel_credentials
from specdec.v1 import orchestrator_pb2, orchestrator_pb2_grpc


@dataclass
class GenerateResult:
    """A whole generation, gathered from the stream."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    request_id: str = ""
    stats: dict[str, Any] = field(default_factory=dict)
    wall_seconds: float = 0.0


def build_request(args: argparse.Namespace) -> orchestrator_pb2.GenerateRequest:
    request = orchestrator_pb2.GenerateRequest(
        text=args.prompt,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        stop=args.stop or [],
    )
    if args.top_p is not None:
        request.top_p = args.top_p
    if args.seed is not None:
        request.seed = args.seed
    if args.num_speculative_tokens is not None:
        request.num_speculative_tokens = args.num_speculative_tokens
    if args.policy:
        request.speculation_policy = POLICY_BY_NAME[args.policy]
    if args.overlap is not None:
        request.overlap_drafting = args.overlap
    return request


def generate(
    stub: orchestrator_pb2_grpc.OrchestratorStub,
    request: orchestrator_pb2.GenerateRequest,
    echo: bool = False,
    metadata: tuple[tuple[str, str], ...] = (),
) -> GenerateResult:
    """Run one Generate call; with echo, write text deltas to stdout as they arrive."""
    from google.protobuf.json_format import MessageToDict

    result = GenerateResult()
    started = time.perf_counter()
    for message in stub.Generate(request, metadata=metadata):
        result.request_id = result.request_id or message.request_id
        result.text += message.text
        result.token_ids.extend(message.token_ids)
        if echo and message.text:
            sys.stdout.write(message.text)
            sys.stdout.flush()
        if message.finish_reason:
            result.finish_reason = (
                orchestrator_pb2.FinishReason.Name(message.finish_reason).removeprefix("FINISH_REASON_").lower()
            )
            result.stats = MessageToDict(
                message.stats, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
            )
    result.wall_seconds = time.perf_counter() - started
    return result


def summary(result: GenerateResult) -> str:
    stats = result.stats
    drafted = int(stats.get("draft_tokens", 0))
    accepted = int(stats.get("accepted_tokens", 0))
    tokens = len(result.token_ids)
    rate = f"{accepted / drafted:.2f}" if drafted else "n/a (target alone)"
    return (
        f"[{result.finish_reason}] {tokens} tokens in {result.wall_seconds:.2f} s = "
        f"{tokens / result.wall_seconds:.1f} tokens/s; rounds {stats.get('rounds', 0)}; "
        f"acceptance rate {rate} ({accepted}/{drafted} draft tokens); "
        f"mean tokens per round {tokens / max(1, int(stats.get('rounds', 1))):.2f}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tools.client", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--server", default="127.0.0.1:50050", help="orchestrator HOST:PORT")
    parser.add_argument("--prompt", required=True, help="prompt text")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    parser.add_argument("--top-k", type=int, default=0, help="0 keeps all tokens")
    parser.add_argument("--top-p", type=float, default=None, help="in (0, 1]; default 1")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--num-speculative-tokens", type=int, default=None, help="K; 0 is the target alone")
    parser.add_argument("--policy", choices=sorted(POLICY_BY_NAME), default=None, help="how K changes between rounds")
    parser.add_argument(
        "--overlap",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="overlapped drafting (server default when unset)",
    )
    parser.add_argument("--stop", action="append", help="stop string (repeatable)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the server")
    parser.add_argument("--tls-ca", default="", help="PEM CA bundle to trust: connect over TLS")
    parser.add_argument("--tls-cert", default="", help="PEM client certificate (mutual TLS, with --tls-key)")
    parser.add_argument("--tls-key", default="", help="PEM private key for --tls-cert")
    parser.add_argument(
        "--api-key", default=os.environ.get("SPECDEC_API_KEY", ""), help="API key (default: $SPECDEC_API_KEY)"
    )
    args = parser.parse_args(argv)
    credentials = channel_credentials(args.tls_ca, args.tls_cert, args.tls_key, flags="--tls")
    metadata = (("authorization", f"Bearer {args.api_key}"),) if args.api_key else ()
    channel = grpc.secure_channel(args.server, credentials) if credentials else grpc.insecure_channel(args.server)
    with channel:
        try:
            grpc.channel_ready_future(channel).result(timeout=args.timeout)
        except grpc.FutureTimeoutError:
            print(f"error: no orchestrator at {args.server}", file=sys.stderr)
            return 2
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
        try:
            if args.json:
                result = generate(stub, build_request(args), metadata=metadata)
                print(
                    json.dumps(
                        {
                            "text": result.text,
                            "token_ids": result.token_ids,
                            "finish_reason": result.finish_reason,
                            "request_id": result.request_id,
                            "wall_seconds": result.wall_seconds,
                            "stats": result.stats,
                        }
                    )
                )
            else:
                sys.stdout.write(args.prompt)
                result = generate(stub, build_request(args), echo=True, metadata=metadata)
                print("\n\n" + summary(result))
        except grpc.RpcError as exc:
            print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)  # type: ignore[attr-defined]
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
