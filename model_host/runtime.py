"""Start-up of a model service: load, serve, expire idle sessions, drain on SIGTERM."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
import structlog
import torch
from grpc_health.v1.health import aio as health_aio

from model_host.config import ModelServiceConfig, parse_model_service_config
from model_host.forward import ModelNotServable
from model_host.kv_memory import PoolTooLarge
from model_host.loading import LoadedModel, load_model
from model_host.session_servicer import SessionServicer
from serving import server as serving
from serving.cpus import available_cpus
from serving.errors import ErrorInterceptor
from serving.log_setup import configure_logging
from serving.security import server_credentials

log = structlog.get_logger(__name__)

T = TypeVar("T")


class _CannotServe(Exception):
    """The server could not listen where it was told to."""


@dataclass
class ModelServer:
    """A running model service: the gRPC server (asyncio, on an event loop of its own thread), its port
    and its servicer. Its methods may be called from any thread."""

    server: grpc.aio.Server
    port: int
    servicer: SessionServicer[Any, Any]
    health: health_aio.HealthServicer
    loop: asyncio.AbstractEventLoop
    loop_thread: threading.Thread
    health_server: grpc.aio.Server | None = None  # the plaintext health-only port, when asked for
    _stopped: threading.Event = field(default_factory=threading.Event)

    def _run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def drain(self, grace_s: float) -> None:
        """Health goes NOT_SERVING and new sessions are refused (UNAVAILABLE: the orchestrator opens them
        elsewhere); open sessions get `grace_s` to finish, then are cancelled (reopened elsewhere); then
        the server stops."""
        self._run(self.health.enter_graceful_shutdown())
        self.servicer.start_draining()
        self._run(self.server.stop(grace_s))
        self.stop()

    def stop(self) -> None:
        if self._stopped.is_set():
            return
        self._run(self.server.stop(None))
        if self.health_server is not None:
            self._run(self.health_server.stop(None))
        self.servicer.stop()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.loop_thread.join(timeout=10)
        self._stopped.set()

    def wait(self) -> None:
        self._stopped.wait()


def start_model_server(
    servicer: SessionServicer[Any, Any],
    register: Callable[[Any, grpc.aio.Server], None],
    service_name: str,
    config: ModelServiceConfig,
    engine_thread: bool = True,
) -> ModelServer:
    """Serve `servicer` on config.host:config.port (port 0 picks one) with health and reflection.

    The gRPC server runs on an asyncio event loop in a thread of its own: one thread receives and
    answers every session's steps, instead of a worker thread per stream taking turns for the
    interpreter. The engine runs in a thread of its own unless `engine_thread` is False, in which case
    the caller runs `servicer.engine.run()` (a service's main thread does)."""
    loop = asyncio.new_event_loop()
    loop_thread = threading.Thread(target=loop.run_forever, name=f"{servicer.role}-grpc", daemon=True)
    loop_thread.start()

    async def serve() -> ModelServer:
        server = grpc.aio.server(
            interceptors=[ErrorInterceptor()],
            options=serving.CHANNEL_OPTIONS,
        )
        register(servicer, server)
        health_servicer = await serving.add_standard_services(server, [service_name])
        credentials = server_credentials(config.tls_cert, config.tls_key, config.tls_client_ca)
        try:
            port = serving.bind(server, config.host, config.port, credentials)
        except SystemExit as exc:  # an exit raised inside the event loop would end the loop, not this call
            raise _CannotServe(str(exc)) from None
        await server.start()
        health_server = await serving.start_health_port(health_servicer, config.host, config.health_port)
        return ModelServer(server, port, servicer, health_servicer, loop, loop_thread, health_server)

    try:
        model_server = asyncio.run_coroutine_threadsafe(serve(), loop).result()
    except BaseException as exc:
        loop.call_soon_threadsafe(loop.stop)
        if isinstance(exc, _CannotServe):
            raise SystemExit(str(exc)) from None
        raise
    if engine_thread:
        servicer.engine.start()
    _start_expiry(model_server, config.session_idle_timeout_s)
    log.info("serving", service=service_name, host=config.host, port=model_server.port)
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
    register: Callable[[Any, grpc.aio.Server], None],
    service_name: str,
) -> None:
    """The `python -m draft_service` / `python -m target_service` entry point."""
    config = parse_model_service_config(prog, argv)
    configure_logging(config.log_level)
    # A simulated device sleeps through most of each forward: one thread, so that no pool spins meanwhile.
    threads = config.threads or (1 if config.simulated_device else available_cpus())
    torch.set_num_threads(threads)
    source = (
        "--threads"
        if config.threads
        else "--simulated-device"
        if config.simulated_device
        else "affinity and cgroup quota"
    )
    log.info("threads", torch_threads=threads, source=source)
    try:
        loaded = load_model(config.model, config.device, config.dtype)
    except ValueError as exc:
        raise SystemExit(f"{prog}: {exc}") from exc
    try:
        servicer = make_servicer(loaded, config)
    except ModelNotServable as exc:
        raise SystemExit(f"{prog}: {config.model}: {exc}") from exc
    except PoolTooLarge as exc:
        raise SystemExit(f"{prog}: {exc}") from exc
    serving.start_metrics(config.host, config.metrics_port)
    model_server = start_model_server(servicer, register, service_name, config, engine_thread=False)
    serving.on_sigterm(lambda: model_server.drain(config.grace_period_s))
    model_server.servicer.engine.run()  # the main thread owns the model until the drain stops the engine
    model_server.wait()
    log.info("stopped", service=service_name)
