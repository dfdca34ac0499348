"""The engine of a model service: one thread owns the model; every iteration runs one forward pass over
every session step that is ready (continuous batching).

gRPC handlers `submit` a `Job` and wait on its future. A job feeds its tokens (a long prompt in chunks
of `prefill_chunk_tokens`, so that it does not stall everyone's decoding) and then calls
`advance(logits)`, which either ends the job or hands back more tokens to feed (the draft's next
token). A job that arrives during a forward joins the next one; there is no waiting window.
"""

from __future__ import annotations

import contextlib
import heapq
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field

import grpc
import structlog
import torch

from model_host.forward import Forward, RowLogits
from model_host.kv_blocks import Row
from model_host.metrics import BATCH_SIZE, BATCH_TOKENS, ENGINE_FORWARD_SECONDS, QUEUE_SECONDS
from serving.errors import HANDLER_INTERNAL_PREFIX, ServiceError, resource_exhausted
from serving.memory import release_freed_memory

log = structlog.get_logger(__name__)

# What one more forward costs, in tokens fed, when nothing better is known (`Engine.overhead_tokens`).
DEFAULT_OVERHEAD_TOKENS = 32.0


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

    def most_reused(self) -> int:
        """How many of the tokens to feed may come from the prefix cache: all but those whose logits
        are wanted, and at least one (a forward needs a token)."""
        return len(self.pending) - max(1, self.num_logits)

    def advance(self, logits: torch.Tensor) -> list[int] | None:
        """Logits [num_logits, vocab] after `pending` was fed: the next tokens to feed, or None when done."""
        return None


