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


def sample_index(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: per row of `weights` ([..., vocab], non-negative, any total), the token
    whose cumulative float64 weight first exceeds uniform * total. A token of weight 0 is never chosen
    (its cumulative weight equals the one before)."""
    cumulative = weights.double().cumsum(-1)  # [..., vocab]
    point = uniform * cumulative[..., -1:]  # [..., 1]
    index = torch.searchsorted(cumulative, point, right=True)
    return index.clamp_max(weights.shape[-1] - 1)[..., 0]


def acceptance_probability(
    token: int,
    draft_row: torch.Tensor,  # [vocab] float32: q, the draft's distribution the token was sampled from
    target_row: torch.Tensor,  # [vocab] float32: p, the target's at the same position
) -> float:
    """min(1, p(token) / q(token)): how likely speculative sampling keeps a draft token."""
    draft_prob = float(draft_row[token])
    return min(1.0, float(target_row[token]) / draft_prob) if draft_prob > 0 else 0.0


@dataclass(frozen=True)
class SampledRound:
    """One sampled round's inputs to accept/reject."""

    draft_token_ids: torch.Tensor  # [k] int
    draft_probs: torch.Tensor  # [k, vocab] float32: q, the rows the draft tokens were sampled from
    target_probs: torch.Tensor  # [k + 1, vocab] float32: p at the same positions, plus the bonus row
    uniforms: torch.Tensor  # [k + 1] float64 (`draw_uniforms`)


def verify_sampled(round_: SampledRound) -> Verdict:
    """Standard speculative sampling (Leviathan et al. 2023; Chen et al. 2023): the committed tokens
    are distributed exactly as the target alone would sample them. The definition that the batched
    path (`verify_sampled_batch`) is tested against, row by row."""
    ids, draft_probs, target_probs, uniforms = (
        round_.draft_token_ids.long(),
        round_.draft_probs,
        round_.target_probs,
        round_.uniforms,
    )
    k = ids.numel()
    positions = torch.arange(k)
    target_of_draft = target_probs[positions, ids]  # [k] p(x)
    draft_of_draft = draft_probs[positions, ids]  # [k] q(x) > 0: each x was sampled from q
    # u < p/q, written without a division; accepts with probability min(1, p/q).
    accepted = uniforms[:k] * draft_of_draft.double() < target_of_draft.double()  # [k] bool
    rejected = (~accepted).nonzero()
    num_accepted = int(rejected[0, 0]) if rejected.numel() else k
    if num_accepted < k:
        last_row = residual_distribution(target_probs[num_accepted], draft_probs[num_accepted])
    else:
        last_row = target_probs[k]
    last_token = int(sample_index(last_row, uniforms[k : k + 1]))
    output = [*ids[:num_accepted].tolist(), last_token]
    return Verdict(output_token_ids=output, num_accepted=num_accepted, num_drafted=k)


def verify_sampled_batch(rounds: Sequence[SampledRound]) -> list[Verdict]:
    """`verify_sampled` over many rounds (of any k, 0 included) in one pass of tensor operations, in
    the shape of vLLM's rejection sampler: the draft positions of every round flattened into one
    vector, the first rejection of each round by a segmented minimum, and every round's recovered or
    bonus row sampled together. Each round decides with its own uniforms, so its verdict is the one
    `verify_sampled` gives it alone."""
    if not rounds:
        return []
    ks = torch.tensor([r.draft_token_ids.numel() for r in rounds])  # [R]
    count = len(rounds)
    ids = torch.cat([r.draft_token_ids.long() for r in rounds])  # [N]
    # Every round's k + 1 target rows in one [N + R, vocab] tensor; round i's rows start at starts[i].
    target = torch.cat([r.target_probs for r in rounds])
    starts = torch.cumsum(ks + 1, 0) - (ks + 1)  # [R]
    round_of = torch.repeat_interleave(torch.arange(count), ks)  # [N]
    position = torch.arange(ids.numel()) - torch.repeat_interleave(starts - torch.arange(count), ks)  # [N]
    target_rows = starts[round_of] + position  # [N]: the target row of each draft position
    draft = torch.cat([r.draft_probs for r in rounds]) if ids.numel() else target[:0]  # [N, vocab]
    uniforms = torch.cat([r.uniforms for r in rounds])  # [N + R]
    flat = torch.arange(ids.numel())
    accepted = uniforms[target_rows] * draft[flat, ids].double() < target[target_rows, ids].double()  # [N]
    rejected = ~accepted
    num_accepted = ks.clone().scatter_reduce(0, round_of[rejected], position[rejected], "amin")  # [R]
    # The row each round samples its last token from: p at the first rejection less q there (the
    # residual), or p's bonus row; a residual that is all zero falls back to p (`residual_distribution`).
    last_target = target[starts + num_accepted]  # [R, vocab]
    last_draft = torch.zeros_like(last_target)
    was_rejected = num_accepted < ks
    if bool(was_rejected.any()):
        draft_starts = torch.cumsum(ks, 0) - ks
        last_draft[was_rejected] = draft[(draft_starts + num_accepted)[was_rejected]]
    residual = (last_target - last_draft).clamp_min(0.0)
    empty = residual.sum(-1) <= 0
    residual[empty] = last_target[empty]
    last_tokens = sample_index(residual, uniforms[starts + ks][:, None]).tolist()
    verdicts = []
    for i, (k, accepted_count) in enumerate(zip(ks.tolist(), num_accepted.tolist(), strict=True)):
        output = [*rounds[i].draft_token_ids[:accepted_count].tolist(), last_tokens[i]]
        verdicts.append(Verdict(output_token_ids=output, num_accepted=accepted_count, num_drafted=k))
    return verdicts
