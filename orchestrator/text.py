"""From committed token ids to streamed text: incremental detokenization and stop strings.

Text is released only when it is final: a token whose bytes do not yet form whole characters, or a
tail that might be the start of a stop string, is held back until the next tokens settle it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

# Tokens decoded again before the newest ones, so merges across the boundary render correctly.
_CONTEXT_TOKENS = 6


@dataclass(frozen=True)
class TextDelta:
    """What one batch of tokens adds to the stream."""

    text: str  # text released now
    token_ids: list[int]  # tokens consumed (up to and including the one that completed a stop string)
    stopped: bool  # a stop string was produced; nothing after it is released


class TextStream:
    """Turns token ids into text deltas, holding back what is not yet final."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: Sequence[str]) -> None:
        self._tokenizer = tokenizer
        self._stop = [s for s in stop if s]
        self._ids: list[int] = []
        self._prefix_offset = 0  # decoding context starts here
        self._read_offset = 0  # tokens whose text is already in self._text
        self._text = ""  # decoded text of ids[:read_offset]
        self._released = 0  # characters of self._text streamed so far

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _absorb(self, token_id: int) -> None:
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self._text += full[len(prefix) :]
            self._read_offset = len(self._ids)
            self._prefix_offset = max(self._read_offset - _CONTEXT_TOKENS, 0)

    def _find_stop(self) -> int:
        """Index in self._text of the earliest stop string, or -1."""
        longest = max((len(s) for s in self._stop), default=0)
        start = max(0, self._released - longest + 1)
        found = [i for i in (self._text.find(s, start) for s in self._stop) if i >= 0]
        return min(found, default=-1)

    def _held_back(self) -> int:
        """Length of the longest tail of the unreleased text that could begin a stop string."""
        tail = self._text[self._released :]
        for size in range(min(len(tail), max((len(s) for s in self._stop), default=0)), 0, -1):
            if any(s.startswith(tail[-size:]) for s in self._stop):
                return size
        return 0

    def push(self, token_ids: Sequence[int]) -> TextDelta:
        """Add committed tokens; returns the text that is now final."""
        consumed: list[int] = []
        for token_id in token_ids:
            consumed.append(token_id)
            self._absorb(token_id)
            if self._stop:
                index = self._find_stop()
                if index >= 0:
                    text = self._text[self._released : max(index, self._released)]
                    self._released = len(self._text)
                    return TextDelta(text=text, token_ids=consumed, stopped=True)
        end = len(self._text) - self._held_back()
        text = self._text[self._released : end]
        self._released = max(self._released, end)
        return TextDelta(text=text, token_ids=consumed, stopped=False)

    def finish(self) -> str:
        """Release everything held back (the generation ended without a stop string)."""
        rest = self._decode(self._ids[self._read_offset :]) if self._read_offset < len(self._ids) else ""
        text = self._text[self._released :] + rest
        self._released = len(self._text)
        return text
