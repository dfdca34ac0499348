"""The speculation cache: while the target verifies a session's block, the draft drafts the next block
for each likely verdict, each on a fork of the session, so that the next step finds it drafted.

A step that asks for it (`DraftRequest.speculate`) ends with k draft tokens d_0 .. d_{k-1}, after a
sequence of n tokens; the session has fed all but d_{k-1}. The target's verdict is one of:
- a rejection at d_j (0 <= j < k): the next step keeps n + j tokens and appends the target's token
  there, which is never d_j. The guesses are the draft's next most likely tokens at j.
- the whole block accepted: the next step keeps n + k - 1 and appends d_{k-1} and the bonus token. The
  guesses are the draft's most likely tokens after d_{k-1}, found by each entry's own first forward.
Each verdict guessed is an entry: a fork of the session whose job is the step that verdict's next step
would run, with the seed that step would carry (`Speculate.seed_base` + the sequence length). The next
step takes the entry whose keep and appended tokens it names, with the same sampling fields, and whose
K is at least its own; the others are dropped. A hit is answered from the entry (its fork becomes the
session), a miss drafts as usual: exact either way, since a block drafted ahead is the block that step
would draft (the same q, the same uniforms), and which entry answers depends on the verdict alone.

Which verdicts are drafted: a whole block's with the draft's most likely bonus token always (what the
orchestrator's step beside the verify drafted before the cache); the others while they pay. A
rejection's chance is a^j (1 - a) q_j(g) / (1 - q_j(d_j)): the session's acceptance per draft token a,
learnt from the verdicts its steps name (`_learn`), and the draft's own distribution at j without its
token for the target's token g; a whole block's with the r-th likeliest bonus token, a^k a (1 - a)^(r-1).
An entry pays when its chance times what a hit saves (K forwards of the session's next step, each
costing about `overhead_tokens` plus the live tokens of a forward, in tokens' worth) exceeds what it
costs the live steps (its K + 1 tokens, in each of the live rows' forwards). On a GPU a forward costs about what
reading its weights costs, so entries are nearly free and the cache fans out; under load few pass.
Entries take only the forward rows live steps leave free (`max_batch_size`), their tokens stay
within `--speculation-cache-tokens`, and their branches are dropped before any live session waits
for a block (model_host/kv_blocks.py).

A draft computing on its host's CPU does not offer the cache (`ModelInfo.speculation_cache_tokens`
is 0), and the orchestrator drafts ahead for a whole block with a step beside the verify, as before
the cache. The CPU is shared with whatever else runs there (the target, in a co-located deployment),
so what an entry costs is not the draft's alone and the cost rule cannot see it: fanning out measured
slower there. Drafting ahead for the whole block alone through the cache measured 0.90-0.93x the side
step at one stream (a hit costs a round trip to the draft, the side step's block is already in hand),
1.0x at 8 (README, "The speculation cache")."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field

import structlog

from draft_service.jobs import DraftJob, GuessingDraftJob
from model_host.engine import Engine
from model_host.job import Job
from model_host.metrics import SPECULATION_ENTRIES, SPECULATION_HELD_TOKENS, SPECULATION_STEPS, SPECULATION_TOKENS
from model_host.sessions import Session
from serving.constraints import SessionConstraint
from serving.errors import resource_exhausted
from specdec.v1 import draft_pb2

log = structlog.get_logger(__name__)

_U64 = (1 << 64) - 1
# The draft's most likely tokens considered at each position, and bonus tokens after a whole block:
# candidates only, the cost rule chooses (3 gave a hit rate of 0.52-0.57 at temperature 0.8 on the
# default pair, 6 gave 0.58-0.66: `make speculation-bench`).
GUESSES = 6
# The weight of older rounds in the acceptance estimate, as the orchestrator's K policies (docs/design.md).
DECAY = 0.9
# make_job(slot, step, constraint, guessing): the engine job of a step on a branch (guessing: a
# GuessingDraftJob, whose appended tokens lack the guess of the bonus token).
MakeJob = Callable[[int, draft_pb2.DraftRequest, "SessionConstraint | None", bool], DraftJob]


@dataclass(frozen=True)
class Verdict:
    """A verdict to draft ahead for: the next step's keep and appended tokens, and its chance. A whole
    block's appended tokens are its last draft token alone: the guess of the bonus token comes later."""

    keep: int
    append: list[int]
    chance: float
    whole: bool = False
    rank: int = 1  # a whole block's: its guess is the draft's rank-th most likely bonus token


