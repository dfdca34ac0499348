"""Prometheus metrics of the model services (labelled by service: draft or target)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)

OPEN_SESSIONS = Gauge("specdec:open_sessions", "Sessions open on this service", ["service"])
CACHED_TOKENS = Gauge("specdec:cached_tokens", "Tokens held in KV caches over all sessions", ["service"])
FORWARD_SECONDS = Histogram(
    "specdec:forward_seconds", "Model forward time of one session step", ["service"], buckets=_LATENCY_BUCKETS
)
STEPS = Counter("specdec:session_steps", "Session steps by result (ok, cache_miss)", ["service", "result"])
FED_TOKENS = Counter("specdec:fed_tokens", "Tokens fed to the model (prefill and verification)", ["service"])
