"""K policies: Hugging Face's heuristic schedule and the cost model's choice."""

from __future__ import annotations

from orchestrator.k_policy import CostModelK, FixedK, HeuristicK, LoadAwareK, best_k, expected_tokens
from orchestrator.rejection import Verdict


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


def _load(target_points, draft_points, batch_size: float):
    from orchestrator.costs import ServiceLoad
    from specdec.v1 import common_pb2

    def info(points):
        return common_pb2.ModelInfo(
            forward_costs=[common_pb2.ForwardCost(batch_tokens=n, seconds=s) for n, s in points]
        )

    load = ServiceLoad(info(target_points), info(draft_points))
    load.batch_size = batch_size
    return load


def test_cost_curve_interpolates_and_extrapolates():
    from orchestrator.costs import CostCurve

    curve = CostCurve([(1, 1.0), (4, 2.5), (8, 4.5)])
    assert curve.seconds(1) == 1.0 and curve.seconds(0.5) == 1.0
    assert abs(curve.seconds(2) - 1.5) < 1e-9 and abs(curve.seconds(6) - 3.5) < 1e-9
    assert abs(curve.seconds(16) - 8.5) < 1e-9  # the last segment's slope, extended
    curve.observe(4, 3.5)
    assert 2.5 < curve.seconds(4) < 3.5  # a running average, not a replacement


def test_cost_curve_never_prices_a_forward_above_a_larger_one_as_points_change():
    """The least cost at or above each point is cached between observations; it must follow them."""
    import random

    from orchestrator.costs import CostCurve

    rng = random.Random(7)
    curve = CostCurve([(1, 0.010), (16, 0.012)])
    for _ in range(300):
        curve.observe(rng.randint(1, 64), rng.uniform(0.005, 0.05))
        points = dict(curve._seconds)
        for tokens in (1, 2.5, 7, 16, 33, 64):
            larger = [seconds for key, seconds in points.items() if key >= tokens]
            if larger:
                assert curve.seconds(tokens) <= min(larger) + 1e-12
        assert curve.seconds(0.5) == min(points.values())


def test_load_aware_speculates_when_verifying_is_cheap():
    # A GPU-like target: a forward of 64 tokens costs what one of 1 costs; a draft 10x cheaper.
    load = _load([(1, 0.020), (64, 0.021), (256, 0.030)], [(1, 0.002), (32, 0.0025)], batch_size=8)
    policy = LoadAwareK(4, 8, load)
    for _ in range(10):
        policy.observe(_verdict(3, 4))
    assert policy.next_k() >= 3


def test_load_aware_falls_to_zero_when_verifying_costs_grow_with_the_batch_and_comes_back():
    # A CPU-like target at batch 16: every extra verified position costs almost a full token's work.
    steep = [(1, 0.005), (16, 0.015), (64, 0.060), (256, 0.240)]
    load = _load(steep, [(1, 0.001), (16, 0.004)], batch_size=16)
    policy = LoadAwareK(4, 8, load)
    for _ in range(5):
        policy.observe(_verdict(1, 4))  # acceptance about 0.3
    assert policy.next_k() == 0
    for _ in range(policy.probe_every - 1):
        policy.observe(_verdict(0, 0))  # rounds at K = 0
        assert not policy.probe_due()
    policy.observe(_verdict(0, 0))
    # A probe keeps the acceptance estimate alive: one draft token beside the next K = 0 step.
    assert policy.next_k() == 0 and policy.probe_due()
    policy.observe_probe(None)  # the draft did not answer: asked again in as many rounds
    assert not policy.probe_due()
    load.batch_size = 1.0  # the load falls, and the probes show the draft agrees well
    for _ in range(10):
        for _ in range(policy.probe_every):
            policy.observe(_verdict(0, 0))
        assert policy.probe_due()
        policy.observe_probe(1.0)
    assert policy.next_k() > 0


def test_a_probe_waits_while_the_gate_holds_k_at_zero():
    """The gate holds a request at K = 0 because draft forwards cost the others: probes are draft
    forwards too."""
    load = _load([(1, 0.020), (256, 0.021)], [(1, 0.0001)], batch_size=1)
    policy = LoadAwareK(4, 4, load)
    _close_the_gate(load)
    for _ in range(2 * policy.probe_every):
        policy.observe(_verdict(0, 0))
    assert policy.next_k() == 0 and not policy.probe_due()