@dataclass(eq=False)
class Entry:
    """A block drafted ahead for one verdict, on a fork branch of its session."""

    keep: int
    append: list[int]  # the verdict's appended tokens; a whole block's guess is added when known
    request: draft_pb2.DraftRequest  # the step it answers (its seed, sampling and K)
    job: DraftJob
    branch: int
    constraint: SessionConstraint | None
    tokens: int  # what it counts against --speculation-cache-tokens

    def answers(self, request: draft_pb2.DraftRequest) -> bool:
        """Whether `request` is the step this entry was drafted for (the verdict alone decides)."""
        job = self.job
        append = list(self.append)
        if isinstance(job, GuessingDraftJob):
            if job.guess < 0:
                return False  # not guessed yet: the verdict cannot be matched
            append.append(job.guess)
        if job.future.done() and not job.token_ids:
            return False  # it drafted nothing (a guess that ends a structured output)
        return (
            request.keep == self.keep
            and list(request.append_token_ids) == append
            and 1 <= request.num_speculative_tokens <= self.request.num_speculative_tokens
            and request.seed == self.request.seed
            and request.sampling == self.request.sampling
            and request.min_confidence == self.request.min_confidence
            and request.vocab_limit == self.request.vocab_limit
            and request.ban == self.request.ban
        )


@dataclass
class Acceptance:
    """A decayed estimate of the chance that a draft token is accepted (a prior of one token at `rate`)."""

    rate: float = 0.5
    accepted: float = 0.0
    judged: float = 0.0
    last: tuple[int, int] | None = None  # the last step that drafted ahead: (n, k)

    def observe(self, accepted: int, judged: int) -> None:
        self.accepted = DECAY * self.accepted + accepted
        self.judged = DECAY * self.judged + judged
        self.rate = (self.accepted + self.rate) / (self.judged + 1.0)


@dataclass
class Counts:
    """What the cache did, for metrics and tests."""

    hits: int = 0
    hits_after_rejection: int = 0  # of the hits, those whose block followed a rejection (not a whole block)
    misses: int = 0
    # Hits whose branch was dropped for a live step's blocks: before the answer (the step then ran as
    # usual) or after it (the session's next step is a cache miss).
    lost: int = 0
    launched: int = 0
    used_tokens: int = 0
    wasted_tokens: int = 0
    verdicts: dict[str, int] = field(default_factory=dict)  # steps with entries, by verdict: whole, rejection


