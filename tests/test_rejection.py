"""The accept/reject step on hand-made rows: greedy table, seeded determinism, distributions."""

from __future__ import annotations

import pytest
import torch
from scipy import stats

from orchestrator.rejection import (
    CompactRound,
    SampledRound,
    Verdict,
    compact_round,
    draw_uniforms,
    last_tokens,
    residual_distribution,
    verify_greedy,
    verify_sampled,
)
from serving.logits import logits_to_probs, rows_from_wire, rows_to_wire
from serving.sampling import SamplingParams
from specdec.v1 import target_pb2
from target_service.servicer import answer_sampled


def verify_seeded(
    ids: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor, generator: torch.Generator
) -> Verdict:
    """`verify_sampled` on a round whose uniforms come from `generator`, as a request draws them."""
    return verify_sampled(SampledRound(ids, draft_probs, target_probs, draw_uniforms(ids.numel(), generator)))


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
        verdict = verify_seeded(torch.tensor([1, 0]), probs, target, generator)
        assert verdict.num_accepted == 2
        assert verdict.output_token_ids == [1, 0, 2]  # bonus from the one-hot last row


def test_sampled_rejects_tokens_the_target_never_produces():
    draft_probs = _rows([0.5, 0.5, 0.0])
    target = _rows([0.0, 0.2, 0.8], [1.0, 0.0, 0.0])
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        verdict = verify_seeded(torch.tensor([0]), draft_probs, target, generator)
        assert verdict.num_accepted == 0
        # residual = norm(max(0, p - q)) = [0, 0, 0.8] / 0.8: only token 2
        assert verdict.output_token_ids == [2]


def test_zero_residual_falls_back_to_target_row():
    row = _rows([0.25, 0.25, 0.5])[0]
    assert torch.equal(residual_distribution(row, row), row)
    nonzero = residual_distribution(_rows([0.5, 0.5, 0.0])[0], _rows([0.0, 1.0, 0.0])[0])
    assert torch.equal(nonzero, torch.tensor([0.5, 0.0, 0.0]))  # unnormalised: sampling scales by the total


def test_same_generator_seed_same_verdicts():
    torch.manual_seed(1)
    draft_probs = torch.softmax(torch.randn(4, 10), -1)
    target = torch.softmax(torch.randn(5, 10), -1)
    draft = torch.multinomial(draft_probs, 1).squeeze(1)

    def run(seed: int) -> list[list[int]]:
        generator = torch.Generator().manual_seed(seed)
        return [verify_seeded(draft, draft_probs, target, generator).output_token_ids for _ in range(50)]

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
        verdict = verify_seeded(torch.tensor([token]), draft_row[None], target, generator)
        counts[verdict.output_token_ids[0]] += 1
    result = stats.chisquare(counts.numpy(), (target_row * samples).numpy())
    assert result.pvalue > 0.01, (counts / samples, target_row)


def test_acceptance_probability_is_min_one_p_over_q():
    from orchestrator.rejection import acceptance_probability

    assert acceptance_probability(0.5, 0.25) == 0.5
    assert acceptance_probability(0.25, 0.5) == 1.0
    assert acceptance_probability(0.25, 0.25) == 1.0
    assert acceptance_probability(0.0, 0.0) == 0.0  # never sampled from q


