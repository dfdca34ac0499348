"""Logits processing: temperature, top-k, top-p, applied identically on both sides."""

from __future__ import annotations

import pytest
import torch

from serving.errors import ServiceError
from serving.logits import logits_to_probs
from serving.sampling import SamplingParams


def test_temperature_one_is_softmax():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    assert torch.allclose(logits_to_probs(logits, SamplingParams(temperature=1.0)), logits.softmax(-1))


def test_temperature_sharpens():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    cold = logits_to_probs(logits, SamplingParams(temperature=0.5))
    assert torch.allclose(cold, (logits / 0.5).softmax(-1))


def test_top_k_keeps_k_tokens():
    probs = logits_to_probs(torch.tensor([[0.1, 3.0, 2.0, -1.0, 2.5]]), SamplingParams(temperature=1.0, top_k=2))
    assert (probs > 0).sum() == 2
    assert probs[0, 1] > 0 and probs[0, 4] > 0
    assert torch.isclose(probs.sum(), torch.tensor(1.0))


@pytest.mark.parametrize(
    ("top_p", "kept"),
    [(0.5, {0}), (0.6, {0, 1}), (0.8, {0, 1}), (0.81, {0, 1, 2}), (1.0, {0, 1, 2, 3})],
)
def test_top_p_keeps_smallest_set_reaching_mass(top_p: float, kept: set[int]):
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=top_p))
    assert {int(i) for i in (probs[0] > 0).nonzero().flatten()} == kept


def test_greedy_forms_no_rows():
    with pytest.raises(ValueError):
        logits_to_probs(torch.zeros(1, 3), SamplingParams())


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (SamplingParams(temperature=-0.1), "temperature"),
        (SamplingParams(temperature=float("nan")), "temperature"),
        (SamplingParams(temperature=1.0, top_p=0.0), "top_p"),
        (SamplingParams(temperature=1.0, top_p=1.5), "top_p"),
        (SamplingParams(temperature=1.0, top_k=-1), "top_k"),
    ],
)
def test_bad_params_name_the_field(params: SamplingParams, field: str):
    with pytest.raises(ServiceError) as error:
        params.validated()
    assert field in error.value.message


def test_top_k_keeps_exactly_k_among_ties():
    probs = logits_to_probs(torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.0]]), SamplingParams(temperature=1.0, top_k=2))
    assert int((probs > 0).sum()) == 2


def test_tiny_temperature_is_greedy_and_extremes_stay_finite():
    assert SamplingParams(temperature=1e-40).validated().greedy
    assert not SamplingParams(temperature=1e-5).greedy
    logits = torch.tensor([[3e4, -3e4, 0.0]])
    for temperature in (1e-5, 100.0):
        probs = logits_to_probs(logits, SamplingParams(temperature=temperature))
        assert torch.isfinite(probs).all() and torch.isclose(probs.sum(), torch.tensor(1.0))


def test_every_bit_of_the_seed_counts():
    from serving.sampling import seeded_generator

    draws = {
        tuple(torch.rand(4, generator=seeded_generator(seed)).tolist()) for seed in (1, 1 + (1 << 32), 1 + (1 << 63))
    }
    assert len(draws) == 3
    assert torch.equal(torch.rand(4, generator=seeded_generator(7)), torch.rand(4, generator=seeded_generator(7)))
