"""The transport's floor: the fastest round trip a step could make between two processes on this
machine, with nothing else to do (`make host-bench` prints it beside where a step's time goes).

    python -m bench.floor PORT MODE     the echo server (MODE: bare, or thread handoff)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence

import grpc

from tools.local_stack import LOOPBACK, free_port

ECHO = "/specdec.bench.Floor/Echo"
MODES = ("bare", "thread handoff")


def transport_floor(round_trips: int = 2000, repetitions: int = 3) -> dict[str, float]:
    """The median round trip of one small message over a grpc.aio bidirectional stream on loopback,
    between two processes and nothing else: answered in the handler (`bare`), and handed to a thread
    and back to the event loop first, as a model service's engine thread does (`thread handoff`). No
    step of the services can take less than the second. Medians over interleaved repetitions."""
    floors: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(repetitions):
        for mode, seconds in floors.items():
            port = free_port()
            server = subprocess.Popen([sys.executable, "-m", "bench.floor", str(port), mode])
            try:
                seconds.append(asyncio.run(ping(f"{LOOPBACK}:{port}", round_trips)))
            finally:
                server.terminate()
                server.wait(timeout=10)
    return {mode: statistics.median(seconds) for mode, seconds in floors.items()}


async def ping(address: str, round_trips: int) -> float:
    """Median seconds from writing a message to reading its echo, after a warm-up of a tenth."""
    async with grpc.aio.insecure_channel(address) as channel:
        await asyncio.wait_for(channel.channel_ready(), timeout=30)
        call = channel.stream_stream(ECHO, request_serializer=bytes, response_deserializer=bytes)()
        seconds = []
        for _ in range(round_trips):
            started = time.perf_counter()
            await call.write(b"x" * 64)
            await call.read()
            seconds.append(time.perf_counter() - started)
        await call.done_writing()
    return statistics.median(seconds[round_trips // 10 :])


async def serve_echo(port: int, mode: str) -> None:
    """The echo server `transport_floor` pings: each message answered in the handler (`bare`), or after
    a thread has had it (`thread handoff`)."""
    handoff = concurrent.futures.ThreadPoolExecutor(1) if mode == "thread handoff" else None

    async def echo(messages: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        loop = asyncio.get_running_loop()
        async for message in messages:
            if handoff is not None:
                message = await asyncio.wrap_future(handoff.submit(bytes, message), loop=loop)
            yield message

    server = grpc.aio.server()
    method = grpc.stream_stream_rpc_method_handler(echo, request_deserializer=bytes, response_serializer=bytes)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("specdec.bench.Floor", {"Echo": method}),))
    server.add_insecure_port(f"{LOOPBACK}:{port}")
    await server.start()
    try:
        await server.wait_for_termination()
    finally:
        await server.stop(None)
        if handoff is not None:
            handoff.shutdown(wait=False)


def main(argv: Sequence[str] | None = None) -> int:
    port, mode = (sys.argv[1:] if argv is None else list(argv))[:2]
    asyncio.run(serve_echo(int(port), mode))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
