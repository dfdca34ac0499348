"""The forward-cost fit that load_aware prices rows by: a roofline's knee is found, a line stays a line."""

from __future__ import annotations

import math
import random
import statistics

from model_host.simulated import PROFILES, Kernels, modeled_curve
from orchestrator.cost_curve import CostCurve
from orchestrator.goodput import Forwards
from specdec.v1 import common_pb2

# The default target's start-up curve as measured on this 2-core machine (`--threads 1`), seconds by tokens.
CPU_TARGET = [
    (1, 0.00439), (2, 0.00544), (3, 0.00626), (4, 0.00599), (5, 0.00625), (6, 0.00652), (8, 0.00727),
    (10, 0.00735), (12, 0.00776), (16, 0.00939), (20, 0.00936), (24, 0.01064), (32, 0.01456), (40, 0.01390),
    (48, 0.01641), (80, 0.02294), (96, 0.02845), (160, 0.04135),
]  # fmt: skip


def _roofline() -> list[tuple[int, float]]:
    """The 8B profile's modeled curve on an H100, out to 128 rows of 17 tokens, as the service reports it."""
    return modeled_curve(
        PROFILES["h100-llama-3.1-8b"], Kernels(40, 20), [1, 2, 4, 8, 16, 32, 64, 128], [1, 3, 5, 17], 32
    )


def test_a_rooflines_knee_is_found_and_rows_priced_on_each_side():
    points = _roofline()
    curve = CostCurve(points)
    line_slope = statistics.linear_regression(*zip(*points, strict=True)).slope
    assert 128 <= curve.knee <= 384, curve.knee  # the H100's ridge for this shape: about 300 tokens a forward
    assert all(abs(curve.seconds(t) - s) < 0.05 * s for t, s in points)
    flat_row = curve.row_seconds(48, 16)  # 16 sessions of 3 tokens: where reading the weights decides
    steep_row = curve.row_seconds(640, 128)
    true_steep = (dict(points)[1088] - dict(points)[544]) / 544
    assert flat_row < 0.25 * line_slope < line_slope < 0.9 * true_steep
    assert abs(steep_row - true_steep) < 0.15 * true_steep


def test_a_line_stays_a_line_or_near_one():
    """This CPU's measured curve stays one line: the hinge does not pay for its two extra parameters, so
    a row costs the least-squares slope wherever the forward is. Straight curves with 3% noise get a
    knee in about 3 seeds of 10 (the knee's search is many tests), but it moves a row's price
    little."""
    curve = CostCurve(CPU_TARGET)
    slope = statistics.linear_regression(*zip(*CPU_TARGET, strict=True)).slope
    assert math.isinf(curve.knee)
    assert abs(curve.row_seconds(5) - slope) < 1e-12 and abs(curve.row_seconds(96, 32) - slope) < 1e-12
    errors = []
    for seed in range(100):
        rng = random.Random(seed)
        noisy = [(t, 0.005 + 2e-4 * t * (1 + rng.gauss(0, 0.03))) for t in (1, 2, 4, 8, 16, 32, 64, 96, 128, 160)]
        noisy_curve = CostCurve(noisy)
        errors += [abs(noisy_curve.row_seconds(t, b) / 2e-4 - 1) for t, b in ((5, 1), (48, 16), (96, 32))]
    assert max(errors) < 0.2 and statistics.median(errors) < 0.05


def test_too_few_points_for_a_hinge_and_none_at_all():
    bent = [(1, 0.010), (32, 0.010), (64, 0.010), (128, 0.020), (256, 0.040)]  # a knee needs 3 points a side
    assert math.isinf(CostCurve(bent).knee)
    single = CostCurve([(1, 0.003)])
    assert single.seconds(50) == 0.003 and single.row_seconds(50) == 0.0
    assert CostCurve([]).row_seconds(8) == 0.0


def test_the_step_times_price_a_row_at_the_live_forwards_size():
    """On the roofline, a row in a forward of 16 short rows costs a fraction of one past the ridge."""
    info = common_pb2.ModelInfo(
        forward_costs=[common_pb2.ForwardCost(batch_tokens=t, seconds=s) for t, s in _roofline()]
    )
    forwards = Forwards(info)

    def row_at(batch: int, tokens: int) -> float:
        for _ in range(80):  # live forwards at this size, as fast as the curve says
            timing = common_pb2.Timing(batch_size=batch, batch_tokens=tokens)
            timing.forward_seconds = forwards.curve.seconds(tokens)
            forwards.observe(timing)
        assert abs(forwards.stretch - 1.0) < 1e-6
        return forwards.row_seconds

    flat = row_at(16, 48)
    assert row_at(128, 640) > 4 * flat
