"""bench/host_cpu.py: each cell asks for its own policy."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from bench.host_cpu import CELLS, REQUESTS_PER_STREAM, _drive
from serving.protocol import POLICY_BY_NAME
from specdec.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from tools.local_stack import LOOPBACK


class _Recording(orchestrator_pb2_grpc.OrchestratorServicer):
    """Answers every Generate with one token, and keeps the requests."""

    def __init__(self) -> None:
        self.requests: list[orchestrator_pb2.GenerateRequest] = []

    async def Generate(
        self, request: orchestrator_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[orchestrator_pb2.GenerateResponse]:
        self.requests.append(request)
        yield orchestrator_pb2.GenerateResponse(token_ids=[7])


@pytest.mark.parametrize("cell", list(CELLS))
def test_each_cell_asks_for_its_own_policy(cell):
    """The fixed K = 4 cell once set K alone, and the orchestrator's default policy (load_aware) ran it."""
    k, policy = CELLS[cell]

    async def run() -> list[orchestrator_pb2.GenerateRequest]:
        servicer = _Recording()
        server = grpc.aio.server()
        orchestrator_pb2_grpc.add_OrchestratorServicer_to_server(servicer, server)
        port = server.add_insecure_port(f"{LOOPBACK}:0")
        await server.start()
        try:
            driven = await _drive(f"{LOOPBACK}:{port}", 2, k, 8, policy)
        finally:
            await server.stop(None)
        assert driven["tokens"] == 2 * REQUESTS_PER_STREAM  # the warm-up request is not counted
        return servicer.requests

    requests = asyncio.run(run())
    assert len(requests) == 3 * REQUESTS_PER_STREAM
    assert {(r.num_speculative_tokens, r.speculation_policy) for r in requests} == {(k, POLICY_BY_NAME[policy])}


def test_a_processs_cpu_is_read_to_well_under_procs_tick(monkeypatch):
    import os
    import subprocess
    import sys
    import time

    from bench import load

    # A child that spins for 0.3 s of CPU, then waits on stdin so that its times stay readable.
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n"
         "print(flush=True)\nsys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert child.stdout is not None and child.stdout.readline() == "\n"
        precise = load._process_cpu(child.pid)
        assert precise >= 0.3
        assert round(precise * 1e9) % 10_000_000 != 0  # not counted in 10 ms ticks
        monkeypatch.setattr(time, "clock_gettime", lambda clock: (_ for _ in ()).throw(OSError("no clock")))
        ticks = load._process_cpu(child.pid)  # the fallback: /proc's user + system time, in ticks
        assert abs(ticks - precise) <= 2 / os.sysconf("SC_CLK_TCK")
    finally:
        child.kill()
        child.wait()
