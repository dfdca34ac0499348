"""`make bench`: specdec beside the alternatives, on the same models and prompts.

    python -m bench [--pair default_models/pair] [--reps 3] [--prompts 6] [--max-new-tokens 96]
    python -m bench --concurrency 1,2,4,8,16 --prompts 8 --max-new-tokens 64   # load mode (bench/load.py)

Starts the target, draft and orchestrator as three processes on loopback, then runs every
configuration over a fixed set of held-out prompts, greedy and sampling, interleaved: each repetition
runs every configuration once, in a rotated order, so that drift in the machine's speed spreads over
all of them. Reports medians over repetitions and ratios taken within a repetition.
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import json
import os
import platform
import shutil
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from bench.load import run_load
from bench.report import as_json, plot, summarise, table
from bench.runs import Config, HuggingFaceRunner, Sample, ServiceRunner, default_configs
from default_models.prompts import edit_prompts, held_out_prompts
from model_host.loading import load_model
from tools.local_stack import LocalStack


def run_all(args: argparse.Namespace, configs: list[Config], prompts: list[str]) -> list[Sample]:
    modes = [m for m in args.modes.split(",") if m]
    samples: list[Sample] = []
    log_dir = args.out / "logs"
    with LocalStack(
        args.target_model,
        args.draft_model,
        log_dir=log_dir,
        extra_orchestrator_args=["--max-speculative-tokens", str(max(16, args.max_k))],
        extra_service_args=["--threads", str(args.threads)] if args.threads else [],
    ) as stack:
        services = ServiceRunner(stack.orchestrator_address)
        hf = HuggingFaceRunner(load_model(args.target_model), load_model(args.draft_model))
        # Warm-up: every kind once, so that first-call allocations are not measured.
        for config in configs:
            for mode in modes:
                _run_one(services, hf, config, mode, prompts[0], 0, 0, min(16, args.max_new_tokens))
        jobs = [
            (rep, mode, configs[(i + rep) % len(configs)], p)
            for rep in range(args.reps)
            for mode in modes
            for i in range(len(configs))
            for p in range(len(prompts))
        ]
        for rep, mode, config, p in tqdm(jobs, desc="bench", unit="gen", mininterval=2.0):
            samples.append(_run_one(services, hf, config, mode, prompts[p], p, rep, args.max_new_tokens))
        services.close()
    return samples


def _run_one(
    services: ServiceRunner,
    hf: HuggingFaceRunner,
    config: Config,
    mode: str,
    prompt: str,
    index: int,
    rep: int,
    max_new_tokens: int,
) -> Sample:
    seed = 1000 * rep + index
    if config.kind == "hf":
        ids, seconds = hf.run(config, mode, prompt, max_new_tokens, seed)
        return Sample(config.name, mode, index, rep, len(ids), seconds, token_ids=ids)
    result = services.run(config, mode, prompt, max_new_tokens, seed)
    stats = result.stats
    return Sample(
        config.name,
        mode,
        index,
        rep,
        len(result.token_ids),
        result.wall_seconds,
        rounds=int(stats.get("rounds", 0)),
        draft_rounds=int(stats.get("draft_rounds", 0)),
        draft_tokens=int(stats.get("draft_tokens", 0)),
        accepted_tokens=int(stats.get("accepted_tokens", 0)),
        accepted_per_position=[int(x) for x in stats.get("accepted_per_position", [])],
        draft_seconds=float(stats.get("draft_seconds", 0.0)),
        target_seconds=float(stats.get("target_seconds", 0.0)),
        wire_bytes=int(stats.get("wire_bytes", 0)),
        ngram_draft_tokens=int(stats.get("ngram_draft_tokens", 0)),
        ngram_accepted_tokens=int(stats.get("ngram_accepted_tokens", 0)),
        token_ids=result.token_ids,
    )


def unrelated_draft(draft: str) -> str:
    """A folder holding the draft's architecture and tokenizer with random weights (seed 0), removed at
    exit: a draft that never agrees with the target, where speculation cannot pay and load_aware should
    fall back to about the target alone."""
    folder = tempfile.mkdtemp(prefix="specdec-unrelated-draft-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    with torch.random.fork_rng():  # the weights' initialisation draws from the global generator
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(draft))
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(draft).save_pretrained(folder)
    return folder


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--pair",
        type=Path,
        default=Path("default_models/pair"),
        help="folder with target/ and draft/, `null`: the near-null pair (bench/null_pair.py), or `big-vocab`: "
        "Llama 3's vocabulary (bench/big_vocab.py)",
    )
    parser.add_argument(
        "--placement",
        choices=("shared", "pinned"),
        default="shared",
        help="load mode: pinned puts the target on core 0, the draft and orchestrator on core 1 (1 thread each), "
        "and Hugging Face's batch on the target's core",
    )
    parser.add_argument("--target-model", default=None, help="overrides PAIR/target")
    parser.add_argument("--draft-model", default=None, help="overrides PAIR/draft")
    parser.add_argument(
        "--unrelated-draft",
        action="store_true",
        help="give the draft random weights (same architecture and tokenizer): speculation cannot pay",
    )
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument(
        "--prompt-set",
        choices=("held_out", "edit"),
        default="held_out",
        help="held_out: function headers; edit: bench/edit_prompts.json (a function, then its header again)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--max-k", type=int, default=8)
    parser.add_argument("--modes", default="greedy,sampling")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per service (0: torch's default)")
    parser.add_argument("--only", default="", help="comma-separated config names to run (plus the baseline)")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument(
        "--concurrency", default="", help="load mode: comma-separated client counts, for example 1,2,4,8,16"
    )
    args = parser.parse_args(argv)
    if str(args.pair) == "null":
        from bench.null_pair import build_null_pair

        args.pair = build_null_pair(args.out / "null_pair")
    big_vocab = str(args.pair) == "big-vocab"
    if big_vocab:
        from bench.big_vocab import build_big_vocab_pair

        args.pair = build_big_vocab_pair(args.out / "big_vocab_pair")
    args.target_model = args.target_model or str(args.pair / "target")
    args.draft_model = args.draft_model or str(args.pair / "draft")
    for path in (args.target_model, args.draft_model):
        if not Path(path).exists() and "/" not in path.strip("./"):
            parser.error(f"model {path} not found; run `make models` or pass --target-model/--draft-model")
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.unrelated_draft:
        args.draft_model = unrelated_draft(args.draft_model)

    prompts = held_out_prompts(args.prompts) if args.prompt_set == "held_out" else edit_prompts(args.prompts)
    if big_vocab:  # its word-level tokenizer knows no text: prompts of random words
        from bench.big_vocab import VOCAB
        from bench.link import random_prompts

        prompts = [" ".join(f"w{i}" for i in ids) for ids in random_prompts(args.prompts, VOCAB)]
    if args.concurrency:
        return run_load(args, prompts)
    configs = default_configs(args.max_k)
    if args.only:
        wanted = {"target alone", *(n.strip() for n in args.only.split(","))}
        configs = [c for c in configs if c.name in wanted]
    samples = run_all(args, configs, prompts)
    rows = summarise(samples, configs)
    print(table(rows))
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    meta = {
        "date": stamp,
        "target_model": args.target_model,
        "draft_model": args.draft_model,
        "prompt_set": args.prompt_set,
        "prompts": prompts,
        "reps": args.reps,
        "max_new_tokens": args.max_new_tokens,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "cuda": torch.cuda.is_available(),
        },
    }
    result_path = args.out / f"bench-{stamp}.json"
    result_path.write_text(
        json.dumps({"meta": meta, "rows": as_json(rows), "samples": [asdict(s) for s in samples]}, indent=1)
    )
    (args.out / "latest.json").write_text(result_path.read_text())
    figures = plot(rows, args.out)
    print(f"\nresults: {result_path}\nplots: {', '.join(str(f) for f in figures)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
