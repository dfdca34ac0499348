"""Tokenizer identity, so that draft, target and orchestrator can prove they share a vocabulary."""

from __future__ import annotations

import hashlib
import json

from transformers import PreTrainedTokenizerBase


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """SHA-256 over the vocabulary and the special tokens: equal exactly when ids mean the same text."""
    payload = json.dumps(
        {"vocab": sorted(tokenizer.get_vocab().items()), "special": sorted(map(str, tokenizer.all_special_tokens))}
    )
    return hashlib.sha256(payload.encode()).hexdigest()
