"""What one round proposes and what a generation counts: the proposal block (from the draft model or
the prompt lookup) and the request's statistics."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from orchestrator.rejection import Verdict
from orchestrator.upstream import Place
from specdec.v1 import orchestrator_pb2

MODEL = "model"
NGRAM = "ngram"
FORCED = "forced"  # the tokens a structured output's grammar forces next
POINT_MASS_PROPOSERS = (NGRAM, FORCED)  # deterministic proposals: q is a point mass on each token


def point_masses(token_ids: list[int], vocab_size: int) -> torch.Tensor:
    """[k, vocab] rows putting all mass on each token: the q of a deterministic (lookup) proposal,
    under which a token is accepted with probability p(x) and a rejection samples p with x removed."""
    rows = torch.zeros(len(token_ids), vocab_size)
    return rows.scatter_(1, torch.tensor(token_ids, dtype=torch.long)[:, None], 1.0)


@dataclass
class Stats:
    """Counts and timings of one generation, converted to proto at the edge."""

    prompt_tokens: int = 0
    output_tokens: int = 0
    rounds: int = 0
    rounds_with_draft: int = 0
    overlapped_rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0
    target_seconds: float = 0.0
    total_seconds: float = 0.0
    time_to_first_token_seconds: float = 0.0
    draft_fallback_rounds: int = 0
    ngram_rounds: int = 0
    ngram_draft_tokens: int = 0
    ngram_accepted_tokens: int = 0
    probe_rounds: int = 0  # K = 0 rounds that asked the draft for one token beside the target's step
    forced_draft_tokens: int = 0  # tokens a structured output forced, proposed without a draft step

    def record_round(self, verdict: Verdict, proposer: str) -> None:
        self.rounds += 1
        self.rounds_with_draft += verdict.num_drafted > 0
        self.draft_tokens += verdict.num_drafted
        self.accepted_tokens += verdict.num_accepted
        if proposer == NGRAM:
            self.ngram_rounds += 1
            self.ngram_draft_tokens += verdict.num_drafted
            self.ngram_accepted_tokens += verdict.num_accepted
        elif proposer == FORCED:
            self.forced_draft_tokens += verdict.num_drafted
        if len(self.accepted_per_position) < verdict.num_drafted:
            self.accepted_per_position.extend([0] * (verdict.num_drafted - len(self.accepted_per_position)))
        for position in range(verdict.num_accepted):
            self.accepted_per_position[position] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    def to_proto(
        self, reopens: int, wire_bytes: int, reused: tuple[int, int] = (0, 0)
    ) -> orchestrator_pb2.GenerationStats:
        return orchestrator_pb2.GenerationStats(
            prompt_tokens=self.prompt_tokens,
            output_tokens=self.output_tokens,
            rounds=self.rounds,
            draft_tokens=self.draft_tokens,
            accepted_tokens=self.accepted_tokens,
            accepted_per_position=self.accepted_per_position,
            draft_seconds=self.draft_seconds,
            target_seconds=self.target_seconds,
            other_seconds=max(0.0, self.total_seconds - self.draft_seconds - self.target_seconds),
            total_seconds=self.total_seconds,
            time_to_first_token_seconds=self.time_to_first_token_seconds,
            session_reopens=reopens,
            draft_fallback_rounds=self.draft_fallback_rounds,
            wire_bytes=wire_bytes,
            draft_rounds=self.rounds_with_draft,
            overlapped_rounds=self.overlapped_rounds,
            ngram_rounds=self.ngram_rounds,
            ngram_draft_tokens=self.ngram_draft_tokens,
            ngram_accepted_tokens=self.ngram_accepted_tokens,
            probe_rounds=self.probe_rounds,
            target_reused_prompt_tokens=reused[0],
            draft_reused_prompt_tokens=reused[1],
            forced_draft_tokens=self.forced_draft_tokens,
        )


@dataclass(frozen=True)
class RowsAt:
    """Where the rows of a model block's tokens are held: the draft session (`SessionStream.where`)
    that drafted it, the step's number there, and the step's index of the block's first token."""

    session: Place
    step_number: int
    offset: int = 0


@dataclass(frozen=True)
class Draft:
    """One block of proposed tokens and the draft's probability of each."""

    token_ids: list[int]  # [k]
    token_probs: list[float] | None  # [k] q(x), float32 as sampled (1 for a lookup's); None for greedy
    forward_seconds: float = 0.0  # the draft service's forward time for this block
    proposer: str = MODEL  # MODEL (the draft service), NGRAM (prompt lookup) or FORCED (a grammar's)
    fed: int = 0  # tokens the draft service was fed for this block (0: it cost no draft step)
    forward_seconds_per_token: float = 0.0  # the draft step's forward seconds per token it drafted
    rows_at: RowsAt | None = None  # a sampled model block's rows, on the draft service
    speculated: bool = False  # drafted ahead by the draft's speculation cache while the last step was verified
    parents: tuple[int, ...] = ()  # a token tree: each token's parent among token_ids (-1: the sequence's end)

    def first(self, k: int) -> Draft:
        """The first k tokens (a ready block may be longer than this round allows)."""
        if k >= len(self.token_ids):
            return self
        probs = self.token_probs[:k] if self.token_probs is not None else None
        return replace(self, token_ids=self.token_ids[:k], token_probs=probs)

    def rest(self) -> Draft:
        """All but the first token (which turned out to be the bonus token); costs nothing more."""
        probs = self.token_probs[1:] if self.token_probs is not None else None
        rows_at = replace(self.rows_at, offset=self.rows_at.offset + 1) if self.rows_at is not None else None
        return replace(
            self, token_ids=self.token_ids[1:], token_probs=probs, forward_seconds=0.0, fed=0, rows_at=rows_at
        )


NO_DRAFT = Draft(token_ids=[], token_probs=None)
