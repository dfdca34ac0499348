"""`python -m bench.host_cpu` (`make host-bench`): the hosts' CPU per generated token, every process.

    python -m bench.host_cpu [--streams 1,8,64] [--rounds 3] [--against REV] [--orchestrator-args "..."]

CPU REGIME, NEAR-NULL PAIR. The near-null pair (bench/null_pair.py: one layer of width 32, the same
weights as target and draft) makes a forward cost about what a GPU's decode step costs relative to the
hosts' own work, so what this bench reads is the serving stack's CPU: per process (target, draft,
orchestrator, and the client, a lean grpc.aio client in a process of its own), CPU microseconds per
generated token from each process's CPU-time clock over the run (bench/load.py `_process_cpu`), and the
target's figure without its forwards (the engine's forward seconds from its metrics; one torch thread,
so a forward's wall is its CPU).

Each stream sends 3 requests of 64 tokens back to back (token-id prompts, `ignore_eos`, greedy). Cells:
the target alone (K = 0), fixed K = 4 and `load_aware` with K up to 4 (the orchestrator's default
policy), with the identical draft, at each stream count; each request names its policy.

A second table gives where a target step's time went, from the orchestrator's step clock
(`specdec:step_seconds`): the service's forwards, its queue before the first, its other host work, the
transport (the round trip less the service's own time: the network, gRPC, and both processes' event
loops), and the time between the step's answer and the session's next step. Last, the transport's
floor on this machine (bench/floor.py).

`--against REV` runs another revision's services and orchestrator beside this tree's (a git worktree,
as bench.compare makes one), and the cells alternate between the trees round by round; the table then
gives both trees' medians and the median of the paired ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

from bench.compare import geomean, interval, worktree
from bench.floor import transport_floor
from bench.load import _forward_seconds, _process_cpu, outside_scrapes, scrape, totals
from bench.null_pair import build_null_pair
from orchestrator.step_timing import StepClock
from serving.protocol import POLICY_BY_NAME
from specdec.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from tools.local_stack import LOOPBACK, LocalStack, free_port

THIS, OTHER = "this", "other"
# A cell: its K, and the policy the requests ask for (the orchestrator's default is load_aware).
CELLS = {"K = 0": (0, "fixed"), "fixed K = 4": (4, "fixed"), "load_aware to K = 4": (4, "load_aware")}
REQUESTS_PER_STREAM = 3
PROMPT = list(range(100, 132))  # 32 token ids


async def _drive(address: str, streams: int, k: int, max_new_tokens: int, policy: str) -> dict[str, float]:
    """`streams` clients, each sending its requests back to back; tokens and seconds."""
    tokens = 0

    async def client(stub: orchestrator_pb2_grpc.OrchestratorStub, index: int) -> None:
        nonlocal tokens
        for n in range(REQUESTS_PER_STREAM):
            request = orchestrator_pb2.GenerateRequest(
                token_ids=orchestrator_pb2.TokenIds(ids=[*PROMPT, index % 1000, n]),
                max_new_tokens=max_new_tokens,
                num_speculative_tokens=k,
                speculation_policy=POLICY_BY_NAME[policy],
                ignore_eos=True,
            )
            async for message in stub.Generate(request):
                tokens += len(message.token_ids)

    async with grpc.aio.insecure_channel(address) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
        await client(stub, 999)  # warm: the first request's allocations are not measured
        tokens = 0
        cpu, started = time.process_time(), time.perf_counter()
        await asyncio.gather(*(client(stub, i) for i in range(streams)))
        return {"tokens": tokens, "seconds": time.perf_counter() - started, "cpu": time.process_time() - cpu}


async def _drive_http(url: str, streams: int, k: int, max_new_tokens: int, policy: str) -> dict[str, float]:
    """As `_drive`, through the OpenAI-compatible API: streamed completions of token-id prompts."""
    import httpx2 as httpx

    tokens = 0

    async def client(http: httpx.AsyncClient, index: int) -> None:
        nonlocal tokens
        for n in range(REQUESTS_PER_STREAM):
            body = {"prompt": [*PROMPT, index % 1000, n], "max_tokens": max_new_tokens, "temperature": 0,
                    "stream": True, "ignore_eos": True, "num_speculative_tokens": k, "speculation_policy": policy,
                    "stream_options": {"include_usage": True}}  # fmt: skip
            async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: {") and '"usage":{' in line.replace(" ", ""):
                        usage = json.loads(line[6:]).get("usage") or {}
                        tokens += usage.get("completion_tokens", 0)

    limits = httpx.Limits(max_connections=streams + 1, max_keepalive_connections=streams + 1)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        await client(http, 999)
        tokens = 0
        cpu, started = time.process_time(), time.perf_counter()
        await asyncio.gather(*(client(http, i) for i in range(streams)))
        return {"tokens": tokens, "seconds": time.perf_counter() - started, "cpu": time.process_time() - cpu}


def _cell(
    stack: LocalStack,
    streams: int,
    cell: tuple[int, str],
    max_new_tokens: int,
    target: str = "",
    extra: dict[str, int] | None = None,
) -> dict[str, Any]:
    """One run of `cell` (K, policy): tokens per second and CPU microseconds per token by process
    (`target`: an HTTP URL to drive instead of the orchestrator's gRPC port; `extra`: more processes to
    measure, by name), and where a target step's time went."""
    ports = stack.metrics_ports

    def read_metrics() -> dict[str, float]:
        text = scrape(ports["orchestrator"])
        clock = totals(text, "specdec:step_seconds_total", "service", "part")
        steps = totals(text, "specdec:steps_total")
        return {"target forwards": _forward_seconds(ports["target"]).get("target", 0.0),
                "target steps": steps.get("target", 0.0),
                **{part: clock.get(f"target:{part}", 0.0) for part in StepClock.PARTS}}  # fmt: skip

    def usage(before: bool) -> dict[str, float]:
        cpu, scraped = outside_scrapes(
            before,
            lambda: {name: _process_cpu(pid) for name, pid in {**stack.pids, **(extra or {})}.items()},
            read_metrics,
        )
        return {**cpu, **scraped}

    before = usage(before=True)
    client = subprocess.run(
        [sys.executable, "-m", "bench.host_cpu", "--drive", target or stack.orchestrator_address,
         "--streams", str(streams), "--k", str(cell[0]), "--policy", cell[1], "--max-new-tokens", str(max_new_tokens)],
        capture_output=True, text=True,
    )  # fmt: skip
    if client.returncode:
        raise SystemExit(f"the client failed:\n{client.stderr[-3000:]}")
    driven = json.loads(client.stdout.strip().splitlines()[-1])
    after = usage(before=False)
    tokens = max(1, driven["tokens"])
    # The client's warm-up request falls inside the services' window: counted out by its share.
    share = tokens / (tokens + max_new_tokens)
    used = {name: share * (after[name] - before[name]) for name in after}
    per_token = {name: 1e6 * used[name] / tokens for name in {**stack.pids, **(extra or {})}}
    per_token["client"] = 1e6 * driven["cpu"] / tokens
    per_token["target outside forwards"] = 1e6 * (used["target"] - used["target forwards"]) / tokens
    # Where a target step's time went, from the orchestrator's step clock (absent in a revision without it)
    steps = after["target steps"] - before["target steps"]
    per_step = {part: 1e6 * (after[part] - before[part]) / steps for part in StepClock.PARTS} if steps else {}
    return {
        "tokens_per_second": driven["tokens"] / driven["seconds"],
        "us_per_token": per_token,
        "us_per_step": per_step,
    }


