"""The one inference model behind `ablate table`, `ablate effects` and `ablate compare`, vectorised over studies
(a leading batch axis `...`) so that the simulations of power.py run these same functions on thousands of
studies at once.

A study's scores y (..., k rows, n seeds), NaN where a (row, seed) trial did not finish; the cells present are
the same in every study of a batch (`mask`, (k, n)).

- Pooled (the default): metric ~ row + seed by least squares, the seed a block (a seed fixes the data order and
  the initialisation of every row alike, Bouthillier et al. 2021), the residual variance sigma^2 pooled over
  every row of the study: a randomised complete block design (Fisher 1935; Montgomery, "Design and Analysis of
  Experiments", ch. 4). With k rows and n shared seeds it has (k - 1)(n - 1) degrees of freedom, where a Welch
  test of one pair has at most 2 (n - 1); a missing (row, seed) cell leaves a design least squares still fits.
  Var(row means) = sigma^2 A (X'X)^+ A'.
- Welch (the fallback, with the reason): each row's own variance over its seeds, Var(mean_r) = s_r^2 / n_r on
  n_r - 1 df (Welch 1947), when the rows share no seeds to block on, or when Bartlett's test (Bartlett 1937)
  says the rows' variances over their seeds differ (p < VARIANCE_CHECK). With 3 to 5 seeds no test can see much
  of a difference in variances: Bartlett's finds one row with 6 times the others' SD in 43% (3 seeds) to 79%
  (5 seeds) of studies without a shared seed part, 15-35% with one (Levene's test, with the median or on the
  pooled model's residuals, in under 30%); docs/significance_power.md gives the size of such a row's test.
- The test set as a sample: a component G (k, k) of the row means' covariance from resampling the test
  sentences (testset.py), on min(sentences, resamples) - 1 df; zero when the inference is conditional on
  the test set.

A contrast c of the row means has the variance sum_k c'V_k c of its components and Satterthwaite's degrees of
freedom (Satterthwaite 1946) (sum_k c'V_k c)^2 / sum_k (c'V_k c)^2 / df_k. Against the baseline the family is
adjusted by Dunnett (pooled; multiple.py) or Holm with Bonferroni intervals (Welch), all pairs by Tukey
(Games-Howell for Welch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import stats

from . import multiple

VARIANCE_CHECK = 0.05  # Bartlett's p below this: the rows' variances differ, pooling them is not safe


@dataclass
class Fit:
    """Row means and the variance components of their estimates for a batch of studies."""

    means: np.ndarray  # (..., k) the model's row means
    parts: list[tuple[np.ndarray, np.ndarray]]  # [(V (..., k, k), df (...))]: Var(means) = sum of the V
    method: str  # "pooled" or "welch"
    estimable: np.ndarray  # (k, k) bool: whether mean_i - mean_j is estimable (the seeds connect the rows)

    def contrasts(self, lin: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Estimates (..., q) and covariance (..., q, q) of the contrasts lin (q, k), and each component's variance
        and degrees of freedom (P, ..., q). A component's covariance is made positive semi-definite (an estimated G
        can have small negative eigenvalues)."""
        est = self.means @ lin.T  # (..., q)
        covs = [psd(lin @ v @ lin.T) for v, _ in self.parts]  # each (..., q, q)
        var = np.stack([np.diagonal(c, axis1=-2, axis2=-1) for c in covs])  # (P, ..., q)
        dfs = np.stack([np.broadcast_to(np.asarray(d, float)[..., None], est.shape) for _, d in self.parts])
        return est, sum(covs), var, dfs


def satterthwaite(var: np.ndarray, dfs: np.ndarray) -> np.ndarray:
    """(sum_k v_k)^2 / sum_k v_k^2 / df_k over the components (axis 0) (Satterthwaite 1946); inf when every
    component with a variance is known (infinite df), NaN without any variance."""
    total = var.sum(0)
    with np.errstate(divide="ignore", invalid="ignore"):
        df = total**2 / np.where(var > 0, var**2 / dfs, 0.0).sum(0)
    return np.where(total > 0, df, np.nan)


def psd(cov: np.ndarray) -> np.ndarray:
    """cov (..., q, q) with its negative eigenvalues set to 0 (NaN stays NaN)."""
    if not np.isfinite(cov).all():
        return cov
    w, v = np.linalg.eigh((cov + np.swapaxes(cov, -1, -2)) / 2)
    return (v * np.clip(w, 0, None)[..., None, :]) @ np.swapaxes(v, -1, -2)


