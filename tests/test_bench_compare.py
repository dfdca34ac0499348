"""bench/compare.py: its statistics, and one round against HEAD end to end (slow)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from bench.compare import OTHER, THIS, Pair, main, summarise


def _pair(round_: int, concurrency: int, this: float, other: float) -> Pair:
    return Pair(round_, concurrency, "target alone (K = 0)", THIS, {THIS: this, OTHER: other},
                {THIS: 1 / this, OTHER: 1 / other}, 0)  # fmt: skip


def test_cells_take_the_median_ratio_and_the_interval_resamples_rounds():
    pairs = [_pair(r, 1, this, 100.0) for r, this in enumerate([90.0, 100.0, 130.0])]
    pairs += [_pair(r, 8, 200.0, 200.0) for r in range(3)]
    summary = summarise(pairs)
    cells = {row["concurrency"]: row for row in summary["cells"]}
    assert cells[1]["throughput"] == pytest.approx(1.0) and cells[1]["rounds"] == 3
    assert cells[8]["throughput"] == pytest.approx(1.0) and cells[8]["cpu"] == pytest.approx(1.0)
    overall = summary["overall"]
    expected = (0.9 * 1.0 * 1.3) ** (1 / 6)
    assert overall["throughput"] == pytest.approx(expected) and overall["cpu"] == pytest.approx(expected)
    low, high = overall["throughput_interval"]
    # Resampling whole rounds: the lowest mean draws round 0 three times, the highest round 2.
    assert 0.9**0.5 - 1e-9 <= low < expected < high <= 1.3**0.5 + 1e-9


def test_rounds_that_agree_give_a_point_interval():
    summary = summarise([_pair(r, c, 105.0, 100.0) for r in range(4) for c in (1, 8)])
    assert summary["overall"]["throughput_interval"] == pytest.approx((1.05, 1.05))
    assert summarise([_pair(0, 1, 105.0, 100.0)])["overall"]["throughput_interval"] is None


@pytest.mark.slow
def test_one_round_against_head_runs_both_trees_and_removes_its_worktree(tmp_path: Path):
    repo = Path(__file__).resolve().parent.parent
    args = ["--against", "HEAD", "--rounds", "1", "--concurrency", "1", "--only", "target alone (K = 0)",
            "--prompts", "2", "--max-new-tokens", "8", "--out", str(tmp_path)]  # fmt: skip
    assert main(args) == 0
    (result,) = tmp_path.glob("compare-2*.json")
    data = json.loads(result.read_text())
    (pair,) = data["pairs"]
    assert pair["tokens_per_second"][THIS] > 0 and pair["tokens_per_second"][OTHER] > 0
    assert pair["differing"] == 0  # the same code at one stream: the same greedy tokens
    worktrees = subprocess.run(["git", "-C", str(repo), "worktree", "list"], capture_output=True, text=True).stdout
    assert "specdec-compare-" not in worktrees
