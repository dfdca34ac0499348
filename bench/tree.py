"""`python -m bench.tree` (`make tree-bench`): token trees against chains at equal verify tokens, on the
trained default pair (default_models/pair), one stream, greedy and at temperature 0.8.

CLOCK-FREE: it counts tokens, not time. Both models run in this process with the services' batched
forward and paged cache (model_host), the tree as one tree row; every request runs to the token
budget. For each verify budget V (the tokens the target scores besides the last committed one), the
chain is K = V drafted tokens, the best chain at V (a longer chain never accepts less), and the tree
is V nodes grown by `draft_service/tree.py` under each acceptance rule of `orchestrator/tree.py`.

Reported, per setting: tokens committed per round (accepted + 1), its ratio to the chain's with a
bootstrap 95% interval over prompts, and the draft's forwards and fed tokens per round. Greedy trees
must commit the chain's very tokens (both are the target's greedy output): a difference is printed.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from default_models.prompts import held_out_prompts
from draft_service.tree import Calibration, TreeBuilder
from model_host.forward import BatchedForward
from model_host.kv_blocks import BlockStore
from model_host.loading import load_model
from model_host.rows import Row
from orchestrator.tree import SampledTree, verify_tree_greedy, verify_tree_sampled
from serving.logits import logits_to_probs
from serving.sampling import SamplingParams
from serving.trees import TreeRule

PAIR = Path(__file__).resolve().parents[1] / "default_models" / "pair"
RESULTS = Path(__file__).resolve().parent / "results"


@dataclass
class Counts:
    rounds: int = 0
    committed: int = 0
    draft_forwards: int = 0
    draft_tokens: int = 0


class Model:
    """One model with the services' batched forward over a paged cache, one session in slot 0."""

    def __init__(self, model: PreTrainedModel, max_context: int) -> None:
        parameter = next(model.parameters())
        self.store = BlockStore(parameter.device, parameter.dtype, max_context, 4 * max_context)
        self.forward = BatchedForward(model, self.store)

    def feed(self, start: int, token_ids: list[int]) -> None:
        with torch.inference_mode():
            self.forward([Row(0, start, token_ids, 0)])

    def tree_logits(self, context: list[int], token_ids: list[int], parents: list[int]) -> torch.Tensor:
        """[N + 1, vocab] logits at the context's last token and at each node, the cache holding all of
        the context but its last token."""
        shifted = (-1, *[parent + 1 for parent in parents])
        row = Row(0, len(context) - 1, [context[-1], *token_ids], len(token_ids) + 1, shifted)
        with torch.inference_mode():
            (logits,) = self.forward([row])
        assert logits is not None
        return logits.float()

    def reset(self) -> None:
        self.store.release(0)


def _probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    return logits.softmax(-1) if params.greedy else logits_to_probs(logits, params)


def generate(
    target: Model,
    draft: Model,
    prompt: list[int],
    tokens: int,
    params: SamplingParams,
    builder: Callable[[torch.Generator], TreeBuilder],
    seed: int,
) -> tuple[list[int], Counts]:
    """Run one request to `tokens` new tokens in tree rounds; the committed tokens and the counts."""
    generator = torch.Generator().manual_seed(seed)
    counts = Counts()
    context = list(prompt)
    for model in (target, draft):
        model.feed(0, context[:-1])
    while len(context) - len(prompt) < tokens:
        grower = builder(generator)
        rows: dict[int, torch.Tensor] = {}

        def draft_rows(
            nodes: list[int], grower: TreeBuilder = grower, rows: dict = rows, context: list[int] = context
        ) -> list[torch.Tensor]:
            q = _probs(draft.tree_logits(context, grower.token_ids, grower.parents), params)
            counts.draft_forwards += 1
            counts.draft_tokens += len(grower.token_ids) + 1
            rows.update({node: q[node + 1] for node in nodes})
            return [q[node + 1] for node in nodes]

        tree = grower.build(draft_rows)
        target_logits = target.tree_logits(context, tree.token_ids, list(tree.parents))
        if params.greedy:
            verdict = verify_tree_greedy(tree, target_logits.argmax(-1).tolist())
        else:
            q_rows = torch.zeros_like(target_logits)
            for node, row in rows.items():
                q_rows[node + 1] = row
            uniforms = torch.rand(len(tree.token_ids) + 1, generator=generator, dtype=torch.float64)
            rule = grower.rule
            assert rule is not None
            verdict = verify_tree_sampled(
                SampledTree(tree, rule, q_rows, logits_to_probs(target_logits, params), uniforms)
            )
        start = len(context) - 1
        context += verdict.output_token_ids
        for model in (target, draft):
            model.feed(start, context[start:-1])
        if grower.calibration is not None:
            grower.calibration.learn(tree, rows, verdict.path)
        counts.rounds += 1
        counts.committed += len(verdict.output_token_ids)
    for model in (target, draft):
        model.reset()
    return context[len(prompt) :], counts


