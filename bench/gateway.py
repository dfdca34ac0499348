"""`python -m bench.gateway`: what the HTTP gateway adds over calling gRPC directly.

The same greedy requests, streamed, interleaved: through the orchestrator's gRPC API and through the
gateway with the `openai` package, at concurrency 1 on loopback. Reports the median over requests of
the extra wall time per streamed token (the goal: under 1 ms).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import openai

from default_models.prompts import held_out_prompts
from specdec.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from tools.local_stack import DEFAULT_PAIR, LOOPBACK, LocalStack, free_port


def _grpc_stream(stub: orchestrator_pb2_grpc.OrchestratorStub, prompt: str, tokens: int) -> tuple[float, int]:
    started = time.perf_counter()
    count = 0
    for message in stub.Generate(orchestrator_pb2.GenerateRequest(text=prompt, max_new_tokens=tokens)):
        count += len(message.token_ids)
    return time.perf_counter() - started, count


def _gateway_stream(client: openai.OpenAI, model: str, prompt: str, tokens: int) -> tuple[float, int]:
    started = time.perf_counter()
    count = 0
    stream = client.completions.create(
        model=model, prompt=prompt, max_tokens=tokens, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    for chunk in stream:
        if chunk.usage is not None:
            count = chunk.usage.completion_tokens
    return time.perf_counter() - started, count


@contextmanager
def running_gateway(orchestrator: str) -> Iterator[tuple[int, int]]:
    """`python -m http_gateway` in front of `orchestrator`, once it answers: its port and pid."""
    port = free_port()
    command = [sys.executable, "-m", "http_gateway", "--orchestrator", orchestrator, "--port", str(port),
               "--log-level", "warning"]  # fmt: skip
    gateway = subprocess.Popen(command, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        client = openai.OpenAI(base_url=f"http://{LOOPBACK}:{port}/v1", api_key="unused", max_retries=0)
        deadline = time.monotonic() + 120
        while True:
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        yield port, gateway.pid
    finally:
        gateway.terminate()
        gateway.wait(15)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.gateway", description=__doc__)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    prompts = held_out_prompts(args.prompts)
    overheads: list[float] = []
    with (
        LocalStack(str(DEFAULT_PAIR / "target"), str(DEFAULT_PAIR / "draft")) as stack,
        running_gateway(stack.orchestrator_address) as (port, _),
    ):
        client = openai.OpenAI(base_url=f"http://{LOOPBACK}:{port}/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        with grpc.insecure_channel(stack.orchestrator_address) as channel:
            stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
            _grpc_stream(stub, prompts[0], 8)
            _gateway_stream(client, model, prompts[0], 8)
            for rep in range(args.reps):
                for index, prompt in enumerate(prompts):
                    runs = [("grpc", stub), ("gateway", client)]
                    if (rep + index) % 2:
                        runs.reverse()  # alternate which goes first
                    times = {}
                    for name, _ in runs:
                        if name == "grpc":
                            times[name] = _grpc_stream(stub, prompt, args.max_new_tokens)
                        else:
                            times[name] = _gateway_stream(client, model, prompt, args.max_new_tokens)
                    (grpc_s, grpc_n), (http_s, http_n) = times["grpc"], times["gateway"]
                    assert grpc_n == http_n, (grpc_n, http_n)
                    overheads.append((http_s - grpc_s) / max(1, http_n))
    median_ms = 1000 * statistics.median(overheads)
    quartiles = [1000 * q for q in statistics.quantiles(overheads, n=4)]
    print(f"gateway overhead per streamed token, concurrency 1: median {median_ms:.3f} ms "
          f"(quartiles {quartiles[0]:.3f} / {quartiles[2]:.3f} ms) over {len(overheads)} request pairs")  # fmt: skip
    (args.out / "gateway-latest.json").write_text(
        json.dumps({"median_ms_per_token": median_ms, "quartiles_ms": quartiles, "pairs": len(overheads)}, indent=1)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
