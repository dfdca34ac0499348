"""How many tokens to draft each round (K).

- fixed: always the request's K.
- heuristic: Hugging Face's schedule: +2 after a fully accepted block, -1 otherwise (at least 1).
- cost_model: the K that maximises expected tokens per unit of cost, from a running estimate of the
  acceptance rate `a` and the measured cost ratio `c` = draft forward / target forward:
  E(K) = (1 - a^(K+1)) / (1 - a) tokens for K*c + 1 target-forwards (docs/design.md, Leviathan et al.).
- load_aware: the K in [0, cap] that maximises E(K) / round_seconds(K), where round_seconds prices a
  round under the services' current load (orchestrator/costs.py): K draft forwards at batch B plus a
  target forward over B (K + 1) tokens, each stretched by its service's step time over forward time,
  scaled by what rounds with and without a draft step measured against that prediction. It starts at
  the server's K and moves only for a clear predicted gain. K = 0 (the target alone) wins when
  speculation does not pay; while there, every few rounds a probe (one draft token, asked beside the
  target's step) keeps the acceptance estimate alive, so speculation comes back when load falls. Its
  first round is the target's prefill alone, the draft prefilling beside it (`drafts_beside_prefill`).
  Above the per-round price, a server-wide gate (costs.SpeculationGate) measures whether speculating
  epochs really commit more tokens per second than K = 0 epochs at the current load, and holds every
  load-aware request at K = 0 while they do not (with two or more requests running: alone, a
  request's own round times say whether its draft pays).
"""

from __future__ import annotations

import abc

from orchestrator.costs import MAX_DRAFT_CATCH_UP, ServiceLoad
from orchestrator.rejection import Verdict

_RATIO_DECAY = 0.9  # weight of the past in the measured / priced round time


class KPolicy(abc.ABC):
    """Chooses K before each round and learns from each verdict."""

    # Whether a request's first round runs the target's prefill alone (K = 0) while the draft prefills
    # the prompt beside it, drafting the next block (Generation._block), also without overlapped
    # drafting (with it, every policy's first round does).
    drafts_beside_prefill = False

    def __init__(self, initial_k: int, max_k: int) -> None:
        self.initial_k = initial_k
        self.max_k = max_k

    @abc.abstractmethod
    def next_k(self) -> int: ...

    def observe(self, verdict: Verdict, draft_seconds: float = 0.0, target_seconds: float = 0.0) -> None:  # noqa: B027
        """Learn from a finished round (its verdict and the services' forward times); a no-op by default."""

    def observe_wall(self, k: int, seconds: float, draft_fed: int = 0) -> None:  # noqa: B027
        """A round at K = k took `seconds` of wall time, proposal to verdict, and its draft step fed
        `draft_fed` tokens; a no-op by default."""

    def probe_due(self) -> bool:
        """Whether this round, at K = 0, should ask the draft for one token beside the target's step,
        to measure whether it agrees again (`observe_probe`). False by default."""
        return False

    def observe_probe(self, acceptance: float | None) -> None:  # noqa: B027
        """A probe's draft token would have been accepted with this probability (None: the draft gave
        no token); a no-op by default."""


class FixedK(KPolicy):
    def next_k(self) -> int:
        return self.initial_k


class HeuristicK(KPolicy):
    def __init__(self, initial_k: int, max_k: int) -> None:
        super().__init__(initial_k, max_k)
        self._k = initial_k

    def next_k(self) -> int:
        return self._k

    def observe(self, verdict: Verdict, draft_seconds: float = 0.0, target_seconds: float = 0.0) -> None:
        if verdict.num_drafted == 0:
            return
        step = 2 if verdict.all_accepted else -1
        self._k = max(1, min(self.max_k, self._k + step))


def expected_tokens(acceptance_rate: float, k: int) -> float:
    """E(K) = (1 - a^(K+1)) / (1 - a): tokens per round, counting the recovered or bonus token."""
    if acceptance_rate >= 1.0:
        return float(k + 1)
    return (1.0 - acceptance_rate ** (k + 1)) / (1.0 - acceptance_rate)


def best_k(acceptance_rate: float, cost_ratio: float, max_k: int) -> int:
    """argmax over K in [1, max_k] of E(K) / (K * c + 1)."""
    return max(range(1, max_k + 1), key=lambda k: expected_tokens(acceptance_rate, k) / (k * cost_ratio + 1.0))


