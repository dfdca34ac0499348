"""K from the measured goodput: the load_aware policy.

Every round is timed, and a request's K maximises what its own rows earn, less what they cost the
sessions sharing its forwards (the marginal goodput of TurboSpec and SmartSpec):

    J(K) = E(a, K) / R(K) - X K

- E(a, K) = (1 - a^(K+1)) / (1 - a): the tokens a round commits, at the request's own running
  acceptance estimate a.
- R(K) = S + beta K + D(K) + (1 - a^K) f: the request's round time at K. S is what its rounds take
  beyond its own extra rows, its wait for the draft and for the draft's row (measured per request:
  queueing, the network, the orchestrator, everyone else's rows); f is a sampled round's wait for the
  draft's row at a rejection (a RowFetch, measured per request; 0 for greedy), paid in the 1 - a^K
  of rounds that reject (about 1 ms a fetch on this CPU, pinned, one stream; counted in S, it priced
  a round at K = 0 as if it fetched too); beta is what one more row adds to a target forward (the
  service's start-up curve fitted by one line or two joined at a knee, `CostCurve`, its chord at the
  live forward's tokens, scaled by live forwards against the fit); D(K) = w + d K is the round's wait
  for a block drafted now, where d is what the draft's forwards take per drafted token (hidden beside
  a verify or not, they take the cores or the device the draft shares) and w what the request's
  rounds wait for the draft beyond its forwards (the RPC and queue on its path, measured per request
  on rounds that waited). A request that drafts ahead (overlapped drafting) finds its block drafted
  beside the last step in the a^(K+1) of rounds after a block accepted whole with its bonus token
  guessed; those wait only for what of that step (K + 1 tokens) outlasted the target's, so
  D(K) = (1 - a^(K+1)) (w + d K) + a^(K+1) max(w + d (K + 1) - S - beta K, 0). Measured on the
  modeled 8B/1B at one stream: rounds of 13.2, 15.9, 19.2 and 24.3 ms at fixed K = 2, 3, 4 and 6;
  this predicts 13.4, 15.6, 18.6 and 24.2 with d fitted to the K = 2 round (docs/design.md). With a
  speculation cache the draft service holds the block in the share r of rounds measured, and the
  round still asks for it: D(K) = (1 - r) (w + d K) + r (w + max(d (K + 1) - S - beta K, 0)). w and r
  are the request's own running means, in which its first rounds weigh one round each (docs/design.md,
  "What a round waits for").
- X = (N beta + N_d beta_d) r / R: each of the N other sessions that wait on a target forward (those
  in it and those queued behind it, measured) waits beta per extra row, each of the N_d that wait on
  a draft forward beta_d per drafted token, and each loses tokens at about this request's rate r per
  second of its round R. Where the draft shares the target's cores (both services on one host's CPU,
  `StepTimes.shared_cores`), a drafted token's forward also takes the cores the target's forwards
  need: X gains N d (measured at 8 co-located streams: rounds of 35-40 ms where the target alone's
  took 16, and load_aware at 0.85x the target alone without this term).

Alone this is the K that maximises E / R. Under load on hardware where rows cost (a CPU, a GPU past
its flat region) the X term brings K down, to 0 (the target alone) where drafting does not pay;
where a forward costs the same for 1 row as for 64, X is near 0 and speculation stays. Other requests
enter only through the measured step times.

J is flat near its best K and falls steeply past it, and a is an estimate over a few rounds: a K
chosen at every swing of it wanders to long blocks that cost more than they earn (modeled 8B/1B, 16
streams: K jumped from 2 to 16 after the first blocks accepted whole, and ran 0.74x fixed K = 2). So K
rises one step a round, where one more token pays (J(K + 1) > J(K)) and only after a block accepted
whole (the one evidence that a longer block would have been); it falls at once to the best K below.
It leaves K = 0 only for a predicted gain of LEAVE_ZERO_GAIN.

At K = 0 a round learns nothing of the acceptance, so every PROBE_EVERY rounds the draft proposes one
token beside the target's step (a lookup proposes one in the round, where it costs nothing to
propose): K comes back when the draft agrees again.
"""

