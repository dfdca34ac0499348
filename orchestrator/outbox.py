"""What a request has for its client and has not written yet.

The round loop puts each round's text and tokens here and goes on; the Generate handler writes
whatever has gathered, one message at a time. While a write is under way (a slow client, or a busy
orchestrator whose write completions queue behind other work) the next rounds' deltas merge into one
message, so a request's rounds never wait for its client and a busy orchestrator writes fewer,
larger messages. It holds at most one request's output, which max_new_tokens bounds.

With a stream interval of N (`--stream-interval`), a message goes out once N tokens have gathered, or
when the oldest of them has waited `hold_s()` (about one round), whichever comes first: one system
call and one wake of the handler for N tokens rather than for each round. The first token and the
last message are never held.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from specdec.v1 import orchestrator_pb2


@dataclass(frozen=True)
class Chunk:
    text: str
    token_ids: list[int]
    closed: bool  # nothing more will come
    logprobs: list[orchestrator_pb2.TokenLogprob] = field(default_factory=list)  # one per token, when asked


class Outbox:
    def __init__(self, interval: int = 1, hold_s: Callable[[], float] = lambda: 0.0) -> None:
        self._interval = interval
        self._hold_s = hold_s
        self._text: list[str] = []
        self._token_ids: list[int] = []
        self._logprobs: list[orchestrator_pb2.TokenLogprob] = []
        self._closed = False
        self._released = False  # a first message has gone out
        self._ready = asyncio.Event()
        self._timer: asyncio.TimerHandle | None = None

    def put(self, text: str, token_ids: list[int], logprobs: Sequence[orchestrator_pb2.TokenLogprob] = ()) -> None:
        if text:
            self._text.append(text)
        self._token_ids.extend(token_ids)
        self._logprobs.extend(logprobs)
        if not self._released or len(self._token_ids) >= self._interval:
            self._release()
        elif self._timer is None and not self._ready.is_set():
            self._timer = asyncio.get_running_loop().call_later(self._hold_s(), self._release)

    def close(self) -> None:
        self._closed = True
        self._release()

    def _release(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._ready.set()

    async def take(self) -> Chunk:
        """Everything gathered since the last take (waits for something to release, or for the close)."""
        await self._ready.wait()
        self._ready.clear()
        if self._token_ids or self._text:
            self._released = True
        chunk = Chunk("".join(self._text), self._token_ids, self._closed, self._logprobs)
        self._text, self._token_ids, self._logprobs = [], [], []
        return chunk
