"""Starting and stopping the orchestrator's asyncio gRPC server."""

from __future__ import annotations

import asyncio
import signal
from dataclasses import dataclass

import grpc
import structlog
from grpc_health.v1.health import aio as health_aio

from orchestrator.config import OrchestratorConfig
from orchestrator.servicer import SERVICE_NAME, OrchestratorServicer
from serving import server as serving
from serving.errors import ErrorInterceptor
from serving.security import ApiKeys, AsyncApiKeyInterceptor, server_credentials
from specdec.v1 import orchestrator_pb2_grpc

log = structlog.get_logger(__name__)

# A text prompt may have 64 characters per context token (checked by the servicer), each up to 4
# bytes of UTF-8; the rest of a request is small.
_MAX_BYTES_PER_CONTEXT_TOKEN = 256
_REQUEST_SLACK_BYTES = 64 * 1024


@dataclass
class RunningOrchestrator:
    server: grpc.aio.Server
    port: int
    servicer: OrchestratorServicer
    health: health_aio.HealthServicer
    health_server: grpc.aio.Server | None = None
    api_keys: ApiKeys | None = None

    async def drain(self, grace_s: float) -> None:
        """Health goes NOT_SERVING; open requests get grace_s to finish; then the server stops."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)
        if self.health_server is not None:
            await self.health_server.stop(None)
        await self.servicer.close()


async def start_orchestrator(config: OrchestratorConfig) -> RunningOrchestrator:
    """Connect to the services, check the pair, and serve (raises PairMismatch or ConnectionError)."""
    credentials = server_credentials(config.tls_cert, config.tls_key, config.tls_client_ca)
    api_keys = ApiKeys(config.api_key_file) if config.api_key_file else None
    if api_keys is None:
        log.warning("no_api_keys", detail="no --api-key-file: any client may call Generate")
    servicer = await OrchestratorServicer.connect(config)
    interceptors: list[grpc.aio.ServerInterceptor] = [ErrorInterceptor()]
    if api_keys is not None:
        interceptors.insert(0, AsyncApiKeyInterceptor(api_keys))
    # A request holds at most a prompt the context can take: bound what the public port accepts by it.
    max_request = _MAX_BYTES_PER_CONTEXT_TOKEN * servicer.target_info.max_context + _REQUEST_SLACK_BYTES
    options = [("grpc.max_receive_message_length", max_request), ("grpc.max_send_message_length", max_request)]
    server = grpc.aio.server(interceptors=interceptors, options=options)
    orchestrator_pb2_grpc.add_OrchestratorServicer_to_server(servicer, server)
    health = await serving.add_standard_services(server, [SERVICE_NAME])
    port = serving.bind(server, config.host, config.port, credentials)
    await server.start()
    health_server = await serving.start_health_port(health, config.host, config.health_port)
    log.info(
        "serving",
        service=SERVICE_NAME,
        host=config.host,
        port=port,
        target=servicer.target_info.model,
        draft=servicer.draft.info.model if servicer.draft and servicer.draft.info else None,
    )
    return RunningOrchestrator(server, port, servicer, health, health_server, api_keys)


async def serve(config: OrchestratorConfig) -> None:
    """Run until SIGTERM or SIGINT, then drain."""
    running = await start_orchestrator(config)
    http = None
    if config.http_port:  # imported here: the gateway's app is loaded only where asked for
        from http_gateway.in_process import start_http

        http = await start_http(
            running.servicer, running.health, config.host, config.http_port, config.api_key_file, config.grace_period_s
        )
        log.info("http_serving", host=config.host, port=config.http_port)
    serving.start_metrics(config.host, config.metrics_port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if running.api_keys is not None:
        loop.add_signal_handler(signal.SIGHUP, running.api_keys.reload)
    await stop.wait()
    log.info("draining", grace_s=config.grace_period_s)
    if http is not None:  # HTTP requests in flight finish (within the grace) before the servicer closes
        await http.stop()
    await running.drain(config.grace_period_s)
    log.info("stopped")
