"""Logits processing, applied identically by the draft and the target: temperature, top-k, top-p."""

from __future__ import annotations

import torch

from serving.sampling import SamplingParams


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Next-token distributions for sampling.

    logits: [rows, vocab] in any float dtype. Returns [rows, vocab] float32 rows summing to 1.
    Tokens removed by top-k or top-p get probability exactly 0.
    """
    if params.greedy:
        raise ValueError("greedy decoding forms no probability rows")
    scores = logits.float() / params.temperature  # [rows, vocab]
    vocab = scores.shape[-1]
    if 0 < params.top_k < vocab:
        # Exactly the k most likely tokens; among tokens tied with the k-th, topk's order decides.
        kept = torch.topk(scores, params.top_k, dim=-1).indices  # [rows, top_k]
        keep = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, kept, True)
        scores = scores.masked_fill(~keep, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)  # [rows, vocab]
        sorted_probs = sorted_scores.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        # Keep the smallest prefix whose mass reaches top_p; the most likely token always stays.
        drop_sorted = mass_before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores.softmax(dim=-1)
