"""A draft step's engine job: feed the new tokens, then draft one token per engine iteration."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from draft_service.tree import TreeBuilder
from model_host.job import Job
from serving.constraints import SessionConstraint, TokenBan, mask_logits
from serving.logits import logits_to_probs, sample_index
from serving.sampling import SamplingParams


def choose_token(
    logits: torch.Tensor,  # [vocab]
    params: SamplingParams,
    generator: torch.Generator,
    need_confidence: bool,
) -> tuple[int, torch.Tensor | None, float]:
    """The draft's next token, the exact row it was sampled from ([vocab]; None for greedy), and the
    draft's probability of it (1.0 for greedy unless `need_confidence`)."""
    if params.greedy:
        token = int(logits.argmax())
        confidence = float(logits.float().softmax(-1)[token]) if need_confidence else 1.0
        return token, None, confidence
    probs = logits_to_probs(logits[None], params)[0]  # [vocab]
    # Inverse CDF: torch.multinomial costs 4.8 ms a token over 128k tokens on one core (this, 0.7 ms with
    # the softmax), which was most of a sampled draft's time per token at Llama 3's vocabulary.
    uniform = torch.rand(1, generator=generator, dtype=torch.float64, device=generator.device)
    token = int(sample_index(probs, uniform))
    return token, probs, float(probs[token])


@dataclass(eq=False)
class DraftJob(Job):
    """Feed the new tokens, then draft: each engine iteration samples one token and feeds it back,
    until K tokens (the last is never fed), an EOS, or the draft's confidence falls below
    min_confidence. K = 0 keeps the next token's logits and drafts nothing. Under a structured output
    each row is masked by the session's constraint, advanced by each token drafted."""

    params: SamplingParams = field(default_factory=SamplingParams)
    num_speculative_tokens: int = 1
    min_confidence: float = 0.0
    generator: torch.Generator | None = None
    constraint: SessionConstraint | None = None
    ban: TokenBan | None = None  # min_tokens' masks, as the target applies them
    position: int = 0  # the sequence position the next row scores
    vocab_limit: int = 0  # propose only ids below this (a draft wider than its target); 0: all
    shared: torch.Tensor | None = None  # [vocab] bool: propose only these (a target with another tokenizer)
    token_ids: list[int] = field(default_factory=list)  # [k] drafted so far
    token_probs: list[float] = field(default_factory=list)  # [k] q(x); sampling only
    rows: list[torch.Tensor] = field(default_factory=list)  # k logit rows of [vocab]; sampling only
    # For the speculation cache (draft_service/speculation.py), when `alternatives` > 0: at each drafted
    # position, the draft's probability of its token and its most likely tokens with theirs.
    alternatives: int = 0
    confidences: list[float] = field(default_factory=list)  # [k] q(x), greedy steps too
    likely: list[list[tuple[int, float]]] = field(default_factory=list)  # [k][alternatives + 1]
    rows_scored: int = 0  # rows this job read (a forward's each): a guess's too
    # The next row's token, q(token) and likeliest tokens, read with the forward's other rows
    # (`read_rows`); None: `advance` reads its row itself.
    prepared: tuple[int, float, list[tuple[int, float]]] | None = None

    def reads_plain_row(self, width: int) -> bool:
        """Whether this job's next row is read as it came from the forward: greedy, nothing masks it,
        and a token is wanted from it (`read_rows` reads such rows together)."""
        return (
            self.params.greedy
            and self.num_speculative_tokens > 0
            and self.constraint is None
            and self.ban is None
            and self.shared is None
            and not 0 < self.vocab_limit < width
        )

    def take_prepared(self) -> tuple[int, float, list[tuple[int, float]]]:
        """The row `read_rows` read for this job, which counts as read here (as `masked` counts one)."""
        assert self.prepared is not None
        prepared, self.prepared = self.prepared, None
        self.rows_scored += 1
        self.position += 1
        return prepared

    def masked(self, logits: torch.Tensor) -> torch.Tensor:
        """The last row of `logits`, masked as the step's constraint, ban, vocab_limit and shared tokens
        say, for the position it scores (which then moves on by one)."""
        row = logits[-1]  # [vocab]
        self.rows_scored += 1
        constraint = self.constraint
        allowed = constraint.allowed()[None] if constraint is not None else None  # [1, vocab]
        if self.ban is not None:
            allowed = self.ban.restrict(allowed, [self.position], row.shape[-1])
        if 0 < self.vocab_limit < row.shape[-1]:
            if allowed is None:
                allowed = torch.ones((1, row.shape[-1]), dtype=torch.bool)
            allowed[:, self.vocab_limit :] = False
        if self.shared is not None:
            allowed = self.shared[None] if allowed is None else allowed & self.shared
        self.position += 1
        if allowed is not None:
            return mask_logits(row[None], allowed)[0]  # a new tensor: no clone needed
        if not self.params.greedy:
            return row.clone()  # a view would keep the whole batch's logits alive
        return row

    def advance(self, logits: torch.Tensor) -> list[int] | None:
        assert self.generator is not None
        if self.prepared is not None:
            token, confidence, likely = self.take_prepared()
            self.token_ids.append(token)
            if self.alternatives:
                self.confidences.append(confidence)
                self.likely.append(likely)
            return self._next_feed(token, confidence)
        row = self.masked(logits)
        if not self.params.greedy:
            self.rows.append(row)
        if self.num_speculative_tokens == 0:
            return None
        need_confidence = self.min_confidence > 0 and not self.alternatives
        token, probs, confidence = choose_token(row, self.params, self.generator, need_confidence)
        self.token_ids.append(token)
        if probs is not None:
            self.token_probs.append(float(probs[token]))
        if self.alternatives:
            confidence = self._note_likely(row, probs, token)
        return self._next_feed(token, confidence)

    def _next_feed(self, token: int, confidence: float) -> list[int] | None:
        """After drafting `token`: the token to feed back, or None where the block ends."""
        if len(self.token_ids) == self.num_speculative_tokens or confidence < self.min_confidence:
            return None
        constraint = self.constraint
        if constraint is not None:
            if constraint.is_eos(token):
                return None  # the generation would end here: nothing to draft past it
            constraint.consume(token)
        return [token]

    def _note_likely(self, row: torch.Tensor, probs: torch.Tensor | None, token: int) -> float:
        """Note q(token) and the most likely tokens at this position; returns q(token)."""
        if probs is None:  # greedy: the draft's own distribution, for how likely each verdict is
            probs = row.float().softmax(-1)
        values, ids = probs.topk(min(self.alternatives + 1, probs.shape[-1]))
        confidence = float(probs[token])
        self.confidences.append(confidence)
        self.likely.append(list(zip(ids.tolist(), values.tolist(), strict=True)))
        return confidence


