"""`python -m bench.sim` (`make sim-bench`): the load table in a GPU's regime, against its ideal.

MODELED, NOT MEASURED ON A GPU. Both model services run with `--simulated-device`: every forward
computes real logits on this host's CPU and is released at a roofline model's clock of a named GPU and
model shape (model_host/simulated.py), so draft and target each behave as if on a GPU of their own,
and what still costs CPU is the hosts' work. The pair is bench/sim_pair.py's, which agrees like the
trained default pair; its unrelated draft agrees about as often as chance.

Cells: streams x context (short prompts, or about 2,000 tokens) x profile (an 8B Llama 3.1 target and
a 1B Llama 3.2 draft on H100s; a 70B Llama 3.3 target on 4 H100s with the same draft). Configurations:
the target alone, load_aware and fixed K = 2 and 4 with the agreeing draft, load_aware with the
unrelated draft. Every request runs to max_new_tokens (`ignore_eos`), greedy.

Beside each cell, its ideal: for the target alone B tokens per modeled step of B rows; for
speculation the tokens per round measured in the cell over the modeled draft and target time of a
round (K draft steps and one verify of B rows). Per process, CPU microseconds per generated token
(the model services' minus their stand-in forwards' own CPU: that is simulation, not host work), and
the projection for a deployment with a core per process: min(1, device seconds per token / CPU seconds
per token), taken over the processes. A cell whose target overran its modeled time in more than 5% of
its forwards is marked not valid: its figures are this CPU's, not the modeled device's.

Ratios are paired, as in bench.compare: each round runs every configuration of a cell, in an order
that rotates; the ratio to the target alone is taken within a round, and its interval is a bootstrap
over rounds. `--quick` is for development (one profile, three stream counts, short context).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc
from transformers import AutoTokenizer

from bench.compare import geomean, interval
from bench.load import (
    PINNED,
    LoadConfig,
    LoadSample,
    _process_cpu,
    outside_scrapes,
    percentile,
    run_services,
    scrape,
    totals,
)
from bench.sim_pair import build_sim_pair
from default_models.prompts import held_out_prompts
from model_host.simulated import DeviceProfile, Kernels, profile_named
from specdec.v1 import common_pb2, orchestrator_pb2, orchestrator_pb2_grpc
from tools.local_stack import LocalStack

TARGET_ALONE = "target alone (K = 0)"


@dataclass(frozen=True)
class SimConfig:
    load: LoadConfig
    draft: str  # the stack: "draft" (agreeing), NO_CACHE (the same draft without a speculation cache), "unrelated"


NO_CACHE = "draft, no speculation cache"
CACHE_OFF = ", cache off"  # a configuration's name with this suffix: the same without the speculation cache
CONFIGS = [
    SimConfig(LoadConfig(TARGET_ALONE, "services", 0), "draft"),
    SimConfig(LoadConfig("load_aware", "services", None, "load_aware"), "draft"),
    SimConfig(LoadConfig("load_aware" + CACHE_OFF, "services", None, "load_aware"), NO_CACHE),
    SimConfig(LoadConfig("fixed K = 2", "services", 2), "draft"),
    SimConfig(LoadConfig("fixed K = 4", "services", 4), "draft"),
    SimConfig(LoadConfig("fixed K = 4" + CACHE_OFF, "services", 4), NO_CACHE),
    # Token trees against chains at equal verify tokens (greedy; a tree request drafts no block ahead).
    SimConfig(LoadConfig("fixed K = 8", "services", 8), "draft"),
    SimConfig(LoadConfig("tree of 4", "services", 4, tree=True), "draft"),
    SimConfig(LoadConfig("tree of 8", "services", 8, tree=True), "draft"),
    SimConfig(LoadConfig("load_aware, unrelated draft", "services", None, "load_aware"), "unrelated"),
]
PROFILES = {  # name: (target profile, draft profile)
    "8b": ("h100-llama-3.1-8b", "h100-llama-3.2-1b"),
    "70b": ("4xh100-llama-3.3-70b", "h100-llama-3.2-1b"),
}
LONG_CONTEXT = 2000
OVERRUN_LIMIT = 0.05
SERVICES = ("target", "draft")


@dataclass
class Cell:
    """One configuration's run in one cell of one round."""

    profile: str
    context: str
    streams: int
    config: str
    round: int
    tokens: int
    seconds: float
    rounds: int
    draft_rounds: int
    draft_tokens: int
    accepted_tokens: int
    ttft: list[float]
    itl: list[float]
    cpu_us_per_token: dict[str, float]  # by process (client: this one), stand-in forwards taken out
    forwards: dict[str, float]  # by service
    overruns: dict[str, float]
    mean_context: float
    overlapped_rounds: int = 0  # rounds whose block was drafted ahead (a speculation-cache hit, or the side step's)
    speculation: dict[str, float] = field(default_factory=dict)  # the draft's cache: hit, miss, used, wasted
    token_ids: list[list[int]] = field(default_factory=list)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def prompts_for(tokenizer: Any, context: str, count: int) -> list[list[int]]:
    """`count` prompts: held-out function headers, or windows of about 2,000 tokens of held-out text,
    each starting elsewhere (so that no two share a cached prefix)."""
    headers = held_out_prompts(64)
    if context == "short":
        return [tokenizer(headers[i % len(headers)])["input_ids"] for i in range(count)]
    stream: list[int] = tokenizer("\n\n".join(headers * 8))["input_ids"]
    while len(stream) < LONG_CONTEXT + 61 * count:
        stream = stream + stream
    return [stream[61 * i : 61 * i + LONG_CONTEXT] for i in range(count)]


