"""The accept/reject step of speculative decoding: a pure function, tensors in, tokens out.

Notation (docs/design.md): the draft proposed k tokens `draft_token_ids`, sampled from `draft_probs`
(the draft's distributions, q). The target scored the k + 1 positions that end with them:
`target_probs` (p) or, for greedy, `target_argmax`. Left to right:
- accepted: a draft token kept (greedy: equals the target's argmax; sampling: kept with
  probability min(1, p(x) / q(x)));
- recovered: at the first rejection, a token from norm(max(0, p - q)) (greedy: the target's argmax);
- bonus: when all k are accepted, one more token from the target's last row.
A round outputs the accepted tokens plus one recovered or bonus token, so it always makes progress.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from serving.logits import first_rejection, sample_index


@dataclass(frozen=True)
class Verdict:
    """What one round commits."""

    output_token_ids: list[int]  # accepted + (recovered | bonus); len = num_accepted + 1
    num_accepted: int  # draft tokens accepted, 0..num_drafted
    num_drafted: int  # k

    @property
    def all_accepted(self) -> bool:
        """Every draft token was kept, so the last output token is a bonus token."""
        return self.num_accepted == self.num_drafted


def verify_greedy(
    draft_token_ids: Sequence[int],  # [k]
    target_argmax: Sequence[int],  # [k + 1]
) -> Verdict:
    """Greedy: accept while the draft agrees with the target's argmax; then take the target's token.
    Token ids as plain integers: a round's k is small, and tensors would cost more than the comparison."""
    k = len(draft_token_ids)
    num_accepted = next((i for i in range(k) if draft_token_ids[i] != target_argmax[i]), k)
    output = list(target_argmax[: num_accepted + 1])
    return Verdict(output_token_ids=output, num_accepted=num_accepted, num_drafted=k)


def draw_uniforms(k: int, generator: torch.Generator) -> torch.Tensor:
    """A round's randomness, [k + 1] float64 in [0, 1): one uniform per draft token, then one for the
    recovered or bonus token. Drawn before the step is sent, so a resend (a cache miss, a failover)
    decides with the same draws, and a request draws exactly its own, whatever the batch.

    float64: a float32 uniform is a multiple of 2^-24, which would accept any p/q below that with
    probability 2^-24 instead of p/q."""
    return torch.rand(k + 1, generator=generator, dtype=torch.float64)


def residual_distribution(target_row: torch.Tensor, draft_row: torch.Tensor) -> torch.Tensor:
    """max(0, p - q) over [vocab], unnormalised (`sample_index` scales by its total).

    The residual sums to zero only when p <= q everywhere, which for two distributions means p == q,
    where a rejection has probability zero; float rounding can still get here. The defined outcome is
    then to sample from p itself, which is the target's distribution either way.
    """
    residual = (target_row - draft_row).clamp_min(0.0)  # [vocab]
    return residual if residual.sum() > 0 else target_row


def acceptance_probability(draft_prob: float, target_prob: float) -> float:
    """min(1, p(x) / q(x)): how likely speculative sampling keeps a draft token x sampled from q (a
    token q never samples, q(x) = 0, is never kept)."""
    return min(1.0, target_prob / draft_prob) if draft_prob > 0 else 0.0


@dataclass(frozen=True)
class SampledRound:
    """One sampled round's inputs to accept/reject."""

    draft_token_ids: torch.Tensor  # [k] int
    draft_probs: torch.Tensor  # [k, vocab] float32: q, the rows the draft tokens were sampled from
    target_probs: torch.Tensor  # [k + 1, vocab] float32: p at the same positions, plus the bonus row
    uniforms: torch.Tensor  # [k + 1] float64 (`draw_uniforms`)


def verify_sampled(round_: SampledRound) -> Verdict:
    """Standard speculative sampling (Leviathan et al. 2023; Chen et al. 2023): the committed tokens
    are distributed exactly as the target alone would sample them. The definition that the path the
    wire takes (`compact_round`, `last_tokens`) is tested against, row by row."""
    ids, draft_probs, target_probs, uniforms = (
        round_.draft_token_ids.long(),
        round_.draft_probs,
        round_.target_probs,
        round_.uniforms,
    )
    k = ids.numel()
    positions = torch.arange(k)
    # p(x) and q(x) > 0 (each x was sampled from q)
    num_accepted = first_rejection(target_probs[positions, ids], draft_probs[positions, ids], uniforms)
    if num_accepted < k:
        last_row = residual_distribution(target_probs[num_accepted], draft_probs[num_accepted])
    else:
        last_row = target_probs[k]
    last_token = int(sample_index(last_row, uniforms[k : k + 1]))
    output = [*ids[:num_accepted].tolist(), last_token]
    return Verdict(output_token_ids=output, num_accepted=num_accepted, num_drafted=k)


@dataclass(frozen=True)
class CompactRound:
    """A sampled round as the wire carries it (docs/design.md, "Sampled rounds"): the first rejection,
    found from the draft tokens' p(x) and q(x) scalars with the round's uniforms (`first_rejection`), and
    the rows its last token needs: p at that position and, after a rejection, q there."""

    draft_token_ids: list[int]  # [k]
    num_accepted: int
    target_row: torch.Tensor  # [vocab] float32: p at position num_accepted
    draft_row: torch.Tensor | None  # [vocab] float32: q there, after a rejection (None: all accepted)
    uniform: float  # the round's last uniform, for the recovered or bonus token


def compact_round(round_: SampledRound) -> CompactRound:
    """What the wire carries of a round whose rows are all at hand (the stand-in services of tests)."""
    ids = round_.draft_token_ids.long()
    positions = torch.arange(ids.numel())
    j = first_rejection(round_.target_probs[positions, ids], round_.draft_probs[positions, ids], round_.uniforms)
    draft_row = round_.draft_probs[j] if j < ids.numel() else None
    return CompactRound(ids.tolist(), j, round_.target_probs[j], draft_row, float(round_.uniforms[ids.numel()]))


def last_tokens(rounds: Sequence[CompactRound]) -> list[Verdict]:
    """The verdicts of many rounds whose first rejections are known: every round's recovered or bonus
    token sampled together, in one pass of tensor operations (the shape of vLLM's rejection sampler).
    Each round samples with its own uniform, so its verdict is the one `verify_sampled` gives it alone."""
    if not rounds:
        return []
    target = torch.stack([r.target_row for r in rounds])  # [R, vocab]
    draft = torch.stack([r.draft_row if r.draft_row is not None else torch.zeros_like(r.target_row) for r in rounds])
    # p less q at a rejection (the residual); p itself for a bonus token, and for a residual that is
    # all zero (`residual_distribution`).
    residual = (target - draft).clamp_min(0.0)
    empty = residual.sum(-1) <= 0
    residual[empty] = target[empty]
    uniforms = torch.tensor([r.uniform for r in rounds], dtype=torch.float64)
    tokens = sample_index(residual, uniforms[:, None]).tolist()
    return [
        Verdict([*r.draft_token_ids[: r.num_accepted], token], r.num_accepted, len(r.draft_token_ids))
        for r, token in zip(rounds, tokens, strict=True)
    ]
