"""Summaries of the benchmark's samples: medians of interleaved repetitions, ratios within a repetition,
the theoretical bound, a table, JSON and PNG plots."""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.runs import Config, Sample

BASELINE = "target alone"


@dataclass
class Row:
    """One configuration in one mode, summarised."""

    config: str
    mode: str
    k: int
    tokens_per_second: float  # median over repetitions
    tokens_per_second_min: float
    tokens_per_second_max: float
    speedup: float  # median over repetitions of (this / target alone), same repetition
    vs_hf: float | None = None  # same, against the matching Hugging Face assisted row
    vs_bound: float | None = None  # speedup / theoretical bound speedup
    bound_speedup: float | None = None
    acceptance_rate: float | None = None  # accepted / drafted
    acceptance_length: float | None = None  # tokens per drafted round, bonus or recovered included
    draft_ms_per_round: float | None = None
    target_ms_per_round: float | None = None
    overhead_ms_per_round: float | None = None  # wall-clock minus draft and target compute
    wire_bytes_per_round: float | None = None
    per_position_acceptance: list[float] = field(default_factory=list)
    ngram_share: float | None = None  # of drafted tokens, those the prompt lookup proposed
    ngram_acceptance: float | None = None  # accepted / drafted, lookup tokens only
    model_acceptance: float | None = None  # accepted / drafted, draft-model tokens only
    exact: bool | None = None  # greedy: token ids equal to the target alone on every prompt


def _per_rep(samples: list[Sample]) -> dict[int, float]:
    by_rep: dict[int, list[Sample]] = defaultdict(list)
    for sample in samples:
        by_rep[sample.repetition].append(sample)
    return {rep: sum(s.tokens for s in ss) / sum(s.seconds for s in ss) for rep, ss in by_rep.items()}


def _median_ratio(numerator: dict[int, float], denominator: dict[int, float]) -> float:
    return statistics.median(numerator[r] / denominator[r] for r in numerator if denominator.get(r))


def _hf_match(config: Config, configs: list[Config]) -> Config | None:
    if config.kind != "specdec":
        return None
    for other in configs:
        if other.kind == "hf" and other.k == config.k and other.k and other.policy == config.policy:
            return other
    return None


def summarise(samples: list[Sample], configs: list[Config]) -> list[Row]:
    grouped: dict[tuple[str, str], list[Sample]] = defaultdict(list)
    for sample in samples:
        grouped[(sample.mode, sample.config)].append(sample)
    rows: list[Row] = []
    for mode in sorted({s.mode for s in samples}):
        baseline = grouped.get((mode, BASELINE), [])
        baseline_rates = _per_rep(baseline)
        target_one = sum(s.target_seconds for s in baseline) / max(1, sum(s.rounds for s in baseline))
        reference = {(s.prompt, s.repetition): s.token_ids for s in baseline}
        for config in configs:
            these = grouped.get((mode, config.name))
            if not these:
                continue
            rates = _per_rep(these)
            values = list(rates.values())
            row = Row(
                config=config.name,
                mode=mode,
                k=config.k,
                tokens_per_second=statistics.median(values),
                tokens_per_second_min=min(values),
                tokens_per_second_max=max(values),
                speedup=_median_ratio(rates, baseline_rates) if baseline_rates else float("nan"),
            )
            match = _hf_match(config, configs)
            if match and (mode, match.name) in grouped:
                row.vs_hf = _median_ratio(rates, _per_rep(grouped[(mode, match.name)]))
            if mode == "greedy" and reference:
                row.exact = all(reference.get((s.prompt, s.repetition)) == s.token_ids for s in these)
            rounds = sum(s.rounds for s in these)
            if config.kind != "hf" and rounds:
                seconds = sum(s.seconds for s in these)
                draft = sum(s.draft_seconds for s in these)
                target = sum(s.target_seconds for s in these)
                row.draft_ms_per_round = 1e3 * draft / rounds
                row.target_ms_per_round = 1e3 * target / rounds
                row.overhead_ms_per_round = 1e3 * (seconds - draft - target) / rounds
                row.wire_bytes_per_round = sum(s.wire_bytes for s in these) / rounds
            drafted = sum(s.draft_tokens for s in these)
            draft_rounds = sum(s.draft_rounds for s in these)
            if drafted and draft_rounds:
                accepted = sum(s.accepted_tokens for s in these)
                row.acceptance_rate = accepted / drafted
                row.acceptance_length = (accepted + draft_rounds) / draft_rounds
                width = max(len(s.accepted_per_position) for s in these)
                totals = [
                    sum(s.accepted_per_position[i] for s in these if i < len(s.accepted_per_position))
                    for i in range(width)
                ]
                row.per_position_acceptance = [t / draft_rounds for t in totals]
                looked_up = sum(s.ngram_draft_tokens for s in these)
                looked_up_accepted = sum(s.ngram_accepted_tokens for s in these)
                row.ngram_share = looked_up / drafted
                if looked_up:
                    row.ngram_acceptance = looked_up_accepted / looked_up
                if drafted > looked_up:
                    row.model_acceptance = (accepted - looked_up_accepted) / (drafted - looked_up)
                if config.policy == "fixed" and not config.overlap and target_one > 0 and row.target_ms_per_round:
                    # Leviathan et al.: E / (K c + v(K)), from the measured forward costs.
                    cost_ratio = (draft / drafted) / target_one
                    verify_cost = (target / rounds) / target_one
                    row.bound_speedup = row.acceptance_length / (config.k * cost_ratio + verify_cost)
                    row.vs_bound = row.speedup / row.bound_speedup
            rows.append(row)
    return rows


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(rows: list[Row]) -> str:
    header = (
        f"{'mode':<9}{'config':<27}{'tok/s':>8}{'range':>14}{'x base':>8}{'x HF':>7}{'x bound':>8}"
        f"{'accept':>8}{'model':>7}{'ngram':>7}{'len':>6}{'draft ms':>9}{'target ms':>10}{'other ms':>9}"
        f"{'B/round':>9}{'exact':>7}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r.mode:<9}{r.config:<27}{r.tokens_per_second:>8.1f}"
            f"{f'{r.tokens_per_second_min:.0f}-{r.tokens_per_second_max:.0f}':>14}"
            f"{r.speedup:>8.2f}{_fmt(r.vs_hf, '.2f'):>7}{_fmt(r.vs_bound, '.2f'):>8}"
            f"{_fmt(r.acceptance_rate, '.3f'):>8}{_fmt(r.model_acceptance, '.2f'):>7}"
            f"{_fmt(r.ngram_acceptance, '.2f'):>7}{_fmt(r.acceptance_length, '.2f'):>6}"
            f"{_fmt(r.draft_ms_per_round, '.2f'):>9}{_fmt(r.target_ms_per_round, '.2f'):>10}"
            f"{_fmt(r.overhead_ms_per_round, '.2f'):>9}{_fmt(r.wire_bytes_per_round, '.0f'):>9}"
            f"{'-' if r.exact is None else ('yes' if r.exact else 'NO'):>7}"
        )
    return "\n".join(lines)


