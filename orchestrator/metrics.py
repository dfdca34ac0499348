"""Prometheus metrics of the orchestrator, named as vLLM users already graph them."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_PER_TOKEN_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)

NUM_DRAFTS = Counter("specdec:spec_decode_num_drafts", "Rounds in which the draft proposed a block")
NUM_DRAFT_TOKENS = Counter("specdec:spec_decode_num_draft_tokens", "Draft tokens proposed")
NUM_ACCEPTED_TOKENS = Counter("specdec:spec_decode_num_accepted_tokens", "Draft tokens accepted")
ACCEPTED_PER_POSITION = Counter(
    "specdec:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted at each position", ["position"]
)
NGRAM_DRAFT_TOKENS = Counter("specdec:ngram_draft_tokens", "Draft tokens proposed by the prompt lookup")
NGRAM_ACCEPTED_TOKENS = Counter("specdec:ngram_accepted_tokens", "Prompt-lookup draft tokens accepted")
GENERATION_TOKENS = Counter("specdec:generation_tokens", "Output tokens streamed to clients")
PROMPT_TOKENS = Counter("specdec:prompt_tokens", "Prompt tokens received")
REQUESTS_FINISHED = Counter("specdec:request_success", "Finished requests by finish reason", ["finished_reason"])
REQUESTS_FAILED = Counter("specdec:request_failure", "Failed requests by gRPC status", ["code"])
SESSION_REOPENS = Counter("specdec:session_reopens", "Service sessions reopened with the full sequence")
DRAFT_FALLBACK_ROUNDS = Counter(
    "specdec:draft_fallback_rounds", "Rounds decoded by the target alone after a draft failure"
)
DRAFT_ROWS = Counter(
    "specdec:draft_rows",
    "Draft rows a sampled rejection needed, by how they came: fetched, recomputed, missing (the request "
    "failed), or redone (the draft replica was gone: the round was the target's alone)",
    ["outcome"],
)
TARGET_DISAGREEMENTS = Counter(
    "specdec:target_disagreements", "Sampled rounds whose first rejection the target found elsewhere (a bug)"
)
CONSTRAINT_VIOLATIONS = Counter(
    "specdec:structured_output_violations",
    "Committed tokens a request's structured_output constraint does not allow (a bug, or a faulty target replica)",
)
STRUCTURED_OUTPUT_REQUESTS = Counter(
    "specdec:structured_output_requests", "Generate requests with a structured_output constraint", ["kind"]
)
# Summed over the workers (--workers: prometheus_client's multiprocess mode; ignored otherwise).
REQUESTS_RUNNING = Gauge("specdec:num_requests_running", "Generate calls in progress", multiprocess_mode="livesum")
TIME_TO_FIRST_TOKEN = Histogram(
    "specdec:time_to_first_token_seconds", "Time to the first streamed token", buckets=_LATENCY_BUCKETS
)
TIME_PER_OUTPUT_TOKEN = Histogram(
    "specdec:time_per_output_token_seconds", "Mean time per output token after the first", buckets=_PER_TOKEN_BUCKETS
)
E2E_LATENCY = Histogram("specdec:e2e_request_latency_seconds", "Request latency, end to end", buckets=_LATENCY_BUCKETS)
CHOSEN_K = Histogram(
    "specdec:num_speculative_tokens_chosen",
    "K chosen for each round (0: the target alone)",
    buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16),
)
# Where a service step's time goes, seen from the orchestrator (README, "Where a step's time goes"):
# the service's forwards, its queue before the first, its other host work, the transport (the network,
# gRPC and both event loops: the round trip less the service's own time), and the orchestrator's time
# between the step's answer and the session's next step (its own work, and any other service's step).
STEP_SECONDS = Counter("specdec:step_seconds", "Seconds of service steps, by service and part", ["service", "part"])
STEPS = Counter("specdec:steps", "Service steps answered, by service", ["service"])
QUEUE_SECONDS = Histogram(
    "specdec:request_queue_seconds", "Time a request waited for a place before it started", buckets=_LATENCY_BUCKETS
)
