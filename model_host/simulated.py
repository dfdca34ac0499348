"""Modeled device time: a GPU's clock on a host's CPU, for benchmarks only (`--simulated-device`).

Each forward runs on the CPU as always, for real logits; its result is released once a roofline model
of a named GPU and model shape says the forward would have finished there. The engine thread sleeps
meanwhile, which frees the GIL and the core, so what still costs CPU is what a GPU deployment pays on
its hosts. A forward whose CPU time overruns its modeled time is counted: its figures are the CPU's.

A forward's modeled time is its fixed cost plus the larger of two terms:
- bytes over bandwidth: the weights once, every row's keys and values read at its real context, the
  new ones written, and what the batch view gathers into its window (a second write of the new ones);
- FLOPs over peak: the linear layers over the padded B x T tokens the engine runs, plus attention.
The fixed cost is the kernels the service's own forward launches (counted on the CPU at start-up: the
count does not depend on the device), times a per-launch cost, plus two all-reduces a layer under
tensor parallelism. docs/design.md ("Modeled device time") gives every parameter with its source.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from model_host.forward import Forward, RowLogits
from model_host.metrics import SIMULATED_FORWARDS, SIMULATED_OVERRUNS, SIMULATED_STAND_IN_CPU
from model_host.rows import Row

log = structlog.get_logger(__name__)

# Derived from published measurements (docs/design.md, "Modeled device time"): Llama 3.1 8B's decode
# step on an H100, 5.1 ms as a CUDA graph (its 16 GB of weights at 94% of HBM bandwidth: 0.92 kept) and
# 8.4 ms eager, whose difference over its ~40 kernels a layer is the exposed cost of one launch.
MEMORY_EFFICIENCY = 0.92
LAUNCH_SECONDS = 2.8e-6
# Large bf16 GEMMs reach about two thirds of dense peak; not checked against a measured prefill here.
COMPUTE_EFFICIENCY = 0.65
ALLREDUCE_LATENCY_SECONDS = 8e-6  # one small NCCL all-reduce over NVLink, before its bytes


@dataclass(frozen=True)
class Gpu:
    """A device, or `count` of them under tensor parallelism, from its datasheet."""

    name: str
    hbm_bytes_per_s: float
    bf16_flops_per_s: float  # dense
    count: int = 1
    link_bytes_per_s: float = 0.0  # NVLink, per GPU: what an all-reduce moves its bytes at


@dataclass(frozen=True)
class ModelShape:
    """A model's shape, from its public config."""

    name: str
    parameters: float
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool  # the output head shares the input embedding
    bytes_per_value: int = 2  # bfloat16

    @property
    def weight_bytes(self) -> float:
        return self.parameters * self.bytes_per_value

    @property
    def kv_bytes_per_token(self) -> float:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_value

    @property
    def matmul_flops_per_token(self) -> float:
        """2 FLOPs a weight a token, less the input embedding (a lookup) when the head has its own."""
        return 2 * (self.parameters - (0 if self.tied else self.vocab * self.hidden))

    @property
    def attention_flops_per_key(self) -> float:
        """A query's QK^T and PV over one key, in every layer."""
        return 4 * self.layers * self.heads * self.head_dim


@dataclass(frozen=True)
class DeviceProfile:
    """What `--simulated-device NAME` models: a model shape on a GPU."""

    name: str
    gpu: Gpu
    shape: ModelShape

    def seconds(
        self,
        rows: list[tuple[int, int]],  # per row: (tokens cached before, tokens fed)
        kernels: Kernels,
        gathered_tokens: int = 0,  # cached tokens the batch view copied into its window
        windowed: bool = True,  # new keys and values are written to the blocks and to a window
    ) -> float:
        """One forward's modeled seconds."""
        shape, gpu = self.shape, self.gpu
        width = max((fed for _, fed in rows), default=0)
        padded = len(rows) * width  # the engine pads every row to the widest
        keys = sum(cached + fed for cached, fed in rows)
        kv = shape.kv_bytes_per_token
        moved = shape.weight_bytes + keys * kv + padded * kv * (2 if windowed else 1) + 2 * gathered_tokens * kv
        flops = padded * shape.matmul_flops_per_token + sum(
            width * (cached + width) * shape.attention_flops_per_key for cached, _ in rows
        )
        memory = moved / (gpu.count * gpu.hbm_bytes_per_s * MEMORY_EFFICIENCY)
        compute = flops / (gpu.count * gpu.bf16_flops_per_s * COMPUTE_EFFICIENCY)
        fixed = kernels.total(shape.layers) * LAUNCH_SECONDS
        if gpu.count > 1:  # two all-reduces a layer (attention and MLP outputs): a ring moves 2 (n - 1) / n
            activation = padded * shape.hidden * shape.bytes_per_value
            ring = 2 * (gpu.count - 1) / gpu.count * activation / gpu.link_bytes_per_s
            fixed += 2 * shape.layers * (ALLREDUCE_LATENCY_SECONDS + ring)
        return fixed + max(memory, compute)


