"""`python -m bench.gpu`: the load benchmark at GPU scale, with random weights (nothing is downloaded).

Builds, on the device, a Llama-shaped target of about 1B parameters and two drafts of about 100M that
share the default pair's tokenizer:

- `close`: the target's own first layers, embeddings and head (a self-speculative draft). Random
  layers of full width all write into the residual stream about as strongly, so a truncated random
  model would not agree with the whole; the target's later layers are scaled by `--late-scale` (their
  attention and MLP output projections), which leaves the draft agreeing often but not always.
- `unrelated`: a separately initialised model with its own output head, which does not agree:
  `load_aware` should settle at K = 0 and lose almost nothing to the target alone.

Then, through the three services on loopback (both model services on the same device), greedy, each
of C clients sending its requests back to back: the target alone (K = 0), specdec `load_aware` and
fixed K = 2 with the close draft, `load_aware` with the unrelated draft; beside Hugging Face
`generate()` of the target on a left-padded batch of the same prompts in this process. It prints the
target's forward-cost curve (`GetModelInfo.forward_costs`, the table load-aware K starts from) and the
throughput table, and writes `gpu-<stamp>.json` under `--out`.

`--tiny` shrinks every shape so that the whole script runs on a CPU in seconds (its test).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import grpc
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from bench.load import (
    HF_BATCH_NAME,
    LOAD_CONFIGS,
    LoadConfig,
    LoadSample,
    differing_outputs,
    load_table,
    run_hf,
    run_services,
    summarise_load,
)
from default_models.prompts import held_out_prompts
from draft_service.jobs import DraftJob, read_rows
from model_host.forward import Forward
from model_host.loading import LoadedModel
from model_host.profile import PROFILE_PREFIX_TOKENS
from model_host.simulated import hf_decode_kernels, modeled_curve, profile_named
from specdec.v1 import common_pb2, target_pb2_grpc
from tools.local_stack import LocalStack

DEFAULT_PAIR = Path("default_models/pair")
TARGET_ALONE = LOAD_CONFIGS[0]  # its name is the baseline `summarise_load` divides by
CLOSE_CONFIGS = [
    TARGET_ALONE,
    LoadConfig("specdec load-aware, close draft", "services", None, "load_aware"),
    LoadConfig("specdec fixed K = 2, close draft", "services", 2),
]
UNRELATED = LoadConfig("specdec load-aware, unrelated draft", "services", None, "load_aware")
HF_BATCH = LoadConfig(HF_BATCH_NAME, "hf_batch")  # the name `summarise_load` takes its x HF ratios from
SECOND_BASELINE = f"{TARGET_ALONE.name}, unrelated draft's stack"
# The unrelated draft is compared with the target alone in its own stack.
BASELINES = {UNRELATED.name: SECOND_BASELINE, SECOND_BASELINE: SECOND_BASELINE}


@dataclass(frozen=True)
class Shapes:
    """A Llama-shaped model family: the target, and how many of its layers the close draft keeps."""

    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    draft_layers: int
    unrelated_hidden: int
    unrelated_layers: int
    unrelated_intermediate: int


FULL = Shapes(2048, 22, 5632, 32, 4, 2, 768, 12, 2048)  # about 1.0B and 0.1B with a 4096-token vocabulary
TINY = Shapes(64, 4, 128, 4, 2, 1, 32, 2, 64)


def _config(
    vocab_size: int, hidden: int, layers: int, intermediate: int, heads: int, kv_heads: int, tied: bool = True
) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=intermediate,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=2048,
        tie_word_embeddings=tied,
    )


@dataclass(frozen=True)
class Models:
    """The benchmark's three models (module docstring)."""

    target: LlamaForCausalLM
    close: LlamaForCausalLM
    unrelated: LlamaForCausalLM