def read_rows(fed: list[tuple[Job, torch.Tensor]]) -> None:
    """The draft's next token at every plain greedy row a forward gave (`DraftJob.reads_plain_row`),
    with its q and the likeliest tokens the speculation cache wants, in one argmax (and one softmax and
    top-k) over all of them, each read to the host once for every row, where each job read its row
    alone before: on a GPU that was a few kernels and a wait for the device per row, between forwards. The engine's
    `before_advance`; a job it leaves reads its row in `advance` as before. The same token as a job's
    own read: the argmax of the same logits (a guess of the bonus token is an argmax too)."""
    plain = [
        (job, logits[-1]) for job, logits in fed if isinstance(job, DraftJob) and job.reads_plain_row(logits.shape[-1])
    ]
    if len(plain) < 2:
        return
    rows = torch.stack([row for _, row in plain])  # [B, vocab]
    tokens = rows.argmax(dim=-1)  # [B]
    top = max(job.alternatives for job, _ in plain)
    confidences: list[float] = [1.0] * len(plain)
    likely: list[list[tuple[int, float]]] = [[] for _ in plain]
    if top or any(job.min_confidence > 0 for job, _ in plain):
        probs = rows.float().softmax(dim=-1)  # [B, vocab]
        confidences = probs.gather(1, tokens[:, None])[:, 0].tolist()
        if top:
            values, ids = probs.topk(min(top + 1, probs.shape[-1]), dim=-1)
            likely = [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
    for (job, _), token, confidence, guesses in zip(plain, tokens.tolist(), confidences, likely, strict=True):
        job.prepared = (token, confidence, guesses[: job.alternatives + 1])


@dataclass(eq=False)
class GuessingDraftJob(DraftJob):
    """A block drafted ahead for a wholly accepted block: feed its last draft token, guess the target's
    bonus token after it (the draft's rank-th most likely token), feed the guess, then draft as a
    DraftJob."""

    guess: int = -1
    rank: int = 1  # the guess is the draft's rank-th most likely token there

    def reads_plain_row(self, width: int) -> bool:
        """As a DraftJob's, and a guess other than the likeliest token is no argmax: read alone."""
        return super().reads_plain_row(width) and (self.guess >= 0 or self.rank == 1)

    def advance(self, logits: torch.Tensor) -> list[int] | None:
        if self.guess >= 0:
            return super().advance(logits)
        if self.prepared is not None:  # the argmax, read with the forward's other rows
            self.guess = self.take_prepared()[0]
        else:
            row = self.masked(logits)
            self.guess = int(row.argmax()) if self.rank == 1 else int(row.topk(self.rank).indices[-1])
        if self.constraint is not None:
            if self.constraint.is_eos(self.guess):
                return None  # the structured output would end there: nothing to draft past it
            self.constraint.consume(self.guess)
        return [self.guess]


@dataclass(eq=False)
class TreeDraftJob(Job):
    """Feed the new tokens, then grow a token tree (draft_service/tree.py): each further engine iteration
    feeds the tree so far as a tree row (its tokens dropped afterwards) and reads the draft's rows at the
    nodes the builder asked for. Greedy: the rows are the draft's distributions at temperature 1."""

    builder: TreeBuilder | None = None
    asked: list[int] = field(default_factory=lambda: [-1])  # the nodes whose rows the last feed scores
    rows: dict[int, torch.Tensor] = field(default_factory=dict)  # node (-1: the root) -> its row, for learning

    def advance(self, logits: torch.Tensor) -> list[int] | None:
        builder = self.builder
        assert builder is not None
        probs = logits.float().softmax(-1)  # [num_logits, vocab]
        for node in self.asked:
            row = probs[-1] if node < 0 else probs[node]  # the root's: the appended chain's last
            self.rows[node] = row
            builder.known(node, row)
        self.asked = builder.rows_wanted()
        if not self.asked:
            return None
        self.num_logits = len(builder.token_ids)
        return list(builder.token_ids)

    def feed_parents(self) -> tuple[int, ...]:
        assert self.builder is not None
        return tuple(self.builder.parents)
