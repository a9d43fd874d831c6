"""What `ablate scaling` concludes from a study's losses, for many studies at once (the report's one study, or the
synthetic studies of scaling_coverage.py, through the same code).

Input: the final validation loss of every (variant, size, learning rate, seed), NaN where a trial did not finish,
and each (variant, size)'s training compute. Each (variant, size) is taken at its best learning rate (lowest mean
over seeds). Everything is recomputed on every draw of the seeds (scaling.seed_draws: every multiset of up to 6
seeds, each with its probability), the best learning rate included: the choice of LR is inside every interval,
and the fit of a draw sees the points of its own choice. An interval is the full data's estimate ± t x the
bootstrap's SE (scaling.interval).

- Per size: each variant's best-LR loss and its difference from the first variant.
- The fit L(C) = E + A C^-alpha (scaling.py) of each variant, and what depends on it (alpha, E, L at 10x and 100x
  the largest run, where two variants cross), only where the variant has >= 4 sizes (EXTRAPOLATE_FROM): with 3,
  three parameters pass through three means, and the two-parameter form A C^-alpha (E = 0) predicted the 100x loss
  17-26% too low for a true E > 0 (issue 44). E may be fitted per variant (`free`), shared by all variants
  (`shared`), or held near a prior (mean, sd; sd 0 fixes it).
- The held-out check (Besiroglu et al. 2024): each variant refitted without its largest size predicts that size;
  the prediction, the measured loss, and their difference (in %, each with its interval). Where the difference's
  interval excludes 0, the extrapolation failed its one test, and everything extrapolated from that variant is
  flagged unreliable.
- Crossings: the share of draws in which the two curves cross in [smallest run, 100x the largest], and the interval
  of the crossing among them; reliable only when the full data cross and >= 80% of draws do (RELIABLE_SHARE).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .scaling import Layout, crossings, curve_params, fit_many, hoffmann_starts, interval, seed_draws

EXTRAPOLATE_FROM = 4  # sizes a variant needs before alpha, E, L at kx and crossings are given
RELIABLE_SHARE = 0.8  # share of draws that must cross for a crossing to be stated
MULTIPLES = (10, 100)  # L at these multiples of the largest run's compute
E_FLOOR = 0.01  # a fitted E below this share of the variant's smallest loss is at its bound: E = 0, not identified
DRAW_STARTS = 15  # a draw's fit starts at the full data's fit and every 10th of Hoffmann et al.'s starts


@dataclass(frozen=True)
class EMode:
    """How E is fitted: `free` (per variant), `shared` (one E for all variants), or each variant's E held near a prior
    (mean, sd: sd 0 fixes E); every figure that depends on it is labelled with `label`."""

    kind: str = "free"  # free | shared | prior
    mean: float = 0.0
    sd: float = 0.0

    @property
    def label(self) -> str:
        if self.kind == "shared":
            return "E shared"
        if self.kind == "prior":
            return f"E fixed at {self.mean:g}" if self.sd == 0 else f"E prior {self.mean:g} ± {self.sd:g}"
        return ""


@dataclass
class ScalingData:
    loss: np.ndarray  # (S, V, K, R, N) studies, variants, sizes, learning rates, seeds; NaN: no result
    compute: np.ndarray  # (V, K) training FLOPs of each (variant, size); NaN: never finished
    lrs: np.ndarray  # (R,) the learning rates, ascending
    grid_lrs: tuple[float, ...] = ()  # the file's LRs: any other is an extension (lr.extend_edges)


@dataclass
class ScalingStudy:
    """One study's ScalingData, and what the report names its axes by (scaling_report.collect)."""

    name: str
    metric: str
    variants: list[str]
    sizes: list[str]  # in ladder order, those with a result
    seeds: list[int]  # with a result
    data: ScalingData  # loss (1, V, K, R, N)
    params: np.ndarray  # (V, K) parameters (count_parameters, as the trials stored them)
    holes: list[str] = field(default_factory=list)


@dataclass
class Estimate:
    """A quantity's estimate on all seeds, its 95% interval (NaN where none), and its draws (..., D)."""

    est: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    draws: np.ndarray = field(repr=False)


