"""What a round costs under the current load, learned from the services' replies.

Verifying K + 1 positions for B sessions costs a target forward over about B (K + 1) tokens, which
grows once the batch is large; drafting K tokens costs K draft forwards at batch B. Both curves start
from the services' start-up measurements (`ModelInfo.forward_costs`) and follow live steps; the
orchestrator also learns what a step costs beyond the forward (RPC, serialization, queueing). Shared by
all requests of one orchestrator: it describes the services, never a request.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterable

from specdec.v1 import common_pb2

_DECAY = 0.9  # weight of the past in every running estimate
# Steps feeding more than this many tokens are prefills or catch-ups, not the rounds being priced.
_MAX_OBSERVED_TOKENS = 256
# A draft step whose feed is longer is catching up after rounds without it: its first forward is a
# small prefill, and counting it as a drafting forward would price drafting too high (and, since
# every return from K = 0 starts with a catch-up, keep K at 0).
_MAX_DRAFT_CATCH_UP = 4


class CostCurve:
    """Seconds of one forward pass by the tokens it feeds: piecewise linear between measured points,
    extended linearly beyond them, and never more than a forward of more tokens was measured to cost
    (a noisy point must not make a small forward look dearer than a large one)."""

    def __init__(self, points: Iterable[tuple[int, float]]) -> None:
        self._seconds: dict[int, float] = {}
        for tokens, seconds in points:
            if tokens > 0 and seconds > 0:
                self._seconds[tokens] = seconds
        self._keys = sorted(self._seconds)

    @classmethod
    def from_info(cls, info: common_pb2.ModelInfo | None) -> CostCurve:
        if info is None:
            return cls(())
        return cls((point.batch_tokens, point.seconds) for point in info.forward_costs)

    def observe(self, tokens: int, seconds: float) -> None:
        if not 0 < tokens <= _MAX_OBSERVED_TOKENS or seconds <= 0:
            return
        if tokens in self._seconds:
            self._seconds[tokens] = _DECAY * self._seconds[tokens] + (1 - _DECAY) * seconds
        else:
            self._seconds[tokens] = seconds
            bisect.insort(self._keys, tokens)

    def seconds(self, tokens: float) -> float:
        keys = self._keys
        if not keys:
            return 0.0
        if tokens <= keys[0]:
            return min(self._seconds.values())
        if len(keys) == 1:
            return self._seconds[keys[0]] * tokens / keys[0]
        index = min(bisect.bisect_left(keys, tokens), len(keys) - 1)
        low, high = keys[index - 1], keys[index]
        slope = (self._seconds[high] - self._seconds[low]) / (high - low)
        estimate = max(self._seconds[low], self._seconds[low] + slope * (tokens - low))
        if tokens <= keys[-1]:
            estimate = min(estimate, min(self._seconds[key] for key in keys[index:]))
        return estimate


class SpeculationGate:
    """Whether speculation pays at the current load: measured, not predicted.

    The cost model prices a round from forward times, but on shared hardware the draft's work also slows
    the target's forwards for other requests, which no per-round price sees (measured on 2 cores: at 8
    streams, K = 2 rounds took twice what the model predicted). So the orchestrator also measures what
    matters, server-wide: committed tokens per second over one-second epochs, in epochs where load-aware
    requests may speculate and epochs where they run K = 0, for each load level (running requests, by
    powers of two). Once both are known at a level it keeps the faster, trying the other one epoch in
    `explore_every`.
    """

    def __init__(
        self, epoch_s: float = 1.0, explore_every: int = 8, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.epoch_s = epoch_s
        self.explore_every = explore_every
        self._clock = clock
        self.speculate = True  # this epoch's mode
        self._started: float | None = None
        self._tokens = 0
        # level -> [rate at K = 0, rate speculating] (committed tokens per second), None until measured
        self._rates: dict[int, list[float | None]] = {}
        self._epochs: dict[int, int] = {}

    def record(self, tokens: int, running: int) -> None:
        """A round committed `tokens` while `running` requests were generating."""
        now = self._clock()
        if self._started is None:
            self._started = now
        self._tokens += tokens
        if now - self._started >= self.epoch_s:
            self._close_epoch(now, running.bit_length())

    def _close_epoch(self, now: float, level: int) -> None:
        assert self._started is not None
        rate = self._tokens / (now - self._started)
        rates = self._rates.setdefault(level, [None, None])
        old = rates[self.speculate]
        rates[self.speculate] = rate if old is None else _DECAY * old + (1 - _DECAY) * rate
        epochs = self._epochs[level] = self._epochs.get(level, 0) + 1
        plain, speculating = rates
        if speculating is None or plain is None:
            self.speculate = speculating is None  # measure the mode still unknown
        else:
            best = speculating > plain
            self.speculate = (not best) if epochs % self.explore_every == 0 else best
        self._started, self._tokens = now, 0


class ServiceLoad:
    """The target's and the draft's cost curves, the target's current batch size, and each service's
    per-step overhead beyond its forward passes."""

    def __init__(self, target: common_pb2.ModelInfo, draft: common_pb2.ModelInfo | None) -> None:
        self.target = CostCurve.from_info(target)
        self.draft = CostCurve.from_info(draft)
        self.batch_size = 1.0  # sessions in a target forward, recently
        self.target_overhead_s = 0.0
        self.draft_overhead_s = 0.0
        self.running = 0  # requests generating now (kept by the orchestrator's admission)
        self.gate = SpeculationGate()

    def record_round(self, tokens: int) -> None:
        """A round of a load-aware request committed `tokens`."""
        self.gate.record(tokens, self.running)

    def set_draft(self, info: common_pb2.ModelInfo) -> None:
        self.draft = CostCurve.from_info(info)

    def observe_target(self, timing: common_pb2.Timing, fed: int, wall_seconds: float) -> None:
        """A verify step: its batch's forward time by batch tokens, the batch size, the overhead."""
        if fed > _MAX_OBSERVED_TOKENS or timing.batch_size == 0:
            return
        self.target.observe(timing.batch_tokens, timing.forward_seconds)
        self.batch_size = _DECAY * self.batch_size + (1 - _DECAY) * timing.batch_size
        overhead = max(0.0, wall_seconds - timing.forward_seconds)
        self.target_overhead_s = _DECAY * self.target_overhead_s + (1 - _DECAY) * overhead

    def observe_draft(self, timing: common_pb2.Timing, forwards: int, fed: int, wall_seconds: float) -> None:
        """A draft step that fed `fed` tokens and ran `forwards` forward passes (one per drafted token)."""
        if forwards < 1 or timing.batch_size == 0 or fed > _MAX_DRAFT_CATCH_UP:
            return
        self.draft.observe(timing.batch_size, timing.forward_seconds / forwards)
        overhead = max(0.0, wall_seconds - timing.forward_seconds)
        self.draft_overhead_s = _DECAY * self.draft_overhead_s + (1 - _DECAY) * overhead

    def round_seconds(self, k: int, drafting: bool = True) -> float:
        """Expected wall time of one synchronous round at K = k, if every session proposes k tokens;
        without `drafting`, the proposal costs nothing (a prompt lookup)."""
        batch = max(1.0, self.batch_size)
        verify = self.target.seconds(batch * (k + 1)) + self.target_overhead_s
        if k == 0 or not drafting:
            return verify
        return k * self.draft.seconds(batch) + self.draft_overhead_s + verify
