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

from orchestrator.metrics import GATE_EPOCHS, GATE_SPECULATING
from specdec.v1 import common_pb2

_DECAY = 0.9  # weight of the past in every running estimate
# Steps feeding more than this many tokens are prefills or catch-ups, not the rounds being priced.
_MAX_OBSERVED_TOKENS = 256
# A draft step whose feed is longer is catching up after rounds without it: its first forward is a
# small prefill, and counting it as a drafting forward would price drafting too high (and, since
# every return from K = 0 starts with a catch-up, keep K at 0).
MAX_DRAFT_CATCH_UP = 4


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
        # _floor[i]: the least seconds measured at keys[i:], rebuilt after an observation changed a
        # point. The load-aware policy prices every K each round; scanning the points per price cost
        # 180 us a round at K up to 16 (measured), on the orchestrator's one core.
        self._floor: list[float] | None = None

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
        self._floor = None

    def _floors(self) -> list[float]:
        if self._floor is None:
            floor, least = [], float("inf")
            for key in reversed(self._keys):
                least = min(least, self._seconds[key])
                floor.append(least)
            floor.reverse()
            self._floor = floor
        return self._floor

    def seconds(self, tokens: float) -> float:
        keys = self._keys
        if not keys:
            return 0.0
        floors = self._floors()
        if tokens <= keys[0]:
            return floors[0]
        if len(keys) == 1:
            return self._seconds[keys[0]] * tokens / keys[0]
        index = min(bisect.bisect_left(keys, tokens), len(keys) - 1)
        low, high = keys[index - 1], keys[index]
        slope = (self._seconds[high] - self._seconds[low]) / (high - low)
        estimate = max(self._seconds[low], self._seconds[low] + slope * (tokens - low))
        if tokens <= keys[-1]:
            estimate = min(estimate, floors[index])
        return estimate


class ModeRates:
    """Per load level, a measured rate for each of two modes (0: the target alone, 1: the other way).

    Each rate is the mean of its measurements until there are `1 / (1 - _DECAY)` of them, then an
    exponentially weighted one. A mode measured rarely (in one exploration in eight) must not be held
    for minutes by its first measurement, which is often its worst: taken while estimates were cold
    (measured: the gate kept one stream at K = 0 for a whole benchmark after a first speculating epoch
    at 0.94x, while fixed K = 2 ran 1.2x faster)."""

    def __init__(self) -> None:
        self._rates: dict[int, list[float | None]] = {}
        self._counts: dict[int, list[int]] = {}

    def get(self, level: int) -> tuple[float | None, float | None]:
        plain, other = self._rates.get(level, (None, None))
        return plain, other

    def observe(self, level: int, mode: bool, value: float) -> None:
        rates = self._rates.setdefault(level, [None, None])
        counts = self._counts.setdefault(level, [0, 0])
        counts[mode] += 1
        old = rates[mode]
        weight = max(1 - _DECAY, 1 / counts[mode])
        rates[mode] = value if old is None else (1 - weight) * old + weight * value


