"""Server bootstrap every specdec server shares: health, reflection, metrics, graceful drain."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Sequence
from types import FrameType

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

log = structlog.get_logger(__name__)

# Large enough for a block of probability rows over a 256k vocabulary.
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
# A link's message carries many sessions' steps: it is split where it would pass this size, so that
# dense rows (a 128k vocabulary's 64 sampled sessions: about 295 MB) never meet the limit.
MESSAGE_BUDGET_BYTES = MAX_MESSAGE_BYTES // 4
CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


def _reflected_names(service_names: Sequence[str]) -> list[str]:
    return [*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME]


async def add_standard_services(server: grpc.aio.Server, service_names: Sequence[str]) -> health_aio.HealthServicer:
    """Standard health checking (SERVING for each service and for "") and server reflection."""
    servicer = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    reflection.enable_server_reflection(_reflected_names(service_names), server)
    for name in ["", *service_names]:
        await servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return servicer


def bind(
    server: grpc.Server | grpc.aio.Server, host: str, port: int, credentials: grpc.ServerCredentials | None = None
) -> int:
    """Listen on host:port (port 0 picks a free one), with TLS when `credentials` are given; returns the
    port, or raises naming the address."""
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError as exc:
        raise SystemExit(f"cannot listen on {address}: {exc}; choose another --host or --port") from exc
    if bound == 0:
        raise SystemExit(f"cannot listen on {address}; choose another --host or --port")
    return bound


async def start_health_port(health_servicer: health_aio.HealthServicer, host: str, port: int) -> grpc.aio.Server | None:
    """A plaintext port serving standard health checks only (0: none), for probes that cannot speak TLS
    (Kubernetes' native gRPC probes); it shares the main server's health status."""
    if not port:
        return None
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bind(server, host, port)
    await server.start()
    return server


def start_metrics(host: str, port: int) -> None:
    """Serve Prometheus metrics on their own port; 0 disables them."""
    if port:
        start_http_server(port, addr=host)
        log.info("metrics_listening", host=host, port=port)


def on_sigterm(drain: Callable[[], None]) -> None:
    """Run `drain` in a thread on SIGTERM or SIGINT (signal handlers must return quickly)."""

    def handler(signum: int, frame: FrameType | None) -> None:
        log.info("draining", signal=signal.Signals(signum).name)
        threading.Thread(target=drain, name="drain", daemon=True).start()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
