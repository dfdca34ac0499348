"""The orchestrator's configuration object, parsed from flags and SPECDEC_* environment variables."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

from serving.config import add_config_arguments
from serving.protocol import DRAFT_METHODS, POLICIES


@dataclass(frozen=True)
class OrchestratorConfig:
    """Settings of the orchestrator; the defaults live here and nowhere else."""

    target: str = ""
    draft: str = ""
    host: str = "127.0.0.1"
    port: int = 50050
    tokenizer: str = ""
    draft_tokenizer: str = ""
    min_vocab_overlap: float = 0.5
    cross_greedy: str = "slem"
    max_new_tokens_cap: int = 4096
    max_speculative_tokens: int = 16
    num_speculative_tokens: int = 2
    speculation_policy: str = "load_aware"
    overlap_drafting: bool = True
    speculation_tree: str = "off"
    draft_method: str = "model"
    ngram_min: int = 2
    ngram_max: int = 4
    min_confidence: float = 0.0
    draft_timeout_s: float = 10.0
    draft_retry_after_s: float = 5.0
    target_timeout_s: float = 60.0
    request_timeout_s: float = 900.0
    target_attempts: int = 4
    target_backoff_s: float = 0.25
    startup_timeout_s: float = 120.0
    resolve_interval_s: float = 30.0
    max_running_requests: int = 0
    cache_aware_routing: bool = True
    route_load_slack: int = 2
    max_queued_requests: int = 1024
    max_queue_wait_s: float = 60.0
    stream_interval: int = 16
    workers: str = "1"
    http_port: int = 0
    metrics_port: int = 0
    health_port: int = 0
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    upstream_tls_ca: str = ""
    upstream_tls_cert: str = ""
    upstream_tls_key: str = ""
    upstream_tls_server_name: str = ""
    api_key_file: str = ""
    grace_period_s: float = 30.0
    log_level: str = "info"


_HELP: dict[str, str] = {
    "target": "target replicas: HOST:PORT[,HOST:PORT...] or dns:///NAME:PORT (a headless Service)",
    "draft": "draft replicas, as --target; empty decodes with the target alone",
    "host": "address to listen on (0.0.0.0 or :: in a container)",
    "port": "gRPC port for clients (0 picks a free one)",
    "tokenizer": "tokenizer checkpoint; defaults to the target service's model",
    "draft_tokenizer": "the draft's tokenizer (a local folder or hub id) when it differs from the target's: sampled "
    "drafts then use the tokens both share, by bytes (token-level intersection, exact at any temperature), greedy "
    "ones as --cross-greedy says; the draft service needs --target-tokenizer. Empty: the draft must share the "
    "target's tokenizer",
    "min_vocab_overlap": "with --draft-tokenizer: refuse to start when the tokens the draft can propose make up less "
    "than this share of the target's tokens over a reference text (a guard against a wrong pairing)",
    "cross_greedy": "with --draft-tokenizer, how greedy requests draft: slem (the draft's whole vocabulary; its text "
    "is re-tokenized and the target keeps the tokens it would have produced: string-level exact match) or tli (the "
    "shared tokens alone, as sampled requests always do). slem by default: on the demo pair 1.17x the target alone "
    "against 1.04x (README, 'A draft with another tokenizer')",
    "max_new_tokens_cap": "largest max_new_tokens a request may ask for",
    "max_speculative_tokens": "largest num_speculative_tokens a request may ask for",
    "num_speculative_tokens": "K for requests that leave it unset",
    "speculation_policy": "how K changes between rounds: " + ", ".join(POLICIES),
    "overlap_drafting": "draft the next block while the target verifies the current one",
    "speculation_tree": "off, or auto: greedy rounds draft a token tree of K nodes instead of a chain (off: on the "
    "default pair trees accept as many tokens a round as chains, README 'Token trees against chains')",
    "draft_method": "who proposes draft tokens for requests that leave it unset: " + ", ".join(DRAFT_METHODS),
    "ngram_min": "prompt lookup: the shortest suffix (in tokens) that may match",
    "ngram_max": "prompt lookup: the longest suffix tried first",
    "min_confidence": "the draft stops a block when its own token's probability is below this (0 never)",
    "draft_timeout_s": "a draft step slower than this falls back to the target alone for the round",
    "draft_retry_after_s": "seconds before an unavailable draft is tried again",
    "target_timeout_s": "a slower target step fails the request with DEADLINE_EXCEEDED; the replica is avoided",
    "request_timeout_s": "a Generate call running longer than this ends with DEADLINE_EXCEEDED",
    "target_attempts": "tries per target step before the request fails with UNAVAILABLE",
    "target_backoff_s": "first backoff between target tries (doubles each try)",
    "startup_timeout_s": "how long to wait for the services at start-up",
    "cache_aware_routing": "send a request to the replicas likely to hold its prompt's prefix in their caches "
    "(--no-cache-aware-routing: the least loaded)",
    "route_load_slack": "with cache-aware routing, take the least loaded replica instead once the preferred one "
    "holds this many sessions more",
    "resolve_interval_s": "seconds between DNS re-resolutions of dns:/// replica names",
    "max_running_requests": "requests generating at once (0: the target replicas' session limits together)",
    "max_queued_requests": "requests waiting for a place beyond those (RESOURCE_EXHAUSTED beyond)",
    "max_queue_wait_s": "a queued request that waits longer gets RESOURCE_EXHAUSTED",
    "stream_interval": "tokens a client stream gathers before a message goes out (at most about one round's wait; "
    "the first token and the last message are never held): fewer, larger messages under load",
    "workers": "orchestrator processes serving --port (N, or auto: the CPU quota); clients spread over them by "
    "connection, and each worker keeps its own links, routing index and share of admission",
    "http_port": "also serve the OpenAI-compatible HTTP API on this port, in this process (0: none; "
    "python -m http_gateway is the same API as a process of its own)",
    "metrics_port": "Prometheus metrics port (0 disables)",
    "health_port": "a plaintext port serving gRPC health checks only, for probes that cannot speak TLS (0: none)",
    "tls_cert": "PEM certificate chain: serve TLS to clients (with --tls-key)",
    "tls_key": "PEM private key for --tls-cert",
    "tls_client_ca": "PEM CA bundle: require client certificates signed by it",
    "upstream_tls_ca": "PEM CA bundle to trust for the services: connect to them over TLS",
    "upstream_tls_cert": "PEM client certificate for the services (mutual TLS, with --upstream-tls-key)",
    "upstream_tls_key": "PEM private key for --upstream-tls-cert",
    "upstream_tls_server_name": "name to verify in the services' certificates (replicas are dialled by address)",
    "api_key_file": "accepted API keys, one a line; requests send `authorization: Bearer KEY` (reloads on change)",
    "grace_period_s": "seconds open requests get to finish after SIGTERM",
    "log_level": "debug, info, warning or error",
}


def parse_orchestrator_config(argv: Sequence[str] | None = None) -> OrchestratorConfig:
    parser = argparse.ArgumentParser(prog="orchestrator", description="specdec orchestrator")
    add_config_arguments(parser, OrchestratorConfig, _HELP)
    config = OrchestratorConfig(**vars(parser.parse_args(argv)))
    if not config.target:
        parser.error("--target is required (HOST:PORT of the target service), or set SPECDEC_TARGET")
    if config.speculation_policy not in POLICIES:
        parser.error(f"--speculation-policy must be one of {', '.join(POLICIES)}")
    if config.speculation_tree not in ("off", "auto"):
        parser.error(f"--speculation-tree must be off or auto; got {config.speculation_tree!r}")
    if config.draft_method not in DRAFT_METHODS:
        parser.error(f"--draft-method must be one of {', '.join(DRAFT_METHODS)}")
    if not 1 <= config.ngram_min <= config.ngram_max:
        parser.error("--ngram-min and --ngram-max need 1 <= --ngram-min <= --ngram-max")
    if not 0 <= config.num_speculative_tokens <= config.max_speculative_tokens:
        parser.error("--num-speculative-tokens must be in [0, --max-speculative-tokens]")
    if config.workers != "auto" and (not config.workers.isdigit() or int(config.workers) < 1):
        parser.error(f"--workers must be a count of at least 1 or auto (the CPU quota); got {config.workers!r}")
    if not 0.0 <= config.min_vocab_overlap <= 1.0:
        parser.error(f"--min-vocab-overlap must be in [0, 1]; got {config.min_vocab_overlap}")
    if config.cross_greedy not in ("tli", "slem"):
        parser.error(f"--cross-greedy must be tli or slem; got {config.cross_greedy!r}")
    if config.stream_interval < 1:
        parser.error("--stream-interval must be at least 1 (1 sends each round's tokens at once)")
    return config
