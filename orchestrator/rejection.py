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


def residual_distribution(target_row: torch.Tensor, draft_row: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) over [vocab].

    The residual sums to zero only when p <= q everywhere, which for two distributions means p == q,
    where a rejection has probability zero; float rounding can still get here. The defined outcome is
    then to sample from p itself, which is the target's distribution either way.
    """
    residual = (target_row - draft_row).clamp_min(0.0)  # [vocab]
    total = residual.sum()
    if total <= 0:
        return target_row
    return residual / total


def acceptance_probability(
    token: int,
    draft_row: torch.Tensor,  # [vocab] float32: q, the draft's distribution the token was sampled from
    target_row: torch.Tensor,  # [vocab] float32: p, the target's at the same position
) -> float:
    """min(1, p(token) / q(token)): how likely speculative sampling keeps a draft token."""
    draft_prob = float(draft_row[token])
    return min(1.0, float(target_row[token]) / draft_prob) if draft_prob > 0 else 0.0


def verify_sampled(
    draft_token_ids: torch.Tensor,  # [k] int
    draft_probs: torch.Tensor,  # [k, vocab] float32: q, the rows the draft tokens were sampled from
    target_probs: torch.Tensor,  # [k + 1, vocab] float32: p at the same positions, plus the bonus row
    generator: torch.Generator,
) -> Verdict:
    """Standard speculative sampling (Leviathan et al. 2023; Chen et al. 2023): the committed tokens
    are distributed exactly as the target alone would sample them."""
    k = draft_token_ids.numel()
    positions = torch.arange(k)
    ids = draft_token_ids.long()
    target_of_draft = target_probs[positions, ids]  # [k] p(x)
    draft_of_draft = draft_probs[positions, ids]  # [k] q(x) > 0: each x was sampled from q
    # float64: a float32 uniform is a multiple of 2^-24, which would accept any p/q below that with
    # probability 2^-24 instead of p/q.
    uniform = torch.rand(k, generator=generator, dtype=torch.float64)  # [k]
    # u < p/q, written without a division; accepts with probability min(1, p/q).
    accepted = uniform * draft_of_draft.double() < target_of_draft.double()  # [k] bool
    rejected = (~accepted).nonzero()
    num_accepted = int(rejected[0, 0]) if rejected.numel() else k
    if num_accepted < k:
        last_row = residual_distribution(target_probs[num_accepted], draft_probs[num_accepted])
    else:
        last_row = target_probs[k]
    last_token = int(torch.multinomial(last_row, 1, generator=generator))
    output = [*ids[:num_accepted].tolist(), last_token]
    return Verdict(output_token_ids=output, num_accepted=num_accepted, num_drafted=k)
