"""The batched forward when streams end and start at different steps (`python -m bench.staggered`).

C closed-loop streams over the held-out prompts, each generating its own number of tokens (32 to 95,
so streams end at different steps and new ones take their place), run through a model service's own
forward (the target's `BatchedForward`, the draft's `LeanDraft`) in this process, with the engine's
split of rows into forwards by width. No gRPC, no orchestrator: what the key-value windows cost shows
without the noise of three processes on two cores. Reports the loop's tokens per second, the median
steady forward (every row one token, or K + 1 with `--verify K`), and how many rows a forward gathered
from the blocks.

`--verify K` feeds verify rows (the last token and K drafted ones; each drafted token accepted with
probability 0.7 after the one before, the rest rolled back), and `--presence P` puts each stream in
an iteration's forwards with probability P, as a verify batch holds whichever sessions' rounds have
arrived (seeded: every run feeds the same rows).

    python -m bench.staggered --model target --concurrency 32 --reps 3
    python -m bench.staggered --model target --verify 2 --presence 0.7
"""

from __future__ import annotations

import argparse
import heapq
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from default_models.prompts import held_out_prompts
from draft_service.lean import LeanDraft
from model_host.batching import group_ends
from model_host.config import ModelServiceConfig
from model_host.engine import DEFAULT_OVERHEAD_TOKENS
from model_host.forward import BatchedForward, Forward
from model_host.kv_blocks import BlockStore
from model_host.kv_memory import pool_size
from model_host.loading import LoadedModel, load_model
from model_host.rows import Row
from tools.local_stack import DEFAULT_PAIR


@dataclass
class _Stream:
    start: int  # tokens cached
    feed: list[int]  # tokens to feed next
    wanted: int  # tokens to generate
    generated: int = 0


ACCEPTANCE = 0.7  # each drafted token's, under --verify


def run(
    loaded: LoadedModel, model: str, concurrency: int, prompts: list[list[int]], verify: int = 0, presence: float = 1.0
) -> dict[str, float]:
    """One pass over 2 x C requests; the loop's figures."""
    rng = random.Random(0)
    defaults = ModelServiceConfig()
    budget = pool_size(  # the services' default
        defaults.max_cached_tokens, loaded, defaults.max_sessions, defaults.max_batch_size, defaults.kv_block_tokens
    ).tokens
    store = BlockStore(loaded.input_device, loaded.dtype, loaded.max_context, budget)
    forward: Forward | None = LeanDraft.attach(loaded.model, store) if model == "draft" else None
    forward = forward or BatchedForward(loaded.model, store)
    requests = [(prompts[i % len(prompts)], 32 + (i * 37) % 64) for i in range(max(len(prompts), 2 * concurrency))]
    free: list[int] = []  # slots of ended streams
    active: dict[int, _Stream] = {}  # by slot
    steady_seconds: list[float] = []  # forwards whose rows are all K + 1 wide
    forwards = tokens = 0
    started = time.perf_counter()
    with torch.inference_mode():
        while requests or active:
            while requests and len(active) < concurrency:
                prompt, wanted = requests.pop(0)
                slot = heapq.heappop(free) if free else len(active)  # slots in use are 0 .. len(active) - 1
                start = store.reuse(slot, prompt, len(prompt) - 1, b"")
                active[slot] = _Stream(start, prompt[start:], wanted)
            rows = sorted(
                (
                    Row(slot, s.start, s.feed, len(s.feed) if s.generated else 1)
                    for slot, s in active.items()
                    if rng.random() < presence
                ),
                key=lambda r: len(r.token_ids),
            )
            first = 0
            for end in group_ends([len(row.token_ids) for row in rows], DEFAULT_OVERHEAD_TOKENS):
                group, first = rows[first:end], end
                forward_started = time.perf_counter()
                logits = forward(group)
                if all(len(row.token_ids) == verify + 1 for row in group):
                    steady_seconds.append(time.perf_counter() - forward_started)
                forwards += 1
                for row, row_logits in zip(group, logits, strict=True):
                    assert row_logits is not None
                    stream = active[row.slot]
                    accepted = 0  # drafted tokens kept
                    if stream.generated:  # a round: its last token and the accepted drafts stay
                        while accepted < verify and rng.random() < ACCEPTANCE:
                            accepted += 1
                        stream.start += 1 + accepted
                        if accepted < verify:
                            store.truncate(row.slot, stream.start)  # the rejected drafts roll back
                    else:  # the prompt
                        stream.start += len(row.token_ids)
                    token = int(row_logits[-1].argmax())
                    stream.feed = [token] * (verify + 1)  # the next round: that token and K drafts
                    committed = min(accepted + 1, stream.wanted - stream.generated)
                    stream.generated += committed
                    tokens += committed
                    if stream.generated == stream.wanted:
                        del active[row.slot]
                        forward.release(row.slot)
                        heapq.heappush(free, row.slot)
    seconds = time.perf_counter() - started
    return {
        "tokens_per_second": tokens / seconds,
        "steady_forward_ms": 1000 * statistics.median(steady_seconds) if steady_seconds else float("nan"),
        "rows_gathered_per_forward": store.windows.rows_gathered / forwards,
        "forwards_gathering_nothing": store.windows.continued / forwards,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("target", "draft"), default="target")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: as a pinned service)")
    parser.add_argument(
        "--verify", type=int, default=0, metavar="K", help="verify rows of K drafted tokens (0: decode)"
    )
    parser.add_argument("--presence", type=float, default=1.0, help="each stream's chance to be in an iteration")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    loaded = load_model(str(DEFAULT_PAIR / args.model))
    assert loaded.tokenizer is not None
    prompts = [list(loaded.tokenizer(text)["input_ids"]) for text in held_out_prompts(24)]
    if not 0 < args.presence <= 1 or args.verify < 0:
        parser.error("--presence must be in (0, 1] and --verify at least 0")
    results = [run(loaded, args.model, args.concurrency, prompts, args.verify, args.presence) for _ in range(args.reps)]
    print(
        f"{args.model}, {args.concurrency} staggered streams, verify K = {args.verify}, presence {args.presence}, "
        f"{args.reps} runs, medians:"
    )
    for key in results[0]:
        print(f"  {key}: {statistics.median(r[key] for r in results):.3g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
