"""Draft, target and orchestrator servers for tests: real gRPC on 127.0.0.1, ports picked by the OS."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from dataclasses import replace
from typing import Any, TypeVar

import grpc

from draft_service.servicer import SERVICE_NAME as DRAFT_SERVICE
from draft_service.servicer import DraftServicer
from draft_service.servicer import register as register_draft
from model_host.config import ModelServiceConfig
from model_host.loading import LoadedModel, load_model
from model_host.runtime import ModelServer, start_model_server
from orchestrator.app import RunningOrchestrator, start_orchestrator
from orchestrator.config import OrchestratorConfig
from specdec.v1 import orchestrator_pb2_grpc
from target_service.servicer import SERVICE_NAME as TARGET_SERVICE
from target_service.servicer import TargetServicer
from target_service.servicer import register as register_target

T = TypeVar("T")
LOOPBACK = "127.0.0.1"
SERVICE_DEFAULTS = ModelServiceConfig(model="", host=LOOPBACK, port=0, max_sessions=16)


def start_target(loaded: LoadedModel, **overrides: Any) -> ModelServer:
    config = replace(SERVICE_DEFAULTS, model=loaded.model_id, **overrides)
    return start_model_server(TargetServicer(loaded, config), register_target, TARGET_SERVICE, config)


def start_draft(loaded: LoadedModel, **overrides: Any) -> ModelServer:
    config = replace(SERVICE_DEFAULTS, model=loaded.model_id, **overrides)
    return start_model_server(DraftServicer(loaded, config), register_draft, DRAFT_SERVICE, config)


class OrchestratorThread:
    """The asyncio orchestrator on its own event loop in a background thread."""

    def __init__(self, config: OrchestratorConfig) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.running: RunningOrchestrator = self.run(start_orchestrator(config), timeout=120)
        self.address = f"{LOOPBACK}:{self.running.port}"
        self.channel = grpc.insecure_channel(self.address)
        self.stub = orchestrator_pb2_grpc.OrchestratorStub(self.channel)

    def run(self, coroutine: Coroutine[Any, Any, T], timeout: float = 60) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def stop(self) -> None:
        self.channel.close()
        self.run(self.running.drain(0.0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)

    def thread_alive(self) -> bool:
        return self._thread.is_alive()


def orchestrator_config(
    target: ModelServer | str, draft: ModelServer | str | None = None, **overrides: Any
) -> OrchestratorConfig:
    def address(server: ModelServer | str) -> str:
        return server if isinstance(server, str) else f"{LOOPBACK}:{server.port}"

    return OrchestratorConfig(
        target=address(target),
        draft=address(draft) if draft is not None else "",
        host=LOOPBACK,
        port=0,
        startup_timeout_s=30.0,
        target_backoff_s=0.05,
        **overrides,
    )


def load(path: Any) -> LoadedModel:
    return load_model(str(path), "cpu", "float32")