class CostModelK(KPolicy):
    """Chooses K from exponentially weighted estimates of the acceptance rate and the cost ratio."""

    def __init__(self, initial_k: int, max_k: int, decay: float = 0.9) -> None:
        super().__init__(initial_k, max_k)
        self.decay = decay
        self._accepted = 0.0  # weighted accept events
        self._trials = 0.0  # weighted accept-or-reject events
        self._draft_per_token = 0.0  # weighted seconds per draft token
        self._target_per_round = 0.0  # weighted seconds per verification
        self._rounds = 0

    @property
    def acceptance_rate(self) -> float:
        return self._accepted / self._trials if self._trials else 0.0

    def next_k(self) -> int:
        if self._rounds < 2 or self._target_per_round <= 0:
            return self.initial_k
        cost_ratio = self._draft_per_token / self._target_per_round
        rate = min(self.acceptance_rate, 0.99)
        return best_k(rate, cost_ratio, self.max_k)

    def observe(self, verdict: Verdict, draft_seconds: float = 0.0, target_seconds: float = 0.0) -> None:
        if verdict.num_drafted == 0:
            return
        # A round is a run of Bernoulli trials that stops at the first rejection.
        trials = verdict.num_accepted + (0 if verdict.all_accepted else 1)
        self._accepted = self.decay * self._accepted + verdict.num_accepted
        self._trials = self.decay * self._trials + trials
        weight = 0.0 if self._rounds == 0 else self.decay
        self._draft_per_token = weight * self._draft_per_token + (1 - weight) * draft_seconds / verdict.num_drafted
        self._target_per_round = weight * self._target_per_round + (1 - weight) * target_seconds
        self._rounds += 1