@dataclass
class ScalingResult:
    n_seeds: int
    exact: bool  # every multiset of seeds drawn (else random resamples)
    n_draws: int
    e_mode: EMode
    best_lr: np.ndarray  # (S, V, K) index into lrs of the full data's choice (-1: no result)
    edge: np.ndarray  # (S, V, K) bool: that choice is the smallest or largest LR the cell tried
    extended: np.ndarray  # (S, V, K) bool: the cell tried an LR beyond the file's grid
    sizes: np.ndarray  # (S, V) sizes with a result
    size_loss: Estimate  # (S, V, K) best-LR loss per size
    size_diff: Estimate  # (S, V, K) minus the first variant's, at each size
    fitted: np.ndarray  # (S, V) bool: >= EXTRAPOLATE_FROM sizes: the fit and its held-out check are given
    identified: np.ndarray  # (S, V) bool: the fit's E is above E_FLOOR (or given by the E mode's prior)
    alpha: Estimate  # (S, V)
    e: Estimate  # (S, V)
    at: dict[int, Estimate]  # multiple -> L at multiple x the largest run (S, V)
    heldout_pred: Estimate  # (S, V) the largest size predicted by the fit without it
    heldout_meas: Estimate  # (S, V) its measured best-LR loss
    heldout_err: Estimate  # (S, V) (predicted - measured) / measured, in %
    failed: np.ndarray  # (S, V) bool: the error's interval excludes 0
    pairs: list[tuple[int, int]]
    cross: Estimate  # (S, pairs) log10 C of the first crossing (NaN: none in range)
    cross_share: np.ndarray  # (S, pairs) share of draws that cross
    c_min: float
    c_max: float
    params: np.ndarray = field(repr=False)  # (S, V, 3) the full data's fit (a, alpha, e) in log C - scale
    draw_params: np.ndarray = field(repr=False)  # (S, D, V, 3)
    held_params: np.ndarray = field(repr=False)  # (S, V, 3) the fit without each variant's largest size
    prob: np.ndarray = field(repr=False)  # (D,)
    scale: float = 0.0


def _estimate(full: np.ndarray, draws: np.ndarray, prob: np.ndarray, n: int, exact: bool,
              positive: bool = False) -> Estimate:
    """`positive`: a loss, E or alpha, whose interval stops at 0 (the t interval is symmetric)."""
    lo, hi = interval(full, draws, prob, n, exact)
    return Estimate(full, np.maximum(lo, 0) if positive else lo, hi, draws)


