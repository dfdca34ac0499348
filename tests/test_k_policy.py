"""K policies: Hugging Face's heuristic schedule, the cost model's choice and the marginal goodput (load_aware)."""

from __future__ import annotations

import pytest

from orchestrator.goodput import PROBE_EVERY, GoodputK, StepTimes, make_policy
from orchestrator.k_policy import CostModelK, FixedK, HeuristicK, best_k, expected_tokens
from orchestrator.rejection import Verdict
from specdec.v1 import common_pb2


def _verdict(accepted: int, drafted: int) -> Verdict:
    return Verdict(output_token_ids=[0] * (accepted + 1), num_accepted=accepted, num_drafted=drafted)


def test_fixed():
    policy = FixedK(3, 8)
    policy.observe(_verdict(0, 3))
    assert policy.next_k() == 3


def test_heuristic_schedule():
    policy = HeuristicK(4, 8)
    policy.observe(_verdict(4, 4))
    assert policy.next_k() == 6
    policy.observe(_verdict(6, 6))
    assert policy.next_k() == 8  # capped
    policy.observe(_verdict(2, 8))
    assert policy.next_k() == 7
    for _ in range(10):
        policy.observe(_verdict(0, 1))
    assert policy.next_k() == 1  # never below 1


def test_expected_tokens_formula():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert abs(expected_tokens(0.5, 2) - 1.75) < 1e-12


def test_best_k_grows_with_acceptance_and_shrinks_with_cost():
    assert best_k(0.9, 0.05, 16) > best_k(0.5, 0.05, 16)
    assert best_k(0.8, 0.5, 16) < best_k(0.8, 0.02, 16)
    assert best_k(0.1, 0.5, 16) == 1


def test_cost_model_learns_from_rounds():
    policy = CostModelK(4, 12)
    for _ in range(30):
        policy.observe(_verdict(4, 4), draft_seconds=0.004, target_seconds=0.05)
    assert policy.next_k() > 4
    for _ in range(60):
        policy.observe(_verdict(0, 4), draft_seconds=0.004, target_seconds=0.05)
    assert policy.next_k() == 1


def _times(target_points, draft_points=((1, 0.002),), batch: float = 1.0) -> StepTimes:
    def info(points):
        return common_pb2.ModelInfo(
            forward_costs=[common_pb2.ForwardCost(batch_tokens=n, seconds=s) for n, s in points]
        )

    times = StepTimes(info(target_points), info(draft_points))
    times.target.batch = batch
    return times


# A GPU-shaped target: a forward of 64 rows costs about what one of 1 costs (the near-null pair's
# 0.90 and 1.77 ms, README); a CPU-shaped one: every row costs its own compute.
FLAT = [(1, 0.020), (64, 0.021), (256, 0.030)]
STEEP = [(1, 0.004), (8, 0.016), (32, 0.060)]


