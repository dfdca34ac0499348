"""`python -m bench --concurrency 1,2,4,8,16`: throughput and latency under concurrent load.

Each of C clients sends its requests back to back (greedy, a fixed set of held-out prompts) through
the three services on loopback. Configurations: the target alone through the services (K = 0),
specdec at a fixed K, and the load-aware policy; anchors in the same run: Hugging Face `generate()` of
the target on a left-padded batch of the same C prompts in this process, and transformers' continuous
batching (`generate_batch`). Every repetition runs every (concurrency, configuration) once, in a
rotated order; medians over repetitions, ratios within one.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import statistics
import time
from argparse import Namespace
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TypeVar

import grpc
import torch
from tqdm import tqdm
from transformers import GenerationConfig

from model_host.loading import LoadedModel
from serving.protocol import POLICY_BY_NAME
from specdec.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from tools.local_stack import LocalStack

CpuT = TypeVar("CpuT")
ScrapeT = TypeVar("ScrapeT")

CHANNELS = 8  # as the gateway's (http_gateway/__main__.py)


@dataclass(frozen=True)
class LoadConfig:
    name: str
    kind: str  # "services", "hf_batch" (padded generate) or "hf_cb" (generate_batch)
    k: int | None = None  # None: the policy's default bound
    policy: str = "fixed"
    tree: bool = False  # greedy model rounds draft a token tree of K nodes (speculation_tree)


HF_BATCH_NAME = "HF generate() padded batch"
LOAD_CONFIGS = [
    LoadConfig("target alone (K = 0)", "services", 0),
    LoadConfig("specdec fixed K = 2", "services", 2),
    LoadConfig("specdec fixed K = 4", "services", 4),
    LoadConfig("specdec load-aware", "services", None, "load_aware"),
    LoadConfig(HF_BATCH_NAME, "hf_batch"),
    LoadConfig("HF generate_batch (continuous batching)", "hf_cb"),
]


@dataclass
class LoadSample:
    """One (repetition, concurrency, configuration) run."""

    config: str
    concurrency: int
    rep: int
    tokens: int
    seconds: float
    ttft: list[float] = field(default_factory=list)  # per request
    itl: list[float] = field(default_factory=list)  # per output token after the first
    draft_tokens: int = 0
    accepted_tokens: int = 0
    probe_rounds: int = 0  # K = 0 rounds that asked the draft for one token beside the target's step
    rounds: int = 0  # target session steps, over all requests
    draft_rounds: int = 0  # of them, rounds that verified a drafted block
    overlapped_rounds: int = 0  # of those, rounds whose block was drafted ahead, during the last verify
    wire_bytes: int = 0  # messages exchanged with the model services, over all requests
    other_ms_per_round: list[float] = field(default_factory=list)  # per request: wall outside the forwards
    cpu_seconds: dict[str, float] = field(default_factory=dict)  # by process, over the run
    forward_seconds: dict[str, float] = field(default_factory=dict)  # by service: its engine's forwards
    token_ids: list[list[int]] = field(default_factory=list)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds


async def _client(
    stub: orchestrator_pb2_grpc.OrchestratorStub, requests: list[orchestrator_pb2.GenerateRequest], sample: LoadSample
) -> None:
    for request in requests:
        started = last = time.perf_counter()
        ids: list[int] = []
        async for message in stub.Generate(request):
            now = time.perf_counter()
            if message.token_ids:
                if not ids:
                    sample.ttft.append(now - started)
                else:
                    sample.itl.extend([(now - last) / len(message.token_ids)] * len(message.token_ids))
                last = now
                ids.extend(message.token_ids)
            if message.finish_reason:
                sample.draft_tokens += message.stats.draft_tokens
                sample.accepted_tokens += message.stats.accepted_tokens
                sample.probe_rounds += message.stats.probe_rounds
                stats = message.stats
                sample.rounds += stats.rounds
                sample.draft_rounds += stats.draft_rounds
                sample.overlapped_rounds += stats.overlapped_rounds
                sample.wire_bytes += stats.wire_bytes
                if stats.rounds:
                    outside = stats.total_seconds - stats.target_seconds - stats.draft_seconds
                    sample.other_ms_per_round.append(1000 * max(0.0, outside) / stats.rounds)
        sample.tokens += len(ids)
        sample.token_ids.append(ids)


async def run_services(
    address: str,
    config: LoadConfig,
    prompts: list[list[int]],
    concurrency: int,
    rep: int,
    max_new_tokens: int,
    temperature: float = 0.0,
    ignore_eos: bool = False,
) -> LoadSample:
    """C clients, each with its share of the requests, back to back (sampled, seeded by request, at a
    temperature above 0; with `ignore_eos`, every request runs to max_new_tokens)."""
    sample = LoadSample(config.name, concurrency, rep, 0, 0.0)
    requests = []
    for index, prompt in enumerate(prompts):
        request = orchestrator_pb2.GenerateRequest(
            token_ids=orchestrator_pb2.TokenIds(ids=prompt),
            max_new_tokens=max_new_tokens,
            speculation_policy=POLICY_BY_NAME[config.policy],
            temperature=temperature,
            seed=1000 * rep + index,
            ignore_eos=ignore_eos,
        )
        if config.k is not None:
            request.num_speculative_tokens = config.k
        if config.tree:
            request.speculation_tree = True
        requests.append(request)
    # A channel per client, each a connection of its own (an orchestrator with --workers balances by
    # connection; identical channels share one unless each has a subchannel pool of its own).
    channels = [
        grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range(min(concurrency, CHANNELS))
    ]
    stubs = [orchestrator_pb2_grpc.OrchestratorStub(channel) for channel in channels]
    try:
        started = time.perf_counter()
        await asyncio.gather(
            *(_client(stubs[i % len(stubs)], requests[i::concurrency], sample) for i in range(concurrency))
        )
        sample.seconds = time.perf_counter() - started
    finally:
        for channel in channels:
            await channel.close()
    return sample


def run_hf(
    target: LoadedModel, config: LoadConfig, prompts: list[list[int]], concurrency: int, rep: int, max_new_tokens: int
) -> LoadSample:
    """The same requests in this process: padded batches of C prompts, or generate_batch over all."""
    sample = LoadSample(config.name, concurrency, rep, 0, 0.0)
    model = target.model
    started = time.perf_counter()
    with torch.inference_mode():
        if config.kind == "hf_cb":
            generation = GenerationConfig(
                max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0
            )
            outputs = model.generate_batch(inputs=prompts, generation_config=generation, progress_bar=False)
            sample.tokens = sum(len(output.generated_tokens) for output in outputs.values())
        else:
            for start in range(0, len(prompts), concurrency):
                batch = prompts[start : start + concurrency]
                width = max(len(p) for p in batch)
                ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
                mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
                out = model.generate(
                    ids, attention_mask=mask, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                    do_sample=False, pad_token_id=0,
                )  # fmt: skip
                sample.tokens += int(out[:, width:].numel())
    sample.seconds = time.perf_counter() - started
    return sample


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def baseline_of(name: str, baselines: dict[str, str] | None = None) -> str:
    """The configuration `name` is compared with: its entry in `baselines`, else the target alone."""
    return (baselines or {}).get(name, LOAD_CONFIGS[0].name)


def summarise_load(
    samples: list[LoadSample], concurrencies: list[int], baselines: dict[str, str] | None = None
) -> list[dict[str, float | str | int]]:
    """One row per (concurrency, configuration): medians over repetitions, and the ratio to its
    baseline (`baseline_of`) taken within each repetition."""
    rows: list[dict[str, float | str | int]] = []
    by_key = {(s.config, s.concurrency, s.rep): s for s in samples}
    names = list(dict.fromkeys(s.config for s in samples))
    for concurrency in concurrencies:
        for name in names:
            runs = [s for s in samples if s.config == name and s.concurrency == concurrency]
            if not runs:
                continue
            ratios = [
                s.tokens_per_second / base.tokens_per_second
                for s in runs
                if (base := by_key.get((baseline_of(name, baselines), concurrency, s.rep)))
            ]
            hf = [
                s.tokens_per_second / base.tokens_per_second
                for s in runs
                if (base := by_key.get((HF_BATCH_NAME, concurrency, s.rep)))
            ]
            ttft = [t for s in runs for t in s.ttft]
            itl = [t for s in runs for t in s.itl]
            drafted = sum(s.draft_tokens for s in runs)
            rows.append(
                {
                    "concurrency": concurrency,
                    "config": name,
                    "tokens_per_second": statistics.median(s.tokens_per_second for s in runs),
                    "x_target_alone": statistics.median(ratios) if ratios else 0.0,
                    "x_hf_batch": statistics.median(hf) if hf else 0.0,
                    "ttft_p50_s": percentile(ttft, 0.5),
                    "ttft_p99_s": percentile(ttft, 0.99),
                    "itl_p50_s": percentile(itl, 0.5),
                    "itl_p99_s": percentile(itl, 0.99),
                    "acceptance": sum(s.accepted_tokens for s in runs) / drafted if drafted else 0.0,
                    "draft_tokens_per_output_token": drafted / max(1, sum(s.tokens for s in runs)),
                    "probe_rounds_per_output_token": sum(s.probe_rounds for s in runs)
                    / max(1, sum(s.tokens for s in runs)),
                    "ttft_median_s": statistics.median(ttft) if ttft else 0.0,
                    **_cpu_per_step(runs),
                }
            )
    return rows


def _cpu_per_step(runs: list[LoadSample]) -> dict[str, float]:
    """Microseconds of CPU per target session-step: the orchestrator's, and each model service's
    outside its forwards (CPU minus forward wall: exact with one thread per service); and the median
    time per step outside the models. Medians over repetitions."""
    measured = [s for s in runs if s.rounds and s.cpu_seconds]
    if not measured:
        return {}
    row = {
        "orchestrator_cpu_us_per_step": statistics.median(
            1e6 * s.cpu_seconds["orchestrator"] / s.rounds for s in measured
        ),
        "other_ms_per_step": statistics.median(statistics.median(s.other_ms_per_round) for s in measured),
    }
    for service in ("target", "draft"):
        if all(service in s.cpu_seconds for s in measured):
            row[f"{service}_cpu_outside_forward_us_per_step"] = statistics.median(
                1e6 * (s.cpu_seconds[service] - s.forward_seconds.get(service, 0.0)) / s.rounds for s in measured
            )
    return row


def load_table(rows: list[dict[str, float | str | int]]) -> str:
    lines = [
        "| C | config | tok/s | x target alone | x HF batch | TTFT p50 / p99 ms | ITL p50 / p99 ms | acceptance "
        "| orch. CPU µs/step | target / draft CPU outside fwd µs/step | outside models ms/step |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        services = " / ".join(
            f"{float(r[key]):.0f}" if key in r else "-"
            for key in ("target_cpu_outside_forward_us_per_step", "draft_cpu_outside_forward_us_per_step")
        )
        lines.append(
            f"| {r['concurrency']} | {r['config']} | {float(r['tokens_per_second']):.0f} | "
            f"{float(r['x_target_alone']):.2f} | {float(r.get('x_hf_batch', 0.0)):.3f} | "
            f"{1000 * float(r['ttft_p50_s']):.0f} / {1000 * float(r['ttft_p99_s']):.0f} | "
            f"{1000 * float(r['itl_p50_s']):.1f} / {1000 * float(r['itl_p99_s']):.1f} | "
            f"{float(r['acceptance']):.2f} | {_fmt(r, 'orchestrator_cpu_us_per_step', '.0f')} | {services} | "
            f"{_fmt(r, 'other_ms_per_step', '.2f')} |"
        )
    return "\n".join(lines)


def _fmt(row: dict[str, float | str | int], key: str, spec: str) -> str:
    return format(float(row[key]), spec) if key in row else "-"


def plot_load(rows: list[dict[str, float | str | int]], out: Path) -> Path:
    """Throughput and p99 inter-token latency against concurrency, one line per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name in dict.fromkeys(str(r["config"]) for r in rows):
        mine = [r for r in rows if r["config"] == name]
        xs = [int(r["concurrency"]) for r in mine]
        left.plot(xs, [float(r["tokens_per_second"]) for r in mine], marker="o", label=name)
        if any(float(r["itl_p99_s"]) for r in mine):
            right.plot(xs, [1000 * float(r["itl_p99_s"]) for r in mine], marker="o", label=name)
    for axis, label in ((left, "tokens per second (all clients)"), (right, "p99 inter-token latency (ms)")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("concurrent clients")
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
    left.legend(fontsize=8)
    fig.tight_layout()
    path = out / "load.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _process_cpu(pid: int) -> float:
    """CPU seconds a process has used, all its threads (those that ended too), to the nanosecond: from
    the process's CPU-time clock, whose id Linux derives from the pid (as glibc's clock_getcpuclockid
    does: CPUCLOCK_SCHED for the whole process). /proc's user + system time, counted in ticks too coarse
    for a one-stream cell (README, "The hosts' CPU per token"), is the fallback where the clock cannot
    be read."""
    try:
        return time.clock_gettime(((~pid) << 3) | 2)
    except OSError:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def scrape(port: int) -> str:
    """A Prometheus port's metrics, as text: read once for every metric a reading needs (a scrape costs
    the scraped process CPU)."""
    import urllib.request

    return str(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode())


def totals(text: str, name: str, *labels: str) -> dict[str, float]:
    """A counter's (or a histogram's `_sum`) value in a scrape by the values of `labels` (default:
    service), joined with ':' and summed over the others."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            key = ":".join(line.split(f'{label}="')[1].split('"')[0] for label in labels or ("service",))
            found[key] = found.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return found


def metric_totals(port: int, name: str, *labels: str) -> dict[str, float]:
    """`totals` of one metric, from a scrape of its own."""
    return totals(scrape(port), name, *labels)


def _forward_seconds(port: int) -> dict[str, float]:
    """Each model service's engine forward wall so far, from its Prometheus port."""
    return metric_totals(port, "specdec:engine_forward_seconds_sum")


def outside_scrapes(before: bool, cpu: Callable[[], CpuT], scrape: Callable[[], ScrapeT]) -> tuple[CpuT, ScrapeT]:
    """The processes' CPU and the services' metrics, read so that the scrape, which costs the scraped
    service CPU of its own (README, "Benchmarks in a GPU's regime: modeled device time"), falls
    outside the run measured: scraped first `before` a run, last after it."""
    if before:
        scraped = scrape()
        return cpu(), scraped
    read = cpu()
    return read, scrape()


def _usage(stack: LocalStack, before: bool) -> tuple[dict[str, float], dict[str, float]]:
    """CPU seconds by process and forward seconds by service, so far."""
    ports = stack.metrics_ports
    return outside_scrapes(
        before,
        lambda: {name: _process_cpu(pid) for name, pid in stack.pids.items()},
        lambda: {name: _forward_seconds(ports[name]).get(name, 0.0) for name in ("target", "draft") if name in ports},
    )


def requests_for(prompts: list[list[int]], concurrency: int) -> list[list[int]]:
    """A run's requests: every prompt, cycled to at least two per client."""
    return [prompts[i % len(prompts)] for i in range(max(len(prompts), 2 * concurrency))]


def run_services_measured(
    stack: LocalStack, config: LoadConfig, requests: list[list[int]], concurrency: int, rep: int, max_new_tokens: int
) -> LoadSample:
    """`run_services` on the stack, with the CPU seconds of its processes and its services' forward
    seconds over the run."""
    cpu_before, forward_before = _usage(stack, before=True)
    sample = asyncio.run(run_services(stack.orchestrator_address, config, requests, concurrency, rep, max_new_tokens))
    cpu_after, forward_after = _usage(stack, before=False)
    sample.cpu_seconds = {name: cpu_after[name] - cpu_before[name] for name in cpu_after}
    sample.forward_seconds = {name: forward_after[name] - forward_before[name] for name in forward_after}
    return sample


# --placement pinned: the target on core 0, the draft and the orchestrator on core 1, one torch thread
# each; Hugging Face's batch runs on the target's core.
PINNED = {"target": {0}, "draft": {1}, "orchestrator": {1}}


def run_load(args: Namespace, prompts_text: list[str]) -> int:
    """The load mode of `python -m bench`."""
    from model_host.loading import load_model

    concurrencies = [int(c) for c in args.concurrency.split(",") if c]
    configs = [c for c in LOAD_CONFIGS if not args.only or c.name in {n.strip() for n in args.only.split(",")}]
    configs = configs or LOAD_CONFIGS
    target = load_model(args.target_model)
    assert target.tokenizer is not None
    prompts = [list(target.tokenizer(text)["input_ids"]) for text in prompts_text]
    samples: list[LoadSample] = []
    pinned = args.placement == "pinned"
    threads = 1 if pinned else args.threads
    bench_cpus = os.sched_getaffinity(0)
    with LocalStack(
        args.target_model,
        args.draft_model,
        log_dir=args.out / "logs",
        extra_service_args=["--threads", str(threads)] if threads else [],
        cpus=PINNED if pinned else {},
        with_metrics=True,
    ) as stack:
        # Warm-up: every configuration once at the first concurrency, not measured.
        warm_up = [(0, concurrencies[0], i) for i in range(len(configs))]
        jobs = [(rep, c, i) for rep in range(args.reps) for c in concurrencies for i in range(len(configs))]
        for number, (rep, concurrency, index) in enumerate(tqdm([*warm_up, *jobs], desc="load", unit="run")):
            config = configs[(index + rep) % len(configs)]
            requests = requests_for(prompts, concurrency)
            if config.kind == "services":
                sample = run_services_measured(stack, config, requests, concurrency, rep, args.max_new_tokens)
            else:
                if pinned:
                    os.sched_setaffinity(0, PINNED["target"])
                    torch.set_num_threads(1)
                try:
                    sample = run_hf(target, config, requests, concurrency, rep, args.max_new_tokens)
                finally:
                    os.sched_setaffinity(0, bench_cpus)
            if number >= len(warm_up):
                samples.append(sample)
    rows = summarise_load(samples, concurrencies)
    print(load_table(rows))
    check_greedy_identity(samples)
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    path = args.out / f"load-{stamp}.json"
    path.write_text(
        json.dumps(
            {
                "meta": {
                    "date": stamp,
                    "target_model": args.target_model,
                    "draft_model": args.draft_model,
                    "placement": args.placement,
                    "reps": args.reps,
                    "max_new_tokens": args.max_new_tokens,
                    "prompts": len(prompts),
                    "cpus": os.cpu_count(),
                    "torch": torch.__version__,
                },
                "rows": rows,
                "samples": [{k: v for k, v in asdict(s).items() if k != "token_ids"} for s in samples],
            },
            indent=1,
        )
    )
    (args.out / "load-latest.json").write_text(path.read_text())
    print(f"\nresults: {path}\nplot: {plot_load(rows, args.out)}")
    return 0


def differing_outputs(samples: list[LoadSample], baselines: dict[str, str] | None = None) -> int:
    """Greedy requests through the services whose output differs from their baseline's (`baseline_of`)
    in the same concurrency and repetition: every run sends the same requests, in any order."""
    outputs = {(s.config, s.concurrency, s.rep): Counter(map(tuple, s.token_ids)) for s in samples}
    differing = 0
    for s in samples:
        base = outputs.get((baseline_of(s.config, baselines), s.concurrency, s.rep))
        if s.token_ids and base is not None:
            differing += sum((base - Counter(map(tuple, s.token_ids))).values())
    return differing


def check_greedy_identity(samples: list[LoadSample]) -> None:
    """Every configuration through the services produced the target alone's tokens (greedy)."""
    differing = differing_outputs(samples)
    print(f"greedy outputs identical to the target alone: {'yes' if not differing else f'NO ({differing} requests)'}")
