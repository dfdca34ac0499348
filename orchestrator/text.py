"""From committed token ids to streamed text: incremental detokenization and stop strings.

Text is released only when it is final: a token whose bytes do not yet form whole characters, or a
tail that might be the start of a stop string, is held back until the next tokens settle it.
"""

from __future__ import annotations

import codecs
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase
from transformers.convert_slow_tokenizer import bytes_to_unicode

# Tokens decoded again before the newest ones, so merges across the boundary render correctly.
_CONTEXT_TOKENS = 6


# Tokens and sequences `byte_table` checks against the tokenizer's own decode before trusting the table.
_CHECKED_TOKENS = 2000
_CHECKED_SEQUENCES = 50


def byte_table(tokenizer: PreTrainedTokenizerBase) -> list[bytes] | None:
    """Each token's bytes, when the tokenizer is byte-level BPE (GPT-2, Llama 3, Qwen, the default
    pair): its decode is then the UTF-8 decoding of the tokens' bytes, one after the other, and text
    streams in constant time per token. None for any other tokenizer, or when a sample of tokens and
    sequences does not decode exactly as the tokenizer itself decodes them."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    if decoder.get("type") != "ByteLevel":
        return None
    to_byte = {char: byte for byte, char in bytes_to_unicode().items()}
    added = tokenizer.added_tokens_decoder
    vocab = backend.get_vocab(with_added_tokens=True)
    table = [b""] * (max(vocab.values()) + 1)
    for token, token_id in vocab.items():
        if token_id in added:
            table[token_id] = b"" if added[token_id].special else added[token_id].content.encode()
        elif all(char in to_byte for char in token):
            table[token_id] = bytes(to_byte[char] for char in token)
        else:
            return None
    rng = random.Random(0)
    ids = list(vocab.values())
    checks = [[i] for i in [*added, *rng.sample(ids, min(len(ids), _CHECKED_TOKENS))]]
    checks += [rng.choices(ids, k=rng.randint(2, 40)) for _ in range(_CHECKED_SEQUENCES)]
    for sequence in checks:
        expected = tokenizer.decode(sequence, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        if b"".join(table[i] for i in sequence).decode("utf-8", errors="replace") != expected:
            return None
    return table


@dataclass(frozen=True)
class TextDelta:
    """What one batch of tokens adds to the stream."""

    text: str  # text released now
    token_ids: list[int]  # tokens consumed (up to and including the one that completed a stop string)
    stopped: bool  # a stop string was produced; nothing after it is released


class TextStream:
    """Turns token ids into text deltas, holding back what is not yet final."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, stop: Sequence[str], table: list[bytes] | None = None
    ) -> None:
        self._tokenizer = tokenizer
        self._table = table  # byte_table(tokenizer): text from bytes, in constant time per token
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
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
        if self._table is not None:  # incomplete characters wait in the decoder for their next bytes
            self._text += self._utf8.decode(self._table[token_id] if token_id < len(self._table) else b"")
            self._read_offset = len(self._ids)
            return
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
        if self._table is not None:
            rest = self._utf8.decode(b"", final=True)
        else:
            rest = self._decode(self._ids[self._read_offset :]) if self._read_offset < len(self._ids) else ""
        text = self._text[self._released :] + rest
        self._released = len(self._text)
        return text
