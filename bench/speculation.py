"""`python -m bench.speculation` (`make speculation-bench`): the speculation cache's hit rate and how
well it predicts verdicts, on the trained default pair (default_models/pair), one stream.

CLOCK-FREE: what is counted (which verdict came, whether a block was drafted ahead for it) does not
depend on how fast anything ran, except through which verdicts the cache drafts for. The draft runs
on a modeled GPU (`--simulated-device`), where a forward costs about what reading the weights costs
and the cache fans out as it would on a GPU of its own; the target runs on the CPU. Every request
runs to max_new_tokens (`ignore_eos`), fixed K, greedy and at temperature 0.8.

Reported, per setting: the hit rate (of the draft steps that followed a step with blocks drafted
ahead), and by the verdict they named: the whole block accepted (a hit needs the draft's guess of the
bonus token) or a rejection (a hit needs the target's token among the guesses drafted for); blocks
drafted ahead per step, and tokens drafted ahead per generated token.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from bench.load import LoadConfig, run_services, scrape, totals
from default_models.prompts import held_out_prompts
from tools.local_stack import LocalStack

PAIR = Path(__file__).resolve().parents[1] / "default_models" / "pair"
DRAFT_DEVICE = "h100-llama-3.2-1b"


def _counts(stack: LocalStack) -> dict[str, float]:
    """The draft's cache counts so far: steps by outcome, and by outcome and verdict; tokens by use."""
    text = scrape(stack.metrics_ports["draft"])
    steps = "specdec:speculation_steps_total"
    counts = {f"steps:{k}": v for k, v in totals(text, steps, "outcome").items()}
    counts.update(totals(text, steps, "outcome", "verdict"))
    used = totals(text, "specdec:speculation_drafted_tokens_total", "use")
    counts.update({f"tokens:{k}": v for k, v in used.items()})
    return counts


def measure(stack: LocalStack, prompts: list[list[int]], k: int, temperature: float, tokens: int) -> dict[str, Any]:
    before = _counts(stack)
    config = LoadConfig(f"fixed K = {k}", "services", k)
    sample = asyncio.run(
        run_services(stack.orchestrator_address, config, prompts, 1, 0, tokens, temperature, ignore_eos=True)
    )
    after = _counts(stack)
    delta = {key: after.get(key, 0.0) - before.get(key, 0.0) for key in after}
    steps = delta.get("steps:hit", 0.0) + delta.get("steps:miss", 0.0)

    def rate(verdict: str) -> float | None:
        seen = delta.get(f"hit:{verdict}", 0.0) + delta.get(f"miss:{verdict}", 0.0)
        return delta.get(f"hit:{verdict}", 0.0) / seen if seen else None

    return {
        "k": k,
        "temperature": temperature,
        "generated_tokens": sample.tokens,
        "acceptance": sample.accepted_tokens / max(1, sample.draft_tokens),
        "steps": steps,
        "hit_rate": delta.get("steps:hit", 0.0) / steps if steps else None,
        "hit_rate_whole": rate("whole"),
        "hit_rate_rejection": rate("rejection"),
        "whole_share": (delta.get("hit:whole", 0.0) + delta.get("miss:whole", 0.0)) / steps if steps else None,
        "ahead_tokens_per_token": (delta.get("tokens:used", 0.0) + delta.get("tokens:wasted", 0.0))
        / max(1, sample.tokens),
        "ready_share": sample.overlapped_rounds / max(1, sample.draft_rounds),
    }


def table(rows: list[dict[str, Any]]) -> str:
    def cell(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    lines = [
        "| K | temperature | acceptance | hit rate | after a whole block | after a rejection | whole blocks "
        "| rounds ready | drafted ahead / token |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['k']} | {r['temperature']:g} | {r['acceptance']:.2f} | {cell(r['hit_rate'])} "
            f"| {cell(r['hit_rate_whole'])} | {cell(r['hit_rate_rejection'])} | {cell(r['whole_share'])} "
            f"| {r['ready_share']:.2f} | {r['ahead_tokens_per_token']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.speculation", description=__doc__)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--k", default="2,4")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(PAIR / "target")
    prompts = [tokenizer(p)["input_ids"] for p in held_out_prompts(args.prompts)]
    rows = []
    stack = LocalStack(
        str(PAIR / "target"),
        str(PAIR / "draft"),
        extra_service_args=["--threads", "1"],
        role_args={"draft": ["--simulated-device", DRAFT_DEVICE]},
        with_metrics=True,
    )
    with stack:
        for k in (int(v) for v in args.k.split(",")):
            for temperature in (0.0, 0.8):
                rows.append(measure(stack, prompts, k, temperature, args.max_new_tokens))
                print(f"K = {k}, temperature {temperature:g}: done", flush=True)
    print("\nThe speculation cache on the trained default pair, 1 stream (CLOCK-FREE counts; the draft on a")
    print(f"modeled {DRAFT_DEVICE} so that it fans out as on a GPU of its own)\n")
    print(table(rows))
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    meta = {"date": stamp, "regime": "clock-free counts", "args": {k: str(v) for k, v in vars(args).items()}}
    record = {"meta": meta, "rows": rows}
    (args.out / f"speculation-{stamp}.json").write_text(json.dumps(record, indent=1))
    (args.out / "speculation-latest.json").write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
