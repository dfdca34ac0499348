"""Names the three servers and their clients share: limits and the speculation policies."""

from __future__ import annotations

from specdec.v1 import orchestrator_pb2

# A prompt's text may be at most this many characters per token of the target's context, in the gRPC
# API and the gateway alike: any text that could fit is far shorter, and a longer one is refused before
# it costs a tokenizer pass.
MAX_PROMPT_CHARS_PER_TOKEN = 64

# Speculation policies by name (flags, configuration, logs) and their wire enum.
POLICY_BY_NAME: dict[str, orchestrator_pb2.SpeculationPolicy] = {
    "fixed": orchestrator_pb2.SPECULATION_POLICY_FIXED,
    "heuristic": orchestrator_pb2.SPECULATION_POLICY_HEURISTIC,
    "cost_model": orchestrator_pb2.SPECULATION_POLICY_COST_MODEL,
    "load_aware": orchestrator_pb2.SPECULATION_POLICY_LOAD_AWARE,
}
POLICY_BY_ENUM: dict[int, str] = {value: name for name, value in POLICY_BY_NAME.items()}
POLICIES = tuple(POLICY_BY_NAME)

# Draft methods by name and their wire enum.
DRAFT_METHOD_BY_NAME: dict[str, orchestrator_pb2.DraftMethod] = {
    "model": orchestrator_pb2.DRAFT_METHOD_MODEL,
    "ngram": orchestrator_pb2.DRAFT_METHOD_NGRAM,
    "hybrid": orchestrator_pb2.DRAFT_METHOD_HYBRID,
}
DRAFT_METHOD_BY_ENUM: dict[int, str] = {value: name for name, value in DRAFT_METHOD_BY_NAME.items()}
DRAFT_METHODS = tuple(DRAFT_METHOD_BY_NAME)
