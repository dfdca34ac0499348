"""Cache-aware routing: a new session goes to the replica most likely to hold its prompt's prefix.

Two layers, both computed from the prompt alone, so several orchestrator replicas choose alike
without sharing state:

- **Rendezvous hashing** on the salt and the prompt's first chunk: every orchestrator ranks a
  pool's replicas in the same order for the same start of a prompt, so requests that share a
  system prompt or a document land where its blocks are.
- **An approximate index** per pool, on top: the chained hashes of the prompt chunks each replica was
  sent (bounded, least recently used out). A request goes to the replica holding its longest run of
  leading chunks, so the turns of a conversation follow its history. It is approximate: it does not
  see evictions on the services, which only cost a prefill there.

Load wins over locality past a margin: when the preferred replica holds more than `load_slack`
sessions more than the least loaded one, the least loaded is taken (`--route-load-slack`).

The draft and target pools are routed independently with the same key, so the draft and the
target a prompt prefers are stable, but they are not a fixed pair.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# Tokens per routing chunk; the services' blocks are their own (--kv-block-tokens), and the index
# only needs to say where a prefix was sent.
CHUNK_TOKENS = 16
# Chunks of a prompt the route looks at: its first 2,048 tokens.
MAX_CHUNKS = 128
# Chunk hashes the index keeps per pool (each maps to the replicas it was sent to).
INDEX_ENTRIES = 1 << 16


@dataclass(frozen=True)
class Route:
    """A prompt's chained chunk hashes under its salt; `key` for rendezvous hashing."""

    chunks: tuple[bytes, ...]
    key: bytes


def route_for(salt: bytes, tokens: Sequence[int]) -> Route:
    parent = hashlib.blake2b(b"specdec-route" + salt, digest_size=16).digest()
    chunks = []
    for start in range(0, min(len(tokens), MAX_CHUNKS * CHUNK_TOKENS) - CHUNK_TOKENS + 1, CHUNK_TOKENS):
        chunk = array("i", tokens[start : start + CHUNK_TOKENS]).tobytes()
        parent = hashlib.blake2b(parent + chunk, digest_size=16).digest()
        chunks.append(parent)
    key = chunks[0] if chunks else hashlib.blake2b(parent + array("i", tokens).tobytes(), digest_size=16).digest()
    return Route(tuple(chunks), key)


def rendezvous(key: bytes, address: str) -> bytes:
    """The replica's score for `key`: the highest wins, the same on every orchestrator."""
    return hashlib.blake2b(key + address.encode(), digest_size=8).digest()


class PrefixIndex:
    """Which replicas were sent which leading chunks (bounded, least recently used out)."""

    def __init__(self, entries: int = INDEX_ENTRIES) -> None:
        self.entries = entries
        self._where: OrderedDict[bytes, set[str]] = OrderedDict()

    def matched(self, route: Route, addresses: Iterable[str]) -> dict[str, int]:
        """Per address, how many of the route's leading chunks it was sent."""
        remaining = set(addresses)
        found = dict.fromkeys(remaining, 0)
        for depth, chunk in enumerate(route.chunks, start=1):
            holders = self._where.get(chunk)
            if not holders:
                break
            remaining &= holders
            if not remaining:
                break
            for address in remaining:
                found[address] = depth
        return found

    def record(self, route: Route, address: str) -> None:
        for chunk in route.chunks:
            holders = self._where.get(chunk)
            if holders is None:
                holders = self._where[chunk] = set()
            else:
                self._where.move_to_end(chunk)
            holders.add(address)
        while len(self._where) > self.entries:
            self._where.popitem(last=False)

    def forget(self, address: str) -> None:
        """A replica left the pool: nothing is routed to it by its old prefixes."""
        for holders in self._where.values():
            holders.discard(address)


def preferred(route: Route, index: PrefixIndex, addresses: Sequence[str]) -> str:
    """The address holding the route's longest run of leading chunks; rendezvous among equals."""
    matched = index.matched(route, addresses)
    return max(addresses, key=lambda address: (matched[address], rendezvous(route.key, address)))
