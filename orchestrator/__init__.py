"""The orchestrator: the public Generate API, the canonical sequence, accept/reject, K policy, routing."""
