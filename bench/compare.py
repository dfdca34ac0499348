"""`python -m bench.compare --against REV`: this tree's load table against another revision's, cell by cell.

    python -m bench.compare --against 0c9e924 [--rounds 12] [--concurrency 1,8,32]
    make compare-bench AGAINST=0c9e924        (default: HEAD, this working tree's changes)

Both stacks (the default pair, each placed as `python -m bench --placement pinned` places one) are up
at once, and all but one idle: every (concurrency, configuration) cell runs on one tree, then at once
on the other, the order alternating from cell to cell, so that a pair's two runs are seconds apart.
On this shared 2-core machine the speed drifts by tens of percent over minutes (other tenants' steal
time); load tables of the two trees run one after the other, minutes apart, gave ratios of one code
that moved from 0.94x to 1.08x between series of four or five pairs.

Reported per cell: the median over rounds of the pair's throughput ratio (this tree / the other), and
of its CPU seconds per token over the three processes (the other / this tree, so that above 1 is
faster for both); over all cells, the geometric mean with a bootstrap 95% interval that resamples
whole rounds (a round's cells share its moment's speed). The requests are greedy; those whose tokens
differ between the trees are counted per cell (batches of other widths may round near ties apart).

The other revision is checked out into a temporary git worktree (removed afterwards), its gRPC code
generated with this environment's grpc_tools, and its processes run with this interpreter from there,
on this tree's default pair: only the code differs. It must take the same service flags (`--threads`,
`--metrics-port`) and serve the same orchestrator API.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import random
import statistics
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from bench.load import LOAD_CONFIGS, PINNED, LoadConfig, LoadSample, requests_for, run_services_measured
from default_models.prompts import held_out_prompts
from tools.local_stack import DEFAULT_PAIR, LocalStack

THIS, OTHER = "this", "other"
CONFIGS = "target alone (K = 0),specdec load-aware,specdec fixed K = 2"
BOOTSTRAP = 2000


@dataclass
class Pair:
    """One cell of one round on both trees."""

    round: int
    concurrency: int
    config: str
    first: str  # the tree that ran first
    tokens_per_second: dict[str, float]
    cpu_per_token: dict[str, float]  # CPU seconds over the three processes, per token
    differing: int  # greedy requests whose tokens differ between the trees


def worktree(repo: Path, revision: str, into: Path) -> None:
    """`revision` checked out at `into`, with its gRPC code generated."""
    added = subprocess.run(
        ["git", "-C", str(repo), "worktree", "add", "--detach", str(into), revision], capture_output=True, text=True
    )
    if added.returncode:
        raise SystemExit(f"--against {revision}: git cannot check it out ({added.stderr.strip()}); name a commit")
    protos = sorted(str(path.relative_to(into)) for path in (into / "protos").rglob("*.proto"))
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I", "protos", "--python_out=.", "--grpc_python_out=.",
         "--pyi_out=.", *protos],
        cwd=into, check=True,
    )  # fmt: skip


def _run(stack: LocalStack, config: LoadConfig, prompts: list[list[int]], concurrency: int, rep: int,
         max_new_tokens: int) -> tuple[LoadSample, float]:  # fmt: skip
    """One cell on one stack: the sample and its CPU seconds per token over the stack's processes."""
    sample = run_services_measured(stack, config, requests_for(prompts, concurrency), concurrency, rep, max_new_tokens)
    return sample, sum(sample.cpu_seconds.values()) / max(1, sample.tokens)


def measure(stacks: dict[str, LocalStack], configs: list[LoadConfig], concurrencies: list[int], rounds: int,
            prompts: list[list[int]], max_new_tokens: int) -> list[Pair]:  # fmt: skip
    """Every configuration once at the first concurrency on each stack (warm-up), then `rounds` rounds of
    every cell on both stacks, the order alternating from cell to cell."""
    for stack in stacks.values():
        for config in configs:
            _run(stack, config, prompts, concurrencies[0], 0, max_new_tokens)
    pairs: list[Pair] = []
    for rep in range(rounds):
        for concurrency in concurrencies:
            for config in configs:
                order = [THIS, OTHER] if len(pairs) % 2 == 0 else [OTHER, THIS]
                runs = {tree: _run(stacks[tree], config, prompts, concurrency, rep, max_new_tokens) for tree in order}
                outputs = {tree: Counter(map(tuple, sample.token_ids)) for tree, (sample, _) in runs.items()}
                pairs.append(
                    Pair(
                        rep, concurrency, config.name, order[0],
                        {tree: sample.tokens_per_second for tree, (sample, _) in runs.items()},
                        {tree: cpu for tree, (_, cpu) in runs.items()},
                        sum((outputs[THIS] - outputs[OTHER]).values()),
                    )
                )  # fmt: skip
        print(f"round {rep + 1} of {rounds} done", flush=True)
    return pairs


def geomean(values: Sequence[float]) -> float:
    return math.exp(sum(math.log(value) for value in values) / len(values))


