"""Running cost fits of the cost model (orchestrator.cost_model): a weighted straight line
(:class:`LinearFit`) and a weighted curve by size (:class:`CostCurve`)."""

from __future__ import annotations

import bisect


class LinearFit:
    """Exponentially weighted least squares of y on x: y ~ a + b * x, with b >= 0."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.w = self.sx = self.sxx = self.sy = self.sxy = 0.0

    def add(self, x: float, y: float) -> None:
        d = self.decay
        self.w = d * self.w + 1
        self.sx = d * self.sx + x
        self.sxx = d * self.sxx + x * x
        self.sy = d * self.sy + y
        self.sxy = d * self.sxy + x * y

    def _fit(self) -> tuple[float, float, float | None]:
        """(mean x, mean y, slope >= 0, or None while only one x has been seen); needs a point."""
        mean_x, mean_y = self.sx / self.w, self.sy / self.w
        var = self.sxx / self.w - mean_x * mean_x
        slope = max((self.sxy / self.w - mean_x * mean_y) / var, 0.0) if var >= 1e-6 else None
        return mean_x, mean_y, slope

    def predict(self, x: float, default_slope_ratio: float) -> float | None:
        """None before any point; with a single x seen, the slope is ``default_slope_ratio`` of
        the mean per unit of x plus one."""
        if self.w == 0:
            return None
        mean_x, mean_y, slope = self._fit()
        if slope is None:
            slope = default_slope_ratio * mean_y / (1 + default_slope_ratio * mean_x)
        return max(mean_y + slope * (x - mean_x), 0.1)

    def intercept(self) -> float:
        """y at x = 0 (at least 0); 0 until two different x have been seen."""
        if self.w == 0:
            return 0.0
        mean_x, mean_y, slope = self._fit()
        return 0.0 if slope is None else max(mean_y - slope * mean_x, 0.0)


class CostCurve:
    """Running cost by size (token rows of a forward pass): a weighted running mean per size seen,
    read between sizes by linear interpolation and beyond them along the nearest segment (slope >= 0).

    A straight line fits a pass's cost badly once the kernel changes with the rows: without packed
    weights the target runs 1-4 rows through MKL and 5 or more through oneDNN, whose cost starts
    higher but grows far more slowly (docs/benchmarks.md, "Verify cost by kernel"). A line through those points
    prices every extra draft token at the steep 1-to-5-row slope and picks too short drafts.
    """

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self._points: dict[int, tuple[float, float]] = {}  # size -> (weight, weighted sum)
        self.count = 0  # observations so far

    def add(self, x: float, y: float) -> None:
        self.count += 1
        key = max(int(round(x)), 0)
        w, total = self._points.get(key, (0.0, 0.0))
        self._points[key] = (self.decay * w + 1, self.decay * total + y)

    def _at(self, x: int) -> float:
        w, total = self._points[x]
        return total / w

    def predict(self, x: float, default_slope_ratio: float) -> float | None:
        """None before any point; with a single size seen, each extra unit of x costs
        ``default_slope_ratio`` of the cost per unit at that size (as :class:`LinearFit`)."""
        if not self._points:
            return None
        xs = sorted(self._points)
        if len(xs) == 1:
            x0, y0 = xs[0], self._at(xs[0])
            slope = default_slope_ratio * y0 / (1 + default_slope_ratio * x0)
            return max(y0 + slope * (x - x0), 0.1)
        i = bisect.bisect_left(xs, x)
        if i < len(xs) and xs[i] == x:
            return max(self._at(xs[i]), 0.1)
        lo, hi = (xs[0], xs[1]) if i == 0 else (xs[-2], xs[-1]) if i == len(xs) else (xs[i - 1], xs[i])
        y_lo, y_hi = self._at(lo), self._at(hi)
        slope = (y_hi - y_lo) / (hi - lo)
        if lo <= x <= hi:
            return max(y_lo + slope * (x - lo), 0.1)
        # beyond what was measured, from the nearest size: never cheaper for more rows
        x0, y0 = (hi, y_hi) if x > hi else (lo, y_lo)
        return max(y0 + max(slope, 0.0) * (x - x0), 0.1)
