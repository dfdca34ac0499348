"""`make cross-bench`: a draft with another tokenizer (token-level intersection) against the same draft
with the target's tokenizer, and the target alone, through the services, at one stream.

    python -m bench.cross_pair [--merges 1500] [--prompts 12] [--max-new-tokens 96] [--reps 3]
    python -m bench.cross_pair --streams 8 --policy load_aware --prompts 16   # under load
    python -m bench.cross_pair --draft default_models/cross_draft               # the trained demo draft

With `--draft`, the cross draft is that checkpoint (default_models/cross_draft: a draft with a
tokenizer of its own, trained against the default target by default_models/cross_draft.py). Otherwise
it is a proxy built here, deterministically, from the default pair: the default draft re-expressed
over a SentencePiece-style tokenizer (Metaspace, byte fallback) whose pieces are the default
tokenizer's first `--merges` merged tokens (a smaller vocabulary, as another family's often is), the
256 byte pieces and specials of its own. Each piece keeps the default draft's rows for those bytes, so
on a context of shared tokens it is the default draft, restricted; it pays what a draft with another
tokenizer pays: the target's tokens outside the intersection can never be drafted, and the draft
sees them spelled in several of its tokens, an input it was never trained on.

Greedy waves also run the cross draft under string-level exact match (`--cross-greedy slem`: it drafts
from its whole vocabulary and its text is re-tokenized for the target), on an orchestrator of its own.

The configurations run interleaved: each repetition runs every wave of `--streams` prompts (at once)
under each configuration in a rotated order, and a ratio compares a wave with the target alone's
same wave in the same repetition. Placement is pinned (target on core 0; draft and orchestrator on
core 1). Tokens per round and acceptance do not depend on the clock; tok/s is this CPU's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
import torch
from tokenizers import Tokenizer, models
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from bench.load import PINNED
from bench.runs import sampling_fields
from default_models.cross_draft import METASPACE, sentencepiece_layout
from default_models.prompts import held_out_prompts
from serving.vocab_map import check_overlap, intersect, token_bytes
from specdec.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from tools.client import generate
from tools.local_stack import LocalStack

PAIR = Path(__file__).resolve().parents[1] / "default_models" / "pair"


def sentencepiece_tokenizer(byte_level: PreTrainedTokenizerFast, keep: Iterable[int]) -> PreTrainedTokenizerFast:
    """A SentencePiece-style tokenizer in Llama 2's layout: specials first (EOS </s> is 2), the 256 byte
    pieces, then a piece for each token of `byte_level` in `keep` that is whole UTF-8 (spaces as ▁),
    "e" (which <0x65> repeats), and one of its own; "zzyzx" is an added token."""
    table = token_bytes(byte_level)
    pieces: list[tuple[str, float]] = [("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0)]
    pieces += [(f"<0x{b:02X}>", -20.0) for b in range(256)]
    for token_id in keep:
        try:
            text = table[token_id].decode("utf-8")
        except (KeyError, UnicodeDecodeError):
            continue
        if text != "e":
            pieces.append((text.replace(" ", METASPACE), -float(len(pieces))))
    pieces += [(f"{METASPACE}zzyzx", -1.0), ("e", -1.0)]
    model = Tokenizer(models.Unigram(pieces, unk_id=0, byte_fallback=True))
    sentencepiece_layout(model)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=model, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tokenizer.add_tokens(["zzyzx"])  # an added token: never shared
    return tokenizer


def build_cross_draft(pair: Path, out: Path, merges: int) -> Path:
    """The default draft over a SentencePiece-style tokenizer of the first `merges` merged tokens (see
    the module's docstring), saved to `out`."""
    target_tokenizer = AutoTokenizer.from_pretrained(pair / "target")
    table = token_bytes(target_tokenizer)
    merged = [i for i in sorted(table) if len(table[i]) > 1][:merges]
    tokenizer = sentencepiece_tokenizer(target_tokenizer, merged)
    draft = AutoModelForCausalLM.from_pretrained(pair / "draft", dtype=torch.float32)
    old_in, old_out = draft.get_input_embeddings().weight.detach(), draft.get_output_embeddings().weight.detach()
    width = len(tokenizer)
    new_in = torch.zeros(width, old_in.shape[1])
    new_out = torch.zeros(width, old_out.shape[1])
    shared = intersect(target_tokenizer, tokenizer)
    for draft_id, target_id in shared.proposable.items():
        new_in[draft_id], new_out[draft_id] = old_in[target_id], old_out[target_id]
    draft.resize_token_embeddings(width, mean_resizing=False)
    with torch.no_grad():
        draft.get_input_embeddings().weight.copy_(new_in)
        draft.get_output_embeddings().weight.copy_(new_out)
    draft.config.vocab_size = width
    draft.config.eos_token_id = tokenizer.eos_token_id
    draft.config.bos_token_id = tokenizer.bos_token_id
    draft.config.pad_token_id = tokenizer.eos_token_id
    if draft.generation_config is not None:
        draft.generation_config.eos_token_id = tokenizer.eos_token_id
        draft.generation_config.bos_token_id = tokenizer.bos_token_id
        draft.generation_config.pad_token_id = tokenizer.eos_token_id
    out.mkdir(parents=True, exist_ok=True)
    draft.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@dataclass
class Run:
    """One generation; `wave_seconds`: the wall time of the wave of streams it ran in."""

    config: str
    mode: str
    prompt: int
    repetition: int
    tokens: int
    seconds: float
    rounds: int
    draft_tokens: int
    accepted_tokens: int
    token_ids: list[int]
    wave: int = 0
    wave_seconds: float = 0.0


CONFIGS = ("target alone", "same tokenizer", "cross tokenizer", "cross SLEM")
GREEDY_ONLY = {"cross SLEM"}  # a sampled request drafts by TLI under --cross-greedy slem too


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair", type=Path, default=PAIR)
    parser.add_argument("--draft", type=Path, help="a trained cross-tokenizer draft (else the proxy is built)")
    parser.add_argument("--merges", type=int, default=1500, help="the proxy: merged tokens its tokenizer keeps")
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--k", type=int, default=4, help="K of both drafts (the first K under load_aware)")
    parser.add_argument("--policy", default="fixed", choices=("fixed", "load_aware"))
    parser.add_argument("--streams", type=int, default=1, help="prompts generating at once (a wave)")
    parser.add_argument("--modes", default="greedy,sampling")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)

    draft_dir = args.draft or build_cross_draft(args.pair, args.out / "cross_draft", args.merges)
    target_tokenizer = AutoTokenizer.from_pretrained(args.pair / "target")
    pair = intersect(target_tokenizer, AutoTokenizer.from_pretrained(draft_dir))
    overlap = check_overlap(pair, target_tokenizer, 0.0)
    print(f"cross draft: {len(pair.draft_to_target)} shared tokens; overlap over the reference text {overlap:.1%}")
    prompts = held_out_prompts(args.prompts)
    modes = [m for m in args.modes.split(",") if m]
    target, same_draft = str(args.pair / "target"), str(args.pair / "draft")
    logs = args.out / "cross-logs"
    runs: list[Run] = []

    def cross_stack(rule: str) -> LocalStack:
        return LocalStack(
            target,
            str(draft_dir),
            cpus=PINNED,
            log_dir=logs / f"cross-{rule}",
            role_args={"draft": ["--target-tokenizer", target]},
            extra_orchestrator_args=[
                *("--draft-tokenizer", str(draft_dir), "--min-vocab-overlap", "0"),
                *("--cross-greedy", rule),
            ],
        )

    with (
        LocalStack(target, same_draft, cpus=PINNED, log_dir=logs / "same") as same,
        cross_stack("tli") as cross,
        cross_stack("slem") as slem,
    ):
        stubs = {
            name: orchestrator_pb2_grpc.OrchestratorStub(grpc.insecure_channel(address))
            for name, address in (
                ("target alone", same.orchestrator_address),
                ("same tokenizer", same.orchestrator_address),
                ("cross tokenizer", cross.orchestrator_address),
                ("cross SLEM", slem.orchestrator_address),
            )
        }
        for name in CONFIGS:  # warm-up
            _one(stubs[name], name, "greedy", prompts[0], 0, 0, args, 16)
        waves = [list(range(i, min(i + args.streams, len(prompts)))) for i in range(0, len(prompts), args.streams)]
        with ThreadPoolExecutor(args.streams) as pool:
            for rep in range(args.reps):
                for mode in modes:
                    for w, wave in enumerate(waves):
                        for shift in range(len(CONFIGS)):
                            name = CONFIGS[(shift + w + rep) % len(CONFIGS)]
                            if mode != "greedy" and name in GREEDY_ONLY:
                                continue
                            started = time.perf_counter()
                            done = list(
                                pool.map(
                                    lambda i, name=name, mode=mode, rep=rep: _one(
                                        stubs[name], name, mode, prompts[i], i, rep, args, args.max_new_tokens
                                    ),
                                    wave,
                                )
                            )
                            elapsed = time.perf_counter() - started
                            for run in done:
                                run.wave, run.wave_seconds = w, elapsed
                            runs.extend(done)
    report = _report(runs, modes, overlap, args)
    args.out.mkdir(parents=True, exist_ok=True)
    name = "cross-latest.json" if args.streams == 1 else f"cross-latest-{args.streams}-streams.json"
    (args.out / name).write_text(json.dumps({"report": report, "runs": [asdict(r) for r in runs]}))
    print(f"wrote {args.out / name}")