@torch.inference_mode()
def build_models(
    shapes: Shapes, vocab_size: int, late_scale: float, device: str, dtype: torch.dtype, seed: int = 0
) -> Models:
    """The target and both drafts, initialised on `device` from `seed` (the global generator is left as
    it was)."""
    target_config = _config(
        vocab_size, shapes.hidden, shapes.layers, shapes.intermediate, shapes.heads, shapes.kv_heads
    )
    heads = max(1, shapes.unrelated_hidden // 64)
    unrelated_config = _config(
        vocab_size,
        shapes.unrelated_hidden,
        shapes.unrelated_layers,
        shapes.unrelated_intermediate,
        heads,
        heads,
        tied=False,
    )
    draft_config = LlamaConfig(**{**target_config.to_dict(), "num_hidden_layers": shapes.draft_layers})
    with (
        torch.random.fork_rng(devices=[torch.device(device)] if device.startswith("cuda") else []),
        torch.device(device),
    ):
        torch.manual_seed(seed)
        target = LlamaForCausalLM(target_config).to(dtype)
        unrelated = LlamaForCausalLM(unrelated_config).to(dtype)
        close = LlamaForCausalLM(draft_config).to(dtype)  # its own weights are replaced by the target's below
    for layer in target.model.layers[shapes.draft_layers :]:
        layer.self_attn.o_proj.weight.mul_(late_scale)
        layer.mlp.down_proj.weight.mul_(late_scale)
    close.load_state_dict({k: v for k, v in target.state_dict().items() if k in close.state_dict()})
    return Models(target.eval(), close.eval(), unrelated.eval())


def parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@torch.inference_mode()
def greedy_agreement(target: LlamaForCausalLM, draft: LlamaForCausalLM, prompts: list[list[int]]) -> float:
    """The share of positions where the draft's argmax is the target's, over the prompts' own tokens:
    an estimate of greedy acceptance at K = 1."""
    same = total = 0
    device = target.device
    for prompt in prompts:
        ids = torch.tensor([prompt], device=device)
        a = target(ids).logits.argmax(-1)
        b = draft(ids).logits.argmax(-1)
        same += int((a == b).sum())
        total += ids.numel()
    return same / total


def answer_waits_for_next_forward(device: str, answering: bool = True) -> bool:
    """Whether the event loop's read of finished logits (`Forward.answering`, or the default stream if
    not `answering`) waits for a forward the engine queued after them. The forward is stood in for by a
    kernel that spins on the default stream for about half a second."""
    forward = Forward()
    forward.device = torch.device(device)
    logits = torch.randn(64, 4096, device=device)
    torch.cuda.synchronize(forward.device)
    torch.cuda._sleep(1_000_000_000)  # the next forward, queued as the engine's thread queues one
    with forward.answering() if answering else contextlib.nullcontext():
        logits.argmax(dim=-1).tolist()
    waited = torch.cuda.default_stream(forward.device).query()  # the stand-in has finished
    torch.cuda.synchronize(forward.device)
    return waited


def _read_rows(logits: list[torch.Tensor], alternatives: int, together: bool) -> None:
    """One forward's greedy rows read by fresh draft jobs: each its own, or all at once first."""
    jobs = [
        DraftJob(0, 0, [], 1, generator=torch.Generator(), num_speculative_tokens=4, alternatives=alternatives)
        for _ in logits
    ]
    if together:
        read_rows(list(zip(jobs, logits, strict=True)))
    for job, row in zip(jobs, logits, strict=True):
        job.advance(row)


def row_reading(
    device: str, widths: Sequence[int], vocab: int, alternatives: int, repeats: int = 20
) -> list[dict[str, Any]]:
    """What the draft's engine spends between two forwards reading B greedy rows of `vocab` logits:
    each job its own row (`DraftJob.advance`), against all of them at once (`read_rows`), with the
    speculation cache's likeliest tokens (`alternatives`) or without. Medians over `repeats`, in µs a
    forward, with the device synchronized before each clock read."""
    cuda = device.startswith("cuda")
    out = []
    for width in widths:
        logits = [torch.randn(1, vocab, device=device) for _ in range(width)]
        times: dict[str, list[float]] = {"alone": [], "together": []}
        for _ in range(repeats):
            for name in times:
                if cuda:
                    torch.cuda.synchronize()
                started = time.perf_counter()
                _read_rows(logits, alternatives, together=name == "together")
                if cuda:
                    torch.cuda.synchronize()
                times[name].append(time.perf_counter() - started)
        medians = {name: 1e6 * statistics.median(values) for name, values in times.items()}
        out.append({"rows": width, "vocab": vocab, "alternatives": alternatives, **medians})
    return out


def target_costs(address: str) -> list[tuple[int, float]]:
    """The target service's measured forward-cost curve: (batch tokens, seconds)."""
    with grpc.insecure_channel(address) as channel:
        info = target_pb2_grpc.TargetServiceStub(channel).GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=30)
    return [(c.batch_tokens, c.seconds) for c in info.forward_costs]


