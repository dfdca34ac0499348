"""TLS for every server and client, and API keys on the public API.

- A server with `--tls-cert` and `--tls-key` (PEM) serves TLS; `--tls-client-ca` makes it require a
  client certificate signed by that CA (mutual TLS between the orchestrator and the model services).
- The orchestrator, as a client of the services: `--upstream-tls-ca` (trust), `--upstream-tls-cert`
  and `--upstream-tls-key` (its own certificate, for mutual TLS).
- `--api-key-file`: one key a line (blank lines and `#` comments ignored). A request carries
  `authorization: Bearer KEY` metadata; keys are compared in constant time, reload when the file
  changes or on SIGHUP, and never appear in a log or metric. Health and reflection stay open.
- Without TLS flags everything stays plaintext, with one warning line at start-up.
"""

from __future__ import annotations

import hmac
import os
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import structlog

log = structlog.get_logger(__name__)

AUTHORIZATION_METADATA = "authorization"
# Methods any client may call without a key: probes and tooling.
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


def _read(path: str, flag: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise SystemExit(f"{flag} {path}: {exc.strerror}; give a readable PEM file") from exc


def server_credentials(cert: str, key: str, client_ca: str = "") -> grpc.ServerCredentials | None:
    """TLS credentials for a server, or None (plaintext, warned about) when no certificate is given."""
    if not cert and not key:
        if client_ca:
            raise SystemExit("--tls-client-ca needs --tls-cert and --tls-key")
        log.warning("plaintext", detail="no --tls-cert/--tls-key: this server accepts unencrypted connections")
        return None
    if not cert or not key:
        raise SystemExit("--tls-cert and --tls-key go together; give both PEM files")
    root = _read(client_ca, "--tls-client-ca") if client_ca else None
    return grpc.ssl_server_credentials(
        [(_read(key, "--tls-key"), _read(cert, "--tls-cert"))], root_certificates=root, require_client_auth=bool(root)
    )


def channel_credentials(
    ca: str, cert: str = "", key: str = "", flags: str = "--upstream-tls"
) -> grpc.ChannelCredentials | None:
    """TLS credentials for a client channel, or None for plaintext; errors name the `flags`-ca/-cert/-key."""
    if bool(cert) != bool(key):
        raise SystemExit(f"{flags}-cert and {flags}-key go together; give both PEM files")
    if not ca and not cert:
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=_read(ca, f"{flags}-ca") if ca else None,
        private_key=_read(key, f"{flags}-key") if key else None,
        certificate_chain=_read(cert, f"{flags}-cert") if cert else None,
    )


class ApiKeys:
    """The accepted keys, reloaded when their file changes (checked at most once a second) or on demand."""

    def __init__(self, path: str, check_interval_s: float = 1.0) -> None:
        self.path = path
        self.check_interval_s = check_interval_s
        self._lock = threading.Lock()
        self._keys: tuple[bytes, ...] = ()
        self._stamp: tuple[float, int] | None = None
        self._checked = 0.0
        self.reload()

    def reload(self) -> None:
        """Read the file again; a file that cannot be read keeps the keys already loaded."""
        try:
            stat = os.stat(self.path)
            text = Path(self.path).read_text()
        except OSError as exc:
            if not self._keys:
                raise SystemExit(f"--api-key-file {self.path}: {exc.strerror}") from exc
            log.warning("api_keys_unreadable", path=self.path, error=exc.strerror, kept=len(self._keys))
            return
        keys = tuple(line.strip().encode() for line in text.splitlines() if line.strip() and not line.startswith("#"))
        if not keys:
            log.warning("api_keys_empty", path=self.path, detail="every request will be refused")
        with self._lock:
            self._keys, self._stamp = keys, (stat.st_mtime, stat.st_size)
        log.info("api_keys_loaded", path=self.path, count=len(keys))

    def _maybe_reload(self) -> None:
        now = time.monotonic()
        if now - self._checked < self.check_interval_s:
            return
        self._checked = now
        try:
            stat = os.stat(self.path)
        except OSError:
            return
        if (stat.st_mtime, stat.st_size) != self._stamp:
            self.reload()

    def first(self) -> str:
        """One accepted key (for a client's own calls upstream, such as a gateway's), or ""."""
        with self._lock:
            return self._keys[0].decode() if self._keys else ""

    def accepts(self, metadata: tuple[tuple[str, Any], ...] | None) -> bool:
        """Whether the call's metadata carries `authorization: Bearer KEY` with a known key."""
        self._maybe_reload()
        value = next((v for k, v in metadata or () if k == AUTHORIZATION_METADATA), "")
        scheme, _, token = str(value).partition(" ")
        if scheme.lower() != "bearer" or not token:
            return False
        given = token.strip().encode()
        with self._lock:
            keys = self._keys
        # Compare with every key, so the time taken says nothing about which one matched.
        return sum(hmac.compare_digest(given, key) for key in keys) > 0


_REFUSED = "a valid API key is required: send the metadata `authorization: Bearer <key>`"


class AsyncApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without a valid key with UNAUTHENTICATED; health and reflection stay open."""

    def __init__(self, keys: ApiKeys) -> None:
        self.keys = keys

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = details.method or ""
        if method.startswith(OPEN_METHOD_PREFIXES) or self.keys.accepts(details.invocation_metadata):
            return await continuation(details)
        handler = await continuation(details)
        if handler is None:
            return handler

        async def refuse_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, _REFUSED)

        async def refuse_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, _REFUSED)
            yield  # pragma: no cover - never reached; makes this an async generator

        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                refuse_stream, handler.request_deserializer, handler.response_serializer
            )
        return grpc.unary_unary_rpc_method_handler(
            refuse_unary, handler.request_deserializer, handler.response_serializer
        )