def interval(by_round: dict[int, list[float]], seed: int = 0) -> tuple[float, float]:
    """A bootstrap 95% interval of the geometric mean over all ratios, resampling whole rounds."""
    rng = random.Random(seed)
    rounds = list(by_round.values())
    means = sorted(
        geomean([ratio for chosen in rng.choices(rounds, k=len(rounds)) for ratio in chosen]) for _ in range(BOOTSTRAP)
    )
    return means[int(0.025 * BOOTSTRAP)], means[int(0.975 * BOOTSTRAP) - 1]


def summarise(pairs: list[Pair]) -> dict[str, Any]:
    """Per cell the median ratios, over all the geometric means and their intervals (see the docstring)."""
    ratios = {
        "throughput": lambda p: p.tokens_per_second[THIS] / p.tokens_per_second[OTHER],
        "cpu": lambda p: p.cpu_per_token[OTHER] / p.cpu_per_token[THIS],
    }
    cells: dict[tuple[int, str], list[Pair]] = {}
    for pair in pairs:
        cells.setdefault((pair.concurrency, pair.config), []).append(pair)
    rows = [
        {
            "concurrency": concurrency,
            "config": config,
            "rounds": len(group),
            **{name: statistics.median(ratio(p) for p in group) for name, ratio in ratios.items()},
            "differing": sum(p.differing for p in group),
        }
        for (concurrency, config), group in cells.items()
    ]
    overall: dict[str, Any] = {"pairs": len(pairs)}
    for name, ratio in ratios.items():
        by_round: dict[int, list[float]] = {}
        for pair in pairs:
            by_round.setdefault(pair.round, []).append(ratio(pair))
        overall[name] = geomean([ratio(p) for p in pairs])
        overall[f"{name}_interval"] = interval(by_round) if len(by_round) > 1 else None
    return {"cells": rows, "overall": overall}


def table(summary: dict[str, Any], against: str) -> str:
    lines = [
        f"this tree / {against}: medians over rounds of each pair's ratio (above 1: this tree faster)",
        "",
        "| streams | configuration | rounds | throughput | CPU a token | greedy requests differing |",
        "|---|---|---|---|---|---|",
    ]
    for row in summary["cells"]:
        lines.append(
            f"| {row['concurrency']} | {row['config']} | {row['rounds']} | {row['throughput']:.3f}x | "
            f"{row['cpu']:.3f}x | {row['differing']} |"
        )
    overall = summary["overall"]
    for name in ("throughput", "cpu"):
        low_high = overall[f"{name}_interval"]
        spread = f", 95% interval {low_high[0]:.3f}x-{low_high[1]:.3f}x" if low_high else ""
        lines.append(f"\n{name}: geometric mean over {overall['pairs']} pairs {overall[name]:.3f}x{spread}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="bench.compare", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--against", default="HEAD", help="a git revision of this repository (default: HEAD)")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--only", default=CONFIGS, help="configurations through the services, comma-separated")
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    names = [name.strip() for name in args.only.split(",") if name.strip()]
    known = {config.name: config for config in LOAD_CONFIGS if config.kind == "services"}
    unknown = [name for name in names if name not in known]
    if unknown:
        parser.error(f"--only: unknown configuration(s) {unknown}; choose from {sorted(known)}")
    configs = [known[name] for name in names]
    concurrencies = [int(c) for c in args.concurrency.split(",") if c]
    repo = Path(__file__).resolve().parent.parent
    tokenizer = AutoTokenizer.from_pretrained(str(DEFAULT_PAIR / "target"))
    prompts = [list(tokenizer(text)["input_ids"]) for text in held_out_prompts(args.prompts)]
    args.out.mkdir(parents=True, exist_ok=True)
    pairs: list[Pair] = []
    with tempfile.TemporaryDirectory(prefix="specdec-compare-") as scratch:
        other = Path(scratch) / "tree"
        try:
            worktree(repo, args.against, other)
            stacks = {
                tree: LocalStack(
                    str(DEFAULT_PAIR / "target"), str(DEFAULT_PAIR / "draft"), extra_service_args=["--threads", "1"],
                    cpus=PINNED, with_metrics=True, log_dir=args.out / "compare-logs" / tree, cwd=cwd,
                )
                for tree, cwd in ((THIS, repo), (OTHER, other))
            }  # fmt: skip
            with stacks[THIS], stacks[OTHER]:
                pairs = measure(stacks, configs, concurrencies, args.rounds, prompts, args.max_new_tokens)
        finally:
            subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(other)], check=False)
    summary = summarise(pairs)
    print(table(summary, args.against))
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    path = args.out / f"compare-{stamp}.json"
    path.write_text(
        json.dumps(
            {"meta": {"date": stamp, "against": args.against, **{k: v for k, v in vars(args).items() if k != "out"}},
             "summary": summary, "pairs": [asdict(p) for p in pairs]},
            indent=1,
            default=str,
        )
    )  # fmt: skip
    print(f"\nresults: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
