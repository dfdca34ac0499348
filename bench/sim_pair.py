"""The simulated-device pair: cheap models that agree like a trained pair, for `make sim-bench`.

Under `--simulated-device` a forward's time is modeled, so the models only need real logits that a
GPU-sized pair's would resemble where speculation is concerned: how confident the target is, how often
the draft's top tokens cover the target's, how acceptance clusters along a sequence. A random network
has none of that (its rows are about equally flat everywhere). These are built instead, from seeds:

- each token has a few candidate successors with weights drawn from a Dirichlet: a small
  concentration makes most tokens near-certain and some diffuse, as a language model's positions are;
  its embedding is the weighted sum of those candidates' output rows, so the target is a bigram model
  over a small plausible set, with two small random layers mixing in the context;
- the agreeing draft has the same candidates with jittered weights and noisy layers: it agrees where
  the target is confident, and where it is not, its top tokens still cover the target's (as a trained
  draft's do), so acceptance comes in runs;
- the unrelated draft is another seed's model: it agrees about as often as chance.

The vocabulary is the default pair's tokenizer (4,096 tokens), so text prompts work. The models are
small enough that the target's CPU forward stays under its modeled time up to 64 rows of 5 tokens.
`python -m bench.sim_pair` measures the agreement statistics beside the trained default pair's
(docs/design.md, "The simulated-device pair").
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import shutil
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedModel

from orchestrator.rejection import SampledRound, verify_greedy, verify_sampled
from serving.logits import logits_to_probs
from serving.sampling import SamplingParams

DEFAULT_PAIR = Path("default_models/pair")
HIDDEN, LAYERS = 64, 1
# Chosen by a small grid search against the trained pair's statistics (`agreement`) on 6 held-out prompts:
# docs/design.md, "The simulated-device pair".
CANDIDATES = 8  # plausible successors a token
CONCENTRATION = 0.3  # the Dirichlet's: small makes a token's weight sit on one candidate
HEAD_GAIN = 11.5  # logit scale: how sharp a confident token's row is
EMBEDDING_SCALE = 1.0  # the token's own weight in the residual stream against the layers' (context)
DRAFT_JITTER = 0.6  # the agreeing draft's candidate weights: times exp(N(0, jitter^2))
DRAFT_NOISE = 0.1  # the agreeing draft's layers' noise, relative to each weight's spread


@dataclass(frozen=True)
class PairShape:
    concentration: float = CONCENTRATION
    head_gain: float = HEAD_GAIN
    embedding_scale: float = EMBEDDING_SCALE
    draft_jitter: float = DRAFT_JITTER
    draft_noise: float = DRAFT_NOISE


def _config(vocab: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        initializer_range=0.05,
        tie_word_embeddings=False,
    )


def _unit_rows(values: torch.Tensor) -> torch.Tensor:
    return values / values.norm(dim=-1, keepdim=True)


def build_models(vocab: int, shape: PairShape, seed: int) -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    """The target and its agreeing draft (module docstring)."""
    torch.manual_seed(seed)
    target = LlamaForCausalLM(_config(vocab)).eval()
    rng = np.random.default_rng(seed)
    generator = torch.Generator().manual_seed(seed)
    candidates = torch.randint(vocab, (vocab, CANDIDATES), generator=generator)  # [vocab, candidates]
    weights = torch.from_numpy(rng.dirichlet([shape.concentration] * CANDIDATES, size=vocab)).float()
    jitter = torch.from_numpy(rng.normal(0.0, shape.draft_jitter, size=weights.shape)).float().exp()
    draft_weights = weights * jitter / (weights * jitter).sum(-1, keepdim=True)
    head = _unit_rows(torch.randn(vocab, HIDDEN, generator=generator))  # [vocab, hidden]
    draft = LlamaForCausalLM(target.config).eval()
    draft.load_state_dict(target.state_dict())
    with torch.no_grad():
        for parameter in draft.parameters():  # the layers' noise (the embeddings are set below)
            parameter.add_(torch.randn(parameter.shape, generator=generator) * shape.draft_noise * parameter.std())
        for model, mix in ((target, weights), (draft, draft_weights)):
            embedding = _unit_rows((mix[:, :, None] * head[candidates]).sum(1))  # [vocab, hidden]
            model.get_input_embeddings().weight.copy_(embedding * shape.embedding_scale)
            model.get_output_embeddings().weight.copy_(head * shape.head_gain / math.sqrt(HIDDEN))
    return target, draft


def build_sim_pair(folder: Path, shape: PairShape = PairShape(), seed: int = 0) -> Path:
    """Write folder/target, folder/draft (agreeing) and folder/unrelated once; returns `folder`."""
    if (folder / "unrelated" / "config.json").exists():
        return folder
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_PAIR / "target")
    vocab = len(tokenizer)
    target, draft = build_models(vocab, shape, seed)
    models = {"target": target, "draft": draft, "unrelated": build_models(vocab, shape, seed + 1)[0]}
    partial = folder.with_name(folder.name + ".partial")  # renamed whole: a crash leaves no half-written pair
    shutil.rmtree(partial, ignore_errors=True)
    for name, model in models.items():
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.save_pretrained(partial / name)
        tokenizer.save_pretrained(partial / name)
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)
    return folder


# --- agreement statistics ------------------------------------------------------------------------


@torch.inference_mode()
def _rows(model: PreTrainedModel, sequence: list[int]) -> torch.Tensor:
    """[len, vocab] float32 logits at every position of `sequence`."""
    return model(torch.tensor([sequence])).logits[0].float()


@torch.inference_mode()
def _greedy(model: PreTrainedModel, sequence: list[int], n: int) -> list[int]:
    out = list(sequence)
    for _ in range(n):
        out.append(int(_rows(model, out)[-1].argmax()))
    return out[len(sequence) :]


def _rounds(
    target: PreTrainedModel,
    draft: PreTrainedModel,
    prompt: list[int],
    n: int,
    k: int,
    params: SamplingParams,
    seed: int,
) -> tuple[int, int]:
    """Speculative rounds of k drafted tokens by the pure accept/reject functions, until n tokens are out:
    (accepted, drafted)."""
    generator = torch.Generator().manual_seed(seed)
    sequence = list(prompt)
    accepted = drafted = 0
    while len(sequence) - len(prompt) < n:
        block: list[int] = []
        draft_rows = []
        for _ in range(k):
            row = _rows(draft, sequence + block)[-1]
            if params.greedy:
                block.append(int(row.argmax()))
            else:
                probs = logits_to_probs(row[None], params)[0]
                draft_rows.append(probs)
                block.append(int(torch.multinomial(probs, 1, generator=generator)))
        target_rows = _rows(target, sequence + block)[len(sequence) - 1 :]  # [k + 1, vocab]
        if params.greedy:
            verdict = verify_greedy(block, target_rows.argmax(-1).tolist())
        else:
            verdict = verify_sampled(
                SampledRound(
                    torch.tensor(block),
                    torch.stack(draft_rows),
                    logits_to_probs(target_rows, params),
                    torch.rand(k + 1, generator=generator, dtype=torch.float64),
                )
            )
        accepted += verdict.num_accepted
        drafted += k
        sequence += verdict.output_token_ids
    return accepted, drafted


def agreement(
    target: PreTrainedModel, draft: PreTrainedModel, prompts: Sequence[list[int]], n: int = 48, k: int = 4
) -> dict[str, Any]:
    """How a pair agrees, along the target's greedy continuation of each prompt: the target's top-token
    probability (quantiles), the draft's top-1/2/4 coverage of the target's token, acceptance at K = k
    greedy and at temperature 0.8 (the pure accept/reject functions' rounds), and how agreement clusters
    (the chance the draft's top token is the target's right after it was, and right after it was not)."""
    top_probs: list[float] = []
    covered = {1: 0, 2: 0, 4: 0}
    after_hit: list[int] = []
    after_miss: list[int] = []
    positions = 0
    for prompt in prompts:
        continuation = _greedy(target, prompt, n)
        sequence = prompt + continuation
        target_rows = _rows(target, sequence)[len(prompt) - 1 : -1]  # [n, vocab]: rows scoring the continuation
        draft_rows = _rows(draft, sequence)[len(prompt) - 1 : -1]
        top_probs += target_rows.softmax(-1).max(-1).values.tolist()
        ranks = draft_rows.topk(4, dim=-1).indices  # [n, 4]
        chosen = torch.tensor(continuation)[:, None]
        for width in covered:
            covered[width] += int((ranks[:, :width] == chosen).any(-1).sum())
        hits = (ranks[:, 0] == chosen[:, 0]).tolist()
        for before, now in itertools.pairwise(hits):
            (after_hit if before else after_miss).append(int(now))
        positions += len(continuation)
    greedy = [_rounds(target, draft, p, n, k, SamplingParams(), i) for i, p in enumerate(prompts)]
    sampled = [_rounds(target, draft, p, n, k, SamplingParams(temperature=0.8), i) for i, p in enumerate(prompts)]

    def rate(pairs: list[tuple[int, int]]) -> float:
        return sum(a for a, _ in pairs) / max(1, sum(d for _, d in pairs))

    quantiles = statistics.quantiles(top_probs, n=10)
    return {
        "target_top_prob_p10_p50_p90": [
            round(quantiles[0], 3),
            round(statistics.median(top_probs), 3),
            round(quantiles[-1], 3),
        ],
        "draft_covers_target_top1_top2_top4": [round(covered[w] / positions, 3) for w in (1, 2, 4)],
        "acceptance_k4_greedy": round(rate(greedy), 3),
        "acceptance_k4_t0.8": round(rate(sampled), 3),
        "agree_after_agree": round(sum(after_hit) / max(1, len(after_hit)), 3),
        "agree_after_disagree": round(sum(after_miss) / max(1, len(after_miss)), 3),
    }


def _prompts(count: int) -> list[list[int]]:
    from default_models.prompts import held_out_prompts

    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_PAIR / "target")
    return [tokenizer(text)["input_ids"] for text in held_out_prompts(count)]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.sim_pair", description=__doc__)
    parser.add_argument("--folder", type=Path, default=Path("bench/results/sim_pair"))
    parser.add_argument("--prompts", type=int, default=12)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    prompts = _prompts(args.prompts)
    trained = {name: LlamaForCausalLM.from_pretrained(DEFAULT_PAIR / name).eval() for name in ("target", "draft")}
    folder = build_sim_pair(args.folder)
    cheap = {name: LlamaForCausalLM.from_pretrained(folder / name).eval() for name in ("target", "draft", "unrelated")}
    table = {
        "trained default pair": agreement(trained["target"], trained["draft"], prompts),
        "simulated-device pair (agreeing draft)": agreement(cheap["target"], cheap["draft"], prompts),
        "simulated-device pair (unrelated draft)": agreement(cheap["target"], cheap["unrelated"], prompts),
    }
    print(json.dumps(table, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