from __future__ import annotations

from orchestrator.cost_curve import CostCurve
from orchestrator.k_policy import CostModelK, FixedK, HeuristicK, KPolicy
from orchestrator.rejection import Verdict
from specdec.v1 import common_pb2

# The weight of the past in every running estimate: about ten steps of memory (README, "Choosing K").
DECAY = 0.9
# The acceptance estimate of a request before its first verdict, worth one draft token: the first
# verdicts (the guess drafted beside the prefill, the first block) outweigh it at once.
PRIOR_ACCEPTANCE = 0.8
# Rounds at K = 0 before the first probe of the draft's agreement; each probe after which the request
# stays at K = 0 doubles the wait for the next (a draft that does not agree costs ever less to watch).
PROBE_EVERY = 8
# K leaves 0 only for a predicted gain of this much: the return costs a catch-up draft step, and puts the
# request's rounds out of step with the others' (the target's forwards split, the links carry more
# messages). It is what is left of a switch gain on every move, measured at 25% (default pair, pinned,
# 2 repetitions: without it 0.94x and 0.99x the target alone at 8 and 32 streams, with it 0.98x and
# 1.13x); docs/design.md has this release's figures.
LEAVE_ZERO_GAIN = 1.25


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else DECAY * old + (1 - DECAY) * new


class Mean:
    """A running mean in which each value weighs DECAY times the next: as an exponentially weighted
    average once there are a few, but a first value weighs one value, not the whole memory (an average
    started at its first value holds it ten rounds' worth). None before the first value."""

    def __init__(self) -> None:
        self._total = 0.0
        self._weight = 0.0

    def add(self, value: float) -> None:
        self._total = DECAY * self._total + value
        self._weight = DECAY * self._weight + 1.0

    @property
    def value(self) -> float | None:
        return self._total / self._weight if self._weight else None


class Forwards:
    """One service's forward: its start-up curve, fitted (`CostCurve`), scaled by live forwards against
    what the fit predicts for them; the tokens a live forward feeds, and how many sessions wait on
    each forward."""

    def __init__(self, info: common_pb2.ModelInfo | None) -> None:
        self.curve = CostCurve([(p.batch_tokens, p.seconds) for p in info.forward_costs] if info else [])
        self.stretch = 1.0
        self.batch = 1.0  # sessions in a forward
        self.tokens = 1.0  # tokens a forward feeds
        self.last_stretch: float | None = None  # the last step's forward against the curve
        self._forward: float | None = None  # seconds of one forward
        self._queue = 0.0  # seconds a step waits before its first forward

    @property
    def row_seconds(self) -> float:
        """What one more row adds to a forward now: the fitted curve's chord from the live forward's
        tokens over one more row for each of its sessions."""
        return self.curve.row_seconds(self.tokens, self.batch) * self.stretch

    @property
    def others(self) -> float:
        """Sessions besides one's own that a longer forward delays: the B - 1 others in it, and those
        queued behind it, B W / F by Little's law (steps arrive at B / F a second where the service is
        busy, and wait W). At 64 streams over forwards of 32 rows, half the sessions are queued."""
        queued = self.batch * self._queue / self._forward if self._forward else 0.0
        return max(self.batch - 1.0, 0.0) + queued

    def observe(self, timing: common_pb2.Timing, forwards: int = 1) -> None:
        """A step's timing: `forwards` forwards (a draft step runs one per drafted token), the largest
        of `timing.batch_size` sessions and `timing.batch_tokens` tokens."""
        predicted = self.curve.seconds(timing.batch_tokens)
        if timing.batch_size == 0 or timing.forward_seconds <= 0 or predicted <= 0 or forwards < 1:
            return
        self.last_stretch = timing.forward_seconds / forwards / predicted
        self.stretch = _ewma(self.stretch, self.last_stretch)
        self.batch = _ewma(self.batch, timing.batch_size)
        self.tokens = _ewma(self.tokens, timing.batch_tokens)
        self._forward = _ewma(self._forward, timing.forward_seconds / forwards)
        self._queue = _ewma(self._queue, max(timing.queue_seconds, 0.0))


