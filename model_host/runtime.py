"""Start-up of a model service: load, serve, expire idle sessions, drain on SIGTERM."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
import structlog
import torch
from grpc_health.v1 import health

from model_host.config import ModelServiceConfig, parse_model_service_config
from model_host.loading import LoadedModel, load_model
from model_host.session_servicer import SessionServicer
from serving import server as serving
from serving.errors import ErrorInterceptor
from serving.log_setup import configure_logging
from serving.security import server_credentials

log = structlog.get_logger(__name__)

# Threads beyond one per session, for GetModelInfo, health checks and reflection.
_SPARE_WORKERS = 8


@dataclass
class ModelServer:
    """A running model service: the gRPC server, its port and its servicer."""

    server: grpc.Server
    port: int
    servicer: SessionServicer[Any, Any]
    health: health.HealthServicer
    health_server: grpc.Server | None = None  # the plaintext health-only port, when asked for
    _stopped: threading.Event = field(default_factory=threading.Event)

    def drain(self, grace_s: float) -> None:
        """Health goes NOT_SERVING; open sessions get `grace_s` to finish, then are cancelled (the
        orchestrator reopens them elsewhere); then the server stops."""
        self.health.enter_graceful_shutdown()
        self.server.stop(grace_s).wait()
        self.stop()

    def stop(self) -> None:
        self.server.stop(None).wait()
        if self.health_server is not None:
            self.health_server.stop(None).wait()
        self.servicer.stop()
        self._stopped.set()

    def wait(self) -> None:
        self._stopped.wait()


def start_model_server(
    servicer: SessionServicer[Any, Any],
    register: Callable[[Any, grpc.Server], None],
    service_name: str,
    config: ModelServiceConfig,
    engine_thread: bool = True,
) -> ModelServer:
    """Serve `servicer` on config.host:config.port (port 0 picks one) with health and reflection.

    The engine runs in a thread of its own unless `engine_thread` is False, in which case the caller
    runs `servicer.engine.run()` (a service's main thread does)."""
    workers = config.max_sessions + _SPARE_WORKERS
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix=servicer.role),
        interceptors=[ErrorInterceptor()],
        options=serving.CHANNEL_OPTIONS,
        maximum_concurrent_rpcs=workers,
    )
    register(servicer, server)
    health_servicer = serving.add_standard_services(server, [service_name])
    credentials = server_credentials(config.tls_cert, config.tls_key, config.tls_client_ca)
    port = serving.bind(server, config.host, config.port, credentials)
    server.start()
    if engine_thread:
        servicer.engine.start()
    model_server = ModelServer(
        server=server,
        port=port,
        servicer=servicer,
        health=health_servicer,
        health_server=serving.start_health_port(health_servicer, config.host, config.health_port),
    )
    _start_expiry(model_server, config.session_idle_timeout_s)
    log.info("serving", service=service_name, host=config.host, port=port)
    return model_server


def _start_expiry(model_server: ModelServer, idle_timeout_s: float) -> None:
    interval = max(0.5, min(30.0, idle_timeout_s / 4))

    def expire() -> None:
        while not model_server._stopped.wait(interval):
            expired = model_server.servicer.store.expire_idle()
            closed = model_server.servicer.close_idle_streams(idle_timeout_s)
            if expired or closed:
                log.info("sessions_expired", count=expired, idle_streams_closed=closed)

    threading.Thread(target=expire, name="session-expiry", daemon=True).start()


def run_model_service(
    prog: str,
    argv: Sequence[str] | None,
    make_servicer: Callable[[LoadedModel, ModelServiceConfig], SessionServicer[Any, Any]],
    register: Callable[[Any, grpc.Server], None],
    service_name: str,
) -> None:
    """The `python -m draft_service` / `python -m target_service` entry point."""
    config = parse_model_service_config(prog, argv)
    configure_logging(config.log_level)
    if config.threads:
        torch.set_num_threads(config.threads)
    try:
        loaded = load_model(config.model, config.device, config.dtype)
    except ValueError as exc:
        raise SystemExit(f"{prog}: {exc}") from exc
    serving.start_metrics(config.host, config.metrics_port)
    model_server = start_model_server(
        make_servicer(loaded, config), register, service_name, config, engine_thread=False
    )
    serving.on_sigterm(lambda: model_server.drain(config.grace_period_s))
    model_server.servicer.engine.run()  # the main thread owns the model until the drain stops the engine
    model_server.wait()
    log.info("stopped", service=service_name)
