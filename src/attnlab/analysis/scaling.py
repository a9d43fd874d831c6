"""Power laws of loss against training compute, fitted many at once (numpy, no loop over fits).

    L(C) = E + A * C^(-alpha)

fitted as Hoffmann et al. 2022 ("Training Compute-Optimal Large Language Models", approach 3, appendix D.2) fit
theirs, from their grid of starting points (alpha0 in {0, 0.5, ..., 2}, log E0 in {-1, -0.5, ..., 1}, log A0 in
{0, 5, ..., 25} for C in FLOPs: 150 starts), the best minimum kept. Their loss, Huber's with delta = 1e-3 on log
residuals, is an L1 loss on the 1-10% residuals of a small study: with 3 sizes the line passes through two points
and ignores the third (issue 44). Here the loss is least squares on log L (Huber's with delta -> infinity: the
maximum-likelihood fit under log-normal noise), each point weighted by how often its seed is drawn, minimised by
Levenberg-Marquardt (Levenberg 1944, Marquardt 1963) on every (problem, start) pair at once. Parameters: a = log of
A C0^-alpha (C0 the median compute of the study, so a stays of order 1), alpha in [1e-4, 3], e = log E (E > 0).

E can be fitted per curve, shared by several curves (one e for a group: `groups`), or held near a prior: a
pseudo-observation (E - mean) / sd, in units of the points' noise (`prior`); sd = 0 fixes E. Besiroglu et al. 2024
("Chinchilla Scaling: A replication attempt") re-fitted Hoffmann et al.'s data and found its intervals far too
narrow: the intervals of scaling_stats.py come from refits on resampled seeds, and a held-out size checks the
extrapolation.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np
from scipy import stats
from scipy.special import expit

ALPHA_BOUNDS = (1e-4, 3.0)
# Hoffmann et al. 2022, appendix D.2: their grid for L(N, D), one exponent and one coefficient here
HOFFMANN_ALPHA = (0.0, 0.5, 1.0, 1.5, 2.0)
HOFFMANN_E = (-1.0, -0.5, 0.0, 0.5, 1.0)
HOFFMANN_A = (0.0, 5.0, 10.0, 15.0, 20.0, 25.0)
EXACT_SEEDS = 6  # up to this many seeds, the bootstrap enumerates every multiset of seeds (462 at 6)


@dataclass(frozen=True)
class Layout:
    """Which parameter each point uses: points belong to curves (a_v, alpha_v) and E groups (e_g)."""

    curve: np.ndarray  # (n,) int: the curve of each point
    group: np.ndarray  # (V,) int: the E group of each curve
    fixed_e: np.ndarray | None = None  # (G,) log E held fixed (a prior with sd 0), else None
    prior: tuple[np.ndarray, np.ndarray, float] | None = None  # (mean E (G,), sd (G,), noise sd of log L)

    @property
    def n_curves(self) -> int:
        return len(self.group)

    @property
    def n_groups(self) -> int:
        return int(self.group.max()) + 1


def predict(p: np.ndarray, logc: np.ndarray, scale: float) -> np.ndarray:
    """L at log-compute `logc` for parameters p (..., 3) = (a, alpha, e) (broadcast over the leading axes)."""
    return np.exp(p[..., 2:3]) + np.exp(p[..., 0:1] - p[..., 1:2] * (logc - scale))


def _unpack(p: np.ndarray, lay: Layout) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    v = lay.n_curves
    a, alpha = p[..., :v], p[..., v:2 * v]
    e = lay.fixed_e if lay.fixed_e is not None else p[..., 2 * v:]
    return a, alpha, np.broadcast_to(e, p.shape[:-1] + (lay.n_groups,))


def _residuals(p: np.ndarray, x: np.ndarray, y: np.ndarray, lay: Layout, jac: bool = True):
    """Residuals log prediction - log L (B, n) [+ prior rows], and their Jacobian (B, rows, P)."""
    a, alpha, e = _unpack(p, lay)
    v = lay.n_curves
    ev = e[..., lay.group]  # (B, V)
    t = a[..., lay.curve] - alpha[..., lay.curve] * x  # (B, n) log of A C^-alpha
    ep = ev[..., lay.curve]  # (B, n)
    r = np.logaddexp(ep, t) - y
    if not jac:
        return _with_prior(r, e, lay), None
    s = expit(t - ep)  # (B, n) share of A C^-alpha in the prediction
    onehot_v = np.eye(v)[lay.curve]  # (n, V)
    cols = [s[..., None] * onehot_v, (-x * s)[..., None] * onehot_v]
    if lay.fixed_e is None:
        cols.append((1 - s)[..., None] * np.eye(lay.n_groups)[lay.group[lay.curve]])
    j = np.concatenate(cols, -1)  # (B, n, P)
    if lay.prior is not None and lay.fixed_e is None:
        mean, sd, noise = lay.prior
        dprior = np.exp(e) * noise / sd  # (B, G)
        jp = np.zeros(p.shape[:-1] + (lay.n_groups, p.shape[-1]))
        jp[..., np.arange(lay.n_groups), 2 * v + np.arange(lay.n_groups)] = dprior
        j = np.concatenate([j, jp], -2)
    return _with_prior(r, e, lay), j


def _with_prior(r: np.ndarray, e: np.ndarray, lay: Layout) -> np.ndarray:
    if lay.prior is None or lay.fixed_e is not None:
        return r
    mean, sd, noise = lay.prior
    return np.concatenate([r, (np.exp(e) - mean) / sd * noise], -1)


def _clip(p: np.ndarray, lay: Layout) -> np.ndarray:
    v = lay.n_curves
    p = p.copy()
    p[..., :v] = np.clip(p[..., :v], -60, 60)
    p[..., v:2 * v] = np.clip(p[..., v:2 * v], *ALPHA_BOUNDS)
    p[..., 2 * v:] = np.clip(p[..., 2 * v:], -30, 5)
    return p


def _cost(p, x, y, w, lay) -> np.ndarray:
    r, _ = _residuals(p, x, y, lay, jac=False)
    wr = np.concatenate([w, np.ones(r.shape[:-1] + (r.shape[-1] - w.shape[-1],))], -1) if r.shape[-1] > w.shape[-1] \
        else w
    return np.einsum("...i,...i->...", wr, r * r)


def levenberg_marquardt(p: np.ndarray, x: np.ndarray, y: np.ndarray, w: np.ndarray, lay: Layout,
                        iters: int = 100) -> tuple[np.ndarray, np.ndarray]:
    """Minimise sum_i w_i r_i^2 (+ the prior's row) from starts p (B, P) for data x, y, w (B, n) broadcast to B;
    projected on the bounds. Returns (parameters (B, P), cost (B,))."""
    p = _clip(np.array(p, dtype=float), lay)
    x, y, w = (np.broadcast_to(z, p.shape[:-1] + z.shape[-1:]) for z in (x, y, w))
    cost = _cost(p, x, y, w, lay)
    lam = np.full(p.shape[:-1], 1e-2)
    active = np.isfinite(cost)
    eye = np.eye(p.shape[-1])
    for _ in range(iters):
        idx = np.nonzero(active)
        if not len(idx[0]):
            break
        pa, xa, ya, wa = p[idx], x[idx], y[idx], w[idx]
        r, j = _residuals(pa, xa, ya, lay)
        extra = r.shape[-1] - wa.shape[-1]
        wr = np.concatenate([wa, np.ones(wa.shape[:-1] + (extra,))], -1) if extra else wa
        jw = j * wr[..., None]
        g = np.einsum("bnp,bn->bp", jw, r)
        h = np.einsum("bnp,bnq->bpq", jw, j)
        d = np.einsum("bpp->bp", h) + 1e-12
        step = -np.linalg.solve(h + lam[idx][:, None, None] * d[:, :, None] * eye, g[..., None])[..., 0]
        new = _clip(pa + step, lay)
        new_cost = _cost(new, xa, ya, wa, lay)
        better = new_cost < cost[idx]
        gain = np.where(better, cost[idx] - new_cost, 0.0)
        p[idx] = np.where(better[:, None], new, pa)
        cost[idx] = np.where(better, new_cost, cost[idx])
        lam[idx] = np.where(better, lam[idx] / 3, lam[idx] * 4)
        done = (better & (gain <= 1e-12 * (1 + cost[idx]))) | (lam[idx] > 1e10)
        active[idx] = ~done
    return p, cost


def hoffmann_starts(scale: float, n_curves: int = 1, n_groups: int = 1) -> np.ndarray:
    """Hoffmann et al.'s 150 starting points (module docstring) as (a, alpha, e) rows with a centred at `scale`
    (log A0 is for C in FLOPs: a = log A0 - alpha0 * scale), repeated for every curve (same start for all)."""
    rows = [(a0 - al * scale, al, e0) for al, e0, a0 in itertools.product(HOFFMANN_ALPHA, HOFFMANN_E, HOFFMANN_A)]
    out = np.array(rows)  # (150, 3)
    return np.concatenate([np.repeat(out[:, :1], n_curves, 1), np.repeat(out[:, 1:2], n_curves, 1),
                           np.repeat(out[:, 2:3], n_groups, 1)], 1)


def fit_many(x: np.ndarray, y: np.ndarray, w: np.ndarray, lay: Layout, starts: np.ndarray,
             keep: int = 4) -> np.ndarray:
    """The best fit of each problem (batch shape of x, y, w: (..., n)) from every start (S, P), or each problem's
    own starts (..., S, P): first a few iterations from all of them, then the `keep` best to convergence.
    Returns (..., P)."""
    batch = np.broadcast_shapes(x.shape[:-1], y.shape[:-1], w.shape[:-1], starts.shape[:-2])
    x, y, w = (np.broadcast_to(z, batch + z.shape[-1:]) for z in (x, y, w))
    w = np.where(np.isfinite(x) & np.isfinite(y), w, 0.0)
    x, y = np.where(w > 0, x, 0.0), np.where(w > 0, y, 0.0)  # an absent point: weight 0 and no NaN
    s = starts.shape[-2]
    if lay.fixed_e is not None:
        starts = starts[..., :2 * lay.n_curves]
    tile = (np.broadcast_to(z[..., None, :], batch + (s, z.shape[-1])) for z in (x, y, w))
    xs, ys, ws = (z.reshape(-1, z.shape[-1]) for z in tile)
    ps = np.broadcast_to(starts, batch + starts.shape[-2:]).reshape(-1, starts.shape[-1])
    ps, cost = levenberg_marquardt(ps, xs, ys, ws, lay, iters=8)
    k = min(keep, s)
    cost = np.where(np.isfinite(cost), cost, np.inf).reshape(-1, s)
    best = np.argsort(cost, -1)[:, :k]  # (B, k)
    ps = ps.reshape(-1, s, ps.shape[-1])[np.arange(best.shape[0])[:, None], best].reshape(-1, ps.shape[-1])
    xs, ys, ws = (z.reshape(-1, s, z.shape[-1])[:, :k].reshape(-1, z.shape[-1]) for z in (xs, ys, ws))
    ps, cost = levenberg_marquardt(ps, xs, ys, ws, lay, iters=200)
    cost = np.where(np.isfinite(cost), cost, np.inf).reshape(-1, k)
    ps = ps.reshape(-1, k, ps.shape[-1])[np.arange(cost.shape[0]), np.argmin(cost, -1)]
    return ps.reshape(batch + ps.shape[-1:])


def curve_params(p: np.ndarray, lay: Layout) -> np.ndarray:
    """(..., P) fitted parameters -> (..., V, 3): each curve's (a, alpha, e)."""
    a, alpha, e = _unpack(p, lay)
    return np.stack([a, alpha, e[..., lay.group]], -1)


def crossings(f: np.ndarray, g: np.ndarray, lo: float, hi: float, scale: float, points: int = 400) -> np.ndarray:
    """The smallest log compute in [lo, hi] where the curves f and g (..., 3) cross, else NaN (...,)."""
    grid = np.linspace(lo, hi, points)  # (G,)
    d = predict(f[..., None, :], grid[:, None], scale)[..., 0] - predict(g[..., None, :], grid[:, None], scale)[..., 0]
    change = (np.sign(d[..., :-1]) * np.sign(d[..., 1:]) < 0) | (d[..., :-1] == 0)  # (..., G - 1)
    has = change.any(-1)
    i = np.argmax(change, -1)
    left, right = grid[i], grid[np.minimum(i + 1, points - 1)]
    sign_left = np.sign(np.take_along_axis(d, i[..., None], -1)[..., 0])

    def diff(lc: np.ndarray) -> np.ndarray:
        return predict(f, lc[..., None], scale)[..., 0] - predict(g, lc[..., None], scale)[..., 0]

    for _ in range(50):  # bisection in log C, all at once
        mid = (left + right) / 2
        same = np.sign(diff(mid)) == sign_left
        left, right = np.where(same, mid, left), np.where(same, right, mid)
    return np.where(has, (left + right) / 2, np.nan)


# ---------------------------------------------------------------------------------------------- the bootstrap
def seed_draws(n: int, resamples: int, seed: int) -> tuple[np.ndarray, np.ndarray, bool]:
    """Draws of n seeds with replacement as counts (D, n) and their probabilities (D,): every multiset of the n
    seeds with its multinomial probability when n <= EXACT_SEEDS (the exact bootstrap: 3 draws for 2 seeds, 10 for
    3, 126 for 5), else `resamples` random draws from default_rng(seed). The third value: exact or not."""
    if n <= EXACT_SEEDS:
        combos = list(itertools.combinations_with_replacement(range(n), n))
        counts = np.zeros((len(combos), n))
        for d, c in enumerate(combos):
            np.add.at(counts[d], list(c), 1)
        logp = (math.lgamma(n + 1) - np.sum([[math.lgamma(k + 1) for k in row] for row in counts], 1)
                - n * math.log(n))
        return counts, np.exp(logp), True
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, (resamples, n))
    counts = np.stack([np.bincount(row, minlength=n) for row in idx]).astype(float)
    return counts, np.full(resamples, 1.0 / resamples), False