PROCESSES = ["orchestrator", "target", "target outside forwards", "draft", "client"]


def _ratio(result: dict[str, Any], process: str) -> float:
    """The other tree's CPU per token over this tree's (above 1: this tree spends less)."""
    this, other = (result[tree]["us_per_token"].get(process, 0.0) for tree in (THIS, OTHER))
    return other / this if this > 0 else float("nan")


def table(results: list[dict[str, Any]], trees: Sequence[str]) -> str:
    lines = [
        "CPU regime, near-null pair, --threads 1 per service: medians over rounds; CPU µs per generated token",
        "",
        "| streams | cell | tree | tok/s | " + " | ".join(PROCESSES) + " |",
        "|---|---|---|---|" + "---|" * len(PROCESSES),
    ]
    cells = _by_cell(results)
    for (streams, cell), group in cells.items():
        medians = {}
        for tree in trees:
            runs = [r[tree] for r in group]
            medians[tree] = {
                "tok/s": statistics.median(r["tokens_per_second"] for r in runs),
                **{p: statistics.median(r["us_per_token"].get(p, 0.0) for r in runs) for p in PROCESSES},
            }
            row = medians[tree]
            lines.append(
                f"| {streams} | {cell} | {tree} | {row['tok/s']:,.0f} | "
                + " | ".join(f"{row[p]:,.0f}" for p in PROCESSES)
                + " |"
            )
        if len(trees) == 2:
            ratios = {p: statistics.median(_ratio(r, p) for r in group) for p in PROCESSES}
            speed = statistics.median(r[THIS]["tokens_per_second"] / r[OTHER]["tokens_per_second"] for r in group)
            lines.append(
                f"| {streams} | {cell} | other / this (paired) | {speed:.2f}x | "
                + " | ".join(f"{ratios[p]:.2f}x" for p in PROCESSES)
                + " |"
            )
    return "\n".join(lines)