def _one(
    stub: orchestrator_pb2_grpc.OrchestratorStub,
    name: str,
    mode: str,
    prompt: str,
    index: int,
    rep: int,
    args: argparse.Namespace,
    tokens: int,
) -> Run:
    request = orchestrator_pb2.GenerateRequest(
        text=prompt,
        max_new_tokens=tokens,
        num_speculative_tokens=0 if name == "target alone" else args.k,
        speculation_policy=(
            orchestrator_pb2.SPECULATION_POLICY_LOAD_AWARE
            if args.policy == "load_aware" and name != "target alone"
            else orchestrator_pb2.SPECULATION_POLICY_FIXED
        ),
        overlap_drafting=args.policy == "load_aware",
        **sampling_fields(mode, 1000 * rep + index),
    )
    result = generate(stub, request)
    stats = result.stats
    return Run(
        name,
        mode,
        index,
        rep,
        len(result.token_ids),
        result.wall_seconds,
        int(stats.get("rounds", 0)),
        int(stats.get("draft_tokens", 0)),
        int(stats.get("accepted_tokens", 0)),
        result.token_ids,
    )


def _report(runs: list[Run], modes: list[str], overlap: float, args: argparse.Namespace) -> dict[str, object]:
    """Medians over (wave, repetition) of tok/s (a wave's tokens over its wall time) and of each
    configuration's ratio to the target alone's same wave and repetition; tokens per round and
    acceptance over all runs; greedy identity."""
    waves: dict[tuple[str, str, int, int], list[Run]] = {}
    for run in runs:
        waves.setdefault((run.config, run.mode, run.wave, run.repetition), []).append(run)

    def rate(group: list[Run]) -> float:
        return sum(r.tokens for r in group) / group[0].wave_seconds

    policy = f"fixed K = {args.k}" if args.policy == "fixed" else f"load_aware (first K = {args.k})"
    report: dict[str, object] = {
        "overlap": overlap,
        "draft": str(args.draft) if args.draft else f"proxy of {args.merges} merges",
        "k": args.k,
        "policy": args.policy,
        "streams": args.streams,
        "regime": "THIS CPU, pinned",
    }
    print(
        f"\nTHIS CPU, pinned, {args.streams} stream(s), {policy}, overlap {overlap:.1%} "
        "(tokens per round and acceptance: clock-free)"
    )
    print("| mode | configuration | tok/s | x target alone (quartiles) | tokens per round | acceptance |")
    print("| --- | --- | --- | --- | --- | --- |")
    for mode in modes:
        for name in CONFIGS:
            mine = {key: group for key, group in waves.items() if key[0] == name and key[1] == mode}
            if not mine:
                continue
            ratios = [
                rate(group) / rate(waves[("target alone", mode, key[2], key[3])])
                for key, group in mine.items()
                if ("target alone", mode, key[2], key[3]) in waves
            ]
            flat = [r for group in mine.values() for r in group]
            per_round = sum(r.tokens for r in flat) / max(1, sum(r.rounds for r in flat))
            drafted = sum(r.draft_tokens for r in flat)
            acceptance = sum(r.accepted_tokens for r in flat) / drafted if drafted else 0.0
            quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
            cell = {
                "tok_s": statistics.median(rate(group) for group in mine.values()),
                "x_target": statistics.median(ratios),
                "x_target_quartiles": [quartiles[0], quartiles[-1]],
                "tokens_per_round": per_round,
                "acceptance": acceptance,
            }
            report[f"{mode}/{name}"] = cell
            print(
                f"| {mode} | {name} | {cell['tok_s']:.1f} | {cell['x_target']:.2f} "
                f"({quartiles[0]:.2f}-{quartiles[-1]:.2f}) | {per_round:.2f} | "
                + (f"{acceptance:.2f} |" if drafted else "- |")
            )
        if mode == "greedy":
            alone = {
                (r.prompt, r.repetition): r.token_ids for r in runs if r.mode == mode and r.config == "target alone"
            }
            differing = sum(
                r.token_ids != alone[(r.prompt, r.repetition)]
                for r in runs
                if r.mode == mode and r.config != "target alone"
            )
            report["greedy_outputs_differing"] = differing
            print(f"greedy outputs differing from the target alone's: {differing}")
    return report


if __name__ == "__main__":
    main()