def interval(estimate: np.ndarray, draws: np.ndarray, prob: np.ndarray, n_seeds: int, exact: bool,
             level: float = 0.95) -> tuple[np.ndarray, np.ndarray]:
    """estimate ± t(0.975, n - 1) x SE x sqrt(n / (n - 1)), SE the bootstrap's standard deviation of the quantity
    over the draws (axis -1; NaN draws left out and the rest reweighted): with the 2 to 5 seeds of a study the
    percentile interval is too narrow, the bootstrap's variance of n resampled seeds is (n - 1) / n of the true one,
    and t widens it for estimating it from n seeds. NaN where fewer than 2 draws are finite or n < 2."""
    ok = np.isfinite(draws)
    wts = np.where(ok, prob, 0.0)
    total = wts.sum(-1)
    mean = np.where(total > 0, np.einsum("...d,...d->...", wts, np.nan_to_num(draws)) / np.maximum(total, 1e-300), 0)
    var = np.einsum("...d,...d->...", wts, np.nan_to_num(draws - mean[..., None]) ** 2) / np.maximum(total, 1e-300)
    if not exact:  # equally weighted random draws: the sample variance (ddof 1)
        m = ok.sum(-1)
        var = var * m / np.maximum(m - 1, 1)
    enough = (ok.sum(-1) >= 2) & (n_seeds >= 2)
    t = stats.t.ppf(0.5 + level / 2, max(n_seeds - 1, 1))
    half = np.where(enough, t * np.sqrt(var) * math.sqrt(n_seeds / max(n_seeds - 1, 1)), np.nan)
    return estimate - half, estimate + half


def weighted_share(flags: np.ndarray, prob: np.ndarray) -> np.ndarray:
    """The bootstrap probability of an event (flags (..., D) bool)."""
    return np.einsum("...d,d->...", flags.astype(float), prob) / prob.sum()
