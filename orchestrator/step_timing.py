"""A service step's timing as the orchestrator reads it: checked where the answer arrives, and split
into where the step's time went, for the `specdec:step_seconds` metric (README, "Where a step's time
goes")."""

from __future__ import annotations

import math
from typing import Any

import structlog

from orchestrator.metrics import STEP_SECONDS, STEPS
from specdec.v1 import common_pb2

log = structlog.get_logger(__name__)


class StepClock:
    """Where one service's steps spend their time, from each answer's Timing and the orchestrator's
    clock. The parts are summed here and added to the counters every FLUSH_STEPS steps with their
    count, so that a scrape's means are over whole flushes and a step costs no counter's lock."""

    PARTS = ("forward", "queue", "service_host", "transport", "between")
    FLUSH_STEPS = 32

    def __init__(self, service: str) -> None:
        self.service = service
        self._steps = STEPS.labels(service)
        self._parts = [STEP_SECONDS.labels(service, part) for part in self.PARTS]
        self._sums = [0.0] * len(self.PARTS)
        self._count = 0

    def check(self, response: Any, replica: str) -> None:
        """Clear an answer's timing if a figure in it is not finite. The step times every request's K
        reads (orchestrator/goodput.py) and this clock are shared: one NaN from a faulty replica would
        stay in their running means for good, for every request."""
        timing = response.timing
        if not all(map(math.isfinite, (timing.forward_seconds, timing.service_seconds, timing.queue_seconds))):
            log.warning("timing_refused", service=self.service, replica=replica, timing=str(timing).replace("\n", " "))
            response.ClearField("timing")

    def account(self, timing: common_pb2.Timing, round_trip: float, between: float) -> None:
        """A step answered `round_trip` seconds after it was sent, `between` seconds after the
        session's last answer (0: its first step, or after a failed one)."""
        # Every part at least 0: a counter refuses a negative increment, (a + b) - a - b may be -1e-17, and
        # a draft step may be sent before the last one was answered.
        forward, queue = max(timing.forward_seconds, 0.0), max(timing.queue_seconds, 0.0)
        service = max(timing.service_seconds, forward + queue)
        sums = self._sums
        sums[0] += forward
        sums[1] += queue
        sums[2] += max(service - forward - queue, 0.0)
        sums[3] += max(round_trip - service, 0.0)
        sums[4] += max(between, 0.0)
        self._count += 1
        if self._count >= self.FLUSH_STEPS:
            self.flush()

    def flush(self) -> None:
        """Add what was summed since the last flush to the counters."""
        for counter, seconds in zip(self._parts, self._sums, strict=True):
            counter.inc(seconds)
        self._steps.inc(self._count)
        self._sums = [0.0] * len(self.PARTS)
        self._count = 0
