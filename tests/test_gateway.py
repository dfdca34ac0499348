"""The OpenAI-compatible gateway, driven by the real `openai` package in front of the real services."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx2 as httpx
import openai
import pytest
import uvicorn
from transformers import AutoTokenizer

from http_gateway.__main__ import GatewayConfig, connect, server_config
from http_gateway.app import render_chat
from http_gateway.in_process import start_http
from http_gateway.openai_api import ApiError
from specdec.v1 import orchestrator_pb2
from tests.conftest import collect, wait_until
from tests.servers import LOOPBACK, OrchestratorThread, orchestrator_config
from tools.local_stack import free_port

TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w1{% endif %}"


class GatewayThread:
    """The gateway (uvicorn) on its own event loop in a background thread, on a free port."""

    def __init__(self, config: GatewayConfig) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.channels, upstream = asyncio.run_coroutine_threadsafe(connect(config), self.loop).result(60)
        self.model = upstream.model
        self.upstream = upstream
        self.server = uvicorn.Server(server_config(replace(config, host=LOOPBACK, log_level="warning"), upstream))
        self.serving = asyncio.run_coroutine_threadsafe(self.server.serve(), self.loop)
        assert wait_until(lambda: self.server.started, timeout_s=20)
        self.base_url = f"http://{LOOPBACK}:{config.port}"

    def client(self, api_key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=api_key, max_retries=0)

    def stop(self) -> None:
        self.server.should_exit = True
        self.serving.result(20)
        for channel in self.channels:
            asyncio.run_coroutine_threadsafe(channel.close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def chat_tokenizer(tiny_pair, tmp_path_factory) -> Path:
    """The tiny target's tokenizer with a chat template."""
    folder = tmp_path_factory.mktemp("chat_tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_pair.target))
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder


def _start(orchestrator: OrchestratorThread, **overrides) -> GatewayThread:
    config = GatewayConfig(orchestrator=orchestrator.address, port=free_port(), startup_timeout_s=10, **overrides)
    return GatewayThread(config)


class InProcessGateway:
    """`orchestrator --http-port`: the gateway's app on an orchestrator's own event loop, calling its
    servicer directly (http_gateway/in_process.py)."""

    def __init__(self, orchestrator: OrchestratorThread) -> None:
        self.orchestrator = orchestrator
        running = orchestrator.running
        port = free_port()
        self.http = orchestrator.run(start_http(running.servicer, running.health, LOOPBACK, port, "", 5.0))
        self.upstream = self.http.upstream
        self.model = self.upstream.model
        self.base_url = f"http://{LOOPBACK}:{port}"

    def client(self, api_key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=api_key, max_retries=0)

    def stop(self) -> None:
        self.orchestrator.run(self.http.stop(), timeout=30)
        self.orchestrator.stop()


@pytest.fixture(scope="module", params=["process", "in-process"])
def gateway(request, orchestrators, chat_tokenizer, target_server, close_draft_server) -> Iterator[Any]:
    """The battery runs against the gateway as a process of its own and inside an orchestrator (one
    with the chat template's tokenizer, over the same services as the `close` orchestrator)."""
    if request.param == "process":
        started: Any = _start(orchestrators["close"], tokenizer=str(chat_tokenizer))
    else:
        config = orchestrator_config(target_server, close_draft_server, tokenizer=str(chat_tokenizer))
        started = InProcessGateway(OrchestratorThread(config))
    yield started
    started.stop()


def _grpc_text(orchestrators, **fields) -> tuple[str, list[int]]:
    ids, text, _ = collect(orchestrators["close"].stub, orchestrator_pb2.GenerateRequest(**fields))
    return text, ids


def test_completions_match_the_grpc_api(gateway, orchestrators):
    client = gateway.client()
    response = client.completions.create(
        model=gateway.model, prompt="w3 w4 w5", max_tokens=12, temperature=0, extra_body={"num_speculative_tokens": 3}
    )
    text, ids = _grpc_text(orchestrators, text="w3 w4 w5", max_new_tokens=12, num_speculative_tokens=3)
    assert response.choices[0].text == text and response.choices[0].finish_reason in ("length", "stop")
    assert response.usage.prompt_tokens == 3 and response.usage.completion_tokens == len(ids)
    assert response.usage.total_tokens == 3 + len(ids)
    stats = response.model_extra["specdec"]
    assert stats["draft_tokens"] > 0 and 0 <= stats["acceptance_rate"] <= 1
    alone = client.completions.create(
        model=gateway.model, prompt=[3, 4, 5], max_tokens=12, temperature=0, extra_body={"num_speculative_tokens": 0}
    )
    assert alone.choices[0].text == text and alone.model_extra["specdec"]["draft_tokens"] == 0


def test_streamed_completions_and_usage(gateway, orchestrators):
    chunks = list(
        gateway.client().completions.create(
            model=gateway.model, prompt="w7 w8", max_tokens=10, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    text, ids = _grpc_text(orchestrators, text="w7 w8", max_new_tokens=10)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("length", "stop")
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(ids)


def test_chat_completions_render_with_the_models_template(gateway, orchestrators, chat_tokenizer):
    messages = [
        {"role": "user", "content": "w5 w6 w7"},
        {"role": "assistant", "content": "w8"},
        {"role": "user", "content": "w9"},
    ]
    tokenizer = AutoTokenizer.from_pretrained(str(chat_tokenizer))
    expected_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(expected_ids, "keys"):
        expected_ids = expected_ids["input_ids"]
    assert render_chat(tokenizer, messages) == list(expected_ids)
    prompt_ids = orchestrator_pb2.TokenIds(ids=list(expected_ids))
    text, _ = _grpc_text(orchestrators, token_ids=prompt_ids, max_new_tokens=9)
    client = gateway.client()
    response = client.chat.completions.create(model=gateway.model, messages=messages, max_tokens=9, temperature=0)
    assert response.choices[0].message.role == "assistant" and response.choices[0].message.content == text
    assert response.usage.prompt_tokens == len(expected_ids)
    stream = client.chat.completions.create(
        model=gateway.model, messages=messages, max_tokens=9, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    default = client.chat.completions.create(model=gateway.model, messages=messages, temperature=0)
    assert default.usage.completion_tokens >= 1  # max_tokens defaults to the room left in the context


def test_a_model_without_a_chat_template_is_told_so(tiny_pair):
    with pytest.raises(ApiError) as error:
        render_chat(AutoTokenizer.from_pretrained(str(tiny_pair.target)), [{"role": "user", "content": "w1"}])
    assert error.value.status == 400 and "chat template" in error.value.message


@pytest.mark.parametrize(
    ("field", "value"),
    [("n", 2), ("best_of", 3), ("logprobs", 21), ("echo", "yes"), ("top_logprobs", 2), ("presence_penalty", 0.5),
     ("min_tokens", -1), ("stop_token_ids", "5"), ("stop_token_ids", [-1]), ("ignore_eos", "yes"),
     ("prompt_logprobs", 30),
     ("frequency_penalty", -1), ("logit_bias", {"5": 10}), ("suffix", "w2"), ("frobnicate", 1),
     ("max_tokens", 0), ("max_tokens", "ten"), ("temperature", "hot"), ("stop", 5), ("prompt", []),
     ("speculation_policy", "fastest"), ("draft_method", "magic"), ("temperature", 500),
     ("max_tokens", 10**12), ("top_k", -1), ("num_speculative_tokens", 99), ("overlap_drafting", "yes"),
     ("speculation_tree", 1)],
)  # fmt: skip
def test_unsupported_or_invalid_fields_are_400_naming_them(gateway, field, value):
    body = {"model": gateway.model, "prompt": "w1 w2", "max_tokens": 3, field: value}
    response = httpx.post(f"{gateway.base_url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert field.split("_")[0] in error["message"], error


def test_neutral_values_of_unsupported_fields_are_accepted(gateway):
    neutral: dict[str, object] = {
        "n": 1, "best_of": 1, "logprobs": None, "echo": False, "presence_penalty": 0, "frequency_penalty": 0.0,
        "logit_bias": {}, "user": "someone",
    }  # fmt: skip
    body = {"model": gateway.model, "prompt": "w1 w2", "max_tokens": 3, **neutral}
    response = httpx.post(f"{gateway.base_url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text


def test_models_unknown_model_and_request_ids(gateway):
    listing = gateway.client().models.list()
    assert [m.id for m in listing.data] == [gateway.model]
    assert listing.data[0].model_extra["specdec"]["draft_model"]
    with pytest.raises(openai.NotFoundError) as error:
        gateway.client().completions.create(model="gpt-4o", prompt="w1", max_tokens=2)
    assert isinstance(error.value.body, dict) and error.value.body["code"] == "model_not_found"
    response = httpx.post(
        f"{gateway.base_url}/v1/completions",
        json={"prompt": "w1", "max_tokens": 2},
        headers={"X-Request-Id": "my-request-7"},
        timeout=30,
    )
    assert response.headers["x-request-id"] == "my-request-7" and response.json()["id"] == "cmpl-my-request-7"
    bad = httpx.post(f"{gateway.base_url}/v1/completions", json={"prompt": "w1"}, headers={"X-Request-Id": "a\tb"})
    assert bad.status_code == 400 and "request_id" in bad.json()["error"]["message"]


def test_a_disconnecting_streaming_client_frees_both_sessions(gateway, target_server, close_draft_server):
    body = {"model": gateway.model, "prompt": "w2 w3", "max_tokens": 200, "temperature": 0, "stream": True,
            "num_speculative_tokens": 2}  # fmt: skip
    with httpx.stream("POST", f"{gateway.base_url}/v1/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        assert wait_until(lambda: target_server.servicer.store.open_sessions > 0)
    assert wait_until(lambda: target_server.servicer.store.open_sessions == 0)
    assert wait_until(lambda: close_draft_server.servicer.store.open_sessions == 0)


def test_keys_full_servers_and_stopped_orchestrators_give_401_429_503(target_server, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("gateway-key\n")
    orchestrator = OrchestratorThread(
        orchestrator_config(target_server, max_running_requests=1, max_queued_requests=0, api_key_file=str(keys))
    )
    gateway = _start(orchestrator, api_key_file=str(keys))
    try:
        with pytest.raises(openai.AuthenticationError):
            gateway.client("wrong").completions.create(model=gateway.model, prompt="w1", max_tokens=2)
        client = gateway.client("gateway-key")
        # Greedy, so that neither request can end at once on a sampled end-of-sequence token.
        assert client.completions.create(model=gateway.model, prompt="w1", max_tokens=2, temperature=0).choices[0].text
        long = client.completions.create(model=gateway.model, prompt="w1", max_tokens=200, temperature=0, stream=True)
        next(iter(long))  # holds the only place
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model=gateway.model, prompt="w2", max_tokens=2)
        long.close()
        orchestrator.stop()
        with pytest.raises(openai.InternalServerError) as error:
            client.completions.create(model=gateway.model, prompt="w2", max_tokens=2)
        assert error.value.status_code == 503
    finally:
        gateway.stop()
        if orchestrator.thread_alive():
            orchestrator.stop()


def test_cached_prompt_tokens_and_salts_per_api_key(target_server, tmp_path, target_model):
    """usage.prompt_tokens_details.cached_tokens reports the target's prefix hits; under
    --cache-salt-per-key two keys never share a cached prefix, whatever cache_salt they send."""
    keys = tmp_path / "keys"
    keys.write_text("key-a\nkey-b\n")
    secret = tmp_path / "secret"
    secret.write_text("s" * 32)
    orchestrator = OrchestratorThread(orchestrator_config(target_server))
    plain = _start(orchestrator)
    salted = _start(orchestrator, api_key_file=str(keys), cache_salt_per_key=True, cache_salt_secret_file=str(secret))
    prompt = list(range(5, 45))  # two full blocks of 16 and some
    try:

        def cached(gateway: GatewayThread, key: str = "unused", **extra) -> int:
            response = gateway.client(key).completions.create(
                model=gateway.model, prompt=prompt, max_tokens=2, temperature=0, extra_body=extra
            )
            assert response.usage is not None and response.usage.prompt_tokens_details is not None
            return int(response.usage.prompt_tokens_details.cached_tokens or 0)

        assert cached(plain, cache_salt="mine") == 0
        assert cached(plain, cache_salt="mine") == 32
        assert cached(plain) == 0  # the shared cache is another salt
        assert cached(salted, "key-a", cache_salt="mine") == 0  # a key's salt is not the body's alone
        assert cached(salted, "key-a", cache_salt="mine") == 32
        assert cached(salted, "key-b", cache_salt="mine") == 0
        assert cached(salted, "key-b") == 0
        with pytest.raises(openai.BadRequestError) as error:
            cached(plain, cache_salt="")
        assert "cache_salt" in str(error.value)
    finally:
        salted.stop()
        plain.stop()
        orchestrator.stop()


# The gateway's logprobs against a gRPC call's to another orchestrator: the same tokens, but load_aware
# may verify them in blocks of other widths, and a float32 forward of another shape differs in the
# last bits (1.07e-6 on a logprob of -1.64 seen once, about 9 ulps). A wrong row, position or
# temperature differs by orders of magnitude more.
LOGPROB_TOLERANCE = 1e-5


def _grpc_entries(orchestrators, **fields) -> tuple[list[int], list, list]:
    """Token ids, logprob entries and prompt logprob entries of a gRPC Generate call."""
    ids, entries, prompt_entries = [], [], []
    for message in orchestrators["close"].stub.Generate(orchestrator_pb2.GenerateRequest(**fields)):
        ids.extend(message.token_ids)
        entries.extend(message.logprobs)
        prompt_entries.extend(message.prompt_logprobs)
    return ids, entries, prompt_entries


def test_completions_logprobs_and_echo_are_the_grpc_apis(gateway, orchestrators):
    prompt = [3, 4, 5, 9]
    ids, entries, prompt_entries = _grpc_entries(
        orchestrators, token_ids=orchestrator_pb2.TokenIds(ids=prompt), max_new_tokens=8, logprobs=True,
        top_logprobs=3, prompt_logprobs=3,
    )  # fmt: skip
    client = gateway.client()
    plain = client.completions.create(model=gateway.model, prompt=prompt, max_tokens=8, temperature=0, logprobs=3)
    logprobs = plain.choices[0].logprobs
    assert logprobs.token_logprobs == pytest.approx([e.logprob for e in entries], abs=LOGPROB_TOLERANCE)
    assert len(logprobs.tokens) == len(ids) == plain.usage.completion_tokens
    assert [len(top) for top in logprobs.top_logprobs] == [3] * len(ids)
    assert logprobs.text_offset == sorted(logprobs.text_offset)
    # echo: the prompt's text and tokens first; no row scores the first prompt token.
    echoed = client.completions.create(
        model=gateway.model, prompt=prompt, max_tokens=8, temperature=0, logprobs=3, echo=True
    )
    logprobs = echoed.choices[0].logprobs
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    expected = [e.logprob for e in prompt_entries] + [e.logprob for e in entries]
    assert logprobs.token_logprobs[1:] == pytest.approx(expected, abs=LOGPROB_TOLERANCE)
    assert echoed.choices[0].text.startswith(gateway.upstream.tokenizer.decode(prompt, skip_special_tokens=True))
    # Streamed, each chunk carries its own tokens' logprobs.
    chunks = list(
        client.completions.create(
            model=gateway.model, prompt=prompt, max_tokens=8, temperature=0, logprobs=1, stream=True
        )
    )
    streamed = [v for c in chunks if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx([e.logprob for e in entries], abs=LOGPROB_TOLERANCE)
    # vLLM's prompt_logprobs extension.
    extra = client.completions.create(
        model=gateway.model, prompt=prompt, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 1}
    )
    listed = extra.choices[0].model_extra["prompt_logprobs"]
    assert listed[0] is None and len(listed) == len(prompt)
    assert listed[1][str(prompt[1])]["logprob"] == pytest.approx(prompt_entries[0].logprob, abs=LOGPROB_TOLERANCE)


def test_chat_logprobs_are_the_grpc_apis(gateway, orchestrators, chat_tokenizer):
    messages = [{"role": "user", "content": "w3 w4"}]
    prompt = render_chat(AutoTokenizer.from_pretrained(str(chat_tokenizer)), messages)
    ids, entries, _ = _grpc_entries(
        orchestrators, token_ids=orchestrator_pb2.TokenIds(ids=prompt), max_new_tokens=6, logprobs=True, top_logprobs=2
    )
    answer = gateway.client().chat.completions.create(
        model=gateway.model, messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2
    )
    content = answer.choices[0].logprobs.content
    assert len(content) == len(ids) == answer.usage.completion_tokens
    assert [c.logprob for c in content] == pytest.approx([e.logprob for e in entries], abs=LOGPROB_TOLERANCE)
    assert all(len(c.top_logprobs) == 2 and c.bytes == list(c.token.encode()) for c in content)


def test_vllm_extras_through_the_gateway(gateway, orchestrators):
    client = gateway.client()
    free = client.completions.create(model=gateway.model, prompt=[3, 4, 5], max_tokens=8, temperature=0, logprobs=0)
    second = gateway.upstream.tokenizer.convert_tokens_to_ids(free.choices[0].logprobs.tokens[1])
    stopped = client.completions.create(
        model=gateway.model, prompt=[3, 4, 5], max_tokens=8, temperature=0, extra_body={"stop_token_ids": [second]}
    )
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == 2
    held = client.completions.create(
        model=gateway.model, prompt=[3, 4, 5], max_tokens=8, temperature=0,
        extra_body={"stop_token_ids": [second], "min_tokens": 3, "ignore_eos": True},
    )  # fmt: skip
    assert held.usage.completion_tokens >= 3


def test_an_in_process_call_reports_errors_as_grpc_would_and_ends_on_cancel():
    """A servicer's ServiceError reaches the app as its AioRpcError; a bug as INTERNAL, never a hang;
    cancelling the call ends the generation."""
    import grpc

    from http_gateway.in_process import InProcessCall
    from serving.errors import ServiceError

    ended = asyncio.Event()

    class Servicer:
        def __init__(self, error: BaseException | None) -> None:
            self.error = error

        async def Generate(self, request, context):
            yield orchestrator_pb2.GenerateResponse(token_ids=[1])
            if self.error is not None:
                raise self.error
            try:
                await asyncio.sleep(60)
            finally:
                ended.set()

    async def codes() -> list[Any]:
        seen = []
        for error in (ServiceError(grpc.StatusCode.INVALID_ARGUMENT, "bad field"), RuntimeError("boom")):
            call = InProcessCall(Servicer(error), orchestrator_pb2.GenerateRequest())
            assert (await anext(call)).token_ids == [1]
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await anext(call)
            seen.append((raised.value.code(), raised.value.details()))
        call = InProcessCall(Servicer(None), orchestrator_pb2.GenerateRequest())
        await anext(call)
        call.cancel()
        await asyncio.wait_for(ended.wait(), 5)
        return seen

    (invalid, invalid_details), (internal, internal_details) = asyncio.run(codes())
    assert invalid == grpc.StatusCode.INVALID_ARGUMENT and invalid_details == "bad field"
    assert internal == grpc.StatusCode.INTERNAL and "boom" in internal_details