H100_SXM = Gpu("H100 SXM", hbm_bytes_per_s=3.35e12, bf16_flops_per_s=989e12, link_bytes_per_s=450e9)
H200_SXM = Gpu("H200 SXM", hbm_bytes_per_s=4.8e12, bf16_flops_per_s=989e12, link_bytes_per_s=450e9)
FOUR_H100_SXM = Gpu("4x H100 SXM", 3.35e12, 989e12, count=4, link_bytes_per_s=450e9)

LLAMA_3_1_8B = ModelShape("Llama-3.1-8B", 8.03e9, 32, 4096, 32, 8, 128, 128_256, tied=False)
LLAMA_3_2_1B = ModelShape("Llama-3.2-1B", 1.24e9, 16, 2048, 32, 8, 64, 128_256, tied=True)
LLAMA_3_3_70B = ModelShape("Llama-3.3-70B", 70.6e9, 80, 8192, 64, 8, 128, 128_256, tied=False)
# bench/gpu.py's random-weight target (TinyLlama-1.1B's shape with a 4,096-token vocabulary).
GPU_BENCH_1B = ModelShape("gpu-bench 1B", 0.98e9, 22, 2048, 32, 4, 64, 4096, tied=True)

PROFILES = {
    profile.name: profile
    for profile in (
        DeviceProfile("h100-llama-3.1-8b", H100_SXM, LLAMA_3_1_8B),
        DeviceProfile("h100-llama-3.2-1b", H100_SXM, LLAMA_3_2_1B),
        DeviceProfile("4xh100-llama-3.3-70b", FOUR_H100_SXM, LLAMA_3_3_70B),
        DeviceProfile("h200-gpu-bench-1b", H200_SXM, GPU_BENCH_1B),
    )
}


def profile_named(name: str) -> DeviceProfile:
    """The shipped profile of that name; ValueError listing them otherwise."""
    if name not in PROFILES:
        raise ValueError(f"--simulated-device {name!r} is not a profile; choose one of {', '.join(PROFILES)}")
    return PROFILES[name]


@dataclass(frozen=True)
class Kernels:
    """Kernels one forward launches: inside each decoder layer, and outside them (embedding, final norm,
    head, the batch view's masks and indices), so that a shallow stand-in model scales to a deep one."""

    per_layer: float
    outside: int

    def total(self, layers: int) -> float:
        return self.per_layer * layers + self.outside


