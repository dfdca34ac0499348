"""Evaluate the default pair and write its model card.

    python -m default_models.evaluate --pair default_models/pair

Prints and records: held-out perplexity of both models; the cost of a target forward pass against a
draft forward pass at the lengths the services run them; acceptance rate at K = 4 on held-out prompts
(greedy and temperature 0.8, per position) measured through the real services; and how often greedy
completions of held-out function headers read as Python (`tokenize` accepts them).
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import platform
import statistics
import time
import tokenize
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
import torch
from transformers import DynamicCache

from default_models.corpus import HELD_OUT_MODULES, load_corpus, read_text
from default_models.prompts import held_out_prompts
from draft_service.lean import LeanDraft
from model_host.kv_blocks import BlockStore
from model_host.loading import LoadedModel, load_model
from model_host.rows import Row
from specdec.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from tools.client import generate
from tools.local_stack import LocalStack

WINDOW = 256


def perplexity(model: LoadedModel, max_windows: int = 400) -> float:
    """exp(mean next-token loss) over non-overlapping windows of the held-out modules."""
    assert model.tokenizer is not None
    texts = [read_text(p) for p in load_corpus().held_out_files]
    ids: list[int] = []
    for encoded in model.tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids += [*encoded, model.tokenizer.eos_token_id]
    stream = torch.tensor(ids)
    total, count = 0.0, 0
    with torch.inference_mode():
        for start in range(0, min(len(stream) - 1, max_windows * WINDOW), WINDOW):
            window = stream[start : start + WINDOW + 1][None]
            logits = model.model(window[:, :-1]).logits[0].float()
            total += float(torch.nn.functional.cross_entropy(logits, window[0, 1:], reduction="sum"))
            count += window.shape[1] - 1
    return math.exp(total / count)


def _median_step_seconds(step: Callable[[], object], rollback: Callable[[], None], repeats: int) -> float:
    """Median wall time of `step`, with `rollback` (untimed) after each so every step sees the same cache."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
        rollback()
    return statistics.median(times)


