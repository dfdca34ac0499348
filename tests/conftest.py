"""Shared fixtures: a tiny model pair built on the fly, real gRPC servers on 127.0.0.1."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
import torch

from model_host.loading import LoadedModel
from model_host.runtime import ModelServer
from orchestrator.link import result_failure
from specdec.v1 import draft_pb2, orchestrator_pb2, target_pb2
from tests.servers import OrchestratorThread, load, orchestrator_config, start_draft, start_target
from tests.tiny_models import TinyPair, build_pair

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory: pytest.TempPathFactory) -> TinyPair:
    return build_pair(tmp_path_factory.mktemp("tiny_pair"))


@pytest.fixture(scope="session")
def target_model(tiny_pair: TinyPair) -> LoadedModel:
    return load(tiny_pair.target)


@pytest.fixture(scope="session")
def close_draft_model(tiny_pair: TinyPair) -> LoadedModel:
    return load(tiny_pair.close_draft)


@pytest.fixture(scope="session")
def random_draft_model(tiny_pair: TinyPair) -> LoadedModel:
    return load(tiny_pair.random_draft)


@pytest.fixture(scope="session")
def target_server(target_model: LoadedModel) -> Iterator[ModelServer]:
    server = start_target(target_model)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def close_draft_server(close_draft_model: LoadedModel) -> Iterator[ModelServer]:
    server = start_draft(close_draft_model)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def random_draft_server(random_draft_model: LoadedModel) -> Iterator[ModelServer]:
    server = start_draft(random_draft_model)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def orchestrators(
    target_server: ModelServer, close_draft_server: ModelServer, random_draft_server: ModelServer
) -> Iterator[dict[str, OrchestratorThread]]:
    """One orchestrator per draft, all over the same target, plus one with no draft."""
    started = {
        "close": OrchestratorThread(orchestrator_config(target_server, close_draft_server)),
        # Every client message at once (the default gathers up to 16 tokens, about one round's wait).
        "random": OrchestratorThread(orchestrator_config(target_server, random_draft_server, stream_interval=1)),
        "none": OrchestratorThread(orchestrator_config(target_server)),
    }
    yield started
    for orchestrator in started.values():
        orchestrator.stop()


def wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def collect(
    stub: Any, request: orchestrator_pb2.GenerateRequest
) -> tuple[list[int], str, orchestrator_pb2.GenerateResponse]:
    """All token ids and text of a Generate call, and its last message."""
    ids: list[int] = []
    text = ""
    last = None
    for message in stub.Generate(request):
        ids.extend(message.token_ids)
        text += message.text
        last = message
    assert last is not None
    return ids, text, last


def hf_generate(model: LoadedModel, prompt: list[int], max_new_tokens: int, **kwargs: Any) -> tuple[list[int], Any]:
    """The target model decoding alone: Hugging Face generate(), greedy (`kwargs`: its other options),
    and its processed scores, one [1, vocab] row per generated token."""
    with torch.no_grad():
        output = model.model.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            num_beams=1,
            pad_token_id=0,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            output_scores=True,
            return_dict_in_generate=True,
            **kwargs,
        )
    return output.sequences[0, len(prompt) :].tolist(), output.scores


def hf_greedy(model: LoadedModel, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The target model decoding alone: Hugging Face generate(), greedy."""
    return hf_generate(model, prompt, max_new_tokens)[0]


def client_json(server: str, *args: str, timeout: float = 120) -> dict[str, Any]:
    """Run `python -m tools.client --json` against a server; its one JSON object."""
    command = [sys.executable, "-m", "tools.client", "--server", server, "--json", *args]
    output = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=True).stdout
    return dict(json.loads(output))


class StepFailed(grpc.RpcError):
    """One session's failed step on a link, shaped as the call error a test expects."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


_LINK_TYPES = {
    target_pb2.VerifyRequest: (target_pb2.VerifyStep, target_pb2.VerifyBatch),
    draft_pb2.DraftRequest: (draft_pb2.DraftStep, draft_pb2.DraftBatch),
}


class RawSession:
    """One session on a link of its own, driven step by step, for protocol tests: a step's error raises
    StepFailed (or the stream's own error)."""

    def __init__(self, method: Callable[..., Iterator[Any]], session: int = 1) -> None:
        self._requests: queue.Queue[Any] = queue.Queue()
        self._responses = method(iter(self._requests.get, None))
        self.session = session
        self._types: tuple[Any, Any] | None = None

    def step(self, request: Any) -> Any:
        step_type, batch_type = self._types = _LINK_TYPES[type(request)]
        self._requests.put(batch_type(steps=[step_type(session=self.session, step=request)]))
        (result,) = next(self._responses).results
        assert result.session == self.session
        failure = result_failure(result)
        if failure is not None:
            raise StepFailed(failure.code, failure.details)
        return result.response

    def fetch(self, step_number: int, index: int) -> Any:
        """A draft session's row fetch: the FetchedRow answering it."""
        self._requests.put(
            draft_pb2.DraftBatch(
                steps=[
                    draft_pb2.DraftStep(
                        session=self.session, fetch=draft_pb2.RowFetch(step_number=step_number, index=index)
                    )
                ]
            )
        )
        (result,) = next(self._responses).results
        assert result.session == self.session and result.HasField("fetched")
        return result.fetched

    def close_session(self) -> None:
        """End the session, keeping the stream."""
        assert self._types is not None
        step_type, batch_type = self._types
        self._requests.put(batch_type(steps=[step_type(session=self.session, close=True)]))

    def close(self) -> None:
        self._requests.put(None)


def still_speculates(stub: Any) -> None:
    """After a bad request: a good one on the fixed policy drafts tokens (nothing switched drafting off)."""
    request = orchestrator_pb2.GenerateRequest(
        token_ids=orchestrator_pb2.TokenIds(ids=[3, 4, 5]),
        max_new_tokens=12,
        num_speculative_tokens=2,
        speculation_policy=orchestrator_pb2.SPECULATION_POLICY_FIXED,
    )
    _, _, last = collect(stub, request)
    assert last.stats.draft_tokens > 0 and last.stats.draft_fallback_rounds == 0