class _KernelCount(TorchDispatchMode):
    """Counts the operators a forward dispatches that launch a kernel on a device (not views, not
    allocations), and how many of them ran inside decoder layers."""

    _FREE = frozenset({"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "lift_fresh"})

    def __init__(self) -> None:
        super().__init__()
        self.kernels = 0
        self.in_layers = 0
        self.depth = 0  # > 0 while a decoder layer runs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if not func.is_view and func._schema.name.removeprefix("aten::") not in self._FREE:
            self.kernels += 1
            self.in_layers += self.depth > 0
        return func(*args, **(kwargs or {}))


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """A causal LM's decoder layers (`model.model.layers`, as Hugging Face's Llama-shaped models hold them)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    return list(layers) if layers is not None else []


def count_kernels(run: Callable[[], object], layers: list[torch.nn.Module]) -> Kernels:
    """Kernels one call of `run` launches (its operators, dispatched on the CPU), split by `layers`; all
    of them spread over the layers when none ran inside one (an upper bound on the fixed cost's growth
    with depth)."""
    counter = _KernelCount()

    def enter(*_: object) -> None:
        counter.depth += 1

    def leave(*_: object) -> None:
        counter.depth -= 1

    hooks = [
        h for layer in layers for h in (layer.register_forward_pre_hook(enter), layer.register_forward_hook(leave))
    ]
    try:
        with torch.inference_mode(), counter:
            run()
    finally:
        for hook in hooks:
            hook.remove()
    if not counter.in_layers:  # a forward of its own that never calls the layers' modules (the lean draft)
        return Kernels(counter.kernels / max(1, len(layers)), 0)
    return Kernels(counter.in_layers / len(layers), counter.kernels - counter.in_layers)


def hf_decode_kernels(model: torch.nn.Module) -> Kernels:
    """Kernels one eager Hugging Face decode step of `model` launches (one token after four), on its device."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    cache = DynamicCache()
    with torch.inference_mode():
        model(torch.tensor([[1, 2, 3, 4]], device=device), cache=cache, use_cache=True)
        step = torch.tensor([[5]], device=device)
        return count_kernels(lambda: model(step, cache=cache, use_cache=True), decoder_layers(model))


def modeled_curve(
    profile: DeviceProfile, kernels: Kernels, batch_sizes: list[int], widths: list[int], prefix: int
) -> list[tuple[int, float]]:
    """The start-up cost curve's shapes, modeled: [(batch tokens, seconds)], the median over shapes that
    feed as many tokens (model_host/profile.py measures the same shapes)."""
    points: dict[int, list[float]] = {}
    for batch in batch_sizes:
        for width in widths:
            points.setdefault(batch * width, []).append(profile.seconds([(prefix, width)] * batch, kernels))
    return sorted((tokens, statistics.median(times)) for tokens, times in points.items())


class SimulatedForward(Forward):
    """A forward whose result is released at the modeled device's clock (module docstring)."""

    def __init__(self, inner: Forward, profile: DeviceProfile, kernels: Kernels, role: str) -> None:
        self.inner = inner
        self.profile = profile
        self.kernels = kernels
        self.name = f"{inner.name}, simulated {profile.name}"
        self.batched = inner.batched
        self.device = inner.device
        self.store = inner.store
        self._stand_in_cpu = SIMULATED_STAND_IN_CPU.labels(role)  # the engine thread's CPU in the forwards
        self._forwards = SIMULATED_FORWARDS.labels(role)
        self._overruns = SIMULATED_OVERRUNS.labels(role)

    def modeled(self, rows: list[Row], gathered_rows: int = 0) -> float:
        """Modeled seconds of a forward over `rows`, `gathered_rows` of which its view gathered."""
        cached = sum(row.start for row in rows)
        gathered = cached * gathered_rows // max(1, len(rows))  # rows gathered, at the batch's mean length
        return self.profile.seconds(
            [(row.start, len(row.token_ids)) for row in rows],
            self.kernels,
            gathered,
            windowed=self.batched,
        )

    def __call__(self, rows: list[Row]) -> RowLogits:
        started, cpu = time.perf_counter(), time.thread_time()
        gathered_before = self.store.windows.rows_gathered
        logits = self.inner(rows)
        self.inner.synchronize()
        gathered = self.store.windows.rows_gathered - gathered_before  # none by the fallback
        self._stand_in_cpu.inc(time.thread_time() - cpu)
        remaining = self.modeled(rows, gathered) - (time.perf_counter() - started)
        self._forwards.inc()
        if remaining > 0:
            time.sleep(remaining)
        else:
            self._overruns.inc()
        return logits

    def release(self, slot: int) -> None:
        self.inner.release(slot)

    def idle(self) -> None:
        self.inner.idle()

    def synchronize(self) -> None:
        self.inner.synchronize()


def simulate(
    inner: Forward, profile: DeviceProfile, model: torch.nn.Module, vocab_size: int, role: str
) -> SimulatedForward:
    """`inner` on the modeled clock: its kernels counted on one row of one token after a short prefix
    (the shape of a decode step), inside and outside the stand-in `model`'s decoder layers."""
    prefix = [i % vocab_size for i in range(1, 9)]
    with torch.inference_mode():
        inner([Row(0, 0, prefix, 1)])
        kernels = count_kernels(lambda: inner([Row(0, len(prefix), [1], 1)]), decoder_layers(model))
    inner.release(0)
    log.warning(
        "simulated_device",
        role=role,
        profile=profile.name,
        gpu=profile.gpu.name,
        model_shape=profile.shape.name,
        kernels_per_layer=round(kernels.per_layer, 1),
        kernels_outside_layers=kernels.outside,
        detail="forwards are released at a modeled GPU's clock: for benchmarks only, never for serving",
    )
    return SimulatedForward(inner, profile, kernels, role)