def _pick(loss: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each draw of seeds (counts (D, N)), each cell's mean over the drawn seeds at each LR and the best LR:
    returns (best index (S, D, V, K), its mean (S, D, V, K), the drawn seeds' losses at it (S, D, V, K, N))."""
    have = np.isfinite(loss)  # (S, V, K, R, N)
    w = have[:, None] * counts[None, :, None, None, None, :]  # (S, D, V, K, R, N)
    total = w.sum(-1)
    mean = np.einsum("sdvkrn,svkrn->sdvkr", w, np.nan_to_num(loss)) / np.where(total > 0, total, 1)
    mean = np.where(total > 0, mean, np.inf)
    best = np.argmin(mean, -1)  # (S, D, V, K)
    m = np.take_along_axis(mean, best[..., None], -1)[..., 0]
    best = np.where(np.isfinite(m), best, -1)
    m = np.where(np.isfinite(m), m, np.nan)
    at = np.take_along_axis(np.broadcast_to(loss[:, None], w.shape), np.maximum(best, 0)[..., None, None], -2)
    at = at[..., 0, :]
    return best, m, np.where(best[..., None] >= 0, at, np.nan)


def _fit(logl: np.ndarray, wts: np.ndarray, x: np.ndarray, mode: EMode, noise: float, scale: float,
         starts: np.ndarray | None, min_sizes: int) -> np.ndarray:
    """Fit every (study, draw) problem: logl, wts (S, D, V, K, N), x (V, K). Returns (S, D, V, 3), NaN where a
    variant has fewer than min_sizes sizes with weight in that draw."""
    s, d, v, k, n = logl.shape
    xs = np.broadcast_to(x[:, :, None], (v, k, n))
    has = (wts.sum(-1) > 0).sum(-1)  # (S, D, V) sizes present
    if mode.kind != "shared":  # each variant its own E: free, or held near the prior (each variant's own)
        lay = Layout(np.zeros(k * n, int), np.zeros(1, int))
        if mode.kind == "prior" and mode.sd == 0:
            lay = Layout(lay.curve, lay.group, fixed_e=np.array([math.log(mode.mean)]))
        elif mode.kind == "prior":
            lay = Layout(lay.curve, lay.group, prior=(np.array([mode.mean]), np.array([mode.sd]), noise))
        st = hoffmann_starts(scale) if starts is None else np.concatenate(
            [starts[..., None, :], np.broadcast_to(hoffmann_starts(scale)[::10], starts.shape[:-1] + (DRAW_STARTS, 3))],
            -2)
        p = fit_many(xs.reshape(v, k * n), logl.reshape(s, d, v, k * n), wts.reshape(s, d, v, k * n), lay, st)
        out = curve_params(p, lay)[..., 0, :]  # (S, D, V, 3)
    else:
        lay = Layout(np.repeat(np.arange(v), k * n), np.zeros(v, int))  # one E for all variants
        grid = hoffmann_starts(scale, v, 1)
        st = grid if starts is None else np.concatenate([starts[..., None, :], np.broadcast_to(
            grid[::10], starts.shape[:-1] + (DRAW_STARTS, grid.shape[-1]))], -2)
        p = fit_many(xs.reshape(v * k * n), logl.reshape(s, d, v * k * n), wts.reshape(s, d, v * k * n), lay, st)
        out = curve_params(p, lay)  # (S, D, V, 3)
    return np.where((has >= min_sizes)[..., None], out, np.nan)


def _flat_start(params: np.ndarray, mode: EMode) -> np.ndarray:
    """(S, 1, V, 3) full fits -> the starts of the draws' fits in each mode's parameter layout."""
    if mode.kind != "shared":
        return params
    return np.concatenate([params[..., 0], params[..., 1], params[..., :1, 2]], -1)  # (S, 1, 2V + 1)


def analyse(data: ScalingData, mode: EMode | None = None, resamples: int = 200, seed: int = 0) -> ScalingResult:
    """Every figure `ablate scaling` prints, for each study of `data` (module docstring)."""
    mode = mode or EMode()
    loss = np.asarray(data.loss, dtype=float)
    s, v, k, r, n = loss.shape
    counts, prob, exact = seed_draws(n, resamples, seed)
    counts = np.concatenate([np.ones((1, n)), counts])  # draw 0: every seed once (the full data)
    best, mean, at = _pick(loss, counts)  # (S, 1 + D, V, K) ...
    logc = np.log(data.compute)  # (V, K)
    present = np.isfinite(mean[:, 0])  # (S, V, K)
    sizes = present.sum(-1)
    finite = logc[np.isfinite(logc)]
    scale = float(np.median(finite))
    x = np.where(np.isfinite(logc), logc - scale, 0.0)
    logl = np.log(np.where(at > 0, at, np.nan))  # (S, 1 + D, V, K, N)
    wts = np.where(np.isfinite(logl), counts[None, :, None, None, :], 0.0)
    noise = _noise(loss)
    need = 3 if mode.kind == "free" else 2  # a draw's fit needs this many sizes
    full = _fit(logl[:, :1], wts[:, :1], x, mode, noise, scale, None, need)  # (S, 1, V, 3)
    draws = _fit(logl[:, 1:], wts[:, 1:], x, mode, noise, scale, _flat_start(np.nan_to_num(full), mode), need)
    largest = np.where(present, np.arange(k), -1).max(-1)  # (S, V) the largest size with a result
    keep = np.arange(k) != largest[..., None]  # (S, V, K)
    held_w = wts * keep[:, None, :, :, None]
    held_full = _fit(logl[:, :1], held_w[:, :1], x, mode, noise, scale, None, need)
    held_draws = _fit(logl[:, 1:], held_w[:, 1:], x, mode, noise, scale, _flat_start(np.nan_to_num(held_full), mode),
                      need)
    fitted = sizes >= EXTRAPOLATE_FROM  # (S, V)
    smallest = np.nanmin(np.where(present, mean[:, 0], np.nan), -1)  # (S, V)
    identified = (np.exp(full[:, 0, :, 2]) >= E_FLOOR * smallest) | (mode.kind == "prior")
    def est(f: np.ndarray, dr: np.ndarray, positive: bool = True) -> Estimate:  # f (S, ...), dr (S, D, ...)
        return _estimate(f, np.moveaxis(dr, 1, -1), prob, n, exact, positive)


    def curve(p: np.ndarray, gate: np.ndarray) -> np.ndarray:  # NaN where the variant is not fitted
        return np.where(gate[:, None, :, None], p, np.nan)

    pf, pd = curve(full, fitted & identified), curve(draws, fitted & identified)  # (S, 1, V, 3), (S, D, V, 3)
    c_max = float(np.nanmax(data.compute))
    c_min = float(np.nanmin(data.compute))
    at_k = {m: est(_at(pf, m * c_max, scale)[:, 0], _at(pd, m * c_max, scale)) for m in MULTIPLES}
    cmax_v = np.take_along_axis(np.broadcast_to(logc, (s, v, k)), np.maximum(largest, 0)[..., None], -1)[..., 0]
    hf, hd = curve(held_full, fitted), curve(held_draws, fitted)
    pred_f = np.exp(hf[:, 0, :, 2]) + np.exp(hf[:, 0, :, 0] - hf[:, 0, :, 1] * (cmax_v - scale))  # (S, V)
    pred_d = np.exp(hd[..., 2]) + np.exp(hd[..., 0] - hd[..., 1] * (cmax_v[:, None] - scale))  # (S, D, V)
    meas = np.take_along_axis(mean, np.maximum(largest, 0)[:, None, :, None], -1)[..., 0]  # (S, 1 + D, V)
    meas = np.where(fitted[:, None], meas, np.nan)
    err_f = 100 * (pred_f - meas[:, 0]) / meas[:, 0]
    err_d = 100 * (pred_d - meas[:, 1:]) / meas[:, 1:]
    heldout_err = est(err_f, err_d, False)
    failed = fitted & ((heldout_err.lo > 0) | (heldout_err.hi < 0))
    pairs = [(i, j) for i in range(v) for j in range(i + 1, v)]
    lo_c, hi_c = math.log(c_min), math.log(100 * c_max)
    cross_f = np.stack([crossings(pf[:, 0, i], pf[:, 0, j], lo_c, hi_c, scale) for i, j in pairs], -1) if pairs \
        else np.zeros((s, 0))
    cross_d = np.stack([crossings(pd[:, :, i], pd[:, :, j], lo_c, hi_c, scale) for i, j in pairs], -1) if pairs \
        else np.zeros((s, len(prob), 0))
    ok = fitted & identified
    both = np.array([[ok[q, i] and ok[q, j] for i, j in pairs] for q in range(s)]).reshape(s, len(pairs))
    share = np.where(both, np.einsum("sdp,d->sp", np.isfinite(cross_d).astype(float), prob) / prob.sum(), np.nan)
    size_mean = mean.copy()
    diff = size_mean - size_mean[:, :, :1]  # (S, 1 + D, V, K)
    grid = set(data.grid_lrs)
    tried = np.isfinite(loss).any(-1)  # (S, V, K, R)
    lr_idx = np.arange(r)
    lowest = np.where(tried, lr_idx, r).min(-1)
    highest = np.where(tried, lr_idx, -1).max(-1)
    b0 = best[:, 0]
    return ScalingResult(
        n_seeds=n, exact=exact, n_draws=len(prob), e_mode=mode, best_lr=b0,
        edge=(b0 >= 0) & (highest > lowest) & ((b0 == lowest) | (b0 == highest)),
        extended=(tried & ~np.isin(data.lrs, list(grid))[None, None, None]).any(-1) if grid else np.zeros_like(present),
        sizes=sizes, size_loss=est(size_mean[:, 0], size_mean[:, 1:]), size_diff=est(diff[:, 0], diff[:, 1:], False),
        fitted=fitted, identified=identified, alpha=est(pf[:, 0, :, 1], pd[..., 1]),
        e=est(np.exp(pf[:, 0, :, 2]), np.exp(pd[..., 2])),
        at=at_k, heldout_pred=est(pred_f, pred_d), heldout_meas=est(meas[:, 0], meas[:, 1:]), heldout_err=heldout_err,
        failed=failed, pairs=pairs, cross=est(cross_f / math.log(10), cross_d / math.log(10), False), cross_share=share,
        c_min=c_min, c_max=c_max, params=pf[:, 0], draw_params=pd, held_params=hf[:, 0], prob=prob,
        scale=scale)


def _at(p: np.ndarray, c: float, scale: float) -> np.ndarray:
    """L at compute c for parameters (..., 3)."""
    return np.exp(p[..., 2]) + np.exp(p[..., 0] - p[..., 1] * (math.log(c) - scale))


def _noise(loss: np.ndarray) -> float:
    """The pooled standard deviation of log L between seeds of the same (variant, size, LR): the unit of a prior's
    pseudo-observation on E (1% where no cell has two seeds)."""
    logl = np.log(np.where(loss > 0, loss, np.nan))  # (S, V, K, R, N)
    have = np.isfinite(logl)
    m = have.sum(-1, keepdims=True)
    mean = np.where(have, logl, 0).sum(-1, keepdims=True) / np.maximum(m, 1)
    dev = np.where(have, logl - mean, 0) ** 2
    dof = np.maximum(m - 1, 0).sum()
    return float(math.sqrt(dev.sum() / dof)) if dof else 0.01
