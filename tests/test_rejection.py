"""The accept/reject step on hand-made rows: greedy table, seeded determinism, distributions."""

from __future__ import annotations

import pytest
import torch
from scipy import stats

from orchestrator.rejection import residual_distribution, verify_greedy, verify_sampled


@pytest.mark.parametrize(
    ("draft", "target_argmax", "expected_output", "expected_accepted"),
    [
        ([], [7], [7], 0),  # K = 0: the target alone
        ([1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 4], 3),  # all accepted, bonus 4
        ([1, 2, 3], [9, 2, 3, 4], [9], 0),  # first rejected, recovered 9
        ([1, 2, 3], [1, 9, 3, 4], [1, 9], 1),  # a later match after a rejection does not count
        ([1, 2, 3], [1, 2, 9, 4], [1, 2, 9], 2),
        ([5], [5, 6], [5, 6], 1),
        ([5], [6, 6], [6], 0),
    ],
)
def test_greedy_table(draft: list[int], target_argmax: list[int], expected_output: list[int], expected_accepted: int):
    verdict = verify_greedy(draft, target_argmax)
    assert verdict.output_token_ids == expected_output
    assert verdict.num_accepted == expected_accepted
    assert verdict.num_drafted == len(draft)
    assert verdict.all_accepted == (expected_accepted == len(draft))


def _rows(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def test_sampled_identical_distributions_always_accept():
    probs = _rows([0.2, 0.3, 0.5], [0.6, 0.2, 0.2])
    target = torch.cat([probs, _rows([0.0, 0.0, 1.0])])
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        verdict = verify_sampled(torch.tensor([1, 0]), probs, target, generator)
        assert verdict.num_accepted == 2
        assert verdict.output_token_ids == [1, 0, 2]  # bonus from the one-hot last row


def test_sampled_rejects_tokens_the_target_never_produces():
    draft_probs = _rows([0.5, 0.5, 0.0])
    target = _rows([0.0, 0.2, 0.8], [1.0, 0.0, 0.0])
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        verdict = verify_sampled(torch.tensor([0]), draft_probs, target, generator)
        assert verdict.num_accepted == 0
        # residual = norm(max(0, p - q)) = [0, 0, 0.8] / 0.8: only token 2
        assert verdict.output_token_ids == [2]


def test_zero_residual_falls_back_to_target_row():
    row = _rows([0.25, 0.25, 0.5])[0]
    assert torch.equal(residual_distribution(row, row), row)
    nonzero = residual_distribution(_rows([0.5, 0.5, 0.0])[0], _rows([0.0, 1.0, 0.0])[0])
    assert torch.allclose(nonzero, torch.tensor([1.0, 0.0, 0.0]))


def test_same_generator_seed_same_verdicts():
    torch.manual_seed(1)
    draft_probs = torch.softmax(torch.randn(4, 10), -1)
    target = torch.softmax(torch.randn(5, 10), -1)
    draft = torch.multinomial(draft_probs, 1).squeeze(1)

    def run(seed: int) -> list[list[int]]:
        generator = torch.Generator().manual_seed(seed)
        return [verify_sampled(draft, draft_probs, target, generator).output_token_ids for _ in range(50)]

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_one_step_output_follows_target_distribution():
    """First output token over many draws of (draft token, verdict): distributed as p, not q."""
    vocab = 6
    torch.manual_seed(3)
    draft_row = torch.softmax(torch.randn(vocab) * 1.5, -1)
    target_row = torch.softmax(torch.randn(vocab) * 1.5, -1)
    target = torch.stack([target_row, torch.full((vocab,), 1.0 / vocab)])
    generator = torch.Generator().manual_seed(11)
    samples = 30_000
    draft_tokens = torch.multinomial(draft_row, samples, replacement=True, generator=generator)
    counts = torch.zeros(vocab)
    for token in draft_tokens.tolist():
        verdict = verify_sampled(torch.tensor([token]), draft_row[None], target, generator)
        counts[verdict.output_token_ids[0]] += 1
    result = stats.chisquare(counts.numpy(), (target_row * samples).numpy())
    assert result.pvalue > 0.01, (counts / samples, target_row)


def test_acceptance_probability_is_min_one_p_over_q():
    from orchestrator.rejection import acceptance_probability

    draft_row = torch.tensor([0.5, 0.25, 0.25, 0.0])
    target_row = torch.tensor([0.25, 0.5, 0.25, 0.0])
    assert acceptance_probability(0, draft_row, target_row) == 0.5
    assert acceptance_probability(1, draft_row, target_row) == 1.0
    assert acceptance_probability(2, draft_row, target_row) == 1.0
    assert acceptance_probability(3, draft_row, target_row) == 0.0  # never sampled from q
