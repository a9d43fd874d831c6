"""Small tests over seeds the tables still use: a mean's t interval (table.csv), and Welch's unpaired t-test
between two rows' seed scores (Welch 1947; scipy.stats.ttest_ind), the test every table used before the pooled
model of inference.py and the baseline power.py measures it against."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from scipy import stats


def welch(base: Sequence[float] | np.ndarray, values: Sequence[float] | np.ndarray) -> tuple[np.ndarray, ...]:
    """(p-value, CI low, CI high) of mean(values) - mean(base) over the last axis by Welch's t-test (scipy's),
    elementwise over leading axes. NaN, no test, with fewer than 2 each, or when neither row varies over its
    seeds: the difference's standard error is 0, so Welch-Satterthwaite's degrees of freedom are 0/0 and the seeds
    show no noise to test against (scipy would give p = 0 for any difference, however small)."""
    base, values = np.asarray(base, dtype=float), np.asarray(values, dtype=float)
    if base.shape[-1] < 2 or values.shape[-1] < 2:
        nan = np.full(np.broadcast_shapes(base.shape[:-1], values.shape[:-1]), np.nan)
        return nan, nan, nan
    flat = (np.ptp(base, -1) == 0) & (np.ptp(values, -1) == 0)
    with np.errstate(invalid="ignore", divide="ignore"):
        res = stats.ttest_ind(values, base, equal_var=False, axis=-1)
        ci = res.confidence_interval(0.95)
    return tuple(np.where(flat, np.nan, x) for x in (res.pvalue, ci.low, ci.high))


def t_interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float]:
    """The t-distribution CI of the mean of `values` (NaN for fewer than 2)."""
    n = len(values)
    if n < 2:
        return math.nan, math.nan
    mean, sd = float(np.mean(values)), float(np.std(values, ddof=1))
    low, high = stats.t.interval(level, n - 1, loc=mean, scale=sd / math.sqrt(n)) if sd > 0 else (mean, mean)
    return float(low), float(high)
