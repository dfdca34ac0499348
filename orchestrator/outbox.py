"""What a request has for its client and has not written yet.

The round loop puts each round's text and tokens here and goes on; the Generate handler writes
whatever has gathered, one message at a time. While a write is under way (a slow client, or a busy
orchestrator whose write completions queue behind other work) the next rounds' deltas merge into one
message, so a request's rounds never wait for its client and a busy orchestrator writes fewer,
larger messages. It holds at most one request's output, which max_new_tokens bounds.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

from specdec.v1 import orchestrator_pb2


@dataclass(frozen=True)
class Chunk:
    text: str
    token_ids: list[int]
    closed: bool  # nothing more will come
    logprobs: list[orchestrator_pb2.TokenLogprob] = field(default_factory=list)  # one per token, when asked


class Outbox:
    def __init__(self) -> None:
        self._text: list[str] = []
        self._token_ids: list[int] = []
        self._logprobs: list[orchestrator_pb2.TokenLogprob] = []
        self._closed = False
        self._ready = asyncio.Event()

    def put(self, text: str, token_ids: list[int], logprobs: Sequence[orchestrator_pb2.TokenLogprob] = ()) -> None:
        if text:
            self._text.append(text)
        self._token_ids.extend(token_ids)
        self._logprobs.extend(logprobs)
        self._ready.set()

    def close(self) -> None:
        self._closed = True
        self._ready.set()

    async def take(self) -> Chunk:
        """Everything gathered since the last take (waits for something, or for the close)."""
        await self._ready.wait()
        self._ready.clear()
        chunk = Chunk("".join(self._text), self._token_ids, self._closed, self._logprobs)
        self._text, self._token_ids, self._logprobs = [], [], []
        return chunk