def _usage(stack: LocalStack, before: bool) -> dict[str, float]:
    """CPU seconds by process, and the services' simulation counters, so far (the scrapes outside the
    cell's CPU: `outside_scrapes`)."""
    cpu, scraped = outside_scrapes(
        before, lambda: {f"cpu:{name}": _process_cpu(pid) for name, pid in stack.pids.items()}, lambda: _scrape(stack)
    )
    return {**cpu, **scraped}


def _scrape(stack: LocalStack) -> dict[str, float]:
    """The services' simulation and speculation counters, so far."""
    usage: dict[str, float] = {}
    texts = {service: scrape(stack.metrics_ports[service]) for service in SERVICES}
    for service, text in texts.items():
        for key, metric in (
            ("stand_in", "specdec:simulated_stand_in_cpu_seconds_total"),
            ("forwards", "specdec:simulated_forwards_total"),
            ("overruns", "specdec:simulated_overrun_forwards_total"),
        ):
            usage[f"{key}:{service}"] = totals(text, metric).get(service, 0.0)
    for metric, label in (
        ("specdec:speculation_steps_total", "outcome"),
        ("specdec:speculation_drafted_tokens_total", "use"),
    ):
        for value, total in totals(texts["draft"], metric, label).items():
            usage[f"speculation:{value}"] = total
    return usage


def run_cell(
    stack: LocalStack,
    config: SimConfig,
    prompts: list[list[int]],
    streams: int,
    rep: int,
    tokens: int,
    where: tuple[str, str],
) -> Cell:
    before, client_before = _usage(stack, before=True), time.process_time()
    sample: LoadSample = asyncio.run(
        run_services(stack.orchestrator_address, config.load, prompts, streams, rep, tokens, ignore_eos=True)
    )
    client = time.process_time() - client_before
    after = _usage(stack, before=False)
    delta = {key: after[key] - before.get(key, 0.0) for key in after}
    out = max(1, sample.tokens)
    cpu = {
        name: 1e6 * (delta[f"cpu:{name}"] - delta.get(f"stand_in:{name}", 0.0)) / out
        for name in ("orchestrator", *SERVICES)
    }
    cpu["client"] = 1e6 * client / out
    return Cell(
        where[0], where[1], streams, config.load.name, rep, sample.tokens, sample.seconds, sample.rounds,
        sample.draft_rounds, sample.draft_tokens, sample.accepted_tokens, sample.ttft, sample.itl, cpu,
        {s: delta[f"forwards:{s}"] for s in SERVICES}, {s: delta[f"overruns:{s}"] for s in SERVICES},
        statistics.mean(len(p) for p in prompts) + tokens / 2, sample.overlapped_rounds,
        {k.removeprefix("speculation:"): v for k, v in delta.items() if k.startswith("speculation:")},
        sample.token_ids,
    )  # fmt: skip


