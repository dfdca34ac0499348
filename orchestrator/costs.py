"""What a round costs under the current load, learned from the services' replies.

Verifying K + 1 positions for B sessions costs a target forward over about B (K + 1) tokens, which
grows once the batch is large; drafting K tokens costs K draft forwards at batch B. Both curves start
from the services' start-up measurements (`ModelInfo.forward_costs`) and follow live steps; the
orchestrator also learns what a step costs beyond the forward (RPC, serialization, queueing). Shared by
all requests of one orchestrator: it describes the services, never a request.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

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

    @property
    def known(self) -> bool:
        return bool(self._keys)

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


class ServiceLoad:
    """The target's and the draft's cost curves, the target's current batch size, and each service's
    per-step overhead beyond its forward passes."""

    def __init__(self, target: common_pb2.ModelInfo, draft: common_pb2.ModelInfo | None) -> None:
        self.target = CostCurve.from_info(target)
        self.draft = CostCurve.from_info(draft)
        self.batch_size = 1.0  # sessions in a target forward, recently
        self.target_overhead_s = 0.0
        self.draft_overhead_s = 0.0

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
