"""How an engine iteration's rows become forwards: a long feed in chunks, and rows of different
widths in groups, each padded to its widest row (model_host/engine.py runs them)."""

from __future__ import annotations


def group_ends(widths: list[int], overhead_tokens: float) -> list[int]:
    """How to split rows sorted by width (ascending) into forwards: the end index of each group.

    A forward pads every row to its widest, so one catch-up or short prefill of 30 tokens among 15
    decoding rows would make the forward 16 x 30 tokens instead of 15 + 30. Each forward costs about
    `overhead_tokens + rows x width` tokens' worth; the split minimises the sum over forwards. Groups
    are contiguous runs of the sorted widths, and split only between distinct widths, so the search
    is over the few distinct widths of a batch, not its rows."""
    if not widths:
        return []
    ends = [i + 1 for i in range(len(widths)) if i + 1 == len(widths) or widths[i + 1] != widths[i]]
    # best[j]: the least cost of the rows before ends[j - 1] (best[0]: no rows); cut[j]: its last split.
    best, cut = [0.0], [0]
    for j, end in enumerate(ends, start=1):
        options = [
            (best[i] + overhead_tokens + (end - (ends[i - 1] if i else 0)) * widths[end - 1], i) for i in range(j)
        ]
        cost, split = min(options)
        best.append(cost)
        cut.append(split)
    result, j = [], len(ends)
    while j:
        result.append(ends[j - 1])
        j = cut[j]
    return result[::-1]


def chunk_tokens(pending: int, num_logits: int, chunk: int) -> int:
    """Tokens to feed now: all of them when they fit in a chunk; otherwise a chunk, leaving at least
    `num_logits` tokens for the last one (the logits come from the last chunk's rows)."""
    if pending <= chunk:
        return pending
    return max(1, min(chunk, pending - num_logits)) if pending > num_logits else pending