def _on_cpu(info: common_pb2.ModelInfo) -> bool:
    """A service computing on its host's CPU, not a GPU nor a modeled device."""
    return info.device == "cpu" and not info.HasField("simulated_device")


class StepTimes:
    """What steps cost at the current load, from every request's timings: shared by the requests of
    one orchestrator (it describes the services, never a request)."""

    def __init__(
        self, target: common_pb2.ModelInfo, draft: common_pb2.ModelInfo | None, one_host: bool = False
    ) -> None:
        self.target = Forwards(target)
        # The draft's forwards may take the target's cores: the replicas at one address, the target on
        # its CPU (set_draft checks the draft).
        self._cores_shareable = one_host and _on_cpu(target)
        self.shared_cores = False  # the draft's forwards take the target's cores (set_draft)
        self.base: float | None = None  # S over every request's rounds: a new request's, until its own
        self.draft_per_token: float | None = None  # a draft step's forward seconds per drafted token
        self.set_draft(draft)  # sets self.draft

    def set_draft(self, draft: common_pb2.ModelInfo | None) -> None:
        """Before a round has waited for it, a drafted token costs the draft's smallest forward. The
        draft's forwards take the target's cores where both run on one host's CPU, neither on a
        modeled device."""
        self.draft = Forwards(draft)
        self.shared_cores = self._cores_shareable and draft is not None and _on_cpu(draft)
        if draft is not None and draft.forward_costs and self.draft_per_token is None:
            self.draft_per_token = min(p.seconds for p in draft.forward_costs)

    def observe_base(self, seconds: float) -> None:
        self.base = _ewma(self.base, seconds)

    def observe_draft_step(self, seconds_per_token: float) -> None:
        self.draft_per_token = _ewma(self.draft_per_token, seconds_per_token)

    def draft_price_at_load(self, stretch: float = 1.0) -> float:
        """A drafted token's price if every session in the target's forwards drafted: one forward of the
        draft with that many rows of one token, from its curve, at `stretch` times its start-up speed."""
        return self.draft.curve.seconds(self.target.batch) * stretch

    def observe_probe_step(self) -> None:
        """A probe's draft step has answered: the draft's price is at most what that step's speed says a
        drafted token would cost at the load there is. Only rounds that draft update the price
        otherwise, so a price learnt under a burst of load (or a draft's slow spell) stood for as long as
        it held every request at K = 0 (docs/design.md, the probes)."""
        if self.draft.last_stretch is not None and self.draft_per_token is not None:
            self.draft_per_token = min(self.draft_per_token, self.draft_price_at_load(self.draft.last_stretch))


