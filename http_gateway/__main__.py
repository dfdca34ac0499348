"""python -m http_gateway --orchestrator HOST:PORT --port 8000 (or specdec-gateway)"""

from __future__ import annotations

import argparse
import asyncio
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import structlog
import uvicorn
from grpc_health.v1 import health_pb2_grpc
from transformers import AutoTokenizer

from http_gateway.app import RequestLimits, Upstream, create_app
from http_gateway.limits import RequestBounds, bounded_protocol, default_max_body_bytes, default_max_connections
from serving.config import add_config_arguments
from serving.log_setup import configure_logging
from serving.security import ApiKeys, channel_credentials
from specdec.v1 import orchestrator_pb2, orchestrator_pb2_grpc

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class GatewayConfig:
    """Settings of the gateway; the defaults live here and nowhere else."""

    orchestrator: str = ""
    host: str = "127.0.0.1"
    port: int = 8000
    tokenizer: str = ""
    api_key_file: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    upstream_tls_ca: str = ""
    upstream_tls_cert: str = ""
    upstream_tls_key: str = ""
    upstream_tls_server_name: str = ""
    upstream_api_key: str = ""
    startup_timeout_s: float = 120.0
    grace_period_s: float = 30.0
    max_body_bytes: int = 0  # 0: derived from the model's context (limits.default_max_body_bytes)
    read_timeout_s: float = 30.0
    max_connections: int = 0  # 0: half the process's open-file limit
    keep_alive_timeout_s: float = 5.0
    cache_salt_per_key: bool = False
    cache_salt_secret_file: str = ""
    log_level: str = "info"


_HELP = {
    "orchestrator": "the orchestrator's HOST:PORT",
    "host": "address to listen on (0.0.0.0 in a container)",
    "port": "HTTP port",
    "tokenizer": "tokenizer (with the chat template) for /v1/chat/completions; default: the orchestrator's target",
    "api_key_file": "accepted API keys, one a line (the same format as the orchestrator's); forwarded upstream",
    "tls_cert": "PEM certificate chain: serve HTTPS (with --tls-key)",
    "tls_key": "PEM private key for --tls-cert",
    "upstream_tls_ca": "PEM CA bundle to trust for the orchestrator: connect over TLS",
    "upstream_tls_cert": "PEM client certificate toward the orchestrator (mutual TLS)",
    "upstream_tls_key": "PEM private key for --upstream-tls-cert",
    "upstream_tls_server_name": "name to verify in the orchestrator's certificate",
    "upstream_api_key": "key for the gateway's own calls to the orchestrator (default: the first of --api-key-file)",
    "startup_timeout_s": "how long to wait for the orchestrator at start-up",
    "grace_period_s": "seconds open requests get to finish after SIGTERM",
    "max_body_bytes": "largest request body (413 beyond); 0 derives it from the model's context",
    "read_timeout_s": "seconds a client has to send a request's headers, and then its body (408 or closed beyond)",
    "max_connections": "open connections at most (429 beyond); 0: half the process's open-file limit",
    "keep_alive_timeout_s": "seconds an idle keep-alive connection stays open between requests",
    "cache_salt_per_key": "keep each API key's cached prefixes apart: every request's cache_salt is an HMAC of its "
    "key (and of the cache_salt it sent) under --cache-salt-secret-file",
    "cache_salt_secret_file": "the server secret for --cache-salt-per-key (the same on every gateway replica, so "
    "that they route alike; never logged)",
    "log_level": "debug, info, warning or error",
}


def parse_config(argv: Sequence[str] | None = None) -> GatewayConfig:
    parser = argparse.ArgumentParser(prog="http_gateway", description="specdec OpenAI-compatible HTTP gateway")
    add_config_arguments(parser, GatewayConfig, _HELP)
    config = GatewayConfig(**vars(parser.parse_args(argv)))
    if not config.orchestrator:
        parser.error("--orchestrator is required (HOST:PORT of the orchestrator), or set SPECDEC_ORCHESTRATOR")
    if bool(config.tls_cert) != bool(config.tls_key):
        parser.error("--tls-cert and --tls-key go together")
    if config.cache_salt_per_key and not config.cache_salt_secret_file:
        parser.error("--cache-salt-per-key needs --cache-salt-secret-file: a file holding the server's secret")
    return config


def read_salt_secret(path: str) -> bytes | None:
    """The secret of --cache-salt-secret-file (None without one); an empty or unreadable file stops start-up."""
    if not path:
        return None
    try:
        secret = Path(path).read_bytes().strip()
    except OSError as exc:
        raise SystemExit(f"http_gateway: --cache-salt-secret-file {path}: {exc.strerror}") from exc
    if len(secret) < 16:
        raise SystemExit(f"http_gateway: --cache-salt-secret-file {path} must hold a secret of at least 16 bytes")
    return secret


