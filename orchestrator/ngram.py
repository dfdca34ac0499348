"""Prompt lookup: free draft tokens from the request's own prompt and output.

When a sequence's last n tokens occurred earlier in it, the tokens that followed that occurrence are
a good guess at what follows now (code, edits, summaries and retrieval answers repeat their input).
The index maps every n-gram, for n in [ngram_min, ngram_max], to the most recent position it ended at
with at least one token after it; it grows as tokens are committed, so a lookup costs a few dictionary
probes however long the sequence is. A proposal is deterministic: its q is a point mass.
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramIndex:
    """The lookup index over one request's sequence (prompt, then committed output)."""

    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max; got {ngram_min} and {ngram_max}")
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self.tokens: list[int] = []
        # n-gram -> index of its last token, for occurrences followed by at least one token
        self._ends: dict[tuple[int, ...], int] = {}

    def extend(self, token_ids: Sequence[int]) -> None:
        """Append committed tokens; every n-gram that now has a successor becomes findable."""
        for token in token_ids:
            end = len(self.tokens) - 1  # the n-grams ending here now gain a successor
            self.tokens.append(token)
            for n in range(self.ngram_min, min(self.ngram_max, end + 1) + 1):
                self._ends[tuple(self.tokens[end - n + 1 : end + 1])] = end

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the most recent earlier occurrence of the longest matching
        suffix; empty when nothing matches."""
        tokens = self.tokens
        if k < 1:
            return []
        for n in range(min(self.ngram_max, len(tokens)), self.ngram_min - 1, -1):
            end = self._ends.get(tuple(tokens[len(tokens) - n :]))
            if end is not None:
                return tokens[end + 1 : end + 1 + k]
        return []
