"""Metrics every specdec server exports."""

from __future__ import annotations

from prometheus_client import Histogram

RPC_LATENCY = Histogram(
    "specdec:rpc_latency_seconds",
    "gRPC call duration by method and status code (for streams: the whole stream)",
    ["method", "code"],
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0),
)
