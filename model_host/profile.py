"""The forward-cost curve a model service reports: seconds of one forward by the tokens it feeds.

Measured once at start-up, before the engine serves, on scratch slots of the service's own block store:
batches of 1 to `max_batch_size` rows, each `width` tokens wide after a short cached prefix. The
orchestrator's load-aware K prices a row by this curve's slope (scaled by live forwards, which set its
level but not its shape), and the engine splits a batch of mixed widths by it (`overhead_tokens`).

So the curve's shape must not depend on when a burst of noise fell (a service starts beside others;
its pair's start-up shares the memory bus): each shape is timed once in each of several rounds and
keeps its fastest, since noise only ever adds time (docs/design.md, "The start-up cost curve").
"""

from __future__ import annotations

import statistics
import time

import torch

from model_host.forward import Forward
from model_host.rows import Row
from model_host.simulated import SimulatedForward, modeled_curve

PROFILE_PREFIX_TOKENS = 32
_ROUNDS = 5


def profile_shapes(
    device: str, role: str, max_batch_size: int, max_speculative_tokens: int
) -> tuple[list[int], tuple[int, ...]]:
    """The batch sizes and widths the curve times. A draft step feeds one token a forward; a verify
    feeds K + 1. On the CPU, 1 to 32 rows of 1, 3 and 5 tokens: its curve is about a line there
    (docs/design.md, "What a row costs"), and wider shapes would cost start-up time only. On an
    accelerator the curve is flat until its ridge point (about 300 tokens a forward for an 8B model on
    an H100), past what 32 rows of 5 reach: it is timed out to the largest batch of the largest verify,
    so that load_aware sees where rows start to cost."""
    accelerator = device != "cpu"
    most = max_batch_size if accelerator else min(max_batch_size, 32)
    batch_sizes = sorted({b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b <= most} | {most})
    if role == "draft":
        return batch_sizes, (1,)
    return batch_sizes, tuple(sorted({1, 3, 5, max_speculative_tokens + 1})) if accelerator else (1, 3, 5)


@torch.inference_mode()
def forward_costs(
    forward: Forward, vocab_size: int, batch_sizes: list[int], widths: tuple[int, ...]
) -> list[tuple[int, float]]:
    """[(batch_tokens, seconds)] sorted by batch_tokens: each shape's fastest forward of `_ROUNDS`
    (the median over shapes that feed as many tokens)."""
    generator = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, vocab_size, (PROFILE_PREFIX_TOKENS,), generator=generator).tolist()
    forward([Row(slot, 0, prefix, 1) for slot in range(batch_sizes[-1])])
    # The first calls of a shape (allocation, kernel choice) fall in the first round, which the fastest
    # of the later rounds outweighs: no separate warm-up.
    fastest: dict[tuple[int, int], float] = {}
    for _ in range(_ROUNDS):
        for batch in batch_sizes:
            # Untimed: a new batch size settles the store's window for its rows (a gather) first.
            forward([Row(slot, PROFILE_PREFIX_TOKENS, prefix[:1], 1) for slot in range(batch)])
            forward.synchronize()  # nothing queued when a clock starts; each timed call ends synced
            for width in widths:
                rows = [Row(slot, PROFILE_PREFIX_TOKENS, prefix[:width], width) for slot in range(batch)]
                started = time.perf_counter()
                forward(rows)
                forward.synchronize()
                seconds = time.perf_counter() - started
                fastest[batch, width] = min(seconds, fastest.get((batch, width), seconds))
    by_tokens: dict[int, list[float]] = {}
    for (batch, width), seconds in fastest.items():
        by_tokens.setdefault(batch * width, []).append(seconds)
    for slot in range(batch_sizes[-1]):
        forward.release(slot)
    return sorted((tokens, statistics.median(times)) for tokens, times in by_tokens.items())


def modeled_costs(
    forward: SimulatedForward, max_batch_size: int, max_speculative_tokens: int
) -> list[tuple[int, float]]:
    """The curve from a simulated device's model instead of the clock: batches of 1 to max_batch_size
    rows, 1 to K + 1 tokens wide (the largest verify), after the profile's short prefix. Measured, a
    curve through at most 160 tokens lies in a GPU's flat region, and its slope would say that K costs
    nothing past the ridge point (about 300 tokens a forward on an H100)."""
    batch_sizes = sorted({min(b, max_batch_size) for b in (1, 2, 4, 8, 16, 32, 64, 128, max_batch_size)})
    widths = sorted({1, 3, 5, max_speculative_tokens + 1})
    return modeled_curve(forward.profile, forward.kernels, batch_sizes, widths, PROFILE_PREFIX_TOKENS)


def overhead_tokens(points: list[tuple[int, float]], default: float, most: float = 4096.0) -> float:
    """A forward's fixed cost in tokens fed: the intercept over the slope of a least-squares line
    through the curve. Measured on 2 CPU cores: about 33 tokens for the default target and 18 for the
    default draft; on a GPU a forward costs about the same at 1 and 100 tokens, so it is large and
    batches stay whole. `default` where the curve says nothing (fewer than two sizes), `most` where
    it does not grow with tokens."""
    if len({tokens for tokens, _ in points}) < 2:
        return default
    slope, intercept = statistics.linear_regression([t for t, _ in points], [s for _, s in points])
    if slope <= 0:
        return most
    return min(max(intercept / slope, 1.0), most)
