"""A service's forward cost by tokens fed, fitted to its start-up curve: what load_aware prices rows by.

One straight line misprices a GPU's curve (and the modeled device's): a roofline, flat while reading
the weights decides, then rising once compute does (the 8B profile on an H100: 8.85 ms from 1 to 192
tokens, then about 23 µs a token). A line through both parts says 20 µs a row in the flat part, where a
row costs about 0.5, and too little past the ridge.

So the curve is fitted by two lines joined at a knee (a hinge), where that explains it better than one
line by the Bayesian information criterion, which charges the hinge its two extra parameters (the knee
and the second slope); with too few points to tell, or where the curve is a line, it is one line (this
CPU's measured curve is: docs/design.md, "What a row costs"). A row is priced by the fitted curve's
chord over the tokens a forward would grow by if each of its sessions fed one more.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np

# A knee has at least this many distinct token counts on each side: a second line through fewer fits the
# noise of the last points (docs/design.md, "What a row costs").
MIN_SIDE_POINTS = 3


def _fit(tokens: np.ndarray, seconds: np.ndarray, knee: float | None) -> tuple[np.ndarray, float]:
    """Least squares of seconds on [1, tokens, max(tokens - knee, 0)] (no third column without a knee):
    the coefficients and the residual sum of squares."""
    columns = [np.ones_like(tokens), tokens]
    if knee is not None:
        columns.append(np.maximum(tokens - knee, 0.0))
    design = np.stack(columns, axis=1)
    coefficients = np.linalg.lstsq(design, seconds, rcond=None)[0]
    residual = seconds - design @ coefficients
    return coefficients, float(residual @ residual)


class CostCurve:
    """Seconds of one forward by the tokens it feeds: one line, or two joined at `knee` (module docstring).
    Both slopes are held at or above 0: more tokens never cost less."""

    def __init__(self, points: Sequence[tuple[int, float]]) -> None:
        points = [(t, s) for t, s in points if s > 0]
        self.intercept, self.slope, self.knee, self.bend = (points[0][1] if points else 0.0), 0.0, math.inf, 0.0
        if len({t for t, _ in points}) < 2:
            return
        tokens = np.array([t for t, _ in points], dtype=np.float64)
        seconds = np.array([s for _, s in points], dtype=np.float64)
        (intercept, slope), best = _fit(tokens, seconds, None)
        n = len(points)
        score = self._bic(best, n, 2)
        self.intercept, self.slope = max(float(intercept), 0.0), max(float(slope), 0.0)
        distinct = sorted(set(tokens.tolist()))
        # Knees with MIN_SIDE_POINTS on either side (the points beyond a knee at the last few would only
        # fit their own noise), at the points and halfway between them (on a log scale: the curve's
        # shapes are spaced so): a roofline bends between the shapes it was measured at.
        inner = distinct[MIN_SIDE_POINTS - 1 : len(distinct) - MIN_SIDE_POINTS]
        knees = inner + [math.sqrt(a * b) for a, b in itertools.pairwise(inner)]
        for knee in knees:
            (a, s1, change), sse = _fit(tokens, seconds, knee)
            hinge = self._bic(sse, n, 4)
            if hinge < score:
                score = hinge
                self.intercept, self.slope, self.knee = max(float(a), 0.0), max(float(s1), 0.0), knee
                self.bend = max(float(s1 + change), 0.0) - self.slope

    @staticmethod
    def _bic(sse: float, n: int, parameters: int) -> float:
        return n * math.log(max(sse / n, 1e-300)) + parameters * math.log(n)

    def seconds(self, tokens: float) -> float:
        """The fitted cost of a forward that feeds `tokens`."""
        return self.intercept + self.slope * tokens + self.bend * max(tokens - self.knee, 0.0)

    def row_seconds(self, tokens: float, rows: float = 1.0) -> float:
        """What a row adds to a forward of `tokens` when `rows` sessions each add one: the chord over
        [tokens, tokens + rows]."""
        rows = max(rows, 1.0)
        return (self.seconds(tokens + rows) - self.seconds(tokens)) / rows
