"""`python -m bench.gateway_hostile`: a good request's latency while one hostile client works on the gateway.

The default pair behind the real gateway process (`--in-process`: the OpenAI API the orchestrator serves
in its own process, `--http-port`, where a hostile client shares the process with the rounds). Each
load runs alone (interleaved with the idle baseline, `--reps` times) while the same good request
(greedy, 16 tokens, not streamed) is timed:
- 4 clients sending 50 MB bodies as fast as loopback takes them;
- 200 connections sending a request header a byte every half second;
- JSON nested 100,000 deep, posted in a loop;
- a body just under the limit (the most JSON the gateway parses), posted in a loop;
- a 10 MB chat message, posted in a loop;
- a chat conversation at the text limit (the most a template renders and the tokenizer reads).

Reports each load's median good-request latency over the idle median (the goal: at most 2x), and
the gateway's RSS before and after. The load generators share the machine's two cores with the
services and the gateway, so part of any slowdown is theirs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx2 as httpx
import psutil

from bench.gateway import running_gateway
from http_gateway.limits import default_max_body_bytes
from serving.protocol import MAX_PROMPT_CHARS_PER_TOKEN
from tools.local_stack import DEFAULT_PAIR, LOOPBACK, LocalStack, free_port

GOOD = {"prompt": "def fibonacci(n):", "max_tokens": 16, "temperature": 0}
Load = Callable[[int, threading.Event], None]


def _post(port: int, path: str, body: bytes, declared: int | None = None) -> None:
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
    head += f"Content-Length: {len(body) if declared is None else declared}\r\n\r\n"
    with socket.create_connection((LOOPBACK, port), timeout=30) as sock:
        try:
            sock.sendall(head.encode() + body)
            while sock.recv(65536):
                pass
        except OSError:
            pass  # refused and closed before the whole body went


def _loop(send: Callable[[], None]) -> Load:
    def run(port: int, stop: threading.Event) -> None:
        while not stop.is_set():
            send()

    return run


def _big_bodies(port: int, stop: threading.Event) -> None:
    chunk = b" " * (1 << 20)

    def one() -> None:
        while not stop.is_set():
            with socket.create_connection((LOOPBACK, port), timeout=30) as sock:
                head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                sock.sendall((head + f"Content-Length: {50 << 20}\r\n\r\n").encode())
                try:
                    for _ in range(50):
                        sock.sendall(chunk)
                except OSError:
                    pass

    threads = [threading.Thread(target=one, daemon=True) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def _slow_headers(port: int, stop: threading.Event) -> None:
    header = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
    sockets: list[socket.socket] = []
    position = 0
    while not stop.is_set():
        while len(sockets) < 200:
            sockets.append(socket.create_connection((LOOPBACK, port), timeout=30))
        alive = []
        for sock in sockets:
            try:
                sock.sendall(header[position % len(header) : position % len(header) + 1])
                alive.append(sock)
            except OSError:
                sock.close()  # closed by the gateway's read timeout: open another
        sockets, position = alive, position + 1
        stop.wait(0.5)
    for sock in sockets:
        sock.close()


def _loads(port: int, context: int) -> dict[str, Load]:
    limit = default_max_body_bytes(context)
    deep = b'{"prompt": "x", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    under = json.dumps(GOOD).encode()
    under += b" " * (limit - len(under))
    big_chat = json.dumps({"messages": [{"role": "user", "content": "x " * 5_000_000}]}).encode()
    at_limit = "word " * (context * MAX_PROMPT_CHARS_PER_TOKEN // 5 - 4)
    chat = json.dumps({"messages": [{"role": "user", "content": at_limit}], "max_tokens": 1}).encode()
    return {
        "4 x 50 MB bodies": _big_bodies,
        "200 slow headers": _slow_headers,
        "JSON 100,000 deep": _loop(lambda: _post(port, "/v1/completions", deep)),
        "a body just under the limit": _loop(lambda: _post(port, "/v1/completions", under)),
        "a 10 MB chat message": _loop(lambda: _post(port, "/v1/chat/completions", big_chat)),
        "chat at the text limit": _loop(lambda: _post(port, "/v1/chat/completions", chat)),
    }


def _good(url: str) -> float:
    started = time.perf_counter()
    response = httpx.post(f"{url}/v1/completions", json=GOOD, timeout=60)
    response.raise_for_status()
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.gateway_hostile", description=__doc__)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--requests", type=int, default=8, help="good requests timed per load and repetition")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="the OpenAI API in the orchestrator's process (--http-port), not the separate gateway",
    )
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    times: dict[str, list[float]] = {}
    in_process_port = free_port() if args.in_process else 0
    with contextlib.ExitStack() as running:
        stack = running.enter_context(
            LocalStack(
                str(DEFAULT_PAIR / "target"),
                str(DEFAULT_PAIR / "draft"),
                extra_orchestrator_args=["--http-port", str(in_process_port)] if args.in_process else [],
            )
        )
        if args.in_process:
            port, pid = in_process_port, stack.pids["orchestrator"]
        else:
            port, pid = running.enter_context(running_gateway(stack.orchestrator_address))
        url = f"http://{LOOPBACK}:{port}"
        context = int(httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["specdec"]["max_context"])
        loads = _loads(port, context)
        _good(url)
        rss_before = psutil.Process(pid).memory_info().rss / 2**20
        for _ in range(args.reps):
            times.setdefault("idle", []).extend(_good(url) for _ in range(args.requests))
            for name, load in loads.items():
                stop = threading.Event()
                worker = threading.Thread(target=load, args=(port, stop), daemon=True)
                worker.start()
                time.sleep(0.5)  # the load under way
                times.setdefault(name, []).extend(_good(url) for _ in range(args.requests))
                stop.set()
                worker.join(60)
                times.setdefault("idle", []).extend(_good(url) for _ in range(args.requests))
        rss_after = psutil.Process(pid).memory_info().rss / 2**20
    idle = statistics.median(times["idle"])
    report = {
        name: {"median_ms": 1000 * statistics.median(t), "ratio": statistics.median(t) / idle}
        for name, t in times.items()
    }
    for name, row in report.items():
        print(f"{name:30s} good request median {row['median_ms']:7.1f} ms  {row['ratio']:.2f}x idle")
    where = "orchestrator (in-process API)" if args.in_process else "gateway"
    print(f"{where} RSS: {rss_before:.0f} MB before the loads, {rss_after:.0f} MB after")
    result = {
        "loads": report,
        "rss_mb": {"before": rss_before, "after": rss_after},
        "reps": args.reps,
        "in_process": args.in_process,
    }
    name = "gateway-hostile-in-process-latest.json" if args.in_process else "gateway-hostile-latest.json"
    (args.out / name).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