def _by_cell(results: list[dict[str, Any]]) -> dict[tuple[int, str], list[dict[str, Any]]]:
    """The rounds' results of each (streams, cell), in the order first run."""
    cells: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for result in results:
        cells.setdefault((result["streams"], result["cell"]), []).append(result)
    return cells


def step_table(results: list[dict[str, Any]], trees: Sequence[str]) -> str:
    """Where a target step's time went (the orchestrator's step clock), medians over rounds."""
    lines = [
        "Where a target step's time goes: µs a step, medians over rounds (`specdec:step_seconds`)",
        "",
        "| streams | cell | tree | " + " | ".join(StepClock.PARTS) + " |",
        "|---|---|---|" + "---|" * len(StepClock.PARTS),
    ]
    cells = _by_cell(results)
    for (streams, cell), group in cells.items():
        for tree in trees:
            runs = [r[tree]["us_per_step"] for r in group if r[tree].get("us_per_step")]
            if runs:
                row = " | ".join(f"{statistics.median(r[part] for r in runs):,.0f}" for part in StepClock.PARTS)
                lines.append(f"| {streams} | {cell} | {tree} | {row} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.host_cpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--streams", default="1,8,64")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--cells", default=",".join(CELLS), help=f"of {', '.join(CELLS)}")
    parser.add_argument("--against", default="", help="a git revision whose stack runs beside this tree's")
    parser.add_argument("--orchestrator-args", default="", help="more flags for this tree's orchestrator")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument(
        "--paths", action="store_true",
        help="K = 0 through gRPC, the OpenAI API in the orchestrator's process (--http-port) and the separate "
        "gateway, this tree alone: orchestrator and gateway CPU per token",
    )  # fmt: skip
    parser.add_argument("--drive", default="", help=argparse.SUPPRESS)  # the client process
    parser.add_argument("--k", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--policy", default="fixed", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.drive:
        drive = _drive_http if args.drive.startswith("http") else _drive
        print(json.dumps(asyncio.run(drive(args.drive, int(args.streams), args.k, args.max_new_tokens, args.policy))))
        return 0
    if args.paths:
        return _paths(args)
    cells = [name.strip() for name in args.cells.split(",") if name.strip()]
    unknown = [name for name in cells if name not in CELLS]
    if unknown:
        parser.error(f"--cells: unknown {unknown}; choose from {list(CELLS)}")
    streams = [int(s) for s in args.streams.split(",") if s]
    repo = Path(__file__).resolve().parent.parent
    pair = build_null_pair(args.out / "null_pair").resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="specdec-host-") as scratch:
        trees = {THIS: repo}
        if args.against:
            trees[OTHER] = Path(scratch) / "tree"
            worktree(repo, args.against, trees[OTHER])
        try:
            stacks = {
                tree: LocalStack(
                    str(pair / "target"), str(pair / "draft"), extra_service_args=["--threads", "1"],
                    extra_orchestrator_args=shlex.split(args.orchestrator_args) if tree == THIS else [],
                    with_metrics=True, log_dir=args.out / "host-logs" / tree, cwd=cwd,
                )
                for tree, cwd in trees.items()
            }  # fmt: skip
            with contextlib.ExitStack() as entered:
                for stack in stacks.values():
                    entered.enter_context(stack)
                for rep in range(args.rounds):
                    for count in streams:
                        for cell in cells:
                            order = list(trees) if len(results) % 2 == 0 else list(reversed(trees))
                            runs = {
                                tree: _cell(stacks[tree], count, CELLS[cell], args.max_new_tokens) for tree in order
                            }
                            results.append({"round": rep, "streams": count, "cell": cell, **runs})
                    print(f"round {rep + 1} of {args.rounds} done", flush=True)
        finally:
            if args.against:
                subprocess.run(
                    ["git", "-C", str(repo), "worktree", "remove", "--force", str(trees[OTHER])], check=False
                )
    floors = transport_floor()
    print(table(results, list(trees)))
    print()
    print(step_table(results, list(trees)))
    print("\nThe transport's floor on this machine (grpc.aio, loopback, one small message each way, median):")
    for mode, seconds in floors.items():
        print(f"- {mode}: {1e6 * seconds:,.0f} µs a round trip")
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    path = args.out / f"host-cpu-{stamp}.json"
    path.write_text(json.dumps({"meta": {"date": stamp, **{k: str(v) for k, v in vars(args).items()}},
                                "results": results, "transport_floor_seconds": floors}, indent=1))  # fmt: skip
    print(f"\nresults: {path}")
    return 0