MODELED_PROFILE = "h200-gpu-bench-1b"


def modeled_target_costs(target: LoadedModel, costs: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """The MODELED cost of the measured curve's shapes: the H200 profile of this target, with the kernels
    an eager decode step of it launches (counted here; the services' batched path adds a few)."""
    curve = modeled_curve(
        profile_named(MODELED_PROFILE),
        hf_decode_kernels(target.model),
        [1, 2, 4, 8, 16, 32],
        [1, 3, 5],
        PROFILE_PREFIX_TOKENS,
    )  # the shapes the services time at start-up (model_host/profile.py)
    points = dict(curve)
    return [(tokens, points.get(tokens, float("nan"))) for tokens, _ in costs]


def requests_at(prompts: list[list[int]], concurrency: int) -> list[list[int]]:
    """Two requests per client (at least 8 in all): short runs, for a device lent for minutes."""
    return [prompts[i % len(prompts)] for i in range(max(2 * concurrency, 8))]


def run_stack(
    stack: LocalStack, configs: list[LoadConfig], prompts: list[list[int]], concurrencies: list[int], reps: int,
    max_new_tokens: int,
) -> list[LoadSample]:  # fmt: skip
    """Every configuration at every concurrency, in a rotated order per repetition, after one warm-up
    run of each at the first concurrency (not kept)."""
    samples = []
    for rep in range(-1, reps):
        for concurrency in concurrencies[:1] if rep < 0 else concurrencies:
            requests = requests_at(prompts, concurrency)
            for index in range(len(configs)):
                config = configs[(index + max(rep, 0)) % len(configs)]
                sample = asyncio.run(
                    run_services(stack.orchestrator_address, config, requests, concurrency, max(rep, 0), max_new_tokens)
                )
                if rep >= 0:
                    samples.append(sample)
                    print(f"  C={concurrency:<3} {config.name}: {sample.tokens_per_second:.0f} tok/s", flush=True)
    return samples


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="bench.gpu", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="", help="default: bfloat16 on a GPU, float32 on a CPU")
    parser.add_argument("--concurrency", default="1,8,32,64")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--late-scale", type=float, default=0.05, help="scale of the target's layers the draft lacks")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes: the whole script on a CPU in seconds")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    concurrencies = [int(c) for c in args.concurrency.split(",") if c]
    dtype_name = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    dtype = getattr(torch, dtype_name)
    shapes = TINY if args.tiny else FULL
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_PAIR / "target")
    prompts = [list(tokenizer(text)["input_ids"]) for text in held_out_prompts(max(8, 2 * max(concurrencies)))]
    started = time.perf_counter()
    models = build_models(shapes, len(tokenizer), args.late_scale, args.device, dtype)
    agreement = greedy_agreement(models.target, models.close, prompts[:8])
    by_name = {field.name: getattr(models, field.name) for field in fields(models)}
    sizes = {name: parameters(model) for name, model in by_name.items()}
    folder = Path(tempfile.mkdtemp(prefix="specdec-gpu-bench-"))
    try:
        paths = {}
        for name, model in by_name.items():
            paths[name] = str(folder / name)
            model.save_pretrained(paths[name])
            tokenizer.save_pretrained(paths[name])
        del models, by_name, model  # the services load their own copies
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
        print(
            f"built in {time.perf_counter() - started:.0f} s on {args.device} ({dtype_name}): target "
            f"{sizes['target'] / 1e9:.2f}B parameters, close draft ({shapes.draft_layers} of its layers, the rest "
            f"scaled by {args.late_scale:g}) {sizes['close'] / 1e6:.0f}M, greedy agreement {agreement:.2f}, "
            f"unrelated draft {sizes['unrelated'] / 1e6:.0f}M",
            flush=True,
        )
        if args.device.startswith("cuda"):
            waits = answer_waits_for_next_forward(args.device)
            print(f"an answer read while the next forward runs waits for it: {'yes (a bug)' if waits else 'no'}")
        reading = [
            cell
            for vocab in ((256,) if args.tiny else (len(tokenizer), 128_256))
            for alternatives in (0, 2)
            for cell in row_reading(args.device, (1, 8, 64), vocab, alternatives, repeats=3 if args.tiny else 20)
        ]
        print(
            f"\nthe draft's greedy rows read between two forwards on {args.device}, µs a forward (medians): each job "
            "its own, against all at once (read_rows)\n| rows | vocab | likeliest tokens | alone | together |\n"
            "| --- | --- | --- | --- | --- |"
        )
        for cell in reading:
            print(
                f"| {cell['rows']} | {cell['vocab']} | {cell['alternatives']} | {cell['alone']:,.0f} | "
                f"{cell['together']:,.0f} |"
            )
        service_args = ["--device", args.device, "--dtype", dtype_name]
        samples: list[LoadSample] = []
        logs = args.out / "gpu-logs"
        with LocalStack(paths["target"], paths["close"], extra_service_args=service_args, log_dir=logs) as stack:
            costs = target_costs(stack.target_address)
            samples += run_stack(stack, CLOSE_CONFIGS, prompts, concurrencies, args.reps, args.max_new_tokens)
        with LocalStack(paths["target"], paths["unrelated"], extra_service_args=service_args, log_dir=logs) as stack:
            second = run_stack(stack, [TARGET_ALONE, UNRELATED], prompts, concurrencies, args.reps, args.max_new_tokens)
        for sample in second:  # the unrelated draft is compared with its own stack's target alone
            if sample.config == TARGET_ALONE.name:
                sample.config = SECOND_BASELINE
        samples += second
        from model_host.loading import load_model

        hf_target = load_model(paths["target"], args.device, dtype_name)  # the weights the services ran
        for rep in range(args.reps):
            for concurrency in concurrencies:
                requests = requests_at(prompts, concurrency)
                samples.append(run_hf(hf_target, HF_BATCH, requests, concurrency, rep, args.max_new_tokens))
    finally:
        shutil.rmtree(folder, ignore_errors=True)

    rows = summarise_load(samples, concurrencies, BASELINES)
    modeled = dict(modeled_target_costs(hf_target, costs))
    print(
        f"\ntarget forward cost (GetModelInfo.forward_costs), MEASURED on {args.device}, beside the MODELED "
        f"{MODELED_PROFILE} profile (--simulated-device; meaningful on an H200 at full shapes only):\n"
        "| batch tokens | measured ms | modeled ms | modeled / measured |\n| --- | --- | --- | --- |"
    )
    for tokens, seconds in costs:
        print(f"| {tokens} | {1000 * seconds:.2f} | {1000 * modeled[tokens]:.2f} | {modeled[tokens] / seconds:.2f} |")
    print()
    print(load_table(rows))
    differing = differing_outputs(samples, BASELINES)
    print(
        f"greedy outputs that differ from the target alone's in the same stack: {differing} "
        "(in bfloat16 a batched forward can round a near tie the other way; see the README's per-dtype contract)"
    )
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    path = args.out / f"gpu-{stamp}.json"
    meta = {
        "date": stamp,
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor(),
        "dtype": dtype_name,
        "shapes": asdict(shapes),
        "parameters": sizes,
        "late_scale": args.late_scale,
        "greedy_agreement": agreement,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
    }
    samples_json = [{k: v for k, v in asdict(s).items() if k != "token_ids"} for s in samples]
    path.write_text(
        json.dumps(
            {
                "meta": meta,
                "forward_costs": costs,
                "row_reading": reading,
                "rows": rows,
                "differing_outputs": differing,
                "samples": samples_json,
            },
            indent=1,
        )
    )
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
