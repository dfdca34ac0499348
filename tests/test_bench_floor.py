"""bench/floor.py: the transport's floor is a round trip measured, in both modes."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from bench.floor import MODES, ping, serve_echo
from tools.local_stack import LOOPBACK, free_port


@pytest.mark.parametrize("mode", MODES)
def test_the_transports_floor_is_a_round_trip_measured(mode):
    async def run() -> float:
        port = free_port()
        serving = asyncio.create_task(serve_echo(port, mode))
        try:
            return await ping(f"{LOOPBACK}:{port}", 50)
        finally:
            serving.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await serving

    assert 0 < asyncio.run(run()) < 1.0