_MAX_RECONNECT_BACKOFF_MS = 1000


# Channels to the orchestrator, each its own connection: an orchestrator with --workers N balances
# connections over its workers (SO_REUSEPORT), so one channel would reach one worker. 8 connections
# leave both of 2 workers idle with a chance of 1 in 128, and spread over up to 8.
CHANNELS = 8


async def connect(config: GatewayConfig) -> tuple[list[grpc.aio.Channel], Upstream]:
    """The orchestrator's channels and info (waiting for it up to the start-up timeout), and the tokenizer."""
    credentials = channel_credentials(config.upstream_tls_ca, config.upstream_tls_cert, config.upstream_tls_key)
    # An orchestrator that comes back is found within a second or two (gRPC's default backoff grows
    # to two minutes, during which every request and the readiness check would fail). Each channel has
    # a subchannel pool of its own: identical channels would share one connection otherwise.
    options: list[tuple[str, str | int]] = [
        ("grpc.max_reconnect_backoff_ms", _MAX_RECONNECT_BACKOFF_MS),
        ("grpc.use_local_subchannel_pool", 1),
    ]
    if config.upstream_tls_server_name:
        options.append(("grpc.ssl_target_name_override", config.upstream_tls_server_name))
    channels = [
        grpc.aio.secure_channel(config.orchestrator, credentials, options=options)
        if credentials
        else grpc.aio.insecure_channel(config.orchestrator, options=options)
        for _ in range(CHANNELS)
    ]
    stubs = [orchestrator_pb2_grpc.OrchestratorStub(channel) for channel in channels]
    stub = stubs[0]
    health = health_pb2_grpc.HealthStub(channels[0])
    key = config.upstream_api_key
    if not key and config.api_key_file:  # the orchestrator may check keys too: the same file's first
        key = ApiKeys(config.api_key_file).first()
    metadata = (("authorization", f"Bearer {key}"),) if key else ()
    deadline = asyncio.get_running_loop().time() + config.startup_timeout_s
    while True:
        try:
            info = await stub.GetInfo(orchestrator_pb2.GetInfoRequest(), metadata=metadata, timeout=5.0)
            break
        except grpc.aio.AioRpcError as exc:
            if asyncio.get_running_loop().time() > deadline:
                raise SystemExit(f"http_gateway: no orchestrator at {config.orchestrator}: {exc.details()}") from exc
            await asyncio.sleep(0.5)
    name = config.tokenizer or info.target.model
    tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, name)
    return channels, Upstream(stubs, info, tokenizer, health)


# Request headers beyond this are answered 431 (h11's own bound on a header section in pieces).
MAX_HEADER_BYTES = 16 * 1024


def server_config(config: GatewayConfig, upstream: Upstream) -> uvicorn.Config:
    """The gateway's app under uvicorn, with its bounds on connections, reads and bodies."""
    keys = ApiKeys(config.api_key_file) if config.api_key_file else None
    limits = RequestLimits(
        max_body_bytes=config.max_body_bytes or default_max_body_bytes(upstream.info.target.max_context),
        read_timeout_s=config.read_timeout_s,
    )
    secret = read_salt_secret(config.cache_salt_secret_file) if config.cache_salt_per_key else None
    return uvicorn.Config(
        RequestBounds(create_app(upstream, limits, keys, secret), MAX_HEADER_BYTES, limits.max_body_bytes),
        host=config.host,
        port=config.port,
        ssl_certfile=config.tls_cert or None,
        ssl_keyfile=config.tls_key or None,
        log_level=config.log_level,
        access_log=False,
        timeout_graceful_shutdown=int(config.grace_period_s),
        http=bounded_protocol(config.read_timeout_s, config.max_connections or default_max_connections()),
        timeout_keep_alive=int(config.keep_alive_timeout_s),
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
    )


async def serve(config: GatewayConfig) -> None:
    channels, upstream = await connect(config)
    server = uvicorn.Server(server_config(config, upstream))
    log.info("serving", port=config.port, orchestrator=config.orchestrator, model=upstream.model)
    try:
        await server.serve()
    finally:
        for channel in channels:
            await channel.close()


def main(argv: Sequence[str] | None = None) -> None:
    config = parse_config(argv)
    configure_logging(config.log_level)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    asyncio.run(serve(config))


if __name__ == "__main__":
    main()
