"""The draft's rows read together (`read_rows`, the engine's `before_advance`) draft what each job
drafts reading its own row: the same tokens, q values and likeliest tokens, the same feeds back."""

from __future__ import annotations

import math

import torch

from draft_service.jobs import DraftJob, GuessingDraftJob, read_rows
from serving.constraints import TokenBan
from serving.sampling import SamplingParams

VOCAB = 64


def _jobs() -> list[DraftJob]:
    """One of each kind of job a draft forward holds, as a fresh copy (each job keeps state)."""
    generator = torch.Generator().manual_seed(3)
    sampled = SamplingParams(temperature=0.8)

    def job(cls: type[DraftJob] = DraftJob, **fields: object) -> DraftJob:
        return cls(slot=0, start=0, pending=[], num_logits=1, generator=generator, **fields)  # type: ignore[arg-type]

    return [
        job(num_speculative_tokens=3),
        job(num_speculative_tokens=3, alternatives=2),  # the speculation cache's
        job(num_speculative_tokens=3, min_confidence=0.2),
        job(GuessingDraftJob, num_speculative_tokens=3),  # its bonus guess first
        job(GuessingDraftJob, num_speculative_tokens=3, rank=2),  # a second guess: read alone
        job(num_speculative_tokens=3, params=sampled),  # sampled: read alone
        job(num_speculative_tokens=3, ban=TokenBan((5,), 9)),  # masked: read alone
        job(num_speculative_tokens=3, vocab_limit=VOCAB - 4),
        job(num_speculative_tokens=0),  # keeps its row, drafts nothing
        job(num_speculative_tokens=1, alternatives=2),  # its block ends at this row
    ]


def _state(job: DraftJob) -> tuple[object, ...]:
    guess = job.guess if isinstance(job, GuessingDraftJob) else None
    likely_ids = [[token for token, _ in position] for position in job.likely]
    return (job.token_ids, likely_ids, guess, job.rows_scored, job.position, len(job.rows))


def test_rows_read_together_draft_what_each_job_drafts_alone() -> None:
    torch.manual_seed(0)
    pairs = list(zip(_jobs(), _jobs(), strict=True))  # (read alone, read together)
    first = True
    while pairs:  # a forward a round, over the jobs still drafting: the guessing ones guess first
        logits = [torch.randn(1, VOCAB) * 3 for _ in pairs]
        read_rows([(together, row) for (_, together), row in zip(pairs, logits, strict=True)])
        if first:  # which rows were read together: plain greedy rows that want a token
            assert [together.prepared is not None for _, together in pairs] == [True] * 4 + [False] * 5 + [True]
            first = False
        going = []
        for (alone, together), row in zip(pairs, logits, strict=True):
            feed = alone.advance(row)
            assert together.advance(row) == feed
            assert together.prepared is None
            assert _state(alone) == _state(together)
            assert all(
                math.isclose(a, b, rel_tol=1e-5) for a, b in zip(alone.confidences, together.confidences, strict=True)
            )
            if feed:
                going.append((alone, together))
        pairs = going


def test_a_single_row_is_read_by_its_job() -> None:
    job = DraftJob(slot=0, start=0, pending=[], num_logits=1, generator=torch.Generator(), num_speculative_tokens=2)
    read_rows([(job, torch.randn(1, VOCAB))])
    assert job.prepared is None