def test_a_lookups_probe_rides_in_the_round():
    """A prompt lookup's probe costs no draft forward: it is a round at K = 1, not a draft step."""
    steep = [(1, 0.005), (16, 0.015), (64, 0.060), (256, 0.240)]
    load = _load(steep, [(1, 0.001), (16, 0.004)], batch_size=16)
    policy = LoadAwareK(4, 8, load, drafts_cost=False)
    for _ in range(5):
        policy.observe(_verdict(0, 4))  # the lookups keep missing
    assert policy.next_k() == 0
    for _ in range(policy.probe_every):
        policy.observe(_verdict(0, 0))
    assert policy.next_k() == 1 and not policy.probe_due()


def test_load_aware_prices_rounds_by_what_they_measured():
    # Forward costs alone predict that K = 4 pays: a draft 10x cheaper than a cheap verify.
    load = _load([(1, 0.010), (5, 0.012)], [(1, 0.001)], batch_size=1)
    policy = LoadAwareK(4, 4, load)
    for _ in range(10):
        policy.observe(_verdict(2, 4))  # acceptance about 0.67
    assert policy.next_k() > 0
    policy.observe_wall(3, 8 * load.round_seconds(3), draft_fed=20)  # a catch-up: no measure of a round
    assert policy.round_seconds(3) == load.round_seconds(3)
    # But on shared cores every round with a draft step takes 3x its prediction, and rounds without one
    # take what they are predicted to take: then the target alone commits more per second.
    for _ in range(40):
        policy.observe_wall(3, 3 * load.round_seconds(3))
        policy.observe_wall(0, load.round_seconds(0))
    assert policy.next_k() == 0
    assert abs(policy.round_seconds(0) - load.round_seconds(0)) < 1e-9
    assert LoadAwareK(4, 4, load).round_seconds(3) == load.round_seconds(3)  # another request's price is its own


def test_load_aware_falls_to_zero_only_for_a_clear_predicted_gain():
    """A round at K = 0 learns nothing of the acceptance, so a small predicted loss keeps speculating."""
    load = _load([(1, 0.010), (256, 0.010)], [(1, 0.002)], batch_size=1)  # rounds: 10, 12, 14 ms at K = 0, 1, 2

    def k_at(acceptance: float) -> int:
        policy = LoadAwareK(1, 1, load)
        policy._accepted, policy._trials = acceptance * 100, 100.0
        return policy.next_k()

    assert k_at(0.15) == 1  # K = 1 predicted at 0.96x the target alone: within the margin
    assert k_at(0.0) == 0  # 0.83x: K = 0


def test_load_aware_moves_its_k_only_for_a_clear_gain():
    load = _load([(1, 0.010), (256, 0.010)], [(1, 0.001)], batch_size=1)  # rounds: 10 + 1 ms per drafted token
    policy = LoadAwareK(2, 8, load)

    def settle(acceptance: float) -> int:
        policy._accepted, policy._trials = acceptance * 100, 100.0
        return policy.next_k()

    assert settle(0.6) == 2  # K = 3 is predicted 3% faster than K = 2: not worth a change
    assert settle(0.95) > 2  # where the draft agrees almost always, long blocks pay far more
    high = policy.next_k()
    assert settle(0.75) == high  # and the K it moved to stays while still about as good


def test_an_explicit_k_bounds_load_aware():
    load = _load([(1, 0.020), (256, 0.021)], [(1, 0.0001)], batch_size=1)
    policy = LoadAwareK(2, 2, load)
    for _ in range(10):
        policy.observe(_verdict(2, 2))
    assert policy.next_k() == 2


