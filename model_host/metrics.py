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

_BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 128)
_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
BATCH_SIZE = Histogram(
    "specdec:batch_size", "Sessions (rows) in one engine forward", ["service"], buckets=_BATCH_BUCKETS
)
BATCH_TOKENS = Histogram(
    "specdec:batch_tokens", "Tokens fed in one engine forward, over all rows", ["service"], buckets=_TOKEN_BUCKETS
)
ENGINE_FORWARD_SECONDS = Histogram(
    "specdec:engine_forward_seconds", "Duration of one batched forward", ["service"], buckets=_LATENCY_BUCKETS
)
QUEUE_SECONDS = Histogram(
    "specdec:queue_wait_seconds", "Time a step waited before its first forward", ["service"], buckets=_LATENCY_BUCKETS
)

# vLLM's names for prefix caching, with our prefix: the hit rate is hits / queries (tokens).
PREFIX_CACHE_QUERIES = Counter(
    "specdec:prefix_cache_queries", "Tokens of new or reopened sessions looked up in the prefix cache", ["service"]
)
PREFIX_CACHE_HITS = Counter(
    "specdec:prefix_cache_hits", "Tokens of those found cached, and not computed again", ["service"]
)
KV_BLOCKS = Gauge(
    "specdec:kv_blocks",
    "Key-value blocks by state: used (held by sessions), cached (free, kept for reuse), free",
    ["service", "state"],
)
KV_RESIDENT_BYTES = Gauge(
    "specdec:kv_resident_bytes",
    "Bytes of the key-value pool written at least once: memory the pool holds, at most its budget's",
    ["service"],
)

# --simulated-device (benchmarks only): forwards released at a modeled GPU's clock, and those whose CPU
# time overran it (their figures are the CPU's, not the modeled device's).
SIMULATED_DEVICE = Gauge("specdec:simulated_device", "1 when forwards run on a modeled device", ["service", "profile"])
SIMULATED_FORWARDS = Counter("specdec:simulated_forwards", "Forwards released at the modeled clock", ["service"])
SIMULATED_STAND_IN_CPU = Counter(
    "specdec:simulated_stand_in_cpu_seconds",
    "CPU seconds of the stand-in forwards themselves (simulation cost, not the host's work)",
    ["service"],
)
SIMULATED_OVERRUNS = Counter(
    "specdec:simulated_overrun_forwards", "Forwards whose CPU time overran their modeled time", ["service"]
)

# The draft's speculation cache (draft_service/speculation.py).
SPECULATION_STEPS = Counter(
    "specdec:speculation_steps",
    "Draft steps of sessions with blocks drafted ahead, by outcome (hit, miss) and the verdict they name "
    "(whole: the block accepted whole; rejection; other: a reopened session's)",
    ["outcome", "verdict"],
)
SPECULATION_TOKENS = Counter(
    "specdec:speculation_drafted_tokens",
    "Tokens drafted ahead, by use: used (a hit's), wasted (a block dropped)",
    ["use"],
)
SPECULATION_ENTRIES = Gauge("specdec:speculation_entries", "Blocks drafted ahead, held or drafting now")
SPECULATION_HELD_TOKENS = Gauge(
    "specdec:speculation_held_tokens", "Tokens of the blocks drafted ahead (--speculation-cache-tokens bounds them)"
)