def _random_round(generator: torch.Generator, k: int, vocab: int, kind: str) -> SampledRound:
    """A round of k draft tokens: peaked or flat rows, p equal to q (a residual of zeros), or rows with
    zeros, the draft tokens sampled from q."""
    scale = {"peaked": 6.0, "flat": 0.3, "equal": 2.0, "sparse": 3.0}[kind]
    draft = torch.softmax(torch.randn(k, vocab, generator=generator) * scale, -1)
    target = torch.softmax(torch.randn(k + 1, vocab, generator=generator) * scale, -1)
    if kind == "equal":
        target[:k] = draft
    if kind == "sparse":
        target[:, : vocab // 2] = 0.0
        target /= target.sum(-1, keepdim=True)
    ids = torch.multinomial(draft, 1, generator=generator)[:, 0] if k else torch.empty(0, dtype=torch.long)
    return SampledRound(ids, draft, target, draw_uniforms(k, generator))


def test_the_batched_sampler_gives_every_round_the_verdict_it_gets_alone():
    """The definition is the per-round function: over batches of mixed k (0 included) and kinds of rows,
    every round's verdict from the path the wire takes (its first rejection from the scalars, its last
    tokens sampled over the batch) equals `verify_sampled`'s on that round."""
    generator = torch.Generator().manual_seed(5)
    kinds = ["peaked", "flat", "equal", "sparse"]
    rejections = 0
    for batch in range(40):
        rounds = [
            _random_round(generator, int(torch.randint(0, 7, (1,), generator=generator)), 37, kinds[(batch + i) % 4])
            for i in range(1 + batch % 9)
        ]
        batched = last_tokens([compact_round(round_) for round_ in rounds])
        alone = [verify_sampled(round_) for round_ in rounds]
        assert batched == alone
        rejections += sum(not verdict.all_accepted for verdict in alone)
    assert rejections > 20  # the residual rows were exercised, not only bonus rows
    assert last_tokens([]) == []


@pytest.mark.parametrize(
    ("dtype", "params"),
    [
        (torch.float32, SamplingParams(temperature=1.0)),
        (torch.bfloat16, SamplingParams(temperature=0.7)),
        (torch.float16, SamplingParams(temperature=1.3, top_k=9)),
        (torch.bfloat16, SamplingParams(temperature=1.0, top_p=0.8)),
    ],
)
def test_the_wire_material_decides_as_the_full_rows_do(dtype, params):
    """What travels (the target's `answer_sampled`: p(x), its first rejection, its one row as logits in
    the model's dtype; the draft's q(x) and its row at the rejection, as logits too) gives every round
    the verdict `verify_sampled` gives it from the full float32 rows of the same logits."""
    generator = torch.Generator().manual_seed(3)
    vocab, rejections = 61, 0
    for trial in range(60):
        k = trial % 5
        target_logits = (torch.randn(k + 1, vocab, generator=generator) * 3).to(dtype)
        draft_logits = (target_logits[:k].float() + torch.randn(k, vocab, generator=generator)).to(dtype)
        draft, target = logits_to_probs(draft_logits, params), logits_to_probs(target_logits, params)
        ids = torch.multinomial(draft, 1, generator=generator)[:, 0] if k else torch.empty(0, dtype=torch.long)
        uniforms = draw_uniforms(k, generator)
        context = torch.randint(0, vocab, (3,), generator=generator)
        request = target_pb2.VerifyRequest(
            append_token_ids=[*context.tolist(), *ids.tolist()],
            num_rows=k + 1,
            draft_token_probs=draft[torch.arange(k), ids].tolist(),
            uniforms=uniforms[:k].tolist(),
        )
        response = target_pb2.VerifyResponse()
        answer_sampled(response, target_logits, params, request)
        j = response.num_accepted
        draft_row = rows_from_wire(rows_to_wire(draft_logits[j : j + 1], params), params, vocab)[0] if j < k else None
        target_row = rows_from_wire(response.row, params, vocab)[0]
        assert torch.equal(target_row, target[j])  # the same function on the same logits
        wire = CompactRound(ids.tolist(), j, target_row, draft_row, float(uniforms[k]))
        alone = verify_sampled(SampledRound(ids, draft, target, uniforms))
        assert last_tokens([wire]) == [alone]
        rejections += not alone.all_accepted
    assert rejections > 10


def test_inverse_cdf_sampling_never_picks_a_zero_and_follows_the_row():
    from serving.logits import sample_index

    row = torch.tensor([0.0, 0.2, 0.0, 0.5, 0.3, 0.0])
    uniforms = torch.rand(60_000, 1, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    picks = sample_index(row.expand(60_000, -1), uniforms)
    counts = torch.bincount(picks, minlength=6)
    assert counts[[0, 2, 5]].sum() == 0
    assert stats.chisquare(counts[[1, 3, 4]].numpy(), (row[[1, 3, 4]] * 60_000).numpy()).pvalue > 0.01
    assert int(sample_index(row, torch.tensor([0.0], dtype=torch.float64))) == 1
    assert int(sample_index(row, torch.tensor([1 - 2**-53], dtype=torch.float64))) == 4


def test_rounds_ready_in_one_turn_are_decided_together_and_a_bad_one_fails_alone(monkeypatch):
    """The requests a link's answer wakes hand their rounds in over one turn of the event loop; the
    batch sampler decides them in one call. A round the batched call cannot take is decided alone, and
    only its request sees the error."""
    import asyncio

    from orchestrator import sampler as sampler_module
    from orchestrator.sampler import BatchSampler

    calls: list[int] = []
    real = sampler_module.last_tokens

    def counted(rounds: list[CompactRound]) -> list[Verdict]:
        calls.append(len(rounds))
        return real(rounds)

    monkeypatch.setattr(sampler_module, "last_tokens", counted)
    generator = torch.Generator().manual_seed(9)
    full = [_random_round(generator, k, 11, "peaked") for k in (0, 2, 4)]
    good = [compact_round(round_) for round_ in full]
    bad = CompactRound([3], 0, torch.ones(11) / 11, torch.ones(5) / 5, 0.5)  # rows of different widths

    async def run() -> list[object]:
        batch = BatchSampler()
        together = await asyncio.gather(*(batch.verdict(round_) for round_ in good))
        mixed = await asyncio.gather(*(batch.verdict(round_) for round_ in [*good, bad]), return_exceptions=True)
        return [together, mixed]

    together, mixed = asyncio.run(run())
    assert calls == [3, 4, 1, 1, 1, 1]  # one call per turn's rounds; the failed batch, round by round
    assert together == [verify_sampled(round_) for round_ in full]
    assert mixed[:3] == together and isinstance(mixed[3], Exception)  # type: ignore[index]
