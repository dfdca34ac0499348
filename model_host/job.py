"""One session step as the engine runs it (`Job`), and the limits of the engine's batches."""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class EngineLimits:
    max_batch_size: int = 32  # rows in one forward
    max_batch_tokens: int = 2048  # tokens fed in one iteration, over all rows
    prefill_chunk_tokens: int = 512  # a longer feed is split over iterations
    max_queue_wait_s: float = 30.0  # a job not started by then fails with RESOURCE_EXHAUSTED ("busy")
    # Before a forward, wait at most this fraction of a typical forward for sessions that stepped
    # recently and are expected back (0: never wait). See Engine._hold.
    batch_hold_fraction: float = 0.5


@dataclass(eq=False)
class Job:
    """One session step. Subclasses say what the logits mean (`advance`)."""

    slot: int
    start: int  # tokens cached for the session before this step
    pending: list[int]  # tokens still to feed
    num_logits: int  # logits wanted once `pending` has been fed
    future: Future[Job] = field(default_factory=Future)
    submitted: float = field(default_factory=time.perf_counter)
    queue_seconds: float = -1.0  # from submission to the first forward; -1 until then
    forward_seconds: float = 0.0  # summed over the forwards this job took part in
    batch_size: int = 0  # rows of the largest forward this job took part in
    batch_tokens: int = 0  # tokens of that forward
    # Whether the session's next step is expected right after this one's result, so that the batch
    # hold waits for it (Engine._hold). A verify of a draft block is not: its session's next step
    # follows a draft step.
    comes_straight_back: bool = True
    cache_salt: bytes = b""  # keeps this session's cached prefix blocks apart from other salts'
    reused: int = 0  # tokens of `pending` found in the prefix cache and not fed
    # The most tokens the session holds by the step's end (0: start + pending), which the step reserves
    # blocks for before its first forward: more than `pending` when `advance` feeds more (the draft's).
    max_length: int = 0
    parents: tuple[int, ...] = ()  # a tree step: each pending token's parent (model_host/rows.py)
    kept: int = 0  # of a tree step's tokens, the first that stay: a chain the step appends before its tree
    # Work no client waits for yet (a block drafted ahead, on a fork branch): scheduled after every
    # live step, in the rows they leave free, and not counted in the engine's live load.
    speculative: bool = False

    def most_reused(self) -> int:
        """How many of the tokens to feed may come from the prefix cache: all but those whose logits
        are wanted, and at least one (a forward needs a token)."""
        return len(self.pending) - max(1, self.num_logits)

    def advance(self, logits: torch.Tensor) -> list[int] | None:
        """Logits [num_logits, vocab] after `pending` was fed: the next tokens to feed, or None when done."""
        return None

    def feed_parents(self) -> tuple[int, ...]:
        """The parents of the tokens `advance` just returned: () for a chain (a tree job's next tree)."""
        return ()