def _save(fig: Any, ax: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot(rows: list[Row], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written: list[Path] = []
    modes = sorted({r.mode for r in rows})
    fixed = {
        m: sorted(
            (r for r in rows if r.mode == m and r.config.startswith("specdec K=") and "overlap" not in r.config),
            key=lambda r: r.k,
        )
        for m in modes
    }

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode in modes:
        line = ax.plot(
            [r.k for r in fixed[mode]],
            [r.tokens_per_second for r in fixed[mode]],
            marker="o",
            label=f"specdec ({mode})",
        )
        base = next((r for r in rows if r.mode == mode and r.config == BASELINE), None)
        if base:
            ax.axhline(
                base.tokens_per_second,
                linestyle="--",
                color=line[0].get_color(),
                alpha=0.6,
                label=f"target alone ({mode})",
            )
        hf = next((r for r in rows if r.mode == mode and r.config == "HF assisted K=4"), None)
        if hf:
            ax.scatter(
                [4],
                [hf.tokens_per_second],
                marker="x",
                s=80,
                color=line[0].get_color(),
                label=f"HF assisted K=4 ({mode})",
            )
    ax.set(xlabel="K (draft tokens per round)", ylabel="tokens / s", title="Throughput against K")
    written.append(_save(fig, ax, out / "tokens_per_second_vs_k.png"))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode in modes:
        widest = max(fixed[mode], key=lambda r: r.k, default=None)
        if widest and widest.per_position_acceptance:
            positions = range(1, len(widest.per_position_acceptance) + 1)
            ax.plot(positions, widest.per_position_acceptance, marker="o", label=f"{widest.config} ({mode})")
    ax.set(xlabel="draft position", ylabel="share of rounds accepted", ylim=(0, 1), title="Acceptance by position")
    written.append(_save(fig, ax, out / "per_position_acceptance.png"))

    split = [r for r in rows if r.mode == modes[0] and r.draft_ms_per_round is not None]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    names = [r.config.replace("specdec ", "") for r in split]
    draft = [r.draft_ms_per_round or 0.0 for r in split]
    target = [r.target_ms_per_round or 0.0 for r in split]
    other = [max(0.0, r.overhead_ms_per_round or 0.0) for r in split]
    ax.bar(names, draft, label="draft compute")
    ax.bar(names, target, bottom=draft, label="target compute")
    ax.bar(names, other, bottom=[d + t for d, t in zip(draft, target, strict=True)], label="everything else")
    ax.set(ylabel="ms per round", title=f"Time per round ({modes[0]})")
    ax.tick_params(axis="x", rotation=45)
    written.append(_save(fig, ax, out / "time_split_per_round.png"))
    return written


def as_json(rows: list[Row]) -> list[dict[str, object]]:
    return [asdict(r) for r in rows]