def test_the_gate_measures_whether_speculating_pays_at_each_load():
    from orchestrator.costs import SpeculationGate

    now = [0.0]
    gate = SpeculationGate(epoch_s=1.0, explore_every=4, max_explore_every=4, clock=lambda: now[0])
    rate = {True: 50, False: 80}  # at 8 running requests, K = 0 commits more tokens per second

    def epoch(running: int) -> bool:
        """Rounds for an epoch at `running` requests; the mode they ran in (after a restart, if the
        first round found the load changed fourfold)."""
        modes = []
        for _ in range(10):
            modes.append(gate.speculate)
            gate.record(rate[gate.speculate] // 10, running)
            now[0] = round(now[0] + 0.1, 6)
        gate.record(0, running)  # closes the epoch
        return modes[-1]

    modes = [epoch(8) for _ in range(13)]
    assert modes[:2] == [True, False]  # both measured first
    assert modes[2:].count(True) == 3 and modes[-1] is False  # then K = 0, speculation tried 1 epoch in 4
    # At a higher load not yet measured, K = 0 is kept from the start; speculation waits for exploration
    # (the first epoch at 16, begun at 8, is chosen again for 16 at its first round: a load rising).
    assert [epoch(16) for _ in range(3)] == [False, False, False]
    assert epoch(16) is True  # the exploration epoch, the 4th begun at this level
    # At another load level the measurements are its own: there speculation pays, and stays on.
    rate.update({True: 120, False: 80})
    levels = [epoch(2) for _ in range(8)]
    # Speculation measured first (no lower level lost), then K = 0, then speculation kept but for
    # one exploration epoch in four (the 4th and 8th epochs begun at this level).
    assert levels == [True, False, True, False, True, True, True, False]
    # After a pause, the first rounds of a new spell run in the mode their own load level chose, not
    # the one the last spell ended in.
    now[0] += 60.0
    gate.record(5, 8)
    assert gate.speculate is False
    now[0] += 60.0
    gate.record(5, 2)
    assert gate.speculate is True


def test_the_gate_explores_less_while_explorations_confirm_the_mode():
    """Each exploration that finds the other mode still losing doubles the epochs until the next one
    at that level (up to `max_explore_every`); one that changes the mode brings back `explore_every`."""
    from orchestrator.costs import SpeculationGate

    now = [0.0]
    gate = SpeculationGate(epoch_s=1.0, explore_every=2, max_explore_every=8, clock=lambda: now[0])
    rate = {True: 50, False: 80}  # at 8 running requests, K = 0 commits more tokens per second

    def epochs(count: int) -> list[bool]:
        modes = []
        for _ in range(count):
            modes.append(gate.speculate)
            for _ in range(10):
                gate.record(rate[gate.speculate] // 10, 8)
                now[0] = round(now[0] + 0.1, 6)
            gate.record(0, 8)
        return modes

    modes = epochs(24)
    explorations = [index for index, mode in enumerate(modes) if mode and index > 0]
    # Measured both first (epochs 0 and 1); explored at the second epoch since (each level counts
    # epochs from its first), then 4 epochs later, then 8, the most.
    assert explorations == [2, 6, 14, 22], modes
    # Speculation now pays here. The next exploration finds it, which brings the explorations back to
    # one in 2, until the mean rate of speculating epochs beats K = 0's and speculation is kept.
    rate.update({True: 160, False: 80})
    modes = epochs(24)
    assert modes[:8].count(True) == 1, modes  # the exploration due 8 epochs after the last
    assert modes[8:10].count(True) == 1, modes  # then one in 2, until speculating measures faster
    assert modes[-6:].count(True) >= 4, modes  # then kept


def test_an_idle_spell_is_no_epoch_of_the_gate():
    from orchestrator.costs import SpeculationGate

    now = [0.0]
    gate = SpeculationGate(epoch_s=1.0, explore_every=100, clock=lambda: now[0])

    def busy(rounds: int, tokens: int) -> None:
        for _ in range(rounds):
            gate.record(tokens, 8)
            now[0] = round(now[0] + 0.1, 6)

    busy(11, 10)  # a first epoch, speculating: 100 tokens/s
    assert gate.speculate is False  # now K = 0 is measured
    busy(5, 12)  # half an epoch at 120 tokens/s, then the clients pause for a minute
    now[0] += 60.0
    busy(11, 12)
    # The spell did not count as an epoch of a few tokens per second at K = 0: K = 0 measured faster.
    assert gate.speculate is False


def _close_the_gate(load) -> list[float]:
    """Make `load`'s gate measure, at 8 running requests, K = 0 faster than speculating; its clock."""
    from orchestrator.costs import SpeculationGate

    now = [0.0]
    load.gate = SpeculationGate(epoch_s=1.0, explore_every=100, clock=lambda: now[0])
    load.running = 8
    rate = {True: 50, False: 80}
    for _ in range(40):
        load.gate.record(rate[load.gate.speculating(load.running)] // 10, load.running)
        now[0] = round(now[0] + 0.1, 6)
    assert load.gate.speculate is False
    return now


def test_load_aware_stays_at_zero_while_the_gate_is_closed():
    load = _load([(1, 0.020), (256, 0.021)], [(1, 0.0001)], batch_size=1)
    policy = LoadAwareK(4, 4, load)
    assert policy.next_k() > 0
    _close_the_gate(load)
    assert policy.next_k() == 0


def test_the_first_rounds_of_a_burst_run_in_the_mode_of_its_load():
    """After a pause, a burst's first rounds (drafting the prompt, were they to speculate) ask the gate
    before any verdict: they get the mode measured for the load now, not the one the previous burst's
    tail (a request alone, speculating) left behind."""
    load = _load([(1, 0.020), (256, 0.021)], [(1, 0.0001)], batch_size=1)
    policy = LoadAwareK(4, 4, load)
    now = _close_the_gate(load)
    load.running = 1
    load.gate.record(5, 1)  # the last request of the burst, alone
    assert policy.next_k() > 0
    now[0] += 60.0  # a pause, then 16 requests arrive together
    load.running = 16
    assert policy.next_k() == 0
    load.running = 1
    assert policy.next_k() == 0  # a fourfold fall: a dip between requests until it lasts ...
    now[0] += 0.06
    assert policy.next_k() > 0  # ... then alone, it speculates


def test_the_gates_mode_is_a_metric():
    from prometheus_client import REGISTRY

    load = _load([(1, 0.020), (256, 0.021)], [(1, 0.0001)], batch_size=1)

    def epochs(mode: str) -> float:
        return REGISTRY.get_sample_value("specdec:speculation_gate_epochs_total", {"mode": mode}) or 0.0

    before = epochs("k0")
    now = _close_the_gate(load)
    assert REGISTRY.get_sample_value("specdec:speculation_gate_open") == 0.0
    assert epochs("k0") > before
    now[0] += 60.0
    load.gate.speculating(1)  # alone after a pause
    assert REGISTRY.get_sample_value("specdec:speculation_gate_open") == 1.0


def test_a_burst_still_arriving_gets_the_mode_measured_for_its_load():
    """Clients arriving together reach the gate as 1, then 4, then 8 running requests within a few
    milliseconds: the epoch is chosen again as the load rises early in it, so that it runs in the mode
    measured at 8, not the one chosen at 4 (where nothing was measured). Later in an epoch, a rise of
    one level (7 to 8 running as requests end and start) keeps the epoch."""
    from orchestrator.costs import SpeculationGate

    now = [0.0]
    gate = SpeculationGate(epoch_s=1.0, explore_every=100, clock=lambda: now[0])
    gate._rates.observe(4, False, 60.0)  # at 8 running, K = 0 measured faster
    gate._rates.observe(4, True, 50.0)
    now[0] = 10.0
    assert gate.speculating(1) is True  # alone
    assert gate.speculating(4) is True  # a fourfold rise: level 3, nothing measured there
    now[0] += 0.005
    assert gate.speculating(8) is False  # still arriving: chosen again for 8
    gate.record(1, 8)
    now[0] += 0.5
    assert gate.speculating(7) is False  # a fall of one level keeps the epoch
    now[0] += 0.005
    assert gate.speculating(1) is False  # the requests ended together: a dip, not a request alone
    now[0] += 0.005
    assert gate.speculating(8) is False  # the next ones arrived
    now[0] += 60.0  # a pause; a new epoch chosen at 7 running (level 3, unmeasured: speculating)
    assert gate.speculating(7) is True
    gate.record(1, 7)
    now[0] += 0.5
    assert gate.speculating(8) is True  # a rise of one level late in the epoch keeps it


def test_the_hybrid_asks_the_draft_on_lookup_misses_only_where_that_pays():
    from orchestrator.costs import HybridChoice

    choice = HybridChoice(explore_every=4)
    rate = {True: 150.0, False: 200.0}  # at one running request, the target alone on misses is faster

    def request(running: int) -> bool:
        model = choice.model_on_misses(running)
        choice.observe(running, model, 64, 64 / rate[model])
        return model

    ways = [request(1) for _ in range(12)]
    assert ways[:2] == [True, False]  # both ways measured first
    assert ways[2:].count(True) == 2 and ways[-1] is False  # then the target alone, the draft tried now and then
    # Another load level measures for itself: there the draft pays, and is asked.
    rate.update({True: 300.0, False: 200.0})
    assert [request(8) for _ in range(5)][2:] == [True, True, True]
    assert choice.model_on_misses(1) is False  # what level 1 learned stands


def test_the_gate_compares_rates_per_running_request():
    from orchestrator.costs import SpeculationGate

    now = [0.0]
    gate = SpeculationGate(epoch_s=1.0, explore_every=100, settle_fraction=0.0, clock=lambda: now[0])
    for _ in range(11):  # speculating, two requests: 120 tokens/s, 60 per request
        gate.record(12, 2)
        now[0] = round(now[0] + 0.1, 6)
    assert gate.speculate is False
    # K = 0 at the tail of a busier spell: 4 requests, then 2 (2.8 on average); 140 tokens/s in all is
    # 50 per request, slower than speculating.
    for running in [4, 4, 4, 4, 2, 2, 2, 2, 2, 2]:
        gate.record(14, running)
        now[0] = round(now[0] + 0.1, 6)
    assert gate.speculate is True


def test_the_gate_does_not_measure_the_switch_between_modes():
    """The first part of an epoch after a switch measures the switch (the previous mode's rounds
    finishing, sessions regrouping into one batch), not the new mode."""
    from orchestrator.costs import SpeculationGate

    def decides(settle_fraction: float) -> bool:
        now = [0.0]
        gate = SpeculationGate(epoch_s=1.0, explore_every=100, settle_fraction=settle_fraction, clock=lambda: now[0])
        # Speculating at 100 tokens/s; then K = 0, which stalls for 0.3 s after the switch and then
        # runs at 120 tokens/s: 84 tokens in the epoch, 120 per second once settled.
        for tokens in [10] * 11 + [0, 0, 0] + [12] * 7:
            gate.record(tokens, 2)
            now[0] = round(now[0] + 0.1, 6)
        return gate.speculate

    assert decides(0.0) is True  # the stall counted: K = 0 looked slower than speculating
    assert decides(0.3) is False  # settled, K = 0 measured 20% faster


def test_the_gate_counts_the_drafts_catching_up_against_speculation():
    """A switch to speculation starts with every session's draft catching up on what K = 0 rounds
    committed: a cost of speculating, measured with it."""
    from orchestrator.costs import SpeculationGate

    now = [0.0]
    gate = SpeculationGate(epoch_s=1.0, explore_every=4, max_explore_every=4, settle_fraction=0.3, clock=lambda: now[0])
    # Speculating first, at 100 tokens/s; then K = 0 at 100 (settled) and a K = 0 epoch at 100.
    # Then the exploration: speculation stalls 0.3 s while the drafts catch up, then runs at 140 tokens/s:
    # 98 in the epoch, counted whole; its mean with the first epoch is 99, short of K = 0's 100 x 1.1
    # (without the stall, 140 would make it 120 and speculation would be kept).
    for tokens in [10] * 11 + [10] * 10 + [10] * 10:
        gate.record(tokens, 8)
        now[0] = round(now[0] + 0.1, 6)
    assert gate.speculate is True  # the exploration epoch
    for tokens in [0, 0, 0] + [14] * 7:
        gate.record(tokens, 8)
        now[0] = round(now[0] + 0.1, 6)
    assert gate.speculate is False


def test_the_gate_keeps_speculation_only_for_a_clear_gain():
    from orchestrator.costs import SpeculationGate

    def decides(plain_tokens: int) -> bool:
        now = [0.0]
        gate = SpeculationGate(epoch_s=1.0, explore_every=100, clock=lambda: now[0])
        for tokens in [20] * 11 + [plain_tokens] * 10:  # speculating at 200 tokens/s, then K = 0
            gate.record(tokens, 2)
            now[0] = round(now[0] + 0.1, 6)
        return gate.speculate

    assert decides(17) is True  # 18% faster than K = 0
    assert decides(19) is False  # 5% faster is within the noise: K = 0 is the safe choice


def test_the_gate_never_holds_a_request_running_alone():
    """Alone, a request's own round times tell whether its draft pays; the gate's epochs at K = 0
    would only cost it the exploration. Where K = 0 measured faster for two, one still speculates."""
    from orchestrator.costs import SpeculationGate

    now = [0.0]
    gate = SpeculationGate(epoch_s=1.0, explore_every=4, clock=lambda: now[0])

    def epochs(running: int, count: int) -> list[bool]:
        modes = []
        for _ in range(count):
            modes.append(gate.speculate)
            for _ in range(10):
                gate.record(10 if gate.speculate else 20, running)  # K = 0 commits twice as much
                now[0] = round(now[0] + 0.1, 6)
            gate.record(0, running)
        return modes

    assert epochs(2, 6)[2:].count(False) >= 3  # two requests: held at K = 0 but for explorations
    assert epochs(1, 8) == [False] + [True] * 7  # alone from the first epoch it begins


def test_a_burst_begins_a_new_epoch_in_the_mode_of_its_load():
    """A burst's first round is often a request alone, which the gate lets speculate; once the burst
    is running at a fourfold load, the epoch starts over in the mode measured for that load."""
    from orchestrator.costs import SpeculationGate

    now = [0.0]
    gate = SpeculationGate(epoch_s=1.0, explore_every=100, clock=lambda: now[0])
    rate = {True: 40, False: 80}  # at 16 running requests, K = 0 commits twice as much
    for _ in range(40):
        gate.record(rate[gate.speculate] // 10, 16)
        now[0] = round(now[0] + 0.1, 6)
    assert gate.speculate is False
    now[0] += 60.0  # idle; then a burst
    gate.record(1, 1)
    assert gate.speculate is True  # one request alone
    now[0] += 0.05
    gate.record(1, 3)
    assert gate.speculate is True  # 3 running: not yet a fourfold change (levels 1 and 2)
    now[0] += 0.05
    gate.record(1, 16)
    assert gate.speculate is False  # K = 0, as measured at this load


def test_the_gate_holds_model_drafts_but_not_lookups():
    load = _load([(1, 0.020), (256, 0.021)], [(1, 0.0001)], batch_size=1)
    model, lookup = LoadAwareK(4, 4, load), LoadAwareK(4, 4, load, drafts_cost=False)
    _close_the_gate(load)  # the draft model's forwards measured a loss at this load
    assert model.next_k() == 0 and lookup.next_k() > 0


def test_a_slow_first_speculating_epoch_does_not_hold_k_at_zero():
    """The rarely measured mode's rate is a mean of its epochs at first: one cold epoch at 0.9x must
    not outweigh the exploration that follows at 1.5x (an exponential average kept it under K = 0's
    for dozens of epochs)."""
    from orchestrator.costs import SpeculationGate

    now = [0.0]
    gate = SpeculationGate(epoch_s=1.0, explore_every=4, clock=lambda: now[0])
    modes: list[bool] = []  # each epoch's mode, as it begins
    while len(modes) < 8:
        speculating = gate.speculate
        cold = speculating and len(modes) <= 1  # the first epoch
        gate.record(9 if cold else 15 if speculating else 10, 2)  # tokens per 0.1 s
        if gate._started == now[0]:
            modes.append(gate.speculate)
        now[0] = round(now[0] + 0.1, 6)
    assert modes[:4] == [True, False, False, True]  # cold speculation lost; K = 0; an exploration
    assert modes[4:7] == [True, True, True]  # (90 + 150) / 2 > 1.1 x 100: speculation is kept
