"""`make soak`: many clients for minutes, with faults of their own making, on loopback.

    python -m bench.soak [--minutes 10] [--clients 32]

32 clients send requests back to back: random prompt lengths, greedy and sampling settings, K and
policies, a share cancelled at a random point and a share of bad requests. The run samples each
process's RSS (the services take their key-value pool whole at start, so RSS is their memory from
then on) and the services' session and cached-token gauges, checks a sample of greedy outputs
against the target decoding alone, and reports: requests served, errors by status (only the expected
ones: INVALID_ARGUMENT for the bad requests, CANCELLED for the cancellations), RSS growth per process
after warm-up (goal under 10%), sessions at the end (goal 0). Bounded in count and time; loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc
import psutil
import torch

from model_host.loading import LoadedModel, load_model
from serving.protocol import DRAFT_METHOD_BY_NAME, POLICY_BY_NAME
from specdec.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from tools.local_stack import DEFAULT_PAIR, LocalStack

_WARM_UP_SHARE = 0.2  # RSS growth is measured from the end of this share of the run
_SAMPLE_EVERY_S = 1.0
_NEAR_TIE = 1e-4
_BAD: list[dict[str, Any]] = [
    {"temperature": -1.0},
    {"top_p": 2.0, "temperature": 1.0},
    {"num_speculative_tokens": 999},
    {"max_new_tokens": 0},
    {"stop": ["x" * 300]},
    {"request_id": "bad\nid"},
]


@dataclass
class SoakReport:
    seconds: float
    clients: int
    served: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    unexpected: list[str] = field(default_factory=list)
    # Per process, RSS (the services' key-value pool included: taken whole at start). Growth: the
    # highest sample after warm-up over the first one (allocator swings count as growth).
    rss_growth: dict[str, float] = field(default_factory=dict)
    rss_trend: dict[str, float] = field(default_factory=dict)  # median of the last fifth over the first fifth
    rss_mb: dict[str, list[float]] = field(default_factory=dict)  # sampled through the run
    kv_pool_mb: dict[str, float] = field(default_factory=dict)  # the pool's resident MB at the end
    sessions_at_end: dict[str, float] = field(default_factory=dict)
    cached_tokens_at_end: dict[str, float] = field(default_factory=dict)
    greedy_checked: int = 0
    greedy_near_ties: list[float] = field(default_factory=list)
    greedy_mismatches: int = 0

    @property
    def ok(self) -> bool:
        return (
            not self.unexpected
            and not self.greedy_mismatches
            and all(v == 0 for v in self.sessions_at_end.values())
            and self.served > 0
        )


def _gauge(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    values = [float(v) for v in re.findall(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)", text, re.M)]
    return sum(values)


def _request(rng: random.Random, vocab: int) -> tuple[orchestrator_pb2.GenerateRequest, str]:
    """A random request and what it is: "greedy", "sampled", "cancel" or "bad"."""
    prompt = [rng.randrange(1, vocab) for _ in range(rng.choice([1, 4, 16, 60, 200]))]
    request = orchestrator_pb2.GenerateRequest(
        token_ids=orchestrator_pb2.TokenIds(ids=prompt), max_new_tokens=rng.choice([8, 32, 64])
    )
    kind = rng.choices(["greedy", "sampled", "cancel", "bad"], weights=[5, 3, 1, 1])[0]
    request.speculation_policy = POLICY_BY_NAME[rng.choice(["fixed", "fixed", "heuristic", "load_aware"])]
    request.num_speculative_tokens = rng.choice([0, 1, 2, 4])
    request.draft_method = DRAFT_METHOD_BY_NAME[rng.choice(["model", "model", "model", "hybrid"])]
    if kind == "sampled":
        request.temperature = rng.choice([0.7, 1.0])
        request.top_p = rng.choice([0.9, 1.0])
        request.seed = rng.getrandbits(64)
    if kind == "bad":
        for name, value in rng.choice(_BAD).items():
            if name == "stop":
                request.stop.extend(value)
            else:
                setattr(request, name, value)
    return request, kind


async def _client(
    stub: orchestrator_pb2_grpc.OrchestratorStub,
    seed: int,
    vocab: int,
    deadline: float,
    report: SoakReport,
    greedy: list[tuple[list[int], list[int]]],
) -> None:
    rng = random.Random(seed)
    while time.monotonic() < deadline:
        request, kind = _request(rng, vocab)
        call = stub.Generate(request)
        cancel_after = rng.randrange(1, 4) if kind == "cancel" else -1
        ids: list[int] = []
        try:
            async for message in call:
                ids.extend(message.token_ids)
                cancel_after -= 1
                if cancel_after == 0:
                    call.cancel()
                    break
            if cancel_after == 0:
                report.errors["CANCELLED"] = report.errors.get("CANCELLED", 0) + 1
                continue
            report.served += 1
            if kind == "greedy" and len(greedy) < 200:
                greedy.append((list(request.token_ids.ids), ids))
        except grpc.aio.AioRpcError as exc:
            code = exc.code().name
            report.errors[code] = report.errors.get(code, 0) + 1
            expected = {"bad": "INVALID_ARGUMENT", "cancel": "CANCELLED"}.get(kind)
            if code != expected:
                report.unexpected.append(f"{kind}: {code}: {exc.details()}")


def _check_greedy(target: LoadedModel, samples: list[tuple[list[int], list[int]]], report: SoakReport) -> None:
    """Greedy outputs against the target decoding alone; a difference must be a float near tie.

    One forward over prompt + output gives the target's argmax after every prefix of the output: where
    they all equal the output, decoding alone produces exactly it, so no token-by-token decode is needed.
    """
    for prompt, got in samples[:40]:
        with torch.inference_mode():
            logits = target.model(torch.tensor([prompt + got])).logits[0, len(prompt) - 1 : -1]  # [len(got), vocab]
        report.greedy_checked += 1
        expected = logits.argmax(-1).tolist()
        if expected == got:
            continue
        first = next(i for i, (a, b) in enumerate(zip(expected, got, strict=True)) if a != b)
        top = logits[first].topk(2).values
        gap = float(top[0] - top[1])
        if gap < _NEAR_TIE:
            report.greedy_near_ties.append(gap)
        else:
            report.greedy_mismatches += 1


async def _load(address: str, clients: int, seconds: float, vocab: int, report: SoakReport, greedy: list) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
        deadline = time.monotonic() + seconds
        await asyncio.gather(*(_client(stub, seed, vocab, deadline, report, greedy) for seed in range(clients)))


def run_soak(
    minutes: float,
    clients: int,
    target_model: str,
    draft_model: str,
    log_dir: Path | None,
    warm_up_share: float = _WARM_UP_SHARE,
) -> SoakReport:
    """Run the soak; RSS growth is measured from the end of `warm_up_share` of the run."""
    seconds = minutes * 60
    report = SoakReport(seconds=seconds, clients=clients)
    target = load_model(target_model)
    greedy: list[tuple[list[int], list[int]]] = []
    extra = ["--max-new-tokens-cap", "256", "--max-queue-wait-s", "120"]
    with LocalStack(
        target_model, draft_model, extra_orchestrator_args=extra, log_dir=log_dir, with_metrics=True
    ) as stack:
        processes = {
            name: psutil.Process(p.pid)
            for name, p in zip(("target", "draft", "orchestrator"), stack.processes, strict=True)
        }
        rss: dict[str, list[tuple[float, float, float]]] = {name: [] for name in processes}  # (t, RSS, pool) MB
        stop = asyncio.Event()

        def pool_mb(name: str) -> float:
            port = stack.metrics_ports.get(name)
            return _gauge(port, "specdec:kv_resident_bytes") / 2**20 if port else 0.0

        async def sample() -> None:
            started = time.monotonic()
            while not stop.is_set():
                for name, process in processes.items():
                    pool = await asyncio.to_thread(pool_mb, name)
                    rss[name].append((time.monotonic() - started, process.memory_info().rss / 2**20, pool))
                await asyncio.sleep(_SAMPLE_EVERY_S)

        async def main() -> None:
            sampler = asyncio.create_task(sample())
            await _load(stack.orchestrator_address, clients, seconds, target.vocab_size, report, greedy)
            stop.set()
            await sampler

        asyncio.run(main())
        time.sleep(1.0)  # cancelled streams close on the services
        for name in ("target", "draft"):
            port = stack.metrics_ports[name]
            report.sessions_at_end[name] = _gauge(port, "specdec:open_sessions")
            report.cached_tokens_at_end[name] = _gauge(port, "specdec:cached_tokens")
    for name, points in rss.items():
        after = [mb for t, mb, _ in points if t >= warm_up_share * seconds]
        if after:
            report.rss_growth[name] = max(after) / after[0] - 1.0
            fifth = max(1, len(after) // 5)
            report.rss_trend[name] = statistics.median(after[-fifth:]) / statistics.median(after[:fifth]) - 1.0
        report.rss_mb[name] = [round(mb, 1) for _, mb, _ in points[:: max(1, len(points) // 20)]]
        report.kv_pool_mb[name] = round(points[-1][2], 1) if points else 0.0
    _check_greedy(target, greedy, report)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="bench.soak", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--target-model", default=str(DEFAULT_PAIR / "target"))
    parser.add_argument("--draft-model", default=str(DEFAULT_PAIR / "draft"))
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    report = run_soak(args.minutes, args.clients, args.target_model, args.draft_model, args.out / "soak-logs")
    summary = asdict(report) | {"ok": report.ok}
    (args.out / "soak-latest.json").write_text(json.dumps(summary, indent=1))
    errors = ", ".join(f"{code} {count}" for code, count in sorted(report.errors.items())) or "none"
    growth = ", ".join(f"{name} {100 * g:+.1f}%" for name, g in report.rss_growth.items())
    print(f"served {report.served} requests in {report.seconds:.0f} s with {report.clients} clients")
    print(f"errors by status: {errors}; unexpected: {len(report.unexpected)} {report.unexpected[:3]}")
    trend = ", ".join(f"{name} {100 * g:+.1f}%" for name, g in report.rss_trend.items())
    print(f"RSS growth after warm-up ({100 * _WARM_UP_SHARE:.0f}% of the run): {growth} (goal under +10%); "
          f"trend (last fifth over first): {trend}; pool at the end: {report.kv_pool_mb} MB")  # fmt: skip
    print(f"sessions at the end: {report.sessions_at_end}; cached tokens: {report.cached_tokens_at_end}")
    print(f"greedy outputs checked: {report.greedy_checked}; near ties: {report.greedy_near_ties}; "
          f"mismatches: {report.greedy_mismatches}")  # fmt: skip
    print("OK" if report.ok else "FAILED")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