def _random_ids(model: LoadedModel, count: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randint(1, model.vocab_size, (1, count), generator=generator)


def forward_seconds(model: LoadedModel, context: int, tokens: int, repeats: int = 60) -> float:
    """Median time of one cached forward pass feeding `tokens` after `context`, as the services do."""
    generator = torch.Generator().manual_seed(0)
    prefix, block = _random_ids(model, context, generator), _random_ids(model, tokens, generator)
    with torch.inference_mode():
        cache = DynamicCache(config=model.model.config)
        model.model(input_ids=prefix, cache=cache, use_cache=True, logits_to_keep=1)
        return _median_step_seconds(
            lambda: model.model(input_ids=block, cache=cache, use_cache=True, logits_to_keep=tokens),
            lambda: cache.crop(-tokens),
            repeats,
        )


def lean_forward_seconds(lean: LeanDraft, model: LoadedModel, context: int, repeats: int = 200) -> float:
    """Median time of the draft service's lean one-token step."""
    generator = torch.Generator().manual_seed(0)
    prefix, step = _random_ids(model, context, generator)[0].tolist(), _random_ids(model, 1, generator)[0].tolist()
    with torch.inference_mode():
        lean([Row(slot=0, start=0, token_ids=prefix, num_logits=1)])
        # The slot store's rollback is the next step's start: every step feeds the same position.
        return _median_step_seconds(
            lambda: lean([Row(slot=0, start=context, token_ids=step, num_logits=1)]), lambda: None, repeats
        )


def forward_costs(target: LoadedModel, draft: LoadedModel, repetitions: int = 7) -> dict[str, Any]:
    """Target (K + 1 = 5 tokens) and draft (1 token) forward times, measured in turn `repetitions` times
    so that a shared machine's drift hits both alike: medians, and the ratio's median and range."""
    # What the draft service runs, when it can.
    lean = LeanDraft.attach(draft.model, BlockStore(draft.input_device, draft.dtype, draft.max_context))
    target_s, draft_hf_s, draft_s = [], [], []
    for _ in range(repetitions):
        target_s.append(forward_seconds(target, context=128, tokens=5))
        draft_hf_s.append(forward_seconds(draft, context=128, tokens=1))
        draft_s.append(lean_forward_seconds(lean, draft, context=128) if lean is not None else draft_hf_s[-1])
    ratios = [t / d for t, d in zip(target_s, draft_s, strict=True)]
    return {
        "target_forward_s": statistics.median(target_s),
        "draft_hf_forward_s": statistics.median(draft_hf_s),
        "draft_forward_s": statistics.median(draft_s),
        "forward_cost_ratio": statistics.median(ratios),
        "forward_cost_ratio_range": [min(ratios), max(ratios)],
        "forward_cost_repetitions": repetitions,
    }


def acceptance(address: str, prompts: list[str], temperature: float, max_new_tokens: int) -> dict[str, Any]:
    with grpc.insecure_channel(address) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
        drafted = accepted = rounds = 0
        per_position = [0, 0, 0, 0]
        completions = []
        for seed, prompt in enumerate(prompts):
            request = orchestrator_pb2.GenerateRequest(
                text=prompt,
                max_new_tokens=max_new_tokens,
                num_speculative_tokens=4,
                temperature=temperature,
                seed=seed,
                speculation_policy=orchestrator_pb2.SPECULATION_POLICY_FIXED,
            )
            result = generate(stub, request)
            stats = result.stats
            drafted += int(stats["draft_tokens"])
            accepted += int(stats["accepted_tokens"])
            rounds += int(stats["draft_rounds"])
            for i, value in enumerate(stats["accepted_per_position"][:4]):
                per_position[i] += int(value)
            completions.append(result.text)
    return {
        "acceptance_rate": accepted / drafted,
        "mean_acceptance_length": (accepted + rounds) / rounds,
        "per_position": [p / rounds for p in per_position],
        "completions": completions,
    }


def function_body(prompt: str, completion: str) -> str:
    """The prompt plus the completion up to where the function ends (the first line back at column 0)."""
    lines = (prompt + completion).splitlines(keepends=True)
    header_lines = prompt.count("\n")
    body = lines[: header_lines + 1]
    for line in lines[header_lines + 1 :]:
        if line.strip() and not line[0].isspace():
            break
        body.append(line)
    return "".join(body)


def tokenize_error(source: str) -> str | None:
    """None when `tokenize` accepts it (brackets balance, strings close, indentation is consistent),
    else tokenize's complaint."""
    # A completion cut by max_new_tokens ends mid-line; judge the complete lines.
    complete = source[: source.rfind("\n") + 1] if "\n" in source else source
    try:
        list(tokenize.generate_tokens(io.StringIO(complete).readline))
    except (tokenize.TokenError, IndentationError, SyntaxError) as exc:
        return str(exc.args[0])
    return None


def model_card(pair: Path, r: dict[str, Any], training: dict[str, Any]) -> str:
    """The model card: what the pair is, how it was trained, and the measured figures."""
    cfg, stage1, rounds = training["config"], training["stage1"], training["rounds"]
    rounds_text = "; ".join(
        f"{r['steps']} steps on {r['generated_tokens']:,} generated tokens, final loss {r['final_loss']:.3f}"
        for r in rounds
    )
    greedy, sampled = r["greedy"], r["sampled"]
    per_greedy = ", ".join(f"{p:.2f}" for p in greedy["per_position"])
    per_sampled = ", ".join(f"{p:.2f}" for p in sampled["per_position"])
    t_ms, d_ms = 1e3 * r["target_forward_s"], 1e3 * r["draft_forward_s"]
    low, high = r["forward_cost_ratio_range"]
    rejected = "; ".join(f"{message} ({count})" for message, count in r["tokenize_errors"].items()) or "none"
    samples = "\n\n".join(f"```python\n{s}\n```" for s in r["samples"])
    lines = [
        "# specdec default pair",
        "",
        "A target and a draft model trained by `make models` (`python -m default_models.train`) on the Python",
        f"standard library's own source (CPython {r['python']}), so that `make run` and `make bench` work offline",
        "and mean something. Both are Llama-architecture checkpoints that `AutoModelForCausalLM` and",
        "`AutoTokenizer` load from this folder with `HF_HUB_OFFLINE=1`; they share one byte-level BPE tokenizer",
        f"of {r['vocab_size']} tokens. Weights are stored in bfloat16 and load exactly into float32.",
        "",
        "| | target | draft |",
        "| --- | --- | --- |",
        f"| parameters | {r['target_parameters']:,} | {r['draft_parameters']:,} |",
        f"| layers x width | {r['target_shape']} | {r['draft_shape']} |",
        f"| held-out perplexity | {r['target_perplexity']:.2f} | {r['draft_perplexity']:.2f} |",
        f"| forward pass, as the services run it | {t_ms:.2f} ms for K + 1 = 5 tokens | {d_ms:.2f} ms for 1 token |",
        "",
        "The draft service runs Llama-family drafts through its lean forward pass (`draft_service/lean.py`,",
        "the same function with far less framework overhead per token; through Hugging Face's forward the",
        f"draft takes {1e3 * r['draft_hf_forward_s']:.2f} ms per token).",
        "",
        f"Target forward / draft forward: **{r['forward_cost_ratio']:.1f}x**, the median of"
        f" {r['forward_cost_repetitions']} interleaved repetitions ({low:.1f}x to {high:.1f}x;"
        f" {r['cpus']} CPU cores, default threads).",
        "",
        "## Training",
        "",
        "- Text: every `.py` file of the standard library except test suites and `lib2to3`; held out for",
        f"  evaluation: {', '.join(HELD_OUT_MODULES)}. {training['training_tokens']:,} training tokens.",
        f"- Target, stage 1: next-token cross-entropy, {cfg['target_steps']} steps of {cfg['batch_size']} x"
        f" {cfg['seq_len']} tokens at {cfg['target']['num_hidden_layers']} layers, AdamW, cosine schedule, bf16",
        f"  autocast on CPU, seed {cfg['seed']}; final loss {stage1['target_final_loss']:.3f}.",
        f"- Target, stage 2: grown by {cfg['grown_layers']} layer (a copy of the last with its output projections"
        " zeroed, so it",
        f"  starts as the identity), then {cfg['target_steps_2']} more steps; final loss"
        f" {training['target_final_loss']:.3f}.",
        "- Draft, stage 1: the target's embeddings, first layers and head, distilled from the stage-1 target:",
        f"  KL(target || draft) on every position plus 0.1 x next-token loss, {cfg['draft_steps']} steps; final"
        f" loss {stage1['draft_final_distill_loss']:.3f}.",
        f"- Draft, stage 2: {len(rounds)} rounds distilled from the final target. Each round has the target write"
        f" fresh continuations of {cfg['generations']:,}",
        "  training-set prompts (function headers and text; greedy and temperature 0.8), then trains on batches",
        f"  of half library text and half those continuations: {rounds_text}.",
        "- The shipped weights were trained in pieces, each going on from the pair the last one saved",
        "  (`--resume`); every piece is seeded, so a from-scratch `make models` follows the same recipe with the",
        "  same seeds, though not bit for bit.",
        "",
        f"## Acceptance at K = 4 on {r['prompts']} held-out function headers, through the services",
        "",
        "| | acceptance rate (accepted / drafted) | mean acceptance length | accepted at positions 1..4 |",
        "| --- | --- | --- | --- |",
        f"| greedy | **{greedy['acceptance_rate']:.3f}** | {greedy['mean_acceptance_length']:.2f} | {per_greedy} |",
        f"| temperature 0.8 | **{sampled['acceptance_rate']:.3f}** | {sampled['mean_acceptance_length']:.2f}"
        f" | {per_sampled} |",
        "",
        "## Does it write Python?",
        "",
        f"{r['reads_as_python']:.0%} of greedy completions of held-out function headers (cut where the function",
        f"ends, or at {r['max_new_tokens']} new tokens) are accepted by Python's `tokenize`. What it said about the"
        f" others: {rejected}.",
        "Three of them, as generated:",
        "",
        samples,
        "",
        f"Measured by `make evaluate` (`python -m default_models.evaluate --pair {pair}`) on {r['date']}.",
        "",
    ]
    return "\n".join(lines)


def _shape(model: LoadedModel) -> str:
    config = model.model.config
    return f"{config.num_hidden_layers} x {config.hidden_size}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="default_models.evaluate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pair", type=Path, default=Path("default_models/pair"))
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args(argv)
    target = load_model(str(args.pair / "target"))
    draft = load_model(str(args.pair / "draft"))
    training = json.loads((args.pair / "training.json").read_text())
    results: dict[str, Any] = {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "vocab_size": target.vocab_size,
        "target_parameters": target.model.num_parameters(),
        "draft_parameters": draft.model.num_parameters(),
        "target_shape": _shape(target),
        "draft_shape": _shape(draft),
        "prompts": args.prompts,
        "max_new_tokens": args.max_new_tokens,
        "date": time.strftime("%Y-%m-%d"),
    }
    results["target_perplexity"] = perplexity(target)
    results["draft_perplexity"] = perplexity(draft)
    results.update(forward_costs(target, draft))
    print(json.dumps(results, indent=1))

    prompts = held_out_prompts(args.prompts)
    with LocalStack(str(args.pair / "target"), str(args.pair / "draft")) as stack:
        results["greedy"] = acceptance(stack.orchestrator_address, prompts, 0.0, args.max_new_tokens)
        results["sampled"] = acceptance(stack.orchestrator_address, prompts, 0.8, args.max_new_tokens)
    bodies = [function_body(p, c) for p, c in zip(prompts, results["greedy"]["completions"], strict=True)]
    errors = [tokenize_error(body) for body in bodies]
    results["reads_as_python"] = errors.count(None) / len(bodies)
    results["tokenize_errors"] = dict(Counter(e for e in errors if e is not None).most_common())
    results["samples"] = bodies[:3]
    for mode in ("greedy", "sampled"):
        print(mode, {k: v for k, v in results[mode].items() if k != "completions"})
    print(f"reads as Python: {results['reads_as_python']:.0%}")
    (args.pair / "evaluation.json").write_text(json.dumps(results, indent=1) + "\n")
    (args.pair / "README.md").write_text(model_card(args.pair, results, training))
    print(f"wrote {args.pair / 'README.md'} and {args.pair / 'evaluation.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