class LoadAwareK(KPolicy):
    """Maximises accepted tokens per second under the current load; may choose K = 0."""

    # The draft's prefill and first block cost the first token nothing beside the target's prefill
    # (measured at one stream: time to first token 24 ms drafting first, against 14 ms for the target
    # alone). Only the draft model's policy is asked (a prompt lookup has no prefill).
    drafts_beside_prefill = True

    def __init__(
        self,
        initial_k: int,
        max_k: int,
        load: ServiceLoad,
        prior_acceptance: float = 0.8,
        prior_weight: float = 2.0,
        decay: float = 0.97,
        probe_every: int = 8,
        margin: float = 0.9,
        drafts_cost: bool = True,
        switch_gain: float = 1.25,
    ) -> None:
        super().__init__(initial_k, max_k)
        self.load = load
        self.margin = margin
        # A speculating K moves to another only for a predicted gain of this much. Under load the
        # prices of neighbouring K lie within a few percent of each other and follow the noise of
        # every step's timing; chasing them gave each request a different K each round, which ran
        # 15% slower than all at K = 2 (16 streams, the gate held open), with the same tokens drafted.
        self.switch_gain = switch_gain
        self._k = max(1, min(initial_k, max_k))  # the K speculating rounds use, unless K = 0 pays
        self.drafts_cost = drafts_cost  # False for prompt lookups: only verifying costs
        self.decay = decay
        self.probe_every = probe_every
        # The acceptance estimate starts as `prior_weight` trials at `prior_acceptance`.
        self._accepted = prior_acceptance * prior_weight
        self._trials = prior_weight
        self._rounds_without_draft = 0
        self._wall_ratio = [1.0, 1.0]  # measured / priced round time, without a draft step and with one

    @property
    def acceptance_rate(self) -> float:
        return self._accepted / self._trials

    def next_k(self) -> int:
        if self.max_k == 0 or (self.drafts_cost and not self.load.gate.speculating(self.load.running)):
            return 0  # the gate measures what the draft model's forwards cost everyone; lookups have none
        if not self.drafts_cost and self._rounds_without_draft >= self.probe_every:
            return 1  # a lookup's probe: proposing costs nothing, verifying one more row little
        rate = min(self.acceptance_rate, 0.99)
        goodput = [expected_tokens(rate, k) / max(self.round_seconds(k), 1e-9) for k in range(self.max_k + 1)]
        best = max(range(1, self.max_k + 1), key=goodput.__getitem__)
        if goodput[best] > self.switch_gain * goodput[self._k]:
            self._k = best
        # K = 0 only for a clear predicted gain (margin < 1). The two mistakes are not alike: a round
        # at K = 0 learns nothing of the acceptance, so a dip in the estimate (a stretch of new text)
        # held the request at K = 0, probing one token in eight, long after the draft agreed again
        # (measured at one stream with K up to 2: at margin 1.0, 50-60% of output tokens drafted and
        # 1.25x the target alone; at 0.9, 76-80% and 1.38x, where fixed K = 2 made 1.39x). Whether
        # speculating costs other requests more than it gains is the gate's question, measured.
        return self._k if goodput[self._k] > self.margin * goodput[0] else 0

    def probe_due(self) -> bool:
        """A draft model's probe, every `probe_every` rounds at K = 0 while the gate lets this request
        speculate. It runs beside the round's K = 0 step rather than as a round at K = 1 before the
        target's step, so it adds nothing to the round's time where the draft has cores of its own
        (measured with a random-weight draft at one stream, as rounds at K = 1: 0.87x the target
        alone, 0.98x without probes)."""
        return (
            self.drafts_cost
            and self.max_k > 0
            and self._rounds_without_draft >= self.probe_every
            and self.load.gate.speculating(self.load.running)
        )

    def observe_probe(self, acceptance: float | None) -> None:
        # Scored once the next round begins (Generation._settle), after the probe's own round was
        # observed: that round counts, so that the next probe comes `probe_every` rounds after it. A
        # draft that did not answer is asked again in as many rounds.
        self._rounds_without_draft = 1
        if acceptance is not None:
            self._learn(acceptance, 1)

    def round_seconds(self, k: int) -> float:
        """The services' price of a round at K = k, scaled by what this request's rounds of its kind
        (with a draft step or without) measured against that price: forward costs miss the
        orchestrator's work and services slowing each other on shared cores. Per request, so that one
        request's rounds (dense sampling rows, a slow network path) never price another's."""
        return self.load.round_seconds(k, self.drafts_cost) * self._wall_ratio[k > 0 and self.drafts_cost]

    def observe_wall(self, k: int, seconds: float, draft_fed: int = 0) -> None:
        """A draft step that caught up (or prefilled) is no measure of a round: counting it would price
        drafting too high, and since every return from K = 0 starts with a catch-up, keep K at 0."""
        predicted = self.load.round_seconds(k, self.drafts_cost)
        if predicted <= 0 or seconds <= 0 or draft_fed > MAX_DRAFT_CATCH_UP:
            return
        kind = k > 0 and self.drafts_cost
        ratio = min(max(seconds / predicted, 0.25), 8.0)  # one stalled round must not swing it
        self._wall_ratio[kind] = _RATIO_DECAY * self._wall_ratio[kind] + (1 - _RATIO_DECAY) * ratio

    def observe(self, verdict: Verdict, draft_seconds: float = 0.0, target_seconds: float = 0.0) -> None:
        # Only load-aware rounds that may ask the draft model feed the gate: its modes are theirs.
        if self.drafts_cost:
            self.load.record_round(len(verdict.output_token_ids))
        if verdict.num_drafted == 0:
            self._rounds_without_draft += 1
            return
        self._rounds_without_draft = 0
        self._learn(verdict.num_accepted, verdict.num_accepted + (0 if verdict.all_accepted else 1))

    def _learn(self, accepted: float, trials: int) -> None:
        """Fold `accepted` of `trials` draft tokens into the decayed acceptance estimate."""
        self._accepted = self.decay * self._accepted + accepted
        self._trials = self.decay * self._trials + trials


def make_policy(
    name: str, initial_k: int, max_k: int, load: ServiceLoad | None = None, drafts_cost: bool = True
) -> KPolicy:
    """The policy called `name` (one of serving.protocol.POLICIES); `drafts_cost` is False for the
    prompt lookup's blocks, which cost nothing to propose."""
    if name == "load_aware":
        if load is None:
            raise ValueError("the load_aware policy needs the services' load")
        return LoadAwareK(initial_k, max_k, load, drafts_cost=drafts_cost)
    policies: dict[str, type[KPolicy]] = {"fixed": FixedK, "heuristic": HeuristicK, "cost_model": CostModelK}
    return policies[name](initial_k, max_k)
