"""`python -m bench.prefix`: prefix caching and cache-aware routing, on the default pair.

    python -m bench.prefix [--reps 2] [--workloads chat,document,routing,memory]

- **chat**: 8 conversations of 6 turns behind a shared prefix of 400 tokens. Each turn sends the whole
  conversation so far (the prefix, every earlier user message and answer) plus a new user message of
  40 tokens, and asks for 32 tokens; the 8 conversations run at once, each turn after the previous
  one's answer. Token-level prompts (random ids of the pair's vocabulary), sized so that turn 6 fits
  the default pair's 1,024-token context.
- **document**: 16 questions of 30 tokens about one document of 600 tokens, 4 at a time.

Each runs with prefix caching on and off (`--no-prefix-caching` on both services), interleaved over
repetitions. Reported: time to first token per turn (median over conversations, then over
repetitions; measured by the client), throughput (output tokens over the workload's wall time), and
the token-weighted hit rate (prompt tokens the target found cached over prompt tokens sent).

- **routing**: the chat workload with 2 target replicas and users who pause up to 1 s between turns,
  cache-aware routing against `--no-cache-aware-routing` (the least loaded replica, ties at random).
- **memory**: a target of 16,384 tokens of context (2 layers, 1 KB of keys and values per token,
  random weights) serves 16 short requests, then one 12,000-token prompt, then 16 short requests
  again; its RSS after each phase.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc
import psutil
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from specdec.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from tools.local_stack import DEFAULT_PAIR, LocalStack

SHARED_PREFIX = 400
TURNS = 6
CONVERSATIONS = 8
USER_TOKENS = 40
ANSWER_TOKENS = 32
DOCUMENT_TOKENS = 600
QUESTIONS = 16
QUESTION_TOKENS = 30
DOCUMENT_CONCURRENCY = 4
# Routing: users pause up to this long between turns, so that a conversation's next turn finds the
# replicas' loads as other conversations left them (without it, the replica a turn just left is the
# least loaded one when the next turn arrives, and least-loaded routing is sticky by accident).
THINK_S = 1.0


@dataclass
class Reply:
    prompt_tokens: int
    output_ids: list[int]
    ttft_s: float
    reused: int


@dataclass
class Run:
    workload: str
    arm: str
    rep: int
    seconds: float
    output_tokens: int
    prompt_tokens: int
    reused_tokens: int
    ttft_by_turn: list[float] = field(default_factory=list)  # median over conversations, per turn

    @property
    def hit_rate(self) -> float:
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds


async def _generate(stub: orchestrator_pb2_grpc.OrchestratorStub, prompt: list[int], max_new: int) -> Reply:
    request = orchestrator_pb2.GenerateRequest(
        token_ids=orchestrator_pb2.TokenIds(ids=prompt), max_new_tokens=max_new, temperature=0.0
    )
    started = time.perf_counter()
    first = 0.0
    ids: list[int] = []
    last = None
    async for message in stub.Generate(request):
        if message.token_ids and not first:
            first = time.perf_counter() - started
        ids.extend(message.token_ids)
        last = message
    assert last is not None
    return Reply(len(prompt), ids, first, last.stats.target_reused_prompt_tokens)


def _tokens(rng: random.Random, vocab: int, count: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(count)]


async def chat(
    address: str, vocab: int, seed: int, think_s: float = 0.0
) -> tuple[list[Reply], list[list[Reply]], float]:
    """The chat workload; its replies, by conversation then turn, and its wall time. With `think_s`, each
    user waits up to that long (uniformly) before the next turn."""
    rng = random.Random(seed)
    shared = _tokens(rng, vocab, SHARED_PREFIX)
    users = [[_tokens(rng, vocab, USER_TOKENS) for _ in range(TURNS)] for _ in range(CONVERSATIONS)]
    async with grpc.aio.insecure_channel(address) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)

        async def conversation(index: int) -> list[Reply]:
            history = list(shared)
            replies = []
            pauses = random.Random(seed * 100 + index)
            for turn in range(TURNS):
                if turn and think_s:
                    await asyncio.sleep(pauses.uniform(0, think_s))
                history += users[index][turn]
                reply = await _generate(stub, history, ANSWER_TOKENS)
                history += reply.output_ids
                replies.append(reply)
            return replies

        started = time.perf_counter()
        by_conversation = await asyncio.gather(*(conversation(i) for i in range(CONVERSATIONS)))
        seconds = time.perf_counter() - started
    return [r for c in by_conversation for r in c], list(by_conversation), seconds


async def document(address: str, vocab: int, seed: int) -> tuple[list[Reply], float]:
    rng = random.Random(seed)
    doc = _tokens(rng, vocab, DOCUMENT_TOKENS)
    questions = [_tokens(rng, vocab, QUESTION_TOKENS) for _ in range(QUESTIONS)]
    gate = asyncio.Semaphore(DOCUMENT_CONCURRENCY)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)

        async def ask(question: list[int]) -> Reply:
            async with gate:
                return await _generate(stub, doc + question, ANSWER_TOKENS)

        started = time.perf_counter()
        replies = await asyncio.gather(*(ask(q) for q in questions))
    return list(replies), time.perf_counter() - started


def _stack(
    pair: Path,
    caching: bool,
    routing: bool = True,
    replicas: int = 1,
    log_dir: Path | None = None,
    extra: Sequence[str] = (),
) -> LocalStack:
    service = [] if caching else ["--no-prefix-caching"]
    orchestrator = [*extra] if routing else ["--no-cache-aware-routing"]
    return LocalStack(
        str(pair / "target"),
        str(pair / "draft"),
        extra_service_args=service,
        extra_orchestrator_args=orchestrator,
        target_replicas=replicas,
        log_dir=log_dir,
    )


def _run(workload: str, arm: str, rep: int, stack: LocalStack, vocab: int) -> Run:
    seed = 1000 + rep
    if workload == "document":
        replies, seconds = asyncio.run(document(stack.orchestrator_address, vocab, seed))
        ttft = [statistics.median(r.ttft_s for r in replies)]
    else:
        think = THINK_S if workload == "routing" else 0.0
        replies, conversations, seconds = asyncio.run(chat(stack.orchestrator_address, vocab, seed, think))
        ttft = [statistics.median(c[turn].ttft_s for c in conversations) for turn in range(TURNS)]
    return Run(
        workload,
        arm,
        rep,
        seconds,
        sum(len(r.output_ids) for r in replies),
        sum(r.prompt_tokens for r in replies),
        sum(r.reused for r in replies),
        ttft,
    )


ARMS: dict[str, list[tuple[str, dict[str, Any]]]] = {
    "chat": [("caching on", {"caching": True}), ("caching off", {"caching": False})],
    "document": [("caching on", {"caching": True}), ("caching off", {"caching": False})],
}


def routing_arms(slacks: Sequence[int]) -> list[tuple[str, dict[str, Any]]]:
    """Cache-aware routing at each load slack, then the least loaded replica (the ratios' base)."""
    arms: list[tuple[str, dict[str, Any]]] = [
        (f"cache-aware, slack {slack}", {"caching": True, "replicas": 2, "extra": ["--route-load-slack", str(slack)]})
        for slack in slacks
    ]
    return [*arms, ("least loaded", {"caching": True, "routing": False, "replicas": 2})]


def run_workload(
    workload: str, reps: int, pair: Path, vocab: int, log_dir: Path, slacks: Sequence[int] = (4,)
) -> list[Run]:
    """Every arm once a repetition, in a rotated order; a fresh stack per run (nothing cached before it)."""
    runs = []
    arms = routing_arms(slacks) if workload == "routing" else ARMS[workload]
    for rep in range(reps):
        for i in range(len(arms)):
            arm, options = arms[(i + rep) % len(arms)]
            with _stack(pair, log_dir=log_dir / f"{workload}-{rep}-{i}", **options) as stack:
                asyncio.run(document(stack.orchestrator_address, vocab, seed=7))  # warm-up, on other tokens
                runs.append(_run(workload, arm, rep, stack, vocab))
            print(json.dumps(asdict(runs[-1]) | {"hit_rate": runs[-1].hit_rate}), flush=True)
    return runs


def summarise(runs: list[Run]) -> list[dict[str, object]]:
    rows = []
    for workload in dict.fromkeys(r.workload for r in runs):
        arms = list(dict.fromkeys(r.arm for r in runs if r.workload == workload))
        base = arms[-1]
        for arm in arms:
            mine = [r for r in runs if r.workload == workload and r.arm == arm]
            ratios = []
            for run in mine:
                other = next(r for r in runs if r.workload == workload and r.arm == base and r.rep == run.rep)
                ratios.append(run.tokens_per_second / other.tokens_per_second)
            turns = len(mine[0].ttft_by_turn)
            rows.append(
                {
                    "workload": workload,
                    "arm": arm,
                    "tokens_per_second": statistics.median(r.tokens_per_second for r in mine),
                    "throughput_ratio": statistics.median(ratios),
                    "hit_rate": statistics.median(r.hit_rate for r in mine),
                    "ttft_ms_by_turn": [
                        round(1000 * statistics.median(r.ttft_by_turn[t] for r in mine), 1) for t in range(turns)
                    ],
                }
            )
    return rows


def table(rows: list[dict[str, object]]) -> str:
    lines = [
        "| workload | arm | tok/s | x last arm | hit rate | time to first token by turn (ms) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        ttft = ", ".join(str(t) for t in row["ttft_ms_by_turn"])  # type: ignore[attr-defined]
        lines.append(
            f"| {row['workload']} | {row['arm']} | {row['tokens_per_second']:.1f} | {row['throughput_ratio']:.2f}x "
            f"| {row['hit_rate']:.2f} | {ttft} |"
        )
    return "\n".join(lines)


# --- memory --------------------------------------------------------------------------------------


def build_long_context_target(folder: Path) -> Path:
    """A Llama of 16,384 tokens of context, 2 layers, 1 KB of keys and values a token (float32: 2 layers x
    keys and values x 2 heads x 32 dims x 4 bytes), with the default pair's tokenizer; random weights."""
    if (folder / "config.json").exists():
        return folder
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_PAIR / "target")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=16384,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def memory(folder: Path, log_dir: Path) -> dict[str, object]:
    model = build_long_context_target(folder)
    vocab = len(AutoTokenizer.from_pretrained(model))
    rng = random.Random(0)

    async def phase(address: str, prompts: list[list[int]], max_new: int) -> None:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
            await asyncio.gather(*(_generate(stub, p, max_new) for p in prompts))

    with LocalStack(str(model), None, log_dir=log_dir / "memory") as stack:
        process = psutil.Process(stack.pids["target"])

        def rss() -> float:
            return process.memory_info().rss / 2**20

        readings = {"started": rss()}
        asyncio.run(phase(stack.orchestrator_address, [_tokens(rng, vocab, 20) for _ in range(16)], 8))
        readings["after 16 short"] = rss()
        asyncio.run(phase(stack.orchestrator_address, [_tokens(rng, vocab, 12000)], 4))
        readings["after one 12,000-token prompt"] = rss()
        asyncio.run(phase(stack.orchestrator_address, [_tokens(rng, vocab, 20) for _ in range(16)], 8))
        readings["after 16 short again"] = rss()
    kv_mb = 12000 * 1024 / 2**20
    growth = readings["after one 12,000-token prompt"] - readings["after 16 short"]
    return {
        "rss_mb": {k: round(v, 1) for k, v in readings.items()},
        "prompt_kv_mb": round(kv_mb, 1),
        "growth_mb": round(growth, 1),
        "growth_over_kv": round(growth / kv_mb, 2),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="bench.prefix", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--workloads", default="chat,document,routing,memory")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--slacks", default="4", help="routing: the --route-load-slack values to compare")
    args = parser.parse_args(argv)
    vocab = len(AutoTokenizer.from_pretrained(DEFAULT_PAIR / "target"))
    workloads = [w for w in args.workloads.split(",") if w]
    result: dict[str, object] = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
    with tempfile.TemporaryDirectory() as scratch:
        log_dir = Path(scratch) / "logs"
        runs: list[Run] = []
        for workload in workloads:
            if workload == "memory":
                result["memory"] = memory(Path(scratch) / "long-context", log_dir)
                print(json.dumps(result["memory"], indent=1))
            else:
                slacks = [int(s) for s in args.slacks.split(",") if s]
                runs += run_workload(workload, args.reps, DEFAULT_PAIR, vocab, log_dir, slacks)
        rows = summarise(runs) if runs else []
    result["rows"] = rows
    result["runs"] = [asdict(r) for r in runs]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "prefix-latest.json").write_text(json.dumps(result, indent=1))
    if rows:
        print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