@dataclass(frozen=True)
class Clock:
    """The services' modeled devices, as their ModelInfo says they were built."""

    target: DeviceProfile
    target_kernels: Kernels
    draft: DeviceProfile
    draft_kernels: Kernels

    def ideal(self, cell: Cell) -> float:
        """The cell's ideal tokens per second (module docstring)."""
        rows, context = cell.streams, int(cell.mean_context)
        if not cell.draft_rounds:
            return rows / self.target.seconds([(context, 1)] * rows, self.target_kernels, windowed=False)
        k = cell.draft_tokens / cell.draft_rounds
        per_round = cell.tokens / max(1, cell.rounds)  # tokens a request commits in a round
        draft = k * self.draft.seconds([(context, 1)] * rows, self.draft_kernels, windowed=False)
        verify = self.target.seconds([(context, round(k) + 1)] * rows, self.target_kernels, windowed=False)
        return rows * per_round / (draft + verify)

    def cache_bound(self, cell: Cell, ready: float, ready_off: float) -> float:
        """The most a speculation cache can gain over drafting ahead for whole blocks alone: a round's
        modeled time (T_t + (1 - h) K T_d) with the cell's share of blocks drafted ahead h, against the
        same with the share `ready_off` of the cache-off cell."""
        if not cell.draft_rounds:
            return 0.0
        rows, context = cell.streams, int(cell.mean_context)
        k = cell.draft_tokens / cell.draft_rounds
        draft = self.draft.seconds([(context, 1)] * rows, self.draft_kernels, windowed=False)
        verify = self.target.seconds([(context, round(k) + 1)] * rows, self.target_kernels, windowed=False)
        return (verify + (1 - ready_off) * k * draft) / (verify + (1 - ready) * k * draft)


def clock_of(address: str) -> Clock:
    async def info() -> orchestrator_pb2.GetInfoResponse:
        async with grpc.aio.insecure_channel(address) as channel:
            answer: orchestrator_pb2.GetInfoResponse = await orchestrator_pb2_grpc.OrchestratorStub(channel).GetInfo(
                orchestrator_pb2.GetInfoRequest(), timeout=30
            )
            return answer

    got = asyncio.run(info())

    def kernels(device: common_pb2.SimulatedDevice) -> Kernels:
        return Kernels(device.kernels_per_layer, device.kernels_outside_layers)

    target, draft = got.target.simulated_device, got.draft.simulated_device
    return Clock(profile_named(target.profile), kernels(target), profile_named(draft.profile), kernels(draft))


