"""`python -m bench.link`: sampled generation across rate-limited links.

    python -m bench.link [--pair big-vocab] [--rates 1gbit,10gbit] [--concurrency 1,8] [--reps 2]

The target and the draft each run in a network namespace of their own, behind a veth pair shaped by
`tbf` to the rate in both directions (tools/netns.py); the orchestrator and the clients stay in this
one. Every repetition runs every (rate, concurrency, configuration) once, in a rotated order: the target
alone (K = 0) over the same link, specdec at a fixed K, and the load-aware policy, all sampled at the
given temperature (OpenAI's default, 1, with no top-k or top-p: no support to trim rows to). Reports
tokens per second, the ratio to the target alone at the same rate and concurrency (within a
repetition, medians over repetitions), bytes on the wire per round, and the acceptance.

Needs root (network namespaces). Pinned placement: the target on core 0, the draft and the
orchestrator on core 1, one thread each.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from tqdm import tqdm

from bench.big_vocab import build_big_vocab_pair
from bench.load import PINNED, LoadConfig, LoadSample, requests_for, run_services, summarise_load
from tools.local_stack import LocalStack
from tools.netns import Hosts, rate_bits

TARGET_ALONE = "target alone (K = 0)"


def _configs(k: int) -> list[LoadConfig]:
    return [
        LoadConfig(TARGET_ALONE, "services", 0),
        LoadConfig(f"specdec fixed K = {k}", "services", k),
        LoadConfig("specdec load-aware", "services", None, "load_aware"),
    ]


def random_prompts(count: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Random word ids (the big-vocabulary tokenizer has no text to speak of), 16 to 32 tokens each."""
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(rng.randrange(16, 33))] for _ in range(count)]


def link_table(rows: list[dict[str, float | str | int]], samples: list[LoadSample]) -> str:
    lines = [
        "| link | C | config | tok/s | x target alone | KB / round | acceptance |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        runs = [s for s in samples if s.config == r["config"] and s.concurrency == r["concurrency"]]
        per_round = sum(s.wire_bytes for s in runs) / max(1, sum(s.rounds for s in runs))
        name, _, rate = str(r["config"]).partition(" @ ")
        lines.append(
            f"| {rate} | {r['concurrency']} | {name} | {float(r['tokens_per_second']):.1f} | "
            f"{float(r['x_target_alone']):.2f} | {per_round / 1024:.0f} | {float(r['acceptance']):.2f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="bench.link", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pair", default="big-vocab", help="`big-vocab` (bench/big_vocab.py) or a folder")
    parser.add_argument("--rates", default="1gbit,10gbit", help="tc rates, comma-separated; `none` is unshaped")
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        parser.error("network namespaces need root")
    rates: list[str | None] = [None if r.strip() == "none" else r.strip() for r in args.rates.split(",")]
    for rate in rates:
        if rate is not None:
            rate_bits(rate)  # a clear error before anything starts
    concurrencies = [int(c) for c in args.concurrency.split(",") if c]
    args.out.mkdir(parents=True, exist_ok=True)
    pair = build_big_vocab_pair(args.out / "big_vocab_pair") if args.pair == "big-vocab" else Path(args.pair)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(pair / "target").vocab_size
    prompts = random_prompts(args.prompts, vocab)
    configs = _configs(args.k)
    samples: list[LoadSample] = []
    with (
        Hosts(["target", "draft"]) as hosts,
        LocalStack(
            str(pair / "target"),
            str(pair / "draft"),
            log_dir=args.out / "logs",
            extra_service_args=["--threads", "1"],
            cpus=PINNED,
            hosts=hosts,
        ) as stack,
    ):
        warm_up = [(0, rates[0], concurrencies[0], i) for i in range(len(configs))]
        jobs = [
            (rep, rate, c, i)
            for rep in range(args.reps)
            for rate in rates
            for c in concurrencies
            for i in range(len(configs))
        ]
        for number, (rep, rate, concurrency, index) in enumerate(tqdm([*warm_up, *jobs], desc="link", unit="run")):
            config = configs[(index + rep) % len(configs)]
            hosts.shape(rate)
            requests = requests_for(prompts, concurrency)
            sample = asyncio.run(
                run_services(
                    stack.orchestrator_address,
                    config,
                    requests,
                    concurrency,
                    rep,
                    args.max_new_tokens,
                    args.temperature,
                )
            )
            sample.config = f"{config.name} @ {rate or 'unshaped'}"
            if number >= len(warm_up):
                samples.append(sample)
    names = {s.config for s in samples}
    baselines = {name: f"{TARGET_ALONE} @ {name.partition(' @ ')[2]}" for name in names}
    rows = summarise_load(samples, concurrencies, baselines)
    rows.sort(key=lambda r: (str(r["config"]).partition(" @ ")[2], int(r["concurrency"])))
    print(link_table(rows, samples))
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    path = args.out / f"link-{stamp}.json"
    meta = {
        "date": stamp,
        "pair": str(pair),
        "rates": args.rates,
        **{name: getattr(args, name) for name in ("reps", "k", "temperature", "max_new_tokens")},
        "prompts": len(prompts),
    }
    samples_json = [{k: v for k, v in asdict(s).items() if k != "token_ids"} for s in samples]
    path.write_text(json.dumps({"meta": meta, "rows": rows, "samples": samples_json}, indent=1))
    print(f"\nresults: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
