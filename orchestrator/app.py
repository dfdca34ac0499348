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
from serving.errors import AsyncErrorInterceptor
from specdec.v1 import orchestrator_pb2_grpc

log = structlog.get_logger(__name__)


@dataclass
class RunningOrchestrator:
    server: grpc.aio.Server
    port: int
    servicer: OrchestratorServicer
    health: health_aio.HealthServicer

    async def drain(self, grace_s: float) -> None:
        """Health goes NOT_SERVING; open requests get grace_s to finish; then the server stops."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)
        await self.servicer.close()


async def start_orchestrator(config: OrchestratorConfig) -> RunningOrchestrator:
    """Connect to the services, check the pair, and serve (raises PairMismatch or ConnectionError)."""
    servicer = await OrchestratorServicer.connect(config)
    server = grpc.aio.server(interceptors=[AsyncErrorInterceptor()], options=serving.CHANNEL_OPTIONS)
    orchestrator_pb2_grpc.add_OrchestratorServicer_to_server(servicer, server)
    health = await serving.add_standard_services_async(server, [SERVICE_NAME])
    port = serving.bind(server, config.host, config.port)
    await server.start()
    log.info(
        "serving",
        service=SERVICE_NAME,
        host=config.host,
        port=port,
        target=servicer.target_info.model,
        draft=servicer.draft.info.model if servicer.draft and servicer.draft.info else None,
    )
    return RunningOrchestrator(server, port, servicer, health)


async def serve(config: OrchestratorConfig) -> None:
    """Run until SIGTERM or SIGINT, then drain."""
    running = await start_orchestrator(config)
    serving.start_metrics(config.host, config.metrics_port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("draining", grace_s=config.grace_period_s)
    await running.drain(config.grace_period_s)
    log.info("stopped")