def summarise(cells: list[Cell], clock_by_profile: dict[str, Clock]) -> list[dict[str, Any]]:
    """One row per (profile, context, streams, configuration)."""
    rows = []
    keys = list(dict.fromkeys((c.profile, c.context, c.streams, c.config) for c in cells))
    by = {(c.profile, c.context, c.streams, c.config, c.round): c for c in cells}
    for profile, context, streams, config in keys:
        runs = [c for c in cells if (c.profile, c.context, c.streams, c.config) == (profile, context, streams, config)]
        clock = clock_by_profile[profile]
        ideals = [clock.ideal(c) for c in runs]
        ratios = {
            c.round: [c.tokens_per_second / base.tokens_per_second]
            for c in runs
            if (base := by.get((profile, context, streams, TARGET_ALONE, c.round))) and base.tokens_per_second
        }
        forwards = {s: sum(c.forwards[s] for c in runs) for s in SERVICES}
        overruns = {s: sum(c.overruns[s] for c in runs) / forwards[s] if forwards[s] else 0.0 for s in SERVICES}
        cpu = {p: statistics.median(c.cpu_us_per_token[p] for c in runs) for p in runs[0].cpu_us_per_token}
        tps = statistics.median(c.tokens_per_second for c in runs)
        ideal = statistics.median(ideals)
        device_us_per_token = 1e6 / ideal
        drafted = sum(c.draft_tokens for c in runs)
        low, high = interval(ratios) if len(ratios) > 1 else (0.0, 0.0)
        cache = _cache_figures(runs, by, clock)
        rows.append(
            {
                "profile": profile, "context": context, "streams": streams, "config": config,
                "tokens_per_second": tps, "ideal_tokens_per_second": ideal, "x_ideal": tps / ideal,
                "x_target_alone": geomean([r for rs in ratios.values() for r in rs]) if ratios else 0.0,
                "x_target_alone_95": [low, high],
                "acceptance": sum(c.accepted_tokens for c in runs) / drafted if drafted else 0.0,
                "tokens_per_round": sum(c.tokens for c in runs) / max(1, sum(c.rounds for c in runs)),
                "itl_p50_ms": 1e3 * percentile([t for c in runs for t in c.itl], 0.5),
                "itl_p99_ms": 1e3 * percentile([t for c in runs for t in c.itl], 0.99),
                "ttft_p50_ms": 1e3 * percentile([t for c in runs for t in c.ttft], 0.5),
                "cpu_us_per_token": cpu,
                "projection": min(1.0, *(device_us_per_token / max(1e-9, v) for v in cpu.values())),
                "overrun_share": overruns,
                "valid": overruns["target"] <= OVERRUN_LIMIT,
                **cache,
            }
        )  # fmt: skip
    return rows


def _cache_figures(runs: list[Cell], by: dict[tuple[Any, ...], Cell], clock: Clock) -> dict[str, Any]:
    """The speculation cache's figures for a configuration's runs: its hit rate (of the draft steps of
    sessions with blocks drafted ahead), the share of rounds whose block was ready, tokens drafted ahead
    per generated token, and, beside its cache-off twin, the paired ratio and the bound at the share
    measured (`Clock.cache_bound`)."""
    steps = sum(c.speculation.get("hit", 0.0) + c.speculation.get("miss", 0.0) for c in runs)
    ahead = sum(c.speculation.get("used", 0.0) + c.speculation.get("wasted", 0.0) for c in runs)
    draft_rounds = sum(c.draft_rounds for c in runs)
    figures: dict[str, Any] = {
        "hit_rate": sum(c.speculation.get("hit", 0.0) for c in runs) / steps if steps else None,
        "ready_share": sum(c.overlapped_rounds for c in runs) / draft_rounds if draft_rounds else None,
        "ahead_tokens_per_token": ahead / max(1, sum(c.tokens for c in runs)) if steps else None,
    }
    twins = {
        c.round: twin
        for c in runs
        if (twin := by.get((c.profile, c.context, c.streams, c.config + CACHE_OFF, c.round))) and twin.tokens_per_second
    }
    if not twins:
        return figures
    ratios = {r: [c.tokens_per_second / twins[r].tokens_per_second] for c in runs if (r := c.round) in twins}
    twin_rounds = sum(t.draft_rounds for t in twins.values())
    ready_off = sum(t.overlapped_rounds for t in twins.values()) / twin_rounds if twin_rounds else 0.0
    bounds = [clock.cache_bound(c, c.overlapped_rounds / max(1, c.draft_rounds), ready_off) for c in runs]
    figures.update(
        x_cache_off=geomean([r for rs in ratios.values() for r in rs]),
        x_cache_off_95=list(interval(ratios)) if len(ratios) > 1 else [0.0, 0.0],
        cache_bound=statistics.median(bounds),
        ready_share_cache_off=ready_off,
    )
    return figures


