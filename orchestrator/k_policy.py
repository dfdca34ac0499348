"""How many tokens to draft each round (K).

- fixed: always the request's K.
- heuristic: Hugging Face's schedule: +2 after a fully accepted block, -1 otherwise (at least 1).
- cost_model: the K that maximises expected tokens per unit of cost, from a running estimate of the
  acceptance rate `a` and the measured cost ratio `c` = draft forward / target forward:
  E(K) = (1 - a^(K+1)) / (1 - a) tokens for K*c + 1 target-forwards (docs/design.md, Leviathan et al.).
- load_aware: the K in [0, cap] with the best marginal goodput, from the measured step times and the
  request's own acceptance (orchestrator/goodput.py); K = 0 where speculation does not pay.
"""

from __future__ import annotations

import abc

from orchestrator.rejection import Verdict


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

    def most_next_k(self, k: int, whole: bool) -> int:
        """The largest K the round after a round at K = k may choose, after a block accepted whole or
        not: the K of the blocks the draft's speculation cache drafts ahead for each (load_aware rises
        a step, and only after a whole block)."""
        return min(self.max_k, k + 1) if whole else k

    def observe(self, verdict: Verdict, draft_seconds: float = 0.0, target_seconds: float = 0.0) -> None:  # noqa: B027
        """Learn from a finished round (its verdict and the services' forward times); a no-op by default."""

    def observe_wall(  # noqa: B027
        self,
        k: int,
        seconds: float,
        draft_wait: float = 0.0,
        draft_fed: int = 0,
        draft_per_token: float = 0.0,
        overlapped: bool = False,
        fetch_seconds: float = 0.0,
    ) -> None:
        """A round at K = k took `seconds` of wall time, proposal to verdict, `draft_wait` of them waiting
        for the draft and `fetch_seconds` for the draft's row at a sampled rejection; its block came
        from a draft step that fed `draft_fed` tokens and took `draft_per_token` seconds per drafted
        token (`overlapped`: beside the last step). A no-op by default."""

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

    def most_next_k(self, k: int, whole: bool) -> int:
        return k


class HeuristicK(KPolicy):
    def __init__(self, initial_k: int, max_k: int) -> None:
        super().__init__(initial_k, max_k)
        self._k = initial_k

    def next_k(self) -> int:
        return self._k

    def most_next_k(self, k: int, whole: bool) -> int:
        return min(self.max_k, k + 2) if whole else k

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
