"""`--workers 2`: two orchestrator processes on one port, each with its own links to the services."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import grpc

from orchestrator.workers import share, worker_count
from specdec.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from tests.conftest import hf_greedy, wait_until
from tests.servers import LOOPBACK
from tools.local_stack import free_port, wait_serving

PROMPTS = [[(7 * i + j) % 40 + 5 for j in range(3 + i % 4)] for i in range(16)]
NEW_TOKENS = 12


def test_worker_counts_and_shares():
    assert worker_count("3") == 3 and worker_count("auto") >= 1
    assert share(64, 2) == 32 and share(5, 2) == 3 and share(0, 2) == 0


def test_two_workers_serve_one_port_exactly_and_the_target_batches_across_their_links(
    target_server, close_draft_server, target_model, tmp_path: Path
):
    """16 requests over 16 connections: both workers serve some, every greedy output is the target
    alone's, and the target answers steps of both workers' links in one forward."""
    servicer = target_server.servicer
    links_before = len(servicer._links)
    most_links = 0
    original = servicer.engine.after_group

    def after_group() -> None:  # the links a forward's jobs belong to, before they are woken
        nonlocal most_links
        with servicer._links_lock:
            most_links = max(most_links, len(servicer._to_wake))
        original()

    servicer.engine.after_group = after_group
    port = free_port()
    log = tmp_path / "orchestrator.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "orchestrator", "--target", f"{LOOPBACK}:{target_server.port}",
             "--draft", f"{LOOPBACK}:{close_draft_server.port}", "--host", LOOPBACK, "--port", str(port),
             "--workers", "2", "--num-speculative-tokens", "2", "--speculation-policy", "fixed"],
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        wait_serving(f"{LOOPBACK}:{port}", 120, process)
        # One worker answering is not both listening: the kernel spreads connections over the sockets
        # bound when they arrive, so a request sent before the second binds can only reach the first.
        assert wait_until(lambda: log.read_text().count('"event": "serving"') == 2, 120)
        outputs = asyncio.run(_generate(f"{LOOPBACK}:{port}"))
        links_during = len(servicer._links)
    finally:
        servicer.engine.after_group = original
        process.terminate()
        process.wait(30)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        assert output == hf_greedy(target_model, prompt, NEW_TOKENS), prompt
    served = [json.loads(line).get("worker") for line in log.read_text().splitlines() if '"request_done"' in line]
    assert len(served) == len(PROMPTS) and set(served) == {0, 1}, served
    assert links_during == links_before + 2  # one link each
    assert most_links >= 2  # a forward held steps of both links
    assert process.returncode == 0


async def _generate(address: str) -> list[list[int]]:
    channels = [grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) for _ in PROMPTS]

    async def one(channel: grpc.aio.Channel, prompt: list[int]) -> list[int]:
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
        request = orchestrator_pb2.GenerateRequest(
            token_ids=orchestrator_pb2.TokenIds(ids=prompt), max_new_tokens=NEW_TOKENS
        )
        return [t async for message in stub.Generate(request) for t in message.token_ids]

    try:
        return await asyncio.gather(*(one(c, p) for c, p in zip(channels, PROMPTS, strict=True)))
    finally:
        for channel in channels:
            await channel.close()