class SpeculationGate:
    """Whether speculation pays at the current load: measured, not predicted.

    The cost model prices a round from forward times, but on shared hardware the draft's work also slows
    the target's forwards for other requests, which no per-round price sees (measured on 2 cores: at 8
    streams, K = 2 rounds took twice what the model predicted). So the orchestrator also measures what
    matters, server-wide: committed tokens per second per running request, over one-second epochs in
    which load-aware requests may speculate and epochs in which they run K = 0, for each load level
    (running requests averaged over the epoch's rounds, by powers of two). Once both are known at a
    level it keeps the faster (speculation only when faster by `margin`), trying the other one epoch in
    `explore_every`, and less often (up to one in `max_explore_every`) while each try confirms the
    choice. A pause longer than an epoch (no load-aware round at all) starts a new epoch rather
    than counting as a slow one, as does a change of load by two levels (a fall only once it has
    lasted `dip_s`) or a rise by one early in the epoch (`_stale`). At a load level not yet measured,
    where speculation already lost at a lower load, it starts at K = 0 and measures speculation only in
    an exploration epoch.

    A request running alone is never held: the gate's question is what its draft forwards cost the
    others, and with no others its own round times, which its policy prices per round, say it all. Its
    epochs at K = 0 would only pay for exploration (measured at one stream, gate on against held
    open: 1.30x the target alone against 1.37x, fixed K = 2 making 1.43x).
    """

    def __init__(
        self,
        epoch_s: float = 1.0,
        explore_every: int = 8,
        max_explore_every: int = 64,
        margin: float = 1.1,
        settle_fraction: float = 0.3,
        ramp_fraction: float = 0.1,
        dip_s: float = 0.05,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.epoch_s = epoch_s
        self.explore_every = explore_every
        # An exploration that confirms the mode kept at its level doubles the epochs until the next one
        # there, up to this; one that changes the mode brings them back to `explore_every`. Each
        # exploration of a mode that loses costs its loss for an epoch, and where one mode is clearly
        # better the same answer comes back every time.
        self.max_explore_every = max(max_explore_every, explore_every)
        self._waits: dict[int, int] = {}  # level -> epochs from one exploration to the next
        self._since: dict[int, int] = {}  # level -> epochs begun there since its last exploration
        self._explored_from: bool | None = None  # this epoch explores: whether speculating was best
        # After a switch to K = 0, the first part of the epoch measures the end of speculating, not
        # K = 0: speculative rounds still finishing, and sessions that drifted out of phase while
        # speculating (the target does not hold batches for speculative verifies) coming back into
        # one batch. Left in, that made K = 0 epochs look 8-15% slower than K = 0 runs (8 streams),
        # and the gate kept a speculation that lost 10%. A switch to speculation is measured whole:
        # its start is every session's draft catching up on the tokens committed at K = 0, a cost of
        # speculating. Left out, the gate at 16 streams measured speculating epochs 10% faster than
        # K = 0 epochs and kept speculating, while whole runs that speculated ran 0.89x the target
        # alone (runs that stayed at K = 0: 0.95x).
        self.settle_fraction = settle_fraction
        self.ramp_fraction = ramp_fraction
        self.dip_s = dip_s
        self._fell_at: float | None = None  # when the load fell fourfold below the epoch's, if it has
        # Speculation must measure this much faster to be kept: epochs are noisy (one that holds the
        # start of a burst of prefills looks slow), and a wrong K = 0 is never slower than the target
        # alone, which a wrong K > 0 can be.
        self.margin = margin
        self._clock = clock
        self.speculate = True  # this epoch's mode
        self._started: float | None = None
        self._measured_from = 0.0  # the epoch's start, or later after a switch of mode
        self._last = 0.0  # when the last round was recorded
        self._tokens = 0
        self._running = 0  # running requests summed over the epoch's rounds, for its load level
        self._rounds = 0
        self._level = 0  # the load level this epoch's mode was chosen for
        # level -> rates at K = 0 and speculating (committed tokens per second per running request)
        self._rates = ModeRates()

    def speculating(self, running: int) -> bool:
        """Whether a round starting now, with `running` requests generating, may speculate.

        The mode is chosen for the load now, not the one the last epoch was chosen for: the first
        rounds of a burst after a pause used to run in the mode the previous burst's tail ended in
        (seen in a debug log at 16 streams: every request's first round at K = 2, drafting its
        prompt, before the first verdict restarted the epoch at K = 0)."""
        now = self._clock()
        if self._stale(now, running):
            self._start_epoch(now, running)
        return self.speculate

    def record(self, tokens: int, running: int) -> None:
        """A round committed `tokens` while `running` requests were generating."""
        now = self._clock()
        if self._stale(now, running):
            # This round's tokens were made before the epoch starts.
            self._start_epoch(now, running)
            return
        started = self._started
        assert started is not None
        self._last = now
        if now > self._measured_from:
            self._tokens += tokens
            self._running += running
            self._rounds += 1
        if now - started >= self.epoch_s:
            self._close_epoch(now)
            self._start_epoch(now, running)

    def _stale(self, now: float, running: int) -> bool:
        """Whether the current epoch no longer measures anything: there is none yet, or no round came
        for longer than an epoch (an idle spell is no measurement of either mode), or the load changed
        fourfold or more within it (a burst starting: its first round is often a request alone), so
        that its mode was chosen for another load; or the load rose by a level within the epoch's
        first `ramp_fraction`: a burst still arriving.

        The last rule: 8 clients arriving together reached the gate as 1, then 4 running requests, and
        the epoch chosen at 4 (a level at which nothing was measured, so speculating) ran its whole
        second at 8, where K = 0 had measured faster (debug log, 8 streams; each such burst drafted
        every prompt and 0.2 tokens per output token in all, and load_aware ran 0.85x the target
        alone). Only early in an epoch, and only rises: at a steady 8 the count moves between 7 and 8
        at every request's end, a level apart."""
        if self._started is None or now - self._last > self.epoch_s:
            return True
        change = running.bit_length() - self._level
        if change <= -2:
            # A fall counts once it has lasted `dip_s`: requests that end together dip the load to 1
            # for the few milliseconds before the next ones arrive, and restarting there chose
            # "alone, speculate" for those next requests' first rounds (each drafting its prompt),
            # then K = 0 again a moment later (debug log, 4 streams: every wave of requests).
            self._fell_at = now if self._fell_at is None else self._fell_at
            return now - self._fell_at >= self.dip_s
        self._fell_at = None
        return change >= 2 or (change >= 1 and now - self._started < self.ramp_fraction * self.epoch_s)

    def _start_epoch(self, now: float, running: int) -> None:
        """Begin an epoch in the mode chosen for the load level now (its measurement starts later after
        a switch to K = 0: `settle_fraction`)."""
        previous = self.speculate if self._started is not None else None
        self._started, self._last, self._tokens, self._running, self._rounds = now, now, 0, 0, 0
        self._fell_at = None
        level = self._level = running.bit_length()
        plain, speculating = self._rates.get(level)
        since = self._since[level] = self._since.get(level, 0) + 1
        explore = since >= self._waits.get(level, self.explore_every)
        self._explored_from = None
        if running < 2:
            self.speculate = True  # alone: nobody else to slow down
        elif plain is None and speculating is None:
            self.speculate = not self._lost_below(level)  # measure first what pays below
        elif plain is None:
            self.speculate = False  # measure K = 0 here
        elif speculating is None:
            # Speculation pays less as load grows: where it lost at a lower load, K = 0 is kept here
            # too until an exploration epoch measures it.
            self.speculate = explore or not self._lost_below(level)
            if explore:
                self._since[level] = 0
        else:
            best = self._pays(plain, speculating)
            self.speculate = (not best) if explore else best
            if explore:
                self._since[level], self._explored_from = 0, best
        GATE_SPECULATING.set(int(self.speculate))
        GATE_EPOCHS.labels("speculating" if self.speculate else "k0").inc()
        to_plain = previous is True and not self.speculate
        self._measured_from = now + self.settle_fraction * self.epoch_s if to_plain else now

    def _close_epoch(self, now: float) -> None:
        assert self._started is not None
        if not self._rounds:
            return
        running = self._running / self._rounds
        # Per running request: an epoch at the tail of a busier spell (2 requests, then 1) must not
        # make its mode look faster than the same mode at a steady 1.
        rate = self._tokens / (now - self._measured_from) / max(running, 1.0)
        level = round(running).bit_length()
        self._rates.observe(level, self.speculate, rate)
        if self._explored_from is not None and level == self._level:
            # Judged on this epoch alone: the kept mode's rate is a mean that one epoch moves little,
            # and a change of the traffic must bring the explorations back at once.
            plain, speculating = self._rates.get(level)
            assert plain is not None and speculating is not None
            pays = self._pays(plain, rate) if self.speculate else self._pays(rate, speculating)
            wait = self._waits.get(level, self.explore_every)
            confirmed = pays == self._explored_from
            self._waits[level] = min(2 * wait, self.max_explore_every) if confirmed else self.explore_every

    def _lost_below(self, level: int) -> bool:
        """Whether the nearest lower load level with both modes measured found K = 0 faster."""
        for lower in range(level - 1, -1, -1):
            plain, speculating = self._rates.get(lower)
            if plain is not None and speculating is not None:
                return not self._pays(plain, speculating)
        return False

    def _pays(self, plain: float, speculating: float) -> bool:
        return speculating > self.margin * plain


class HybridChoice:
    """For the hybrid method: whether a request asks the draft model on rounds where the prompt lookup
    finds nothing, or runs those rounds on the target alone.

    Where the lookup misses, the text is new, and there the draft agrees less than it does overall
    (measured on the edit prompts: 0.42 against 0.81), while asking it costs a draft step, catching the
    draft up on what the lookup rounds committed, and the draft's prefill of the prompt. Whether that
    pays is measured, like the gate, server-wide and per load level: each finished hybrid request
    reports its tokens per second after its first token (the prompt's prefill is the same either way)
    and which way it went; new requests take the faster way, and one in
    `explore_every` the other. Per request rather than per round, because a request that tries the
    draft once pays its prefill, which a 64-token request cannot earn back in a few rounds.
    """

    def __init__(self, explore_every: int = 8) -> None:
        self.explore_every = explore_every
        # level -> tokens per second on the target alone and with the draft model
        self._rates = ModeRates()
        self._requests: dict[int, int] = {}

    def model_on_misses(self, running: int) -> bool:
        level = running.bit_length()
        plain, model = self._rates.get(level)
        if model is None or plain is None:
            return model is None  # measure the way still unknown
        requests = self._requests[level] = self._requests.get(level, 0) + 1
        best = model > plain
        return (not best) if requests % self.explore_every == 0 else best

    def observe(self, running: int, model_on_misses: bool, tokens: int, seconds: float) -> None:
        """A finished hybrid request that started with `running` requests generating: `tokens` after
        its first, in `seconds` after its first."""
        if tokens < 1 or seconds <= 0:
            return
        self._rates.observe(running.bit_length(), model_on_misses, tokens / seconds)


class ServiceLoad:
    """The target's and the draft's cost curves, the target's current batch size, and how much longer
    each service's steps take than their forward passes (the stretch).

    A stretch, not a fixed overhead: under load most of a step's time beyond its own forwards is the
    wait for the forward running when it arrived, which grows with that forward, and so with K. A
    fixed overhead made every round look dearer by a constant, which larger blocks amortise: measured
    at 16 streams, 11-28 ms of "overhead" per verify against 9-22 ms forwards, and K chosen from 3 to
    16 where K = 2 ran 15% faster (one stack, the gate held open)."""

    def __init__(self, target: common_pb2.ModelInfo, draft: common_pb2.ModelInfo | None) -> None:
        self.target = CostCurve.from_info(target)
        self.draft = CostCurve.from_info(draft)
        self.batch_size = 1.0  # sessions in a target forward, recently
        self.target_stretch = 1.0  # a step's wall time over its forward time
        self.draft_stretch = 1.0
        self.running = 0  # requests generating now (kept by the orchestrator's admission)
        self.gate = SpeculationGate()
        self.hybrid = HybridChoice()

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
        self.target_stretch = _stretched(self.target_stretch, timing.forward_seconds, wall_seconds)

    def observe_draft(self, timing: common_pb2.Timing, forwards: int, fed: int, wall_seconds: float) -> None:
        """A draft step that fed `fed` tokens and ran `forwards` forward passes (one per drafted token)."""
        if forwards < 1 or timing.batch_size == 0 or fed > MAX_DRAFT_CATCH_UP:
            return
        self.draft.observe(timing.batch_size, timing.forward_seconds / forwards)
        self.draft_stretch = _stretched(self.draft_stretch, timing.forward_seconds, wall_seconds)

    def round_seconds(self, k: int, drafting: bool = True) -> float:
        """One synchronous round at K = k from the services' forward costs and step stretches, if every
        session proposes k tokens; without `drafting`, the proposal costs nothing (a prompt lookup)."""
        batch = max(1.0, self.batch_size)
        verify = self.target.seconds(batch * (k + 1)) * self.target_stretch
        if k == 0 or not drafting:
            return verify
        return k * self.draft.seconds(batch) * self.draft_stretch + verify


_MAX_STRETCH = 20.0  # one step stalled behind a long prefill must not price every round


def _stretched(stretch: float, forward_seconds: float, wall_seconds: float) -> float:
    """The running stretch after a step that took `wall_seconds` for `forward_seconds` of forwards."""
    if forward_seconds <= 0 or wall_seconds <= 0:
        return stretch
    ratio = min(max(wall_seconds / forward_seconds, 1.0), _MAX_STRETCH)
    return _DECAY * stretch + (1 - _DECAY) * ratio