def block_design(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The design X (cells, k + n - 1) of metric ~ row + seed over the cells present (row indicators, then the
    seeds but the first), and A (k, k + n - 1), which maps the coefficients to each row's mean over all n seeds."""
    k, n = mask.shape
    rows, seeds = np.nonzero(mask)
    x = np.zeros((len(rows), k + n - 1))
    x[np.arange(len(rows)), rows] = 1.0
    later = seeds > 0
    x[np.arange(len(rows))[later], k + seeds[later] - 1] = 1.0
    a = np.hstack([np.eye(k), np.full((k, n - 1), 1.0 / n)])
    return x, a


def pooled(y: np.ndarray, mask: np.ndarray) -> tuple[Fit, np.ndarray, np.ndarray]:
    """metric ~ row + seed by least squares: its Fit, the residuals (..., k, n) (NaN where absent) and sigma^2
    (...)."""
    x, a = block_design(mask)
    pinv = np.linalg.pinv(x)  # (p, cells)
    cells = y[..., mask]  # (..., cells) in np.nonzero's order
    beta = cells @ pinv.T  # (..., p)
    resid = cells - beta @ x.T  # (..., cells)
    df = int(mask.sum()) - int(np.linalg.matrix_rank(x))
    sigma2 = (resid**2).sum(-1) / df if df > 0 else np.full(y.shape[:-2], np.nan)
    m = a @ np.linalg.pinv(x.T @ x) @ a.T  # (k, k)
    row_space = pinv @ x  # (p, p): a contrast c of the coefficients is estimable iff c @ row_space == c
    diffs = a[:, None, :] - a[None, :, :]  # (k, k, p) mean_i - mean_j
    estimable = np.isclose(diffs @ row_space, diffs, atol=1e-8).all(-1)  # (k, k)
    full = np.full(y.shape, np.nan)
    full[..., mask] = resid
    fit = Fit(beta @ a.T, [(sigma2[..., None, None] * m, np.full(y.shape[:-2], float(df)))], "pooled", estimable)
    return fit, full, sigma2


def welch(y: np.ndarray, mask: np.ndarray) -> Fit:
    """Each row's mean over its seeds and its own variance s_r^2 / n_r on n_r - 1 df (NaN under 2 seeds)."""
    k = mask.shape[0]
    n = mask.sum(1)  # (k,)
    means = np.nanmean(np.where(mask, y, np.nan), -1)  # (..., k)
    with np.errstate(invalid="ignore", divide="ignore"):
        var = np.nansum((np.where(mask, y, np.nan) - means[..., None]) ** 2, -1) / (n - 1)  # (..., k)
    var = np.where(n > 1, var, np.nan)
    parts = []
    for r in range(k):
        v = np.zeros(y.shape[:-2] + (k, k))
        v[..., r, r] = var[..., r] / n[r]
        parts.append((v, np.full(y.shape[:-2], float(n[r] - 1))))
    return Fit(means, parts, "welch", np.ones((k, k), bool))


def bartlett(y: np.ndarray) -> np.ndarray:
    """Bartlett's test (Bartlett 1937; scipy.stats.bartlett) that the rows of y (..., k, n), NaN where absent,
    have one variance over their seeds: its p-value (...); NaN with fewer than 2 rows of 2 values. A row that
    does not vary while another does gives p = 0 (the variances differ); none varying gives NaN."""
    present = np.isfinite(y)
    n = present.sum(-1)  # (..., k)
    rows = n >= 2
    with np.errstate(invalid="ignore", divide="ignore"):
        v = np.nansum((y - np.nanmean(y, -1, keepdims=True)) ** 2, -1) / (n - 1)  # (..., k)
        k = rows.sum(-1)
        dof = np.where(rows, n - 1, 0)
        total = dof.sum(-1)
        sp = np.where(rows, dof * v, 0).sum(-1) / total
        log_v = np.where(rows, np.log(np.where(rows, v, 1.0)), 0.0)
        stat = (total * np.log(sp) - (dof * log_v).sum(-1)) / (
            1 + (np.where(rows, 1 / np.maximum(dof, 1), 0).sum(-1) - 1 / total) / (3 * (k - 1)))
        p = stats.chi2.sf(stat, k - 1)
    return np.where((k >= 2) & (sp > 0), np.where(np.isnan(stat), 0.0, p), np.nan)


def with_test_set(fit: Fit, g: np.ndarray | None, df: float = math.inf) -> Fit:
    """The fit with the test set's sampling covariance G (..., k, k) added, known (infinite df: it rests on the
    hundreds of test sentences, where the seed part rests on a few seeds)."""
    if g is None:
        return fit
    return Fit(fit.means, fit.parts + [(g, np.full(g.shape[:-2], float(df)))], fit.method, fit.estimable)


@dataclass
class Tested:
    """A family of contrasts tested together: each (..., q)."""

    estimate: np.ndarray
    se: np.ndarray
    df: np.ndarray  # of the part of the variance estimated from the seeds
    p_raw: np.ndarray  # each alone: 2 P(T_df > |t|)
    p: np.ndarray  # adjusted for the family (Dunnett, Tukey or Holm), or p_raw when uncorrected
    low: np.ndarray  # the interval (simultaneous when adjusted); NaN when not asked for
    high: np.ndarray
    critical: np.ndarray  # (..., q) the multiplier of se that gives the interval
    adjust: str  # "dunnett", "tukey", "holm" (Bonferroni intervals) or "none"


def family(fit: Fit, lin: np.ndarray, adjust: str, level: float = 0.95, intervals: bool = True,
           skip_above: float | None = None) -> Tested:
    """Test the contrasts lin (q, k) as one family. adjust: "dunnett" (many-to-one; pooled fits), "tukey" (all
    pairs of the rows lin compares: lin's rows must be every pair), "holm", or "none". skip_above (simulations):
    Dunnett's p is computed only where the unadjusted p is below it, and is the unadjusted p elsewhere (a lower
    bound, above skip_above: a decision at a level below skip_above is the same)."""
    est, cov, var, dfs = fit.contrasts(lin)
    se = np.sqrt(np.diagonal(cov, axis1=-2, axis2=-1))  # (..., q)
    scale = 1.0 + np.max(np.abs(np.nan_to_num(fit.means)), -1, keepdims=True)  # (..., 1)
    se = np.where(se > 1e-9 * scale, se, 0.0)  # rounding left of a variance that is 0: no variance, no test
    # the degrees of freedom of the part estimated from the seeds (the test set's part counts as known): the t
    # statistic of the whole variance on these is conservative whatever the two parts' shares
    estimated = np.isfinite(dfs)  # (P, ..., q)
    v_seed = np.where(estimated, var, 0.0).sum(0)
    nu = satterthwaite(np.where(estimated, var, 0.0), np.where(estimated, dfs, 1.0))
    nu = np.where(v_seed > 0, nu, np.inf)
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where(se > 0, est / se, np.nan)
    p_raw = 2 * stats.t.sf(np.abs(t), nu)
    q = lin.shape[0]
    crit = np.full(est.shape, np.nan)
    if adjust == "dunnett":
        nu_f = np.min(np.where(np.isfinite(t), nu, np.inf), -1) if q else np.array(np.nan)  # one df: the pooled
        with np.errstate(divide="ignore", invalid="ignore"):
            corr = np.nan_to_num(cov / (se[..., :, None] * se[..., None, :]))
        todo = np.isfinite(t) if skip_above is None else p_raw < skip_above  # (..., q)
        p = p_raw.copy()
        if todo.any():  # each comparison's bound alone: (P,) of them, each with its study's correlation and df
            study = np.nonzero(todo)[:-1]
            nus = np.broadcast_to(nu_f, todo.shape[:-1])[study]
            p[todo] = multiple.dunnett_p(t[todo][:, None], corr[study], nus)[:, 0]
        if intervals:
            crit = _each(lambda c, v: multiple.dunnett_critical(c, v, level), corr, nu_f, est.shape)
    elif adjust == "tukey":
        k = int(round((1 + math.sqrt(1 + 8 * q)) / 2))  # q = k (k - 1) / 2 pairs
        # Games-Howell: each pair on its own Welch df; pooled: one df (the smallest Satterthwaite's gives)
        df = satterthwaite(var, dfs)
        nu = df if fit.method == "welch" else np.broadcast_to(np.nanmin(df, -1, keepdims=True), df.shape)
        p = multiple.tukey_p(t, k, nu)
        if intervals:
            crit = np.vectorize(lambda v: multiple.tukey_critical(k, v, level) if np.isfinite(v) else np.nan)(nu)
    elif adjust == "holm":
        p = multiple.holm(p_raw)
        tests = np.isfinite(p_raw).sum(-1, keepdims=True)
        crit = stats.t.isf((1 - level) / (2 * np.maximum(tests, 1)), nu)  # Bonferroni: simultaneous, Holm's 1st
    else:
        p = p_raw
        crit = stats.t.isf((1 - level) / 2, nu)
    p = np.where(np.isfinite(t), p, np.nan)
    half = crit * se
    return Tested(est, se, nu, p_raw, p, est - half, est + half, crit, adjust)


def _each(fn, corr: np.ndarray, nu: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """fn(corr, nu) of every study in the batch, broadcast over its q contrasts (NaN where nu is not a positive
    number of degrees of freedom)."""
    flat_c, flat_n = corr.reshape((-1,) + corr.shape[-2:]), np.asarray(nu, float).reshape(-1)
    out = np.array([fn(c, v) if v > 0 and not np.isnan(v) else np.nan for c, v in zip(flat_c, flat_n, strict=True)])
    return np.broadcast_to(out.reshape(np.shape(nu))[..., None], shape).copy()


def versus(k: int, base: int, rows: list[int]) -> np.ndarray:
    """The contrasts (len(rows), k) mean_r - mean_base."""
    lin = np.zeros((len(rows), k))
    lin[np.arange(len(rows)), rows] = 1.0
    lin[:, base] -= 1.0
    return lin


def pairs(rows: list[int], k: int) -> tuple[list[tuple[int, int]], np.ndarray]:
    """Every pair (i, j), i before j, of `rows` and the contrasts (pairs, k) mean_j - mean_i."""
    out = [(i, j) for a, i in enumerate(rows) for j in rows[a + 1:]]
    lin = np.zeros((len(out), k))
    for m, (i, j) in enumerate(out):
        lin[m, j], lin[m, i] = 1.0, -1.0
    return out, lin


def choose(y: np.ndarray, mask: np.ndarray) -> tuple[Fit | None, Fit, np.ndarray, np.ndarray, str]:
    """The pooled fit (None when the seeds cannot carry it), the Welch fit, per study whether the pooled one is
    used (...), Bartlett's p (...), and why it is not when the reason is the design's (the same for the batch)."""
    wel = welch(y, mask)
    none = np.zeros(y.shape[:-2], bool)
    nan = np.full(y.shape[:-2], np.nan)
    if (mask.sum(0) >= 2).sum() < 2:
        return None, wel, none, nan, "the rows do not share their seeds: no 2 seeds that 2 rows both have"
    pool, _, _ = pooled(y, mask)
    if not pool.estimable.all():
        return None, wel, none, nan, "the rows do not share their seeds: the seeds do not connect every row"
    if pool.parts[0][1].reshape(-1)[0] < 1:
        return None, wel, none, nan, "no residual degrees of freedom"
    p = bartlett(np.where(mask, y, np.nan))
    return pool, wel, ~(p < VARIANCE_CHECK), p, ""


def merge(use: np.ndarray, a: Tested, b: Tested) -> Tested:
    """Per study, a where use else b."""
    pick = {f: np.where(use[..., None], getattr(a, f), getattr(b, f)) for f in
            ("estimate", "se", "df", "p_raw", "p", "low", "high", "critical")}
    return Tested(**pick, adjust=a.adjust if use.all() else b.adjust if not use.any() else "mixed")


def against_baseline(y: np.ndarray, mask: np.ndarray, base: int, g: np.ndarray | None = None,
                     correction: str = "dunnett", level: float = 0.95, intervals: bool = True,
                     skip_above: float | None = None) -> tuple[Tested, np.ndarray, np.ndarray, str]:
    """Every other row of y (..., k, n) against row `base`: the family's Tested (..., k - 1 contrasts in row
    order), per study whether the pooled model was used, Bartlett's p, and the design's reason when it was not."""
    k = mask.shape[0]
    lin = versus(k, base, [r for r in range(k) if r != base])
    pool, wel, use, p_check, why = choose(y, mask)
    welch_t = family(with_test_set(wel, g), lin, "none" if correction == "none" else "holm", level, intervals)
    if pool is None:
        return welch_t, use, p_check, why
    pool_t = family(with_test_set(pool, g), lin, correction, level, intervals and bool(use.any()), skip_above)
    return merge(use, pool_t, welch_t), use, p_check, why