def _interval(ratios: list[float], seed: int = 0) -> tuple[float, float]:
    """Bootstrap 95% interval of the mean of per-prompt ratios."""
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(ratios, k=len(ratios))) for _ in range(2000))
    return means[50], means[1949]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument(
        "--warmup", type=int, default=4, help="further prompts that calibrated trees learn from before measuring"
    )
    parser.add_argument("--budgets", default="4,8")
    parser.add_argument("--rules", default=",".join(rule.value for rule in TreeRule))
    parser.add_argument("--temperatures", default="0,0.8")
    parser.add_argument(
        "--calibrated-only", action="store_true", help="leave out trees scored by the draft's raw probabilities"
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "tree-latest.json")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    target_model, draft_model = load_model(str(PAIR / "target")), load_model(str(PAIR / "draft"))
    assert target_model.tokenizer is not None
    target, draft = (Model(m.model, m.max_context) for m in (target_model, draft_model))
    every = [
        target_model.tokenizer(p, add_special_tokens=False)["input_ids"]
        for p in held_out_prompts(args.prompts + args.warmup)
    ]
    prompts, warmup = every[: args.prompts], every[args.prompts :]
    rules = [TreeRule(value) for value in args.rules.split(",")]
    results: list[dict[str, Any]] = []
    for temperature in (float(t) for t in args.temperatures.split(",")):
        params = SamplingParams(temperature=temperature)
        for budget in (int(b) for b in args.budgets.split(",")):
            # One child per node: every sampled rule draws a chain's tokens alike.
            chain_rule = None if params.greedy else TreeRule.WITHOUT_REPLACEMENT
            settings: list[tuple[str, Callable[[torch.Generator], TreeBuilder]]] = [
                ("chain", functools.partial(TreeBuilder, chain_rule, budget, width=1))
            ]
            if not params.greedy:  # a second exact chain, drawn another way: the noise floor of the ratios
                settings.append(
                    ("chain, i.i.d. draws", functools.partial(TreeBuilder, TreeRule.SAMPLED_IID, budget, width=1))
                )
            for rule in [None] if params.greedy else rules:
                name = "tree" if rule is None else f"tree {rule.value}"
                if not args.calibrated_only:
                    settings.append((name, functools.partial(TreeBuilder, rule, budget)))
                # Learnt over the prompts, as a service learns over requests.
                calibration = Calibration(budget)
                settings.append(
                    (f"{name} calibrated", functools.partial(TreeBuilder, rule, budget, calibration=calibration))
                )
            per_prompt: dict[str, list[Counts]] = {name: [] for name, _ in settings}
            outputs: dict[str, list[list[int]]] = {name: [] for name, _ in settings}
            for index, prompt in enumerate(warmup):
                for name, builder in settings:
                    if name.endswith("calibrated"):
                        generate(target, draft, prompt, args.tokens, params, builder, seed=-1 - index)
            for index, prompt in enumerate(prompts):
                for name, builder in settings:
                    output, counts = generate(target, draft, prompt, args.tokens, params, builder, seed=index)
                    per_prompt[name].append(counts)
                    outputs[name].append(output)
            chain = per_prompt["chain"]
            for name, _ in settings:
                runs = per_prompt[name]
                ratios = [(r.committed / r.rounds) / (c.committed / c.rounds) for r, c in zip(runs, chain, strict=True)]
                low, high = _interval(ratios)
                differing = sum(
                    o[: args.tokens] != c[: args.tokens] for o, c in zip(outputs[name], outputs["chain"], strict=True)
                )
                results.append(
                    {
                        "temperature": temperature,
                        "verify_tokens": budget,
                        "setting": name,
                        "committed_per_round": sum(r.committed for r in runs) / sum(r.rounds for r in runs),
                        "ratio_to_chain": statistics.fmean(ratios),
                        "ratio_interval": [low, high],
                        "draft_forwards_per_round": sum(r.draft_forwards for r in runs) / sum(r.rounds for r in runs),
                        "draft_tokens_per_round": sum(r.draft_tokens for r in runs) / sum(r.rounds for r in runs),
                        "greedy_outputs_differing_from_chain": differing if params.greedy else None,
                    }
                )
                print(_line(results[-1]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "when": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "regime": "clock-free (token counts), trained default pair, in-process",
        "prompts": args.prompts,
        "tokens": args.tokens,
        "results": results,
    }
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")


def _line(r: dict[str, Any]) -> str:
    low, high = r["ratio_interval"]
    temperature = "greedy" if r["temperature"] == 0 else f"t={r['temperature']}"
    differing = r["greedy_outputs_differing_from_chain"]
    note = f", {differing} outputs differ from the chain's" if differing else ""
    return (
        f"{temperature:7} V={r['verify_tokens']:2} {r['setting']:26} {r['committed_per_round']:.2f} tokens/round, "
        f"{r['ratio_to_chain']:.2f}x chain ({low:.2f}-{high:.2f}), draft {r['draft_forwards_per_round']:.1f} "
        f"forwards {r['draft_tokens_per_round']:.1f} tokens a round{note}"
    )


if __name__ == "__main__":
    main()