def cache_table(rows: list[dict[str, Any]]) -> str:
    """The speculation cache against its cache-off twins."""
    lines = [
        "| profile | context | B | config | x cache off (95%) | bound | hit rate | ready: on / off "
        "| drafted ahead / token |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        if "x_cache_off" not in r:
            continue
        low, high = r["x_cache_off_95"]
        lines.append(
            f"| {r['profile']} | {r['context']} | {r['streams']} | {r['config']} | {r['x_cache_off']:.2f} "
            f"({low:.2f}-{high:.2f}) | {r['cache_bound']:.2f} | {r['hit_rate'] or 0:.2f} "
            f"| {r['ready_share'] or 0:.2f} / {r['ready_share_cache_off']:.2f} "
            f"| {r['ahead_tokens_per_token'] or 0:.2f} |"
        )
    return "\n".join(lines)


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| profile | context | B | config | tok/s | ideal | x ideal | x target alone (95%) | acc. | tok/round "
        "| ITL p50 / p99 ms | TTFT p50 ms | CPU µs/tok orch / target / draft / client | projection "
        "| overruns target / draft |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        low, high = r["x_target_alone_95"]
        cpu, overruns = r["cpu_us_per_token"], r["overrun_share"]
        flag = "" if r["valid"] else " (not valid)"
        lines.append(
            f"| {r['profile']} | {r['context']} | {r['streams']} | {r['config']}{flag} | {r['tokens_per_second']:.0f} "
            f"| {r['ideal_tokens_per_second']:.0f} | {r['x_ideal']:.2f} | {r['x_target_alone']:.2f} "
            f"({low:.2f}-{high:.2f}) | {r['acceptance']:.2f} | {r['tokens_per_round']:.2f} "
            f"| {r['itl_p50_ms']:.1f} / {r['itl_p99_ms']:.1f} | {r['ttft_p50_ms']:.0f} "
            f"| {cpu['orchestrator']:.0f} / {cpu['target']:.0f} / {cpu['draft']:.0f} / {cpu['client']:.0f} "
            f"| {r['projection']:.2f} | {100 * overruns['target']:.1f}% / {100 * overruns['draft']:.1f}% |"
        )
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], out: Path) -> Path:
    """tok/s against streams per configuration, the target alone's ideal as a dashed line; one panel a
    (profile, context)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(dict.fromkeys((r["profile"], r["context"]) for r in rows))
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for axis, (profile, context) in zip(axes[0], panels, strict=True):
        mine = [r for r in rows if (r["profile"], r["context"]) == (profile, context)]
        for config in dict.fromkeys(r["config"] for r in mine):
            line = [r for r in mine if r["config"] == config]
            axis.plot([r["streams"] for r in line], [r["tokens_per_second"] for r in line], marker="o", label=config)
            if config == TARGET_ALONE:
                ideal = [r["ideal_tokens_per_second"] for r in line]
                axis.plot([r["streams"] for r in line], ideal, "k--", label="target alone's ideal")
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_title(f"{profile}, {context} context (modeled device time)")
        axis.set_xlabel("streams")
        axis.set_ylabel("tokens per second")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
    fig.tight_layout()
    path = out / "sim.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def stack_for(
    folder: Path, draft: str, target_profile: str, draft_profile: str, log_dir: Path, pinned: bool
) -> LocalStack:
    common = ["--threads", "1", "--max-batch-size", "128", "--max-sessions", "256", "--max-cached-tokens", "600000"]
    no_cache = ["--speculation-cache-tokens", "0"] if draft == NO_CACHE else []
    return LocalStack(
        str(folder / "target"),
        str(folder / ("draft" if draft == NO_CACHE else draft)),
        extra_service_args=common,
        role_args={
            "target": ["--simulated-device", target_profile],
            "draft": ["--simulated-device", draft_profile, *no_cache],
        },
        extra_orchestrator_args=["--max-running-requests", "256"],
        with_metrics=True,
        log_dir=log_dir,
        cpus=PINNED if pinned else {},
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.sim", description=__doc__)
    parser.add_argument("--profiles", default="8b,70b", help=f"of {', '.join(PROFILES)}")
    parser.add_argument("--streams", default="1,4,16,64,128")
    parser.add_argument("--contexts", default="short,long")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="8b, streams 1,16,64, short context, 2 rounds, 32 tokens")
    parser.add_argument(
        "--placement",
        choices=("pinned", "shared"),
        default="pinned",
        help="pinned: the target on a core of its own, the rest (draft, orchestrator, clients) on the other, so "
        "that the target's stand-in forwards keep to the modeled clock; shared: every process on every core",
    )
    parser.add_argument(
        "--configs", default="", help="only these configurations, separated by ';' (the target alone always runs)"
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    chosen = {name.strip() for name in args.configs.split(";") if name.strip()}
    unknown = chosen - {c.load.name for c in CONFIGS}
    if unknown:
        parser.error(f"--configs: unknown {sorted(unknown)}; choose from {[c.load.name for c in CONFIGS]}")
    configs = [c for c in CONFIGS if not chosen or c.load.name in chosen or c.load.name == TARGET_ALONE]
    if args.quick:
        args.profiles, args.streams, args.contexts, args.rounds, args.max_new_tokens = "8b", "1,16,64", "short", 2, 32
    args.out.mkdir(parents=True, exist_ok=True)
    folder = build_sim_pair(args.out / "sim_pair")
    tokenizer = AutoTokenizer.from_pretrained(folder / "target")
    streams = [int(s) for s in args.streams.split(",")]
    cells: list[Cell] = []
    clocks: dict[str, Clock] = {}
    pinned = args.placement == "pinned" and len(os.sched_getaffinity(0)) >= 2
    if pinned:
        os.sched_setaffinity(0, PINNED["draft"])  # the clients share the draft's and orchestrator's core
    for profile in args.profiles.split(","):
        target_profile, draft_profile = PROFILES[profile]
        logs = args.out / "logs"
        stacks = {d: stack_for(folder, d, target_profile, draft_profile, logs / f"sim-{profile}-{_log_name(d)}", pinned)
                  for d in dict.fromkeys(c.draft for c in configs)}  # fmt: skip
        with contextlib.ExitStack() as running:
            for stack in stacks.values():
                running.enter_context(stack)
            clocks[profile] = clock_of(stacks["draft"].orchestrator_address)
            for context in args.contexts.split(","):
                for rep in range(args.rounds + 1):  # round 0 warms every cell up, unmeasured
                    for b in streams:
                        prompts = prompts_for(tokenizer, context, max(2 * b, 8))
                        shift = rep + streams.index(b)
                        for config in configs[shift % len(configs) :] + configs[: shift % len(configs)]:
                            cell = run_cell(
                                stacks[config.draft], config, prompts, b, rep, args.max_new_tokens, (profile, context)
                            )
                            if rep:
                                cells.append(cell)
                    print(f"{profile} {context}: round {rep} of {args.rounds} done", flush=True)
    rows = summarise(cells, clocks)
    print("\nMODELED device time (bench/sim.py; not measured on a GPU)\n")
    print(table(rows))
    print("\nThe speculation cache against the same configuration without it (MODELED)\n")
    print(cache_table(rows))
    differing = _differing(cells)
    print(f"\ngreedy outputs identical to the target alone: {'yes' if not differing else f'NO ({differing} requests)'}")
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    record = {
        "meta": {"date": stamp, "regime": "modeled device time", "args": {k: str(v) for k, v in vars(args).items()},
                 "cpus": os.cpu_count()},
        "rows": rows,
        "cells": [{k: v for k, v in asdict(c).items() if k not in ("token_ids", "itl", "ttft")} for c in cells],
    }  # fmt: skip
    (args.out / f"sim-{stamp}.json").write_text(json.dumps(record, indent=1))
    (args.out / "sim-latest.json").write_text(json.dumps(record, indent=1))
    print(f"plot: {plot(rows, args.out)}")
    return 1 if differing else 0


def _log_name(draft: str) -> str:
    return "draft-no-cache" if draft == NO_CACHE else draft


def _differing(cells: list[Cell]) -> int:
    """Greedy requests whose tokens differ from the target alone's in the same cell and round."""
    from collections import Counter

    base = {
        (c.profile, c.context, c.streams, c.round): Counter(map(tuple, c.token_ids))
        for c in cells
        if c.config == TARGET_ALONE
    }
    differing = 0
    for c in cells:
        reference = base.get((c.profile, c.context, c.streams, c.round))
        if reference is not None and c.config != TARGET_ALONE:
            differing += sum((reference - Counter(map(tuple, c.token_ids))).values())
    return differing


if __name__ == "__main__":
    raise SystemExit(main())
