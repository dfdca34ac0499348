"""The engine of a model service: one thread owns the model; every iteration runs one forward pass over
every session step that is ready (continuous batching).

gRPC handlers `submit` a `Job` and wait on its future. A job feeds its tokens (a long prompt in chunks
of `prefill_chunk_tokens`, so that it does not stall everyone's decoding) and then calls
`advance(logits)`, which either ends the job or hands back more tokens to feed (the draft's next
token). A job that arrives during a forward joins the next one; there is no waiting window.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError

import grpc
import structlog
import torch

from model_host.batching import chunk_tokens, group_ends
from model_host.forward import Forward, RowLogits
from model_host.job import EngineLimits, Job
from model_host.kv_blocks import OutOfBlocks
from model_host.metrics import BATCH_SIZE, BATCH_TOKENS, ENGINE_FORWARD_SECONDS, QUEUE_SECONDS
from model_host.rows import Row, tree_error
from model_host.slots import SlotAllocator
from serving.errors import HANDLER_INTERNAL_PREFIX, ServiceError, invalid_argument, resource_exhausted
from serving.memory import release_freed_memory

log = structlog.get_logger(__name__)

# What one more forward costs, in tokens fed, when nothing better is known (`Engine.overhead_tokens`).
DEFAULT_OVERHEAD_TOKENS = 32.0


class Engine:
    """One model, one thread, one forward per iteration over every ready job."""

    def __init__(
        self, forward: Forward, limits: EngineLimits, role: str, overhead_tokens: float = DEFAULT_OVERHEAD_TOKENS
    ) -> None:
        self.forward = forward
        self.store = forward.store  # what each slot holds, and the one allocator (model_host/kv_blocks.py)
        self.limits = limits
        self.role = role
        # The fixed cost of a forward over the cost of one token fed (`profile.overhead_tokens`): how
        # much padding a row may add to a forward before it pays to run it in a forward of its own.
        self.overhead_tokens = overhead_tokens
        self.slots = SlotAllocator()
        self._inbox: deque[Job] = deque()
        self._commands: deque[Callable[[], None]] = deque()  # forks and resolves, run before the jobs entered with them
        self._active: list[Job] = []
        self._wake = threading.Condition()
        self._stopped = False
        self._thread: threading.Thread | None = None
        # Called in the engine's thread after each forward's jobs have ended (and after jobs fail outside
        # one): the servicer wakes its event loop once for all of them, not once a job.
        self.after_group: Callable[[], None] = lambda: None
        # Called in the engine's thread with the jobs a forward's logits are about to advance, before
        # any does: work over all their rows at once (the draft's next tokens), where each job would
        # otherwise launch its own kernels and, on a GPU, wait for its own copy to the host.
        self.before_advance: Callable[[list[tuple[Job, torch.Tensor]]], None] = lambda fed: None
        self._forward_seconds = 0.0  # running mean of one forward
        # Running means of the live (not speculative) rows and tokens of a forward: the load that work
        # done ahead must not delay (draft_service/speculation.py).
        self.live_rows = 0.0
        self.live_tokens = 0.0
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
        """Run the loop in the calling thread until `stop`. A service runs it in its main thread, where
        torch's intra-op pool works at full speed (docs/design.md, "The engine")."""
        self._loop()

    def release(self, slot: int) -> None:
        """A session's slot is free once the current iteration ends; the loop wakes to take it back
        (and, after the last session, to drop what only a next step could have reused)."""
        with self._wake:
            self.slots.release(slot)
            self._wake.notify()

    def fork(self, slot: int, count: int) -> list[int]:
        """`count` branches of the session at `slot`, as it stands between its steps: each shares its
        cached keys and values (model_host/kv_blocks.py, `fork`) and steps like a session, in the same
        forwards, from slots returned now. A branch is reclaimable: when blocks run short it is dropped
        before a live session waits, and its next step fails with RESOURCE_EXHAUSTED. End each with
        `release`, or keep one with `resolve`."""
        if not self.forward.batched:
            raise invalid_argument(f"the {self.forward.name} forward serves chains only: it cannot fork a session")
        branches = [self.slots.lease() for _ in range(count)]
        self._command(lambda: self._fork(slot, branches))
        return branches

    def resolve(self, slot: int, branch: int, others: list[int]) -> Future[bool]:
        """Make `branch` the session at `slot` and end `others`, in one step on the engine's thread:
        the session's old blocks and the others' go back. True, or False when the branch was dropped
        meanwhile (the session then keeps what it held)."""
        done: Future[bool] = Future()

        def run() -> None:
            try:  # a session closed meanwhile keeps nothing: its slot is free
                done.set_result(self.slots.holds(slot) and self.store.resolve(slot, branch))
            except Exception as exc:
                done.set_exception(exc)
                raise
            finally:
                for other in [branch, *others]:
                    self.forward.release(other)
                    self.slots.release(other)  # leasable again after this iteration

        self._command(run)
        return done

    def end_branches(self, branches: list[int]) -> None:
        """End fork branches (their jobs cancelled or done): their blocks go back, in order with the
        command that forked them, so that a fork never lands in a slot already given back."""

        def run() -> None:
            for branch in branches:
                self.forward.release(branch)
                self.slots.release(branch)

        self._command(run)

    def _command(self, command: Callable[[], None]) -> None:
        with self._wake:
            self._commands.append(command)
            self._wake.notify()

    def _fork(self, slot: int, branches: list[int]) -> None:
        for branch in branches:
            try:
                self.store.fork(slot, branch)
            except (OutOfBlocks, ValueError) as exc:
                log.debug("fork_refused", slot=slot, branch=branch, reason=str(exc))
                self.store.drop(branch)  # its steps fail as a dropped branch's

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
                while not self._ready() and not self._stopped:
                    self._wake.wait()
                if self._stopped:
                    break
                if self._inbox or self._active:
                    self._hold()
                entered = list(self._inbox)
                self._inbox.clear()
                commands = list(self._commands)
                self._commands.clear()
            for slot in self.slots.recycle():
                self.forward.release(slot)
                self._last_step.pop(slot, None)
            for command in commands:
                try:
                    command()
                except Exception:
                    log.exception("engine_command_failed")
            if commands:
                self.after_group()  # a resolve may have ended a step (draft_service/speculation.py)
            if not entered and not self._active:  # woken by a session's end: perhaps the last one
                continue
            for job in entered:
                self._enter(job)
            with torch.inference_mode():
                self._iteration()
        for job in [*self._active, *self._inbox]:
            _fail(job, resource_exhausted("the service stopped; retry on another replica"))
        self.after_group()

    def _ready(self) -> bool:
        """Whether the loop has anything to do (the condition's lock held)."""
        return bool(self._inbox or self._active or self._commands) or self.slots.released()

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
        once (docs/design.md, "The engine")."""
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
        if job.future.cancelled():
            return  # ended before it entered (a block drafted ahead and dropped): nothing to reserve
        self._active.append(job)
        store = self.store
        try:
            # A step's own faults fail it here, never the forward it would share with other sessions
            tree = tree_error(job.parents, len(job.pending), job.start, job.kept)
            if tree or (job.parents and not self.forward.batched):
                raise invalid_argument(tree or f"the {self.forward.name} forward serves chains only: no tree rows")
            if job.slot in store.reclaimed and job.start:
                raise _dropped()
            store.truncate(job.slot, job.start)
            if job.start == 0:
                most = job.most_reused() if not job.parents else min(job.most_reused(), job.kept - 1)
                job.reused = reused = store.reuse(job.slot, job.pending, most, job.cache_salt)
                job.start, job.pending = reused, job.pending[reused:]
                if job.parents and reused:  # the tree row starts past the reused part of its chain
                    job.parents = tuple(max(parent - reused, -1) for parent in job.parents[reused:])
                    job.kept -= reused
            length = max(job.max_length, job.start + len(job.pending))
            if not store.reserve(job.slot, length):
                taken = (store.used_blocks + store.reserved_blocks) * store.block_tokens
                raise resource_exhausted(
                    f"caching {length} tokens for this session would exceed the {self.role}'s budget of "
                    f"{store.budget_tokens} tokens ({taken} held or reserved, in blocks of {store.block_tokens}); "
                    "retry later, add replicas, or raise --max-cached-tokens"
                )
        except OutOfBlocks as exc:
            self._active.remove(job)
            self._end(job, resource_exhausted(f"{exc}; retry later, add replicas, or raise --max-cached-tokens"))
        except Exception as exc:  # noqa: BLE001 - this step's own failure
            self._active.remove(job)
            self._end(job, exc if isinstance(exc, ServiceError) else _internal(exc, job))

    def _iteration(self) -> None:
        now = time.perf_counter()
        waiting = []
        for job in self._active:
            if job.future.cancelled():
                self.store.settle(job.slot)
            else:
                waiting.append(job)
        self._active = []
        reclaimed = self.store.reclaimed
        for job in waiting:
            if job.slot in reclaimed:  # a branch dropped for a live step's blocks since this job entered
                self._end(job, _dropped())
            elif job.queue_seconds < 0 and now - job.submitted > self.limits.max_queue_wait_s:
                self._end(job, _busy(self.limits.max_queue_wait_s))
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
        active = self._active
        if any(job.speculative for job in active):  # live steps first: work done ahead takes what they leave
            active = [job for job in active if not job.speculative] + [job for job in active if job.speculative]
        for job in active:
            feed = job.pending
            if not job.parents:  # a tree is fed whole
                feed = job.pending[: chunk_tokens(len(job.pending), job.num_logits, limits.prefill_chunk_tokens)]
            if chosen and (len(chosen) >= limits.max_batch_size or tokens + len(feed) > limits.max_batch_tokens):
                continue
            last = len(feed) == len(job.pending)
            chosen.append((job, Row(job.slot, job.start, feed, job.num_logits if last else 0, job.parents, job.kept)))
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
                self._end(job, error)
            return
        seconds = time.perf_counter() - started
        self._forward_seconds = 0.9 * self._forward_seconds + 0.1 * seconds if self._forward_seconds else seconds
        batch_tokens = sum(len(row.token_ids) for row in rows)
        live = [row for (job, row) in group if not job.speculative]
        self.live_rows = 0.9 * self.live_rows + 0.1 * len(live)
        self.live_tokens = 0.9 * self.live_tokens + 0.1 * sum(len(row.token_ids) for row in live)
        self._trim_when_idle |= batch_tokens >= self.limits.prefill_chunk_tokens
        self._batch_size.observe(len(rows))
        self._batch_tokens.observe(batch_tokens)
        self._engine_forward_seconds.observe(seconds)
        fed: list[tuple[Job, torch.Tensor | None]] = []  # jobs whose feed is done, with their logits
        for (job, row), row_logits in zip(group, logits, strict=True):
            if job.queue_seconds < 0:
                job.queue_seconds = started - job.submitted
                self._queue_seconds.observe(job.queue_seconds)
            job.forward_seconds += seconds
            if len(rows) >= job.batch_size:
                job.batch_size, job.batch_tokens = len(rows), batch_tokens
            # A tree's tokens are dropped after the forward, but for the chain it keeps.
            job.start += row.kept if row.parents else len(row.token_ids)
            job.pending = job.pending[len(row.token_ids) :]
            if not job.pending:  # else the next chunk of a long feed
                fed.append((job, row_logits))
        try:
            rows_fed = [(job, row_logits) for job, row_logits in fed if row_logits is not None]
            if rows_fed:
                self.before_advance(rows_fed)
        except Exception:  # each job then reads its own row (advance)
            log.exception("before_advance_failed", role=self.role)
        for job, row_logits in fed:
            try:
                more = job.advance(row_logits) if row_logits is not None else None
            except Exception as exc:  # noqa: BLE001 - this job's own failure
                self._active.remove(job)
                self._end(job, exc)
                continue
            if more:
                job.pending, job.parents, job.kept = more, job.feed_parents(), 0
            else:
                self._active.remove(job)
                if job.comes_straight_back:
                    self._last_step[job.slot] = time.perf_counter()
                else:
                    self._last_step.pop(job.slot, None)
                self._end(job)

    def _end(self, job: Job, error: BaseException | None = None) -> None:
        """The job is over (failed when `error`): its reservation's rest goes back."""
        self.store.settle(job.slot)
        if error is None:
            _finish(job)
        else:
            _fail(job, error)


def _internal(exc: Exception, job: Job) -> ServiceError:
    log.exception("step_entry_failed", slot=job.slot)
    return ServiceError(grpc.StatusCode.INTERNAL, f"{HANDLER_INTERNAL_PREFIX}{type(exc).__name__}: {exc}")


def _busy(waited_s: float) -> ServiceError:
    return resource_exhausted(
        f"busy: the step waited {waited_s:g} s in the service's queue without starting; retry later or add replicas"
    )


def _dropped() -> ServiceError:
    return resource_exhausted(
        "this branch was dropped to admit a live session's step (branches are reclaimable); fork again"
    )


def _finish(job: Job) -> None:
    with contextlib.suppress(InvalidStateError):  # cancelled meanwhile: nobody is waiting
        job.future.set_result(job)


def _fail(job: Job, exc: BaseException) -> None:
    with contextlib.suppress(InvalidStateError):
        job.future.set_exception(exc)
