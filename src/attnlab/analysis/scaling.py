"""Scaling curves of an ablation over model sizes: a power law in training compute, fitted per variant.

    L(C) = E + A * C^(-alpha)                      (three parameters: with >= 4 distinct compute values)
    L(C) = A * C^(-alpha)                          (two: the stated fallback with fewer; E is taken as 0)

fitted as Hoffmann et al. 2022 ("Training Compute-Optimal Large Language Models", approach 3) fit theirs: the Huber
loss (delta 1e-3) between log L and the log of the prediction, minimised (scipy's trust-region least squares
with its Huber loss) from a grid of starting points, the best kept. E and A are fitted as their logs (both
positive, E below every observed loss), alpha is bounded to (0, 3].

Intervals come from the seeds: each resample draws the seeds with replacement (a seed keeps all its sizes: its
trials share an initialisation stream and data order), refits, and the spread of a quantity over the resamples
is its bootstrap standard error. With the 2 to 5 seeds of an ablation the percentile interval of so few
resampled seeds is too narrow (the same lesson as the table's test: stats.py), so the 95% interval is the fit on
all seeds ± t(0.975, n - 1) * SE * sqrt(n / (n - 1)): the bootstrap's variance of n resampled seeds is (n - 1) / n
of the true one, and t widens it for estimating it from n seeds. tests/test_ablate_scaling.py checks its
coverage on synthetic studies with known laws.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import optimize, stats
from scipy.special import expit

HUBER_DELTA = 1e-3  # Hoffmann et al. 2022, appendix D.2
THREE_PARAMS_FROM = 4  # distinct compute values a three-parameter fit needs (3 would interpolate)


@dataclass(frozen=True)
class PowerLaw:
    e: float  # the irreducible loss E (0 for the two-parameter form)
    a: float
    alpha: float
    form: str  # "E + A C^-alpha" or "A C^-alpha"

    def __call__(self, c: np.ndarray | float) -> np.ndarray:
        return self.e + self.a * np.power(np.asarray(c, dtype=float), -self.alpha)


def huber(r: np.ndarray, delta: float = HUBER_DELTA) -> np.ndarray:
    absr = np.abs(r)
    return np.where(absr <= delta, 0.5 * r**2, delta * (absr - 0.5 * delta))


def fit_power_law(c: np.ndarray, loss: np.ndarray, three: bool | None = None, near: PowerLaw | None = None
                  ) -> PowerLaw:
    """Fit L(C) to points (c_i, loss_i) (module docstring). `three`: force the form; default: three parameters
    when there are at least THREE_PARAMS_FROM distinct compute values. `near`: a fit of similar points (a
    bootstrap resample's full-data fit) to start from instead of the grid."""
    c, loss = np.asarray(c, dtype=float), np.asarray(loss, dtype=float)
    if len(c) != len(loss) or len(c) < 2 or (c <= 0).any() or (loss <= 0).any():
        raise ValueError(f"a power law needs >= 2 points with compute and loss > 0, got {len(c)}")
    if len(np.unique(c)) < 2:
        raise ValueError("a power law needs points at 2 or more compute values")
    three = len(np.unique(c)) >= THREE_PARAMS_FROM if three is None else three
    logc, logl = np.log(c), np.log(loss)
    scale = float(np.median(logc))  # fit in log C - scale: A's log stays of order 1 whatever the units
    x = logc - scale

    def residuals(p: np.ndarray) -> np.ndarray:  # (n,) log prediction - log L
        pred = p[0] - p[1] * x  # log(A C^-alpha)
        if three:
            pred = np.logaddexp(p[2], pred)  # log(E + A C^-alpha)
        return pred - logl

    def jacobian(p: np.ndarray) -> np.ndarray:  # (n, params) d residual / d (log A, alpha[, log E])
        w = expit(p[0] - p[1] * x - p[2]) if three else np.ones_like(x)  # share of A C^-alpha in the prediction
        cols = [w, -x * w] + ([1.0 - w] if three else [])
        return np.stack(cols, axis=1)

    best = None
    lo = float(logl.min())
    e_cap = math.log(math.exp(lo) * 0.999)  # E below every observed loss
    starts = []
    for alpha0 in (0.05, 0.2, 0.6):
        for e_frac in ((0.3, 0.9) if three else (None,)):
            start = [float(logl.mean()), alpha0]
            if three:  # A where the points are, given E
                start.append(math.log(e_frac * math.exp(lo)))
                start[0] = float(np.log(np.clip(np.exp(logl) - math.exp(start[2]), 1e-9, None)).mean())
            starts.append(start)
    if near is not None and near.form == ("E + A C^-alpha" if three else "A C^-alpha"):  # a refit: start there
        starts = [[math.log(near.a) - near.alpha * scale, near.alpha] + ([math.log(min(near.e, math.exp(e_cap)))]
                                                                         if three else [])]
    for start in starts:
        bounds = ([-np.inf, 1e-4] + ([-np.inf] if three else []), [np.inf, 3.0] + ([e_cap] if three else []))
        start = np.clip(start, [b + 1e-9 for b in bounds[0]], [b - 1e-9 for b in bounds[1]])
        # scipy's "huber" loss on residuals scaled by f_scale is Huber's with delta = f_scale
        res = optimize.least_squares(residuals, start, jac=jacobian, bounds=bounds, loss="huber",
                                     f_scale=HUBER_DELTA, x_scale="jac", xtol=1e-12, ftol=1e-12, gtol=1e-12,
                                     max_nfev=500)
        cost = float(huber(res.fun).sum())
        if best is None or cost < best[0]:
            best = (cost, res.x)
    p = best[1]
    a, alpha = float(p[0]), float(p[1])
    e = math.exp(p[2]) if three else 0.0
    return PowerLaw(e, math.exp(a + alpha * scale), alpha, "E + A C^-alpha" if three else "A C^-alpha")


def crossing(f: PowerLaw, g: PowerLaw, c_low: float, c_high: float) -> float | None:
    """The smallest compute in [c_low, c_high] where the two curves cross, or None."""
    grid = np.geomspace(c_low, c_high, 801)  # (801,)
    d = f(grid) - g(grid)
    change = np.nonzero(np.sign(d[:-1]) * np.sign(d[1:]) < 0)[0]
    if d[0] == 0:
        return float(grid[0])
    if not len(change):
        return None
    i = int(change[0])
    root = optimize.brentq(lambda lc: float(f(math.exp(lc)) - g(math.exp(lc))), math.log(grid[i]),
                           math.log(grid[i + 1]), xtol=1e-12)
    return math.exp(root)


def seed_interval(estimate: float, resampled: list[float], n_seeds: int, level: float = 0.95
                  ) -> tuple[float, float]:
    """estimate ± t(n - 1) * bootstrap SE * sqrt(n / (n - 1)) (module docstring); NaN with 1 seed or no resample."""
    values = np.array([v for v in resampled if v is not None and np.isfinite(v)], dtype=float)
    if n_seeds < 2 or len(values) < 2:
        return math.nan, math.nan
    half = stats.t.ppf(0.5 + level / 2, n_seeds - 1) * values.std(ddof=1) * math.sqrt(n_seeds / (n_seeds - 1))
    return estimate - half, estimate + half


def resample_seeds(seeds: list[int], resamples: int, seed: int) -> list[list[int]]:
    """`resamples` draws of the seeds with replacement (each a list as long as `seeds`), from default_rng(seed)."""
    rng = np.random.default_rng(seed)
    return [[seeds[i] for i in rng.integers(0, len(seeds), len(seeds))] for _ in range(resamples)]