class SpeculationCache:
    """Entries by session id; used on the server's event loop only (the engine runs their jobs)."""

    def __init__(
        self,
        engine: Engine,
        budget_tokens: int,
        max_rows: int,
        make_job: MakeJob,
        max_speculative_tokens: int,
        max_context: int,
        fans_out: bool,
    ) -> None:
        self.engine = engine
        self.budget_tokens = budget_tokens
        self.max_rows = max_rows
        self.make_job = make_job
        self.max_speculative_tokens = max_speculative_tokens
        self.max_context = max_context
        # Whether rejections get entries too, or only a whole block: see the module's docstring.
        self.fans_out = fans_out
        self.counts = Counts()
        self._entries: dict[str, list[Entry]] = {}
        self.entries = 0  # held or drafting, over all sessions
        self.held_tokens = 0
        self._running = 0  # entries' jobs in the engine, each a forward row: counted, not scanned, per launch
        self._lock = threading.Lock()
        # Acceptance per drafted token, learnt from the verdicts the next steps name: each session's
        # (decayed counts of tokens accepted and judged, from its last step: n and k), and the
        # service's, the prior of a new session.
        self._sessions: dict[str, Acceptance] = {}
        self.prior = Acceptance()

    @property
    def alternatives(self) -> int:
        """The likeliest tokens a job notes at each drafted position, for the entries its answer launches
        (`launch`): live steps that ask to draft ahead, and every entry, since a hit's answer launches
        entries in turn."""
        return GUESSES if self.fans_out else 0

    def running(self) -> int:
        """Entries whose job is still in the engine: they take forward rows."""
        with self._lock:
            return self._running

    # --- launching ---------------------------------------------------------------------------

    def launch(self, session: Session, request: draft_pb2.DraftRequest, job: DraftJob) -> None:
        """Draft ahead for the verdicts of the step `job` just answered (`request` asked for it)."""
        self.drop(session)
        token_ids = job.token_ids
        if session.cache is None or session.stepping:
            return  # closed, or already on its next step, since the step was answered
        if not token_ids or (self.fans_out and len(job.likely) != len(token_ids)):
            return
        n = request.keep + len(request.append_token_ids)
        acceptance = self._sessions.setdefault(session.session_id, Acceptance(self.prior.rate))
        acceptance.last = (n, len(token_ids))
        candidates = self._candidates(job, n, acceptance.rate)
        if session.constraint is not None:  # a structured output ends at an EOS: nothing is fed past one
            candidates = [v for v in candidates if not any(session.constraint.is_eos(t) for t in v.append)]
        engine = self.engine
        live_rows = max(1.0, engine.live_rows)
        rows_free = self.max_rows - round(engine.live_rows) - self.running()
        worth = engine.overhead_tokens + engine.live_tokens  # a forward's cost, in tokens' worth
        # A session's share of the budget: a session that stalls while it holds entries keeps them until
        # its next step or its end, and must not starve the others.
        share = self.budget_tokens // max(1, len(self._sessions))
        held = 0
        chosen: list[tuple[Verdict, int]] = []
        for verdict in candidates:
            wanted = request.speculate.next_k_whole if verdict.whole and request.speculate.next_k_whole else 0
            next_k = min(
                wanted or request.speculate.next_k, self.max_speculative_tokens, self.max_context - verdict.keep - 2
            )
            tokens = len(verdict.append) + int(verdict.whole) + next_k
            if (
                next_k < 1
                or len(chosen) >= rows_free
                or self.held_tokens + tokens > self.budget_tokens
                or held + tokens > share
            ):
                continue
            first_guess = verdict.whole and verdict.rank == 1  # drafted ahead whatever the load, as before the cache
            if not first_guess and verdict.chance * next_k * worth < (next_k + 1) * live_rows:
                continue
            chosen.append((verdict, next_k))
            self.held_tokens += tokens
            held += tokens
        if not chosen:
            return
        branches = engine.fork(session.cache.slot, len(chosen))
        entries = []
        for (verdict, next_k), branch in zip(chosen, branches, strict=True):
            try:
                entries.append(self._entry(session, request, verdict, next_k, branch))
            except Exception:
                log.exception("drafting_ahead_failed", request_id=session.request_id)
                self.held_tokens -= len(verdict.append) + int(verdict.whole) + next_k
                engine.end_branches([branch])
        self._entries[session.session_id] = entries
        self.entries += len(entries)
        self.counts.launched += len(entries)
        self._publish()

    def _candidates(self, job: DraftJob, n: int, rate: float) -> list[Verdict]:
        """The verdicts of a step that drafted after n tokens, likeliest first, by a session accepting
        each draft token with chance `rate`. A rejection's token is guessed by the draft's own
        distribution without its token there (the target's token after a rejection is never it); a
        whole block's bonus token by the draft's most likely token, right as often as a draft token."""
        token_ids = job.token_ids
        candidates: list[Verdict] = []
        reach = 1.0  # the chance that d_0 .. d_{j-1} are all accepted
        for j, token in enumerate(token_ids):
            if self.fans_out:
                rest = max(1e-6, 1.0 - job.confidences[j])
                guesses = [(guess, q) for guess, q in job.likely[j] if guess != token]
                candidates += [
                    Verdict(n + j, [guess], reach * (1.0 - rate) * min(1.0, q / rest)) for guess, q in guesses[:GUESSES]
                ]
            reach *= rate
        # The bonus token: the draft's most likely tokens after the block, the r-th right (1 - a)^(r - 1) a
        # as often as a draft token (a geometric guess: the draft has not scored that position yet).
        for rank in range(1, (GUESSES if self.fans_out else 1) + 1):
            chance = reach * rate * (1.0 - rate) ** (rank - 1)
            candidates.append(Verdict(n + len(token_ids) - 1, [token_ids[-1]], chance, whole=True, rank=rank))
        candidates.sort(key=lambda verdict: -verdict.chance)
        return candidates

    def _entry(
        self, session: Session, request: draft_pb2.DraftRequest, verdict: Verdict, next_k: int, branch: int
    ) -> Entry:
        length = verdict.keep + len(verdict.append) + int(verdict.whole)  # the sequence it drafts after
        step = draft_pb2.DraftRequest(
            request_id=request.request_id,
            keep=verdict.keep,
            append_token_ids=verdict.append,
            num_speculative_tokens=next_k,
            sampling=request.sampling,
            seed=(request.speculate.seed_base + length) & _U64,
            min_confidence=request.min_confidence,
            vocab_limit=request.vocab_limit,
        )
        if request.HasField("ban") and length < request.ban.until:
            step.ban.CopyFrom(request.ban)
        constraint = session.constraint.copy() if session.constraint is not None else None
        job = self.make_job(branch, step, constraint, verdict.whole)
        if isinstance(job, GuessingDraftJob):
            job.rank = verdict.rank
        job.speculative = True
        job.comes_straight_back = False
        job.alternatives = self.alternatives
        job.max_length = length + next_k - 1
        self.engine.submit(job)
        with self._lock:
            self._running += 1
        job.future.add_done_callback(self._job_ended)  # the engine's thread, or here on a cancel
        return Entry(verdict.keep, verdict.append, step, job, branch, constraint, length - verdict.keep + next_k)

    def _job_ended(self, _: Future[Job]) -> None:
        with self._lock:
            self._running -= 1

    # --- the next step -----------------------------------------------------------------------

    def take(self, session: Session, request: draft_pb2.DraftRequest) -> Entry | None:
        """The entry that answers `request`, now the session's to resolve; the others are dropped.
        None (a miss) when no entry answers it, or the session had none."""
        verdict = self._learn(session, request)
        entries = self._entries.pop(session.session_id, None)
        if entries is None:
            return None
        self.entries -= len(entries)
        hit = next((entry for entry in entries if entry.answers(request)), None)
        for entry in entries:
            if entry is not hit:
                self._discard(entry)
        self.counts.verdicts[verdict] = self.counts.verdicts.get(verdict, 0) + 1
        if hit is None:
            self.counts.misses += 1
            SPECULATION_STEPS.labels("miss", verdict).inc()
        else:
            self.counts.hits += 1
            self.counts.hits_after_rejection += not isinstance(hit.job, GuessingDraftJob)
            self.held_tokens -= hit.tokens
            self.counts.used_tokens += request.num_speculative_tokens
            SPECULATION_STEPS.labels("hit", verdict).inc()
            SPECULATION_TOKENS.labels("used").inc(request.num_speculative_tokens)
        self._publish()
        return hit

    def settle(self, session: Session, entry: Entry) -> Future[DraftJob]:
        """The future of a hit's answer: set once the entry's job has ended, the branch then queued to
        become the session (`Engine.resolve`: an engine command, run before any later step of the
        session enters; `Session.resolving` says its length meanwhile). An error when the entry was lost
        first (its branch dropped for a live session's blocks): the step then runs as usual, the
        session holding what it held. A branch dropped after the answer leaves the session `lost`:
        its next step is a cache miss, and the orchestrator reopens it."""
        settled: Future[DraftJob] = Future()
        slot = session.cache.slot if session.cache is not None else -1
        engine = self.engine

        def resolved(done: Future[bool]) -> None:
            if done.exception() is not None or not done.result():
                self.counts.lost += 1
                session.lost = True
            session.resolving = None

        def job_ended(ended: Future[Job]) -> None:
            if ended.cancelled() or ended.exception() is not None or slot < 0:
                engine.end_branches([entry.branch])
                self.counts.lost += 1
                with contextlib.suppress(InvalidStateError):
                    settled.set_exception(_dropped())
                return
            session.resolving = entry.job.start  # what the branch holds
            session.constraint = entry.constraint
            engine.resolve(slot, entry.branch, []).add_done_callback(resolved)
            with contextlib.suppress(InvalidStateError):
                settled.set_result(entry.job)

        entry.job.future.add_done_callback(job_ended)
        return settled

    def _learn(self, session: Session, request: draft_pb2.DraftRequest) -> str:
        """The verdict a session's step names on the step before it (which asked to draft ahead): j of
        its k tokens accepted when the step keeps n + j and appends the target's token, or all k when it
        keeps n + k - 1 and appends the last draft token and the bonus token. Returns its kind: "whole",
        "rejection", or "other" (a step that names no verdict: a reopened session's)."""
        acceptance = self._sessions.get(session.session_id)
        if acceptance is None or acceptance.last is None:
            return "other"
        (n, k), acceptance.last = acceptance.last, None
        accepted = request.keep - n + len(request.append_token_ids) - 1
        if not request.keep or not 0 <= accepted <= k:
            return "other"
        judged = min(k, accepted + 1)
        acceptance.observe(accepted, judged)
        self.prior.observe(accepted, judged)
        return "whole" if accepted == k else "rejection"

    def forget(self, session: Session) -> None:
        """The session ended."""
        self.drop(session)
        self._sessions.pop(session.session_id, None)

    def drop(self, session: Session) -> None:
        """Drop a session's entries (a new step of its own, or its end)."""
        entries = self._entries.pop(session.session_id, None)
        self.entries -= len(entries or ())
        for entry in entries or ():
            self._discard(entry)
        if entries:
            self._publish()

    def _discard(self, entry: Entry) -> None:
        entry.job.future.cancel()  # the engine drops it before its next forward
        self.engine.end_branches([entry.branch])
        self.held_tokens -= entry.tokens
        self.counts.wasted_tokens += len(entry.job.token_ids)
        SPECULATION_TOKENS.labels("wasted").inc(len(entry.job.token_ids))

    def _publish(self) -> None:
        SPECULATION_ENTRIES.set(self.entries)
        SPECULATION_HELD_TOKENS.set(self.held_tokens)


def _dropped() -> Exception:
    return resource_exhausted("the block drafted ahead was dropped to admit a live session's step")