def _paths(args: argparse.Namespace) -> int:
    """The OpenAI API's cost beside gRPC's: the same K = 0 requests through each path, interleaved."""
    from bench.gateway import running_gateway

    pair = build_null_pair(args.out / "null_pair").resolve()
    http_port = free_port()
    stack = LocalStack(
        str(pair / "target"), str(pair / "draft"), extra_service_args=["--threads", "1"],
        extra_orchestrator_args=["--http-port", str(http_port)], with_metrics=True,
        log_dir=args.out / "host-logs" / "paths",
    )  # fmt: skip
    rows: list[dict[str, Any]] = []
    with stack, running_gateway(stack.orchestrator_address) as (gateway_port, gateway_pid):
        paths = {
            "gRPC": ("", {}),
            "HTTP in the orchestrator": (f"http://{LOOPBACK}:{http_port}", {}),
            "HTTP gateway process": (f"http://{LOOPBACK}:{gateway_port}", {"gateway": gateway_pid}),
        }
        for rep in range(args.rounds):
            for count in [int(s) for s in args.streams.split(",") if s]:
                for name, (url, extra) in paths.items():
                    cell = _cell(stack, count, CELLS["K = 0"], args.max_new_tokens, url, extra)
                    rows.append({"round": rep, "streams": count, "path": name, **cell})
            print(f"round {rep + 1} of {args.rounds} done", flush=True)
    print("CPU regime, near-null pair, K = 0: medians over rounds; CPU µs per generated token; the last")
    print("column is (orchestrator + gateway) / gRPC's orchestrator, paired by round: geometric mean [95% interval]\n")
    print("| streams | path | tok/s | orchestrator | gateway | orchestrator + gateway | client | x gRPC |")
    print("|---|---|---|---|---|---|---|---|")

    def host(row: dict[str, Any]) -> float:
        return float(row["us_per_token"]["orchestrator"] + row["us_per_token"].get("gateway", 0.0))

    for count in sorted({r["streams"] for r in rows}):
        grpc_by_round = {r["round"]: host(r) for r in rows if r["streams"] == count and r["path"] == "gRPC"}
        for name in ("gRPC", "HTTP in the orchestrator", "HTTP gateway process"):
            group = [r for r in rows if r["streams"] == count and r["path"] == name]
            med = {p: statistics.median(r["us_per_token"].get(p, 0.0) for r in group)
                   for p in ("orchestrator", "gateway", "client")}  # fmt: skip
            ratios = {r["round"]: [host(r) / grpc_by_round[r["round"]]] for r in group}
            low, high = interval(ratios) if len(ratios) > 1 else (float("nan"), float("nan"))
            speed = statistics.median(r["tokens_per_second"] for r in group)
            print(f"| {count} | {name} | {speed:,.0f} | {med['orchestrator']:,.0f} | {med['gateway']:,.0f} | "
                  f"{statistics.median(host(r) for r in group):,.0f} | {med['client']:,.0f} | "
                  f"{geomean([v[0] for v in ratios.values()]):.2f}x [{low:.2f}-{high:.2f}] |")  # fmt: skip
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    path = args.out / f"host-paths-{stamp}.json"
    path.write_text(json.dumps({"meta": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1))
    print(f"\nresults: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
