"""The HTTP gateway against a hostile client: the real `python -m http_gateway` process, on loopback.

A battery of bad inputs (malformed, out of range, oversized, slow, cut off), each answered with a
4xx whose JSON names what to change, never a 500, and each followed by a good request that must
succeed. After the battery the gateway's memory is within a bound of its start, and the services
hold no session. Readiness falls when the orchestrator goes away and comes back with it.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import httpx2 as httpx
import psutil
import pytest
from transformers import AutoTokenizer

from tests.conftest import wait_until
from tests.servers import LOOPBACK, OrchestratorThread, orchestrator_config
from tools.local_stack import free_port

# Refuses roles it does not know, as many models' templates do.
TEMPLATE = (
    "{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}{{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}w1{% endif %}"
)
READ_TIMEOUT_S = 1.0
MAX_CONNECTIONS = 64
GOOD = {"prompt": "w1 w2", "max_tokens": 3, "temperature": 0}
VOCAB = 96  # the tiny pair's
CONTEXT = 256
BODY_LIMIT = CONTEXT * 64 * 12 + 64 * 1024  # limits.default_max_body_bytes at the tiny target's context
RSS_BOUND_MB = 200


@dataclass
class Gateway:
    process: subprocess.Popen[bytes]
    port: int
    orchestrator: OrchestratorThread
    latencies: list[float]
    start_rss_mb: float = 0.0

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def rss_mb(self) -> float:
        return float(psutil.Process(self.process.pid).memory_info().rss) / 2**20

    def good(self) -> None:
        """A good request after a bad one: it succeeds (its latency is kept for the report)."""
        started = time.perf_counter()
        response = httpx.post(f"{self.url}/v1/completions", json=GOOD, timeout=30)
        self.latencies.append(time.perf_counter() - started)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def gateway(target_server, close_draft_server, tiny_pair, tmp_path_factory) -> Iterator[Gateway]:
    folder = tmp_path_factory.mktemp("strict_template")
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_pair.target))
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(folder)
    orchestrator = OrchestratorThread(orchestrator_config(target_server, close_draft_server))
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "http_gateway",
        "--orchestrator",
        orchestrator.address,
        "--host",
        LOOPBACK,
        "--port",
        str(port),
        "--tokenizer",
        str(folder),
        "--read-timeout-s",
        str(READ_TIMEOUT_S),
        "--max-connections",
        str(MAX_CONNECTIONS),
        "--log-level",
        "warning",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    started = Gateway(process, port, orchestrator, [])

    def up() -> bool:
        try:
            return httpx.get(f"{started.url}/health", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    try:
        assert wait_until(up, timeout_s=120), "the gateway did not start"
        started.good()
        started.start_rss_mb = started.rss_mb()
        yield started
    finally:
        process.terminate()
        try:
            _, errors = process.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            _, errors = process.communicate()
        started.orchestrator.stop()  # the readiness test replaces the first
        log = errors.decode(errors="replace")
        assert "Traceback" not in log and "unexpected_error" not in log, log[-4000:]


def _raw(port: int, data: bytes, read: bool = True, timeout: float = 10.0) -> bytes:
    """Send raw bytes on a new connection; what the server answers before it closes."""
    with socket.create_connection((LOOPBACK, port), timeout=timeout) as sock:
        with contextlib.suppress(OSError):  # the server may answer and close before it has read everything
            sock.sendall(data)
        if not read:
            return b""
        answer = b""
        while True:
            try:
                chunk = sock.recv(65536)
            except (ConnectionResetError, TimeoutError):
                break
            if not chunk:
                break
            answer += chunk
        return answer


def _post(path: str, body: bytes, content_type: str = "application/json", length: int | None = None) -> bytes:
    headers = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: {content_type}\r\nConnection: close\r\n"
    headers += f"Content-Length: {len(body) if length is None else length}\r\n\r\n"
    return headers.encode() + body


def _status_and_error(answer: bytes) -> tuple[int, dict[str, Any]]:
    head, _, body = answer.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    if b"transfer-encoding: chunked" in head.lower():
        body = body.split(b"\r\n", 1)[1].rsplit(b"\r\n0\r\n", 1)[0]
    return status, json.loads(body)["error"]


def _nested(depth: int) -> bytes:
    return b'{"prompt": "w1", "max_tokens": 2, "x": ' + b"[" * depth + b"]" * depth + b"}"


def _json(fields: dict[str, Any], base: dict[str, Any] | None = None) -> bytes:
    return json.dumps({**(GOOD if base is None else base), **fields}).encode()


CHAT = {"messages": [{"role": "user", "content": "w3 w4"}], "max_tokens": 3, "temperature": 0}

CHAT_PATH = "/v1/chat/completions"
OVER_LIMIT = _json({}) + b" " * (BODY_LIMIT + 1 - len(_json({})))
LONG_CHAT = [{"role": "user", "content": "w1 " * (CONTEXT * 22)}]  # past 64 characters per context token
REFUSED_ROLE = [{"role": "user", "content": "w1"}, {"role": "tool", "content": "w2"}]


@dataclass(frozen=True)
class Case:
    """A bad request: its body, the status it must get, and a word its error must hold."""

    name: str
    body: bytes
    status: int
    names: str
    path: str = "/v1/completions"
    content_type: str = "application/json"


CASES = [
    Case("lone surrogate in prompt", b'{"prompt": "w1 \\ud800", "max_tokens": 2}', 400, "prompt"),
    Case("lone surrogate in stop", b'{"prompt": "w1", "stop": ["\\udfff"]}', 400, "stop"),
    Case("lone surrogate in model", b'{"prompt": "w1", "model": "\\ud800"}', 400, "model"),
    Case("lone surrogate in a field name", b'{"prompt": "w1", "\\ud800": 1}', 400, "field name"),
    Case(
        "lone surrogate in a message",
        b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
        400,
        "content",
        CHAT_PATH,
    ),
    Case("token id 2^31", _json({"prompt": [1, 2**31]}), 400, "prompt"),
    Case("token id 2^64", _json({"prompt": [2**64]}), 400, "prompt"),
    Case("token id -1", _json({"prompt": [3, -1]}), 400, "prompt"),
    Case("token id = vocabulary", _json({"prompt": [VOCAB]}), 400, "prompt"),
    Case("token ids beyond the context", _json({"prompt": [1] * (CONTEXT + 1)}), 400, "prompt"),
    Case("two prompts", _json({"prompt": [[1, 2], [3]]}), 400, "prompt"),
    Case("boolean token ids", _json({"prompt": [True, False]}), 400, "prompt"),
    Case("token id 2^31 in a batch of one", _json({"prompt": [[2**31]]}), 400, "prompt"),
    Case("JSON 100,000 deep", _nested(100_000), 400, "nests"),
    Case("JSON 40 deep", _nested(40), 400, "nests"),
    Case("speculation_policy a list", _json({"speculation_policy": []}), 400, "speculation_policy"),
    Case("draft_method an object", _json({"draft_method": {}}), 400, "draft_method"),
    Case("speculation_policy a number", _json({"speculation_policy": 3}), 400, "speculation_policy"),
    Case("NaN temperature", b'{"prompt": "w1", "temperature": NaN}', 400, "NaN"),
    Case("infinite top_p", b'{"prompt": "w1", "top_p": Infinity}', 400, "Infinity"),
    Case("temperature 1e308", _json({"temperature": 1e308}), 400, "temperature"),
    Case("temperature below 0", _json({"temperature": -0.5}), 400, "temperature"),
    Case("top_p above 1", _json({"top_p": 1.5}), 400, "top_p"),
    Case("top_k 2^40", _json({"top_k": 2**40}), 400, "top_k"),
    Case("max_tokens 2^64", _json({"max_tokens": 2**64}), 400, "max_tokens"),
    Case("max_tokens -1", _json({"max_tokens": -1}), 400, "max_tokens"),
    Case("max_tokens 1.5", _json({"max_tokens": 1.5}), 400, "max_tokens"),
    Case("max_tokens past the cap", _json({"max_tokens": 10**6}), 400, "max_new_tokens"),
    Case("seed a string", _json({"seed": "x"}), 400, "seed"),
    Case("stop a number", _json({"stop": 5}), 400, "stop"),
    Case("stop 10,000 strings", _json({"stop": ["w9"] * 10_000}), 400, "stop"),
    Case("stream a string", _json({"stream": "yes"}), 400, "stream"),
    Case("stream_options a list", _json({"stream_options": []}), 400, "stream_options"),
    Case("model a number", _json({"model": 5}), 400, "model"),
    Case("an unknown model", _json({"model": "gpt-4o"}), 404, "model"),
    Case("an unknown field holding a huge array", _json({"extra": list(range(20_000))}), 400, "extra"),
    Case("no prompt", b'{"max_tokens": 2}', 400, "prompt"),
    Case("an empty prompt list", _json({"prompt": []}), 400, "prompt"),
    Case("malformed JSON", b'{"prompt": "w1",', 400, "JSON"),
    Case("a JSON array", b"[1, 2]", 400, "object"),
    Case("not UTF-8", b'{"prompt": "\xff"}', 400, "UTF-8"),
    Case("an empty body", b"", 400, "JSON"),
    Case("text/plain", _json({}), 415, "Content-Type", content_type="text/plain"),
    Case("form-encoded", b"prompt=w1", 415, "Content-Type", content_type="application/x-www-form-urlencoded"),
    Case("messages a string", _json({"messages": "hi"}, CHAT), 400, "messages", CHAT_PATH),
    Case("no messages", _json({"messages": []}, CHAT), 400, "messages", CHAT_PATH),
    Case(
        "content a list",
        _json({"messages": [{"role": "user", "content": [1]}]}, CHAT),
        400,
        "messages[0].content",
        CHAT_PATH,
    ),
    Case("a role the template refuses", _json({"messages": REFUSED_ROLE}, CHAT), 400, "messages[1]", CHAT_PATH),
    Case("chat past the text limit", _json({"messages": LONG_CHAT}, CHAT), 400, "characters", CHAT_PATH),
    Case("a text prompt past the text limit", _json({"prompt": "w1 " * (CONTEXT * 22)}), 400, "characters"),
    Case("a body just over the limit", OVER_LIMIT, 413, "bytes"),
    Case("a 50 MB Content-Length", b"", 413, "bytes"),
    Case("an unknown path", _json({}), 404, "/v1/frobnicate", "/v1/frobnicate"),
    Case("/openapi.json", b"", 404, "openapi", "/openapi.json"),
    Case("/docs", b"", 404, "docs", "/docs"),
]


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_a_bad_request_is_a_4xx_naming_what_to_change(gateway, case):
    if case.path in ("/openapi.json", "/docs"):
        request = f"GET {case.path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode()
    elif case.names == "bytes" and not case.body:
        request = _post(case.path, b'{"prompt": "w1"', length=50_000_000)  # the client would send 50 MB
    else:
        request = _post(case.path, case.body, case.content_type)
    status, error = _status_and_error(_raw(gateway.port, request))
    assert status == case.status, error
    assert case.names.lower() in json.dumps(error).lower(), error
    gateway.good()


def test_a_body_just_under_the_limit_is_served(gateway):
    body = _json({}) + b" " * (BODY_LIMIT - len(_json({})))
    answer = _raw(gateway.port, _post("/v1/completions", body))
    assert answer.startswith(b"HTTP/1.1 200"), answer[:400]
    gateway.good()


def test_a_chunked_body_over_the_limit_is_refused_while_it_is_read(gateway):
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    head += b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    chunk = b" " * 65536
    body = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(BODY_LIMIT // len(chunk) + 2))
    status, error = _status_and_error(_raw(gateway.port, head + b"1\r\n{\r\n" + body + b"0\r\n\r\n"))
    assert status == 413 and "bytes" in error["message"], error
    gateway.good()


def test_headers_and_authorization_beyond_their_limits(gateway):
    long_key = "Bearer " + "k" * 12_000
    response = httpx.post(f"{gateway.url}/v1/completions", json=GOOD, headers={"Authorization": long_key}, timeout=10)
    assert response.status_code == 431 and response.json()["error"]["param"] == "authorization", response.text
    gateway.good()
    huge = _post("/v1/completions", _json({})).replace(b"Host: x\r\n", b"Host: x\r\nX-Big: " + b"b" * 20_000 + b"\r\n")
    status, error = _status_and_error(_raw(gateway.port, huge))
    assert status == 431 and "headers" in error["message"], error
    gateway.good()
    with socket.create_connection((LOOPBACK, gateway.port), timeout=10) as sock:  # the same, in pieces
        sock.sendall(huge[:10_000])
        time.sleep(0.1)
        sock.sendall(huge[10_000:])
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    status, error = _status_and_error(answer)
    assert status == 431 and "headers" in error["message"], error
    gateway.good()
    accented = _post("/v1/completions", _json({})).replace(b"Host: x\r\n", b"Host: x\r\nAuthorization: Bearer \xe9\r\n")
    status, error = _status_and_error(_raw(gateway.port, accented))
    assert status == 400 and error["param"] == "authorization", error
    gateway.good()
    status, error = _status_and_error(_raw(gateway.port, b"NOT HTTP AT ALL\r\n\r\n"))
    assert status == 400 and "HTTP" in error["message"], error
    gateway.good()


def test_a_wrong_method_and_a_bad_request_id(gateway):
    response = httpx.get(f"{gateway.url}/v1/completions", timeout=10)
    assert response.status_code == 405 and "error" in response.json(), response.text
    response = httpx.post(f"{gateway.url}/v1/completions", json=GOOD, headers={"X-Request-Id": "r" * 500}, timeout=10)
    assert response.status_code == 400 and "request_id" in response.json()["error"]["message"], response.text
    gateway.good()


def test_slow_headers_are_closed_after_the_read_timeout(gateway):
    """50 connections that send half a request header and stop: a good request meanwhile succeeds, and
    the gateway closes each of them once the read timeout has passed."""
    slow = [socket.create_connection((LOOPBACK, gateway.port), timeout=10) for _ in range(50)]
    try:
        for sock in slow:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        gateway.good()
        time.sleep(READ_TIMEOUT_S + 0.5)
        for sock in slow:
            sock.settimeout(5)
            assert sock.recv(100) == b""  # closed by the gateway
    finally:
        for sock in slow:
            sock.close()
    gateway.good()


def test_a_slow_body_gets_408(gateway):
    request = _post("/v1/completions", b'{"prompt"', length=200)  # 9 of 200 bytes, then nothing
    started = time.perf_counter()
    status, error = _status_and_error(_raw(gateway.port, request))
    assert status == 408 and "did not arrive" in error["message"], error
    assert time.perf_counter() - started >= READ_TIMEOUT_S
    gateway.good()


def test_clients_that_disconnect_midway_leave_nothing_behind(gateway):
    for cut in (b"POST /v1/comp", _post("/v1/completions", b'{"prompt": "w', length=100)):
        _raw(gateway.port, cut, read=False)
    streamed = _json({"stream": True, "max_tokens": 200})
    with socket.create_connection((LOOPBACK, gateway.port), timeout=10) as sock:
        sock.sendall(_post("/v1/completions", streamed))
        assert sock.recv(100).startswith(b"HTTP/1.1 200")
    gateway.good()


def test_connections_beyond_the_cap_get_429(gateway):
    held = []
    try:
        for _ in range(MAX_CONNECTIONS + 5):
            held.append(socket.create_connection((LOOPBACK, gateway.port), timeout=10))
        time.sleep(0.2)
        late = socket.create_connection((LOOPBACK, gateway.port), timeout=10)
        late.sendall(_post("/v1/completions", _json({})))  # sent before the answer is read, as clients do
        answer = b""
        while chunk := late.recv(65536):
            answer += chunk
        late.close()
        status, error = _status_and_error(answer)
        assert status == 429 and "--max-connections" in error["message"], error
    finally:
        for sock in held:
            sock.close()
    assert wait_until(lambda: _can_serve(gateway), timeout_s=10)


def _can_serve(gateway: Gateway) -> bool:
    try:
        gateway.good()
        return True
    except AssertionError:
        return False


def test_after_the_battery_memory_is_bounded_and_sessions_closed(gateway, target_server, close_draft_server):
    """Runs after the battery (file order): the oversized cases were refused before they were read."""
    before = gateway.rss_mb()
    for _ in range(4):  # the cases that once took gigabytes: a 50 MB body, a 10 MB chat message
        _raw(gateway.port, _post("/v1/completions", b"{", length=50_000_000))
        big_chat = _json({"messages": [{"role": "user", "content": "w1 " * 3_500_000}]}, CHAT)
        status, _ = _status_and_error(_raw(gateway.port, _post("/v1/chat/completions", big_chat)))
        assert status == 413
    assert gateway.rss_mb() - before < RSS_BOUND_MB, (before, gateway.rss_mb())
    assert gateway.rss_mb() - gateway.start_rss_mb < RSS_BOUND_MB, (gateway.start_rss_mb, gateway.rss_mb())
    assert wait_until(lambda: target_server.servicer.store.open_sessions == 0, timeout_s=10)
    assert wait_until(lambda: close_draft_server.servicer.store.open_sessions == 0, timeout_s=10)
    gateway.good()
    latencies = sorted(gateway.latencies)
    print(
        f"good requests after bad ones: {len(latencies)}, median {latencies[len(latencies) // 2] * 1000:.0f} ms, "
        f"slowest {latencies[-1] * 1000:.0f} ms; gateway RSS {gateway.start_rss_mb:.0f} MB at the start, "
        f"{gateway.rss_mb():.0f} MB after the battery"
    )


def test_readiness_follows_the_orchestrator(gateway):
    assert httpx.get(f"{gateway.url}/ready", timeout=5).status_code == 200
    port = gateway.orchestrator.running.port
    config = gateway.orchestrator.running.servicer.config
    gateway.orchestrator.stop()
    went = time.perf_counter()
    assert wait_until(lambda: httpx.get(f"{gateway.url}/ready", timeout=5).status_code == 503, timeout_s=2)
    print(f"readiness 503 after {time.perf_counter() - went:.2f} s")
    assert httpx.get(f"{gateway.url}/health", timeout=5).status_code == 200  # alive all the same
    gateway.orchestrator = OrchestratorThread(replace(config, port=port))
    assert wait_until(lambda: httpx.get(f"{gateway.url}/ready", timeout=5).status_code == 200, timeout_s=10)
    gateway.good()