def _run(policy: GoodputK, rounds: int, accepted_of: tuple[int, int] = (4, 4), seconds: float | None = None) -> None:
    """`rounds` rounds at the policy's own K, each accepting min(accepted, k) of k; each round's wall time
    is what the policy's own model says (or `seconds`)."""
    for _ in range(rounds):
        k = policy.next_k()
        accepted = min(accepted_of[0] * k // max(accepted_of[1], 1), k)
        wall = seconds if seconds is not None else 0.02 + (policy.times.target.row_seconds + 0.002) * k
        policy.observe(_verdict(accepted, k))
        policy.observe_wall(k, wall, draft_wait=0.002 * k, draft_fed=accepted + 1, draft_per_token=0.002)


def _round_seconds(policy: GoodputK, k: int) -> float:
    """R(K) by hand, from the policy's estimates."""
    times = policy.times
    assert policy._base is not None and times.draft_per_token is not None
    step = policy._base + times.target.row_seconds * k
    drafting = policy.latency + times.draft_per_token * k
    fetch = (1 - policy.acceptance_rate**k) * (policy._fetch or 0.0)  # the draft's row, in the rounds that reject
    if not k or not policy.overlaps:
        return step + drafting * (k > 0) + fetch
    ready = policy._ready.value if policy.speculates else None
    if ready is not None:  # a cache: the share measured ready, each a step to the draft
        ahead = ready
        hidden = policy.latency + max(times.draft_per_token * (k + 1) - step, 0.0)
    else:  # drafted beside the last step: K + 1 tokens beside this one's
        ahead = policy.acceptance_rate ** (k + 1)
        hidden = max(drafting + times.draft_per_token - step, 0.0)
    return step + (1 - ahead) * drafting + ahead * hidden + fetch


def test_alone_it_maximises_tokens_per_second_of_its_rounds():
    """With no other session in its forwards (B = 1), J(K) is E(a, K) / R(K); where the request drafts
    its next block beside each step, a round whose last block was accepted whole and whose bonus token
    the draft guessed (a^(K+1) of them) waits only for what of that draft step outlasted the target's."""
    for overlaps in (False, True):
        policy = GoodputK(2, 8, _times(STEEP), overlaps=overlaps)
        _run(policy, 30, accepted_of=(3, 4))
        policy.observe_wall(2, 0.03, draft_wait=0.010, draft_fed=3, draft_per_token=0.002)  # waited 6 ms more
        assert policy.latency > 0
        alone = [expected_tokens(policy.acceptance_rate, k) / _round_seconds(policy, k) for k in range(9)]
        assert all(abs(g - a) < 1e-9 * a for g, a in zip(policy.goodputs(), alone, strict=True))
        assert policy.next_k() > 0


def test_drafting_ahead_hides_a_draft_step_only_as_long_as_the_targets():
    """Overlapped, a short block's draft step hides beside the target's and a long one's outlasts it:
    the same request, draft and acceptance choose a shorter K where the draft is slow."""
    chosen = []
    for draft_per_token in (0.001, 0.006):
        policy = GoodputK(2, 8, _times(FLAT), overlaps=True)
        policy._k = 8
        policy.observe_wall(0, 0.02)
        policy.times.draft_per_token = draft_per_token
        for _ in range(20):
            policy.observe(_verdict(7, 8))
        chosen.append(policy.next_k())
        # Against a draft step hidden whole whenever the block was drafted ahead: longer rounds.
        ahead, beta = policy.acceptance_rate**9, policy.times.target.row_seconds
        hidden_whole = 0.02 + beta * 8 + (1 - ahead) * (policy.latency + draft_per_token * 8)
        outlasts = 9 * draft_per_token > 0.02
        assert (_round_seconds(policy, 8) > hidden_whole + 1e-6) == outlasts
        assert (
            abs(policy.goodputs()[8] * _round_seconds(policy, 8) / expected_tokens(policy.acceptance_rate, 8) - 1)
            < 1e-9
        )
    assert chosen[1] < chosen[0]


def test_k_rises_a_step_at_a_time_and_only_after_a_block_accepted_whole():
    """The acceptance estimate of a few rounds is noisy, and J(K) at a high estimate favours a long
    block: K grows one step per round, and only after the last block was accepted whole; it falls at
    once (modeled 8B/1B at 16 streams: K jumped from 2 to 16 after the first blocks, 0.74x fixed K = 2)."""
    policy = GoodputK(2, 8, _times(FLAT))
    policy.observe_wall(0, 0.02)
    chosen = []
    for _ in range(4):
        k = policy.next_k()
        chosen.append(k)
        policy.observe(_verdict(k, k))
    assert chosen == [2, 3, 4, 5]
    policy.observe(_verdict(4, 5))  # a rejection: no evidence for a longer block, though J wants one
    assert max(range(9), key=policy.goodputs().__getitem__) > 5 and policy.next_k() == 5
    for _ in range(30):  # the draft stops agreeing: K falls at once, not a step at a time
        policy.observe(_verdict(0, max(policy.next_k(), 1)))
    assert policy.next_k() == 0


def test_with_a_speculation_cache_the_share_of_ready_blocks_is_learnt():
    """A draft that drafts ahead for every likely verdict has a block ready in the share of rounds
    measured, not only after whole blocks (a^(K+1)): R(K) prices that share, so the same request, draft
    and acceptance choose at least as long a block, and J(K) is E(K) / R(K) by hand."""
    chosen = []
    for speculates in (False, True):
        policy = GoodputK(2, 8, _times(STEEP), overlaps=True, speculates=speculates)
        _run(policy, 30, accepted_of=(2, 4))
        for _ in range(20):
            policy.observe_wall(2, 0.02, draft_wait=0.0, draft_fed=3, draft_per_token=0.002, overlapped=True)
        ready = policy._ready.value
        assert ready is None if not speculates else ready is not None and ready > 0.8
        by_hand = [expected_tokens(policy.acceptance_rate, k) / _round_seconds(policy, k) for k in range(9)]
        assert all(abs(g - h) < 1e-9 * h for g, h in zip(policy.goodputs(), by_hand, strict=True))
        chosen.append(max(range(9), key=policy.goodputs().__getitem__))
    assert chosen[1] >= chosen[0]
    assert not GoodputK(2, 8, _times(STEEP), overlaps=False, speculates=True).speculates  # needs drafting ahead


def test_the_drafts_wait_is_learnt_from_rounds_that_waited():
    """A block drafted beside the last step costs its round no wait: such rounds say nothing of the
    draft's RPC and queue on the request's path (w)."""
    policy = GoodputK(2, 4, _times(FLAT), overlaps=True)
    policy.observe_wall(2, 0.03, draft_wait=0.010, draft_fed=3, draft_per_token=0.002)
    waited = policy.latency
    assert waited > 0
    for _ in range(10):
        policy.observe_wall(2, 0.02, draft_wait=0.0, draft_fed=3, draft_per_token=0.002, overlapped=True)
    assert policy.latency == waited


def test_a_requests_waits_are_its_own_and_its_first_round_weighs_one():
    """w and the share of ready rounds are the request's own running means, in which its first round
    weighs one round, not the estimate's whole memory: a w that started at 0 and a share that started
    at the first round (the block drafted beside the prefill, always ready) priced the modeled 8B/1B's
    rounds at one stream at 13.4 ms where they took 17.1 (docs/design.md). Not every request's: a w
    learnt under a burst then priced every new request's drafting, held it at K = 0, where it learnt no
    w of its own, and kept the probes off (modeled 8B/1B, 1 to 64 streams: load_aware at 1.2 tokens a
    round where fixed K = 4 made 3.3)."""
    times = _times(FLAT)
    burst = GoodputK(2, 4, times, overlaps=True, speculates=True)
    for _ in range(20):  # the draft queued 200 ms beyond its forwards
        burst.observe_wall(2, 0.3, draft_wait=0.204, draft_fed=3, draft_per_token=0.002)
    assert abs(burst.latency - 0.2) < 1e-9 and burst.next_k() == 0
    fresh = GoodputK(2, 4, times, overlaps=True, speculates=True)
    assert fresh.latency == 0.0 and fresh.next_k() > 0
    fresh.observe_wall(2, 0.03, draft_wait=0.0, draft_fed=3, draft_per_token=0.002, overlapped=True)
    for _ in range(9):
        fresh.observe_wall(2, 0.03, draft_wait=0.006, draft_fed=3, draft_per_token=0.002, overlapped=False)
    assert abs(fresh.latency - 0.002) < 1e-9
    ready = fresh._ready.value
    assert ready is not None and ready < 0.07  # an average started at the first round: 0.9^9 = 0.39


def test_a_block_the_cache_holds_still_waits_for_a_step_to_the_draft():
    """A ready block comes by a draft step to the draft service (the cache answers it): its round pays
    w even where the draft's forwards hid whole beside the target's, where a block drafted beside the
    last step is in hand (measured on the modeled 8B/1B, one stream: a ready round at K = 2 waited 1.7
    ms, the rounds that drafted 1.8 ms beyond their forwards)."""
    for speculates in (False, True):
        policy = GoodputK(2, 4, _times(FLAT), overlaps=True, speculates=speculates)
        for _ in range(20):
            policy.observe(_verdict(1, 2))
            for overlapped in (True, False):
                policy.observe_wall(2, 0.05, draft_wait=0.02, draft_fed=3, draft_per_token=0.002, overlapped=overlapped)
        one = expected_tokens(policy.acceptance_rate, 1) / policy.goodputs()[1]  # R(1)
        assert abs(one - _round_seconds(policy, 1)) < 1e-9 * one
        assert policy._base is not None
        every_round_waits = policy._base + policy.times.target.row_seconds + policy.latency
        assert (one >= every_round_waits - 1e-12) == speculates


def test_a_sampled_rounds_wait_for_the_drafts_row_is_priced_in_the_rounds_that_reject():
    """The draft's row at a rejection (a RowFetch) is no part of S: a K = 0 round does not fetch. It is
    f, paid in the 1 - a^K of rounds that reject; where it is dear, a middling draft stops paying."""
    chosen = []
    for fetch in (0.0, 0.004, 0.03):
        policy = GoodputK(2, 4, _times(FLAT))
        for _ in range(30):
            k = policy.next_k()
            policy.observe(_verdict(k // 2, k))
            rejected = fetch if k else 0.0  # every round at K > 0 rejects (k // 2 of k accepted)
            wall = 0.02 + 0.002 * k + rejected
            policy.observe_wall(
                k, wall, draft_wait=0.002 * k, draft_fed=k, draft_per_token=0.002, fetch_seconds=rejected
            )
        assert policy._base is not None and abs(policy._base - 0.02) < 1e-3  # the fetch is no part of S
        if fetch:
            assert policy._fetch is not None and abs(policy._fetch - fetch) < 1e-9
        else:
            assert policy._fetch is None  # no round fetched: f is unknown, and priced at 0
        by_hand = [expected_tokens(policy.acceptance_rate, k) / _round_seconds(policy, k) for k in range(5)]
        assert all(abs(g - h) < 1e-9 * h for g, h in zip(policy.goodputs(), by_hand, strict=True))
        chosen.append(policy._k)
    assert chosen[0] > 0 and chosen[-1] == 0, chosen


def test_where_rows_cost_the_others_in_its_forward_it_falls_to_k0_and_comes_back():
    """The same request, acceptance and draft, in a forward shared with 15 others: on a steep target
    its extra rows cost them more than they earn; on a flat one they cost nothing, and K stays."""
    steep, flat = _times(STEEP, batch=16), _times(FLAT, batch=16)
    assert steep.target.row_seconds > 20 * flat.target.row_seconds
    crowded, free = GoodputK(2, 8, steep), GoodputK(2, 8, flat)
    _run(crowded, 30, accepted_of=(3, 4))
    _run(free, 30, accepted_of=(3, 4))
    assert crowded.next_k() == 0 and free.next_k() >= 2
    steep.target.batch = 1.0  # the load is gone: alone, its own rounds say that drafting pays
    assert crowded.next_k() > 0


def test_at_k0_a_probe_comes_every_few_rounds_and_brings_k_back():
    """A draft that stopped agreeing holds K at 0; probes watch it, ever less often, until it agrees."""
    times = _times(FLAT, batch=16)
    policy = GoodputK(2, 4, times)
    policy.observe_wall(0, 0.02)  # one round measured S
    for _ in range(20):  # rejected blocks: the acceptance falls, K goes to 0
        policy.observe(_verdict(0, 2))
    assert policy.next_k() == 0
    for _ in range(PROBE_EVERY - 1):
        policy.observe(_verdict(0, 0))
        assert not policy.probe_due()
    policy.observe(_verdict(0, 0))
    assert policy.probe_due()
    policy.observe_probe(0.0)  # the draft still disagrees: the next probe waits twice as long
    for _ in range(2 * PROBE_EVERY - 1):
        assert not policy.probe_due() and policy.next_k() == 0
        policy.observe(_verdict(0, 0))
    assert policy.probe_due()
    times.target.batch = 1.0
    for _ in range(30):  # probes that agree, alone again: K comes back
        policy.observe_probe(1.0)
    assert not policy.probe_due() and policy.next_k() > 0


def test_a_draft_price_learnt_under_a_burst_does_not_hold_k_at_0_once_it_is_gone():
    """Only rounds that draft update the price of a drafted token. One learnt under a burst of load (here
    40 ms, 2 ms at start-up) held every later request at K = 0 for good: the probes' gate priced an
    agreeing draft at it, so no probe ran, and no round drafted to measure it again (seen on the modeled
    8B/1B: a whole one-stream cell at K = 0 after a 64-stream one). The gate prices the draft as at
    start-up, and the probe's draft step brings the price down to what its forward measured."""
    times = _times(FLAT)
    times.draft_per_token = 0.040  # learnt in the burst
    policy = GoodputK(2, 4, times)
    policy.observe_wall(0, 0.02)  # one round measured S
    assert policy.next_k() == 0  # at 40 ms a drafted token, drafting does not pay
    for _ in range(PROBE_EVERY):
        policy.observe(_verdict(0, 0))
    assert policy.probe_due()
    probe = common_pb2.Timing(batch_size=1, batch_tokens=PROBE_EVERY, forward_seconds=0.0021)
    times.draft.observe(probe)  # the probe's step: one forward catching up on the rounds since the last
    policy.observe_probe(1.0)
    assert times.draft_per_token == pytest.approx(0.0021)  # its speed, at the load there is (one session)
    assert policy.next_k() > 0


def test_no_probe_where_the_load_alone_holds_k_at_0():
    """Rows that cost the others more than an always-agreeing draft would earn: a probe would learn
    nothing that could bring K back, and its draft step would cost the cores."""
    times = _times(STEEP, batch=16)
    policy = GoodputK(2, 4, times)
    _run(policy, 30, accepted_of=(4, 4))
    assert policy.next_k() == 0
    for _ in range(4 * PROBE_EVERY):
        policy.observe(_verdict(0, 0))
        assert not policy.probe_due()
    times.target.batch = 1.0  # alone again: an agreeing draft would pay, so a probe is worth asking
    assert policy.probe_due()


def test_a_lookups_probe_rides_in_the_round():
    """A prompt lookup costs nothing to propose: at K = 0 its probe is a round at K = 1."""
    policy = GoodputK(2, 4, _times(STEEP, batch=64), drafts_cost=False)
    policy.observe_wall(0, 0.02)
    for _ in range(20):
        policy.observe(_verdict(0, 2))
    assert policy.next_k() == 0 and not policy.probe_due()
    for _ in range(PROBE_EVERY):
        policy.observe(_verdict(0, 0))
    assert policy.next_k() == 1


def test_a_catch_up_prices_no_ones_drafting_and_a_requests_rounds_price_its_own():
    """A draft step that fed more than a round commits (a catch-up after K = 0 or lookup rounds, a
    reopened session) says nothing of what drafting costs; a slow round (its own network path, its
    dense rows) prices that request's rounds alone."""
    times = _times(STEEP)
    first, second = GoodputK(2, 4, times), GoodputK(2, 4, times)
    first.observe_wall(2, 0.02, draft_wait=0.004, draft_fed=3, draft_per_token=0.002)
    assert times.draft_per_token == 0.002
    first.observe_wall(2, 2.0, draft_wait=1.0, draft_fed=40, draft_per_token=0.5)
    assert times.draft_per_token == 0.002  # the catch-up is the request's own wait, not the draft's price
    second.observe_wall(0, 0.02)
    first.observe_wall(0, 5.0)
    assert second._base == 0.02


def test_the_step_times_follow_the_live_forwards():
    """beta is the start-up curve's slope, scaled by live forwards against what it predicts."""
    times = _times(STEEP)
    before = times.target.row_seconds
    for _ in range(50):  # forwards twice as slow as at start-up (another process on the cores)
        timing = common_pb2.Timing(batch_size=8, batch_tokens=8)
        timing.forward_seconds = 2 * times.target.curve.seconds(8)
        times.target.observe(timing)
    assert abs(times.target.row_seconds / before - 2) < 0.02 and abs(times.target.batch - 8) < 0.1


def test_an_explicit_k_bounds_load_aware_and_k0_means_the_target_alone():
    policy = make_policy("load_aware", 2, 2, _times(FLAT))
    _run(policy, 20)  # type: ignore[arg-type]
    assert policy.next_k() <= 2
    alone = make_policy("load_aware", 0, 0, _times(FLAT))
    alone.observe_wall(0, 0.02)
    assert alone.next_k() == 0 and not alone.probe_due()


def test_a_drafted_token_also_costs_the_others_in_the_drafts_forwards():
    """Each drafted token is a row in a draft forward shared with the draft's other sessions: where
    the draft's rows cost compute and its forwards are crowded, the same request drafts less; a
    lookup's blocks cost no draft forward and keep their K."""
    quiet, crowded = _times(FLAT, STEEP), _times(FLAT, STEEP)
    crowded.draft.batch = 32.0
    policies = [GoodputK(2, 8, quiet), GoodputK(2, 8, crowded), GoodputK(2, 8, crowded, drafts_cost=False)]
    for policy in policies:
        _run(policy, 30, accepted_of=(3, 4))
    alone, drafting, lookup = (policy.next_k() for policy in policies)
    assert drafting < alone and lookup >= alone


def test_a_forward_delays_the_sessions_in_it_and_those_queued_behind_it():
    """Little's law: where steps wait W for forwards of F seconds with B rows each, B W / F sessions
    are queued, and a longer forward delays them too (64 streams over forwards of 32 rows)."""
    forwards = _times(STEEP).target
    for _ in range(100):
        timing = common_pb2.Timing(batch_size=32, batch_tokens=32, forward_seconds=0.02, queue_seconds=0.02)
        forwards.observe(timing)
    assert abs(forwards.others - (31 + 32)) < 0.5
    idle = _times(STEEP).target
    idle.observe(common_pb2.Timing(batch_size=1, batch_tokens=1, forward_seconds=0.004))
    assert idle.others == 0.0


def test_a_draft_on_the_targets_cores_costs_every_session_waiting_on_the_target():
    """Both services on one host's CPU: a drafted token's forward takes the cores the target's forward
    needs, so it delays every session waiting on the target by about its own time (measured at 8
    co-located streams: rounds of 35-40 ms against 16 for the target alone, and load_aware at 0.85x).
    Alone, or on devices of their own, drafting still pays."""
    shared, apart, alone = _times(FLAT, batch=8), _times(FLAT, batch=8), _times(FLAT)
    shared.shared_cores = alone.shared_cores = True
    policies = [GoodputK(2, 8, shared), GoodputK(2, 8, apart), GoodputK(2, 8, alone)]
    for policy in policies:
        policy.times.draft_per_token = 0.006
        _run(policy, 30, accepted_of=(3, 4), seconds=0.04)
    crowded, separate, single = (policy.next_k() for policy in policies)
    assert crowded == 0 and separate > 0 and single > 0


def test_the_orchestrator_knows_when_the_draft_shares_the_targets_cores():
    from orchestrator.config import OrchestratorConfig
    from orchestrator.pair import one_host

    cpu, gpu = common_pb2.ModelInfo(device="cpu"), common_pb2.ModelInfo(device="cuda:0")
    modeled = common_pb2.ModelInfo(device="cpu", simulated_device=common_pb2.SimulatedDevice(profile="h100"))
    local = one_host(OrchestratorConfig(target="127.0.0.1:1", draft="127.0.0.1:2"))
    assert local and not one_host(OrchestratorConfig(target="10.0.0.1:1", draft="10.0.0.2:1"))  # two machines
    assert not one_host(OrchestratorConfig(target="dns:///target:1", draft="dns:///draft:1"))
    assert not one_host(OrchestratorConfig(target="127.0.0.1:1"))
    assert StepTimes(cpu, cpu, local).shared_cores
    assert not StepTimes(cpu, cpu, False).shared_cores
    assert not StepTimes(gpu, gpu, local).shared_cores and not StepTimes(cpu, modeled, local).shared_cores
    times = StepTimes(cpu, None, local)
    assert not times.shared_cores
    times.set_draft(cpu)  # a draft that answers after start-up
    assert times.shared_cores


def test_k_leaves_0_only_for_a_clear_gain():
    """A return from K = 0 costs a catch-up and puts the request's rounds out of step with the others':
    a draft that agrees a little (here J(1) about 1.1 J(0)) keeps the request at K = 0."""
    policy = GoodputK(0, 4, _times(FLAT))
    policy.observe_wall(0, 0.02)
    policy.times.draft_per_token = 0.002
    policy._accepted, policy._trials = 0.3, 1.0
    goodputs = policy.goodputs()
    assert goodputs[0] < goodputs[1] < 1.25 * goodputs[0]
    assert policy.next_k() == 0
    policy._accepted = 0.9
    assert policy.next_k() == 1
