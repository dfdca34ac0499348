"""bench/sim_pair.py: the simulated-device pair agrees like the trained default pair, and its unrelated
draft as chance does. Each statistic is held within 0.15 of the trained pair's on the same held-out
prompts, the two conditional agreement rates within 0.2: they rest on the few dozen positions where the
draft disagrees, and move by about that between samples of the trained pair itself."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from bench.sim_pair import DEFAULT_PAIR, _prompts, agreement, build_sim_pair

TOLERANCE = 0.15
CONDITIONAL_TOLERANCE = 0.2


@pytest.fixture(scope="module")
def statistics(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    folder = build_sim_pair(tmp_path_factory.mktemp("sim") / "pair")
    prompts = _prompts(6)

    def load(path: Path) -> LlamaForCausalLM:
        return LlamaForCausalLM.from_pretrained(path).eval()

    torch.manual_seed(0)
    return {
        "trained": agreement(load(DEFAULT_PAIR / "target"), load(DEFAULT_PAIR / "draft"), prompts, n=32),
        "agreeing": agreement(load(folder / "target"), load(folder / "draft"), prompts, n=32),
        "unrelated": agreement(load(folder / "target"), load(folder / "unrelated"), prompts, n=32),
    }


def flat(stats: dict) -> dict[str, float]:
    out: dict[str, float] = {}
    for key, value in stats.items():
        for index, item in enumerate(value if isinstance(value, list) else [value]):
            out[f"{key}[{index}]"] = item
    return out


def test_the_agreeing_draft_agrees_like_the_trained_pair(statistics: dict[str, dict]) -> None:
    trained, cheap = flat(statistics["trained"]), flat(statistics["agreeing"])
    far = {
        key: (trained[key], cheap[key])
        for key in trained
        if abs(trained[key] - cheap[key]) > (CONDITIONAL_TOLERANCE if key.startswith("agree_after") else TOLERANCE)
    }
    assert not far, far


def test_the_unrelated_draft_agrees_as_chance_does(statistics: dict[str, dict]) -> None:
    unrelated = statistics["unrelated"]
    assert unrelated["draft_covers_target_top1_top2_top4"][2] < 0.05
    assert unrelated["acceptance_k4_greedy"] < 0.05