class GoodputK(KPolicy):
    """One request's K in [0, max_k] by J(K); `drafts_cost` is False for prompt-lookup blocks, which
    cost no draft step."""

    drafts_beside_prefill = True  # the draft prefills beside the target's prefill: the first token waits for neither

    def __init__(
        self,
        initial_k: int,
        max_k: int,
        times: StepTimes,
        drafts_cost: bool = True,
        overlaps: bool = False,
        speculates: bool = False,
    ) -> None:
        super().__init__(initial_k, max_k)
        self.times = times
        self.drafts_cost = drafts_cost
        self.overlaps = overlaps  # the request drafts its next block beside each step
        # The draft drafts ahead for each likely verdict (its speculation cache): the share of rounds
        # whose block is ready is learnt (`_ready`), not a^(K + 1).
        self.speculates = overlaps and speculates
        self._ready = Mean()  # the share of this request's rounds whose block was ready
        self._accepted, self._trials = PRIOR_ACCEPTANCE, 1.0
        self._base: float | None = None  # S: a round's seconds beyond its own rows and draft wait
        self._latency = Mean()  # w: what a speculating round waits for the draft beyond its forwards
        self._fetch: float | None = None  # f: what a sampled round waits for the draft's row at a rejection
        self._k = min(initial_k, max_k)  # the last choice
        self._whole = False  # the last block was accepted whole
        self._rounds_without_draft = 0
        self._probe_wait = PROBE_EVERY  # rounds at K = 0 before the next probe

    @property
    def acceptance_rate(self) -> float:
        return self._accepted / self._trials

    @property
    def latency(self) -> float:
        """w, 0 before the request's first round that waited for a draft step."""
        return self._latency.value or 0.0

    def goodputs(
        self, acceptance: float | None = None, upto: int | None = None, draft_price: float | None = None
    ) -> list[float]:
        """J(K) for K = 0 .. `upto` (default max_k; empty before a round measured S), at the request's
        acceptance estimate or at `acceptance`, and at the draft's learnt price or at `draft_price`."""
        # A new request starts from every request's S: its first round (the prefill, and the block
        # drafted beside it) is then chosen for the load there is, not for none.
        base = self._base if self._base is not None else self.times.base
        if base is None:
            return []
        times = self.times
        beta = times.target.row_seconds
        draft = (times.draft_per_token or 0.0) if draft_price is None else draft_price
        draft = draft if self.drafts_cost else 0.0
        # What one more row of this request costs the others per second of their rounds: a row in a
        # target forward shared with B - 1 sessions, and (drafting) a row in a draft forward.
        crowd = times.target.others * beta
        if self.drafts_cost:
            crowd += times.draft.others * times.draft.row_seconds
            if times.shared_cores:  # the draft's forwards take the cores the target's forwards need
                crowd += times.target.others * draft
        rate = min(self.acceptance_rate if acceptance is None else acceptance, 0.99)

        # Each K's expected tokens from the last's (E(K) = E(K - 1) + a^K): this runs every round of every
        # request, and at 32 streams its cost showed in the orchestrator's CPU.
        base, wait, fetch = max(base, 1e-6), self.latency, self._fetch or 0.0
        ready = self._ready.value  # None without a speculation cache: it learns only with one
        tokens, seconds, power = [1.0], [base], 1.0
        for k in range(1, (self.max_k if upto is None else max(upto, self._k)) + 1):
            power *= rate
            tokens.append(tokens[-1] + power)
            step, drafting = base + beta * k, wait + draft * k
            if self.overlaps:
                # The block was drafted beside the last step when that one was accepted whole and the
                # draft guessed its bonus token (a^(K + 1) of rounds), or, with a speculation cache,
                # in the share of rounds measured; that draft step, K + 1 tokens, ran beside the
                # target's, and the round waits only for what outlasted it. A block the cache holds
                # still comes by a step to the draft: its w is paid whole.
                if ready is None:
                    ahead, hidden = power * rate, max(drafting + draft - step, 0.0)
                else:
                    ahead, hidden = ready, wait + max(draft * (k + 1) - step, 0.0)
                drafting = (1.0 - ahead) * drafting + ahead * hidden
            seconds.append(step + drafting + (1.0 - power) * fetch)
        now = self._k
        others = crowd * tokens[now] / seconds[now] / seconds[now]
        goodputs = [t / r - others * k for k, (t, r) in enumerate(zip(tokens, seconds, strict=True))]
        return goodputs

    def next_k(self) -> int:
        if not self.drafts_cost and self._k == 0 and self._rounds_without_draft >= self._probe_wait:
            self._probe_wait *= 2
            return 1  # a lookup's probe: proposing costs nothing, verifying one more row little
        # K falls to the best of 0 .. K, and rises a step where one more token pays (from 0: pays well).
        # J over 0 .. K + 1 is all a round needs (17 values at max_k 16 cost 9 µs of orchestrator CPU).
        goodputs = self.goodputs(upto=min(self._k + 1, self.max_k))
        if goodputs:
            best = max(range(self._k + 1), key=goodputs.__getitem__)
            if best < self._k:
                self._k = best
            elif self._k < self.max_k and (self._k == 0 or self._whole):
                gain = LEAVE_ZERO_GAIN if self._k == 0 else 1.0
                self._k += int(goodputs[self._k + 1] > gain * goodputs[self._k])
        if self._k > 0:
            self._probe_wait = PROBE_EVERY
        return self._k

    def probe_due(self) -> bool:
        """A draft model's probe: one token drafted beside a K = 0 round's step, scored against it. Only
        where the acceptance could bring K back: where the load holds K at 0 even for a draft that always
        agrees, at its start-up speed with every session drafting, a probe would learn nothing, and its
        draft step (catching up on every token since the last) costs the cores it may share with the
        target (measured at 32 co-located streams). Not at the learnt price: the probe's step is also
        what brings a stale price down (`StepTimes.observe_probe_step`)."""
        if not (self.drafts_cost and self.max_k > 0 and self._rounds_without_draft >= self._probe_wait):
            return False
        agreeing = self.goodputs(acceptance=1.0, upto=1, draft_price=self.times.draft_price_at_load())
        return not agreeing or agreeing[1] > LEAVE_ZERO_GAIN * agreeing[0]

    def observe_probe(self, acceptance: float | None) -> None:
        self._rounds_without_draft = 1  # the probe's round counts; a draft that did not answer is asked again
        self._probe_wait *= 2  # unless K leaves 0 before it
        if acceptance is not None:
            self.times.observe_probe_step()
            self._learn(acceptance, 1)

    def observe(self, verdict: Verdict, draft_seconds: float = 0.0, target_seconds: float = 0.0) -> None:
        if verdict.num_drafted == 0:
            self._rounds_without_draft += 1
            return
        self._rounds_without_draft = 0
        self._probe_wait = PROBE_EVERY  # rounds at K = 0 before the next probe
        self._whole = verdict.all_accepted
        self._learn(verdict.num_accepted, verdict.num_accepted + (0 if verdict.all_accepted else 1))

    def observe_wall(
        self,
        k: int,
        seconds: float,
        draft_wait: float = 0.0,
        draft_fed: int = 0,
        draft_per_token: float = 0.0,
        overlapped: bool = False,
        fetch_seconds: float = 0.0,
    ) -> None:
        """A round at K = k took `seconds`, `draft_wait` of them waiting for the draft and `fetch_seconds`
        for the draft's row at a sampled rejection (f, learnt from the rounds that fetched); its block came
        from a draft step that fed `draft_fed` tokens and ran `draft_per_token` seconds of forwards per
        drafted token. The forwards price drafting, not the wait: a step hidden beside a verify still
        takes the cores or the device the draft shares (measured on 2 cores, pinned: pricing the wait
        chose K of 3 to 4 at one stream, 0.9x fixed K = 2), and a step's wall time holds its queueing
        behind other sessions' drafts (30-40 ms a token at 32 streams, where a forward took a few). A
        step that fed more than a round commits was catching the draft up after rounds without it (or
        after lookup rounds, or on a reopened session): its time is this request's own, no price."""
        base = max(seconds - draft_wait - fetch_seconds - self.times.target.row_seconds * k, 0.0)
        if fetch_seconds > 0:
            self._fetch = _ewma(self._fetch, fetch_seconds)
        self._base = _ewma(self._base, base)
        self.times.observe_base(base)
        priced = self.drafts_cost and k > 0 and draft_per_token > 0 and draft_fed <= self.max_k + 1
        if priced:
            self.times.observe_draft_step(draft_per_token)
        if self.speculates and k > 0:
            self._ready.add(float(overlapped))
        if priced and not overlapped:
            # The request's own wait for a draft step beyond its forwards: the draft's RPC and queue on
            # this request's path. Rounds whose block was drafted ahead do not measure it: their wait is
            # what of the draft's work outlasted the last step, if any.
            self._latency.add(max(draft_wait - draft_per_token * k, 0.0))

    def _learn(self, accepted: float, trials: int) -> None:
        self._accepted = DECAY * self._accepted + accepted
        self._trials = DECAY * self._trials + trials


def make_policy(name: str, initial_k: int, max_k: int, times: StepTimes, **load_aware: bool) -> KPolicy:
    """The policy called `name` (one of serving.protocol.POLICIES); `load_aware`: GoodputK's options
    (`drafts_cost`, `overlaps`, `speculates`), which the other policies do without."""
    if name == "load_aware":
        return GoodputK(initial_k, max_k, times, **load_aware)
    policies: dict[str, type[KPolicy]] = {"fixed": FixedK, "heuristic": HeuristicK, "cost_model": CostModelK}
    return policies[name](initial_k, max_k)