class SlotAllocator:
    """Slot numbers for sessions: the lowest free one first, so a batch's slots tend to be contiguous.

    A released slot is reused only after the engine's current iteration (a forward may still be
    writing to it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: list[int] = []
        self._released: list[int] = []
        self._next = 0

    def lease(self) -> int:
        with self._lock:
            if self._free:
                return heapq.heappop(self._free)
            self._next += 1
            return self._next - 1

    def release(self, slot: int) -> None:
        with self._lock:
            self._released.append(slot)

    def released(self) -> bool:
        """Whether slots were released since the last `recycle`."""
        with self._lock:
            return bool(self._released)

    def leased(self) -> int:
        """Slots that sessions hold now."""
        with self._lock:
            return self._next - len(self._free) - len(self._released)

    def recycle(self) -> list[int]:
        """Make released slots leasable again; returns them."""
        with self._lock:
            released, self._released = self._released, []
            for slot in released:
                heapq.heappush(self._free, slot)
            return released


class Engine:
    """One model, one thread, one forward per iteration over every ready job."""

    def __init__(
        self, forward: Forward, limits: EngineLimits, role: str, overhead_tokens: float = DEFAULT_OVERHEAD_TOKENS
    ) -> None:
        self.forward = forward
        self.limits = limits
        self.role = role
        # The fixed cost of a forward over the cost of one token fed (`profile.overhead_tokens`): how
        # much padding a row may add to a forward before it pays to run it in a forward of its own.
        self.overhead_tokens = overhead_tokens
        self.slots = SlotAllocator()
        self._inbox: deque[Job] = deque()
        self._active: list[Job] = []
        self._wake = threading.Condition()
        self._stopped = False
        self._thread: threading.Thread | None = None
        # Called in the engine's thread after each forward's jobs have ended (and after jobs fail outside
        # one): the servicer wakes its event loop once for all of them, not once a job.
        self.after_group: Callable[[], None] = lambda: None
        self._forward_seconds = 0.0  # running mean of one forward
        self._last_step: dict[int, float] = {}  # slot -> when its last job finished
        self._trim_when_idle = False  # a prefill chunk ran since the engine was last idle
        self._batch_size = BATCH_SIZE.labels(role)
        self._batch_tokens = BATCH_TOKENS.labels(role)
        self._engine_forward_seconds = ENGINE_FORWARD_SECONDS.labels(role)
        self._queue_seconds = QUEUE_SECONDS.labels(role)

    def start(self) -> None:
        """Run the loop in a thread of its own (in-process servers, tests)."""
        self._thread = threading.Thread(target=self.run, name=f"{self.role}-engine", daemon=True)
        self._thread.start()

    def run(self) -> None:
        """Run the loop in the calling thread until `stop`.

        A service runs it in its main thread: torch's intra-op thread pool then works at full speed,
        while a loop in a secondary thread paid for waking its worker threads in every operation
        (measured: one forward of the default target at two threads, 5.2 ms from the main thread,
        11-12 ms from another)."""
        self._loop()

    def release(self, slot: int) -> None:
        """A session's slot is free once the current iteration ends; the loop wakes to take it back
        (and, after the last session, to drop what only a next step could have reused)."""
        with self._wake:
            self.slots.release(slot)
            self._wake.notify()

    def submit(self, job: Job) -> Future[Job]:
        with self._wake:
            if self._stopped:
                raise resource_exhausted("the service is shutting down; retry on another replica")
            self._inbox.append(job)
            self._wake.notify()
        return job.future

    def stop(self) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    # --- the loop ------------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            if not self._inbox and not self._active:  # nothing to run: nobody waits on what follows
                if not self.slots.leased():  # and no session open: what a next step could reuse goes
                    self.forward.idle()
                if self._trim_when_idle:
                    self._trim_when_idle = False
                    release_freed_memory()  # a long prefill's scores and masks, kept by the allocator
            with self._wake:
                while not self._inbox and not self._active and not self._stopped and not self.slots.released():
                    self._wake.wait()
                if self._stopped:
                    break
                if self._inbox or self._active:
                    self._hold()
                entered = list(self._inbox)
                self._inbox.clear()
            for slot in self.slots.recycle():
                self.forward.release(slot)
                self._last_step.pop(slot, None)
            if not entered and not self._active:  # woken by a session's end: perhaps the last one
                continue
            for job in entered:
                self._enter(job)
            with torch.inference_mode():
                self._iteration()
        for job in [*self._active, *self._inbox]:
            _fail(job, resource_exhausted("the service stopped; retry on another replica"))
        self.after_group()

    def _hold(self) -> None:
        """Wait briefly (the condition's lock held) for sessions that are expected back.

        Sessions of a speculative round come back together: each one's step returns to the
        orchestrator, which answers with the next step a few milliseconds later. Starting a forward
        with whatever has arrived splits them into groups that then stay out of phase, each group
        paying for a forward of its own. So when sessions that finished a step within the last few
        forwards have not come back yet, the engine waits for them, at most `batch_hold_fraction` of
        a forward; with nobody expected it starts at once.

        Sessions whose step was a speculative verify are not waited for (`Job.comes_straight_back`):
        their next step follows a draft step, and the hold would only keep the whole batch in one
        phase, the draft and the target taking turns, where sessions out of phase let both compute at
        once (measured: 8 streams, fixed K = 2 with overlapped drafting, 1.17x faster without the
        target's hold; the target alone 0.77x without it)."""
        if not self.limits.batch_hold_fraction or not self._forward_seconds:
            return
        started = time.perf_counter()
        deadline = started + self.limits.batch_hold_fraction * self._forward_seconds
        recent = started - 4 * self._forward_seconds
        expected = {slot for slot, finished in self._last_step.items() if finished > recent}
        while not self._stopped:
            ready = {job.slot for job in self._inbox} | {job.slot for job in self._active}
            if len(ready) >= self.limits.max_batch_size or expected <= ready:
                return
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                return
            self._wake.wait(remaining)

    def _enter(self, job: Job) -> None:
        """A new step: its slot rolls back to where the step starts (the blocks past it are freed), and
        a session's first step starts from the longest cached prefix of its tokens."""
        self._active.append(job)
        try:
            self.forward.truncate(job.slot, job.start)
            if job.start == 0:
                job.reused = self.forward.reuse(job.slot, job.pending, job.most_reused(), job.cache_salt)
                job.start, job.pending = job.reused, job.pending[job.reused :]
        except Exception as exc:
            log.exception("step_entry_failed", slot=job.slot)
            self._active.remove(job)
            _fail(job, ServiceError(grpc.StatusCode.INTERNAL, f"{HANDLER_INTERNAL_PREFIX}{type(exc).__name__}: {exc}"))

    def _iteration(self) -> None:
        now = time.perf_counter()
        waiting = [job for job in self._active if not job.future.cancelled()]
        self._active = []
        for job in waiting:
            if job.queue_seconds < 0 and now - job.submitted > self.limits.max_queue_wait_s:
                _fail(job, _busy(self.limits.max_queue_wait_s))
            else:
                self._active.append(job)
        chosen = sorted(self._schedule(), key=lambda pair: len(pair[1].token_ids))
        start = 0
        self.after_group()  # jobs that waited too long
        for end in group_ends([len(row.token_ids) for _, row in chosen], self.overhead_tokens):
            self._run_group(chosen[start:end])  # the narrowest first: decoding rows come back soonest
            self.after_group()
            start = end

    def _schedule(self) -> list[tuple[Job, Row]]:
        """Rows for this iteration: first come, first served, within the batch limits."""
        limits = self.limits
        chosen: list[tuple[Job, Row]] = []
        tokens = 0
        for job in self._active:
            feed = job.pending[: _chunk(len(job.pending), job.num_logits, limits.prefill_chunk_tokens)]
            if chosen and (len(chosen) >= limits.max_batch_size or tokens + len(feed) > limits.max_batch_tokens):
                continue
            last = len(feed) == len(job.pending)
            chosen.append((job, Row(job.slot, job.start, feed, job.num_logits if last else 0)))
            tokens += len(feed)
        return chosen

    def _run_group(self, group: list[tuple[Job, Row]]) -> None:
        rows = [row for _, row in group]
        started = time.perf_counter()
        try:
            logits: RowLogits = self.forward(rows)
            self.forward.synchronize()
        except Exception as exc:
            log.exception("forward_failed", rows=len(rows))
            message = f"{HANDLER_INTERNAL_PREFIX}the {self.role} forward: {type(exc).__name__}: {exc}"
            error = ServiceError(grpc.StatusCode.INTERNAL, message)
            for job, _ in group:
                self._active.remove(job)
                _fail(job, error)
            return
        seconds = time.perf_counter() - started
        self._forward_seconds = 0.9 * self._forward_seconds + 0.1 * seconds if self._forward_seconds else seconds
        batch_tokens = sum(len(row.token_ids) for row in rows)
        self._trim_when_idle |= batch_tokens >= self.limits.prefill_chunk_tokens
        self._batch_size.observe(len(rows))
        self._batch_tokens.observe(batch_tokens)
        self._engine_forward_seconds.observe(seconds)
        for (job, row), row_logits in zip(group, logits, strict=True):
            if job.queue_seconds < 0:
                job.queue_seconds = started - job.submitted
                self._queue_seconds.observe(job.queue_seconds)
            job.forward_seconds += seconds
            if len(rows) >= job.batch_size:
                job.batch_size, job.batch_tokens = len(rows), batch_tokens
            job.start += len(row.token_ids)
            job.pending = job.pending[len(row.token_ids) :]
            if job.pending:
                continue  # the next chunk of a long feed
            try:
                more = job.advance(row_logits) if row_logits is not None else None
            except Exception as exc:  # noqa: BLE001 - this job's own failure
                self._active.remove(job)
                _fail(job, exc)
                continue
            if more:
                job.pending = more
            else:
                self._active.remove(job)
                if job.comes_straight_back:
                    self._last_step[job.slot] = time.perf_counter()
                else:
                    self._last_step.pop(job.slot, None)
                _finish(job)


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


def _chunk(pending: int, num_logits: int, chunk: int) -> int:
    """Tokens to feed now: all of them when they fit in a chunk; otherwise a chunk, leaving at least
    `num_logits` tokens for the last one (the logits come from the last chunk's rows)."""
    if pending <= chunk:
        return pending
    return max(1, min(chunk, pending - num_logits)) if pending > num_logits else pending


def _busy(waited_s: float) -> ServiceError:
    return resource_exhausted(
        f"busy: the step waited {waited_s:g} s in the service's queue without starting; retry later or add replicas"
    )


def _finish(job: Job) -> None:
    with contextlib.suppress(InvalidStateError):  # cancelled meanwhile: nobody is waiting
        job.future.set_result(job)


def _fail(job: Job, exc: BaseException) -> None:
    with contextlib.suppress(InvalidStateError):
        job.future.set_exception(exc)
