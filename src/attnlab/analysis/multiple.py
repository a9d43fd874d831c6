"""Multiple comparisons of a family of contrasts that share one model, and the power a family has.

- Many-to-one (every row against the baseline): Dunnett's single-step procedure (Dunnett 1955, "A multiple
  comparison procedure for comparing several treatments with a control", JASA 50:1096-1121). With
  T_i = estimate_i / se_i jointly multivariate t (correlation R, df nu), the adjusted p of comparison j is
  P(max_i |T_i| >= |t_j|), and the simultaneous interval is estimate ± c se with P(max_i |T_i| <= c) = 1 - alpha,
  so an interval excludes 0 exactly when its adjusted p is below alpha. `scipy.stats.dunnett` is the reference
  (tests/test_ablate_inference.py); it integrates by randomised quasi-Monte Carlo, this module by quadrature:
  R is taken as one factor, R_ij = lambda_i lambda_j (Hsu 1992, "The factor analytic approach to simultaneous
  inference in the general linear model", J. Comput. Graph. Stat. 1:151-168), exact for Dunnett's one-way design
  and for a complete block design (R_ij = 1/2), a close fit otherwise. Then T_i = (lambda_i Z_0 +
  sqrt(1 - lambda_i^2) E_i) / S with Z_0, E_i standard normal and S = sqrt(chi2_nu / nu), and
      P(max_i |T_i| <= c) = E_S E_Z0 prod_i [Phi((c S - lambda_i Z_0) / s_i) - Phi((-c S - lambda_i Z_0) / s_i)],
  s_i = sqrt(1 - lambda_i^2): the trapezoid rule over Z_0 (the integrand is even in Z_0: step 0.25 on [0, 8]) and
  tanh-sinh nodes over the quantile of S (Takahasi & Mori 1974): |error| < 1e-6 for nu >= 2, 3e-5 at nu = 1
  (tests/test_ablate_inference.py). Loadings above 0.95 are taken as 0.95 (the probability grows with each
  loading, Sidak 1968, so that only widens the interval a little).
  Deterministic and vectorised over studies (the simulations in power.py run thousands at once).
- All pairs: Tukey's studentized range (Tukey 1953; Kramer 1956 for unequal n; Games & Howell 1976 with each
  pair's own Welch degrees of freedom), p = P(Q_{k,nu} >= sqrt(2) |t|) (scipy.stats.studentized_range;
  `scipy.stats.tukey_hsd` is the reference).
- Step-down Holm (Holm 1979, "A simple sequentially rejective multiple test procedure"), for families without
  one shared variance (Welch's fallback, sacreBLEU's per-seed bootstrap).
- The minimum detectable difference: the smallest |Delta| that a two-sided test at critical value c finds with
  80% power, from the noncentral t distribution (Cohen 1988, ch. 2).
"""

from __future__ import annotations

import math

import numpy as np
from scipy import optimize, special, stats

_Z = np.arange(33) * 0.25  # (33,) trapezoid nodes over Z_0 >= 0; each weight doubled for -Z_0 but Z_0 = 0's
_WZ = 0.25 * stats.norm.pdf(_Z) * np.where(_Z > 0, 2.0, 1.0)  # (33,)
_T = np.arange(-15, 16) * 0.2  # (31,) tanh-sinh: u = (1 + tanh(pi/2 sinh t)) / 2, the quantile of S
_U, _UBAR = special.expit(np.pi * np.sinh(_T)), special.expit(-np.pi * np.sinh(_T))  # u and 1 - u, both exact
_WU = 0.2 * _U * _UBAR * np.pi * np.cosh(_T)  # (31,) du/dt times the step
MAX_LAMBDA = 0.95  # a loading near 1 makes s_i 0 and the integrand a step the nodes cannot follow


def one_factor(corr: np.ndarray, iterations: int = 200) -> np.ndarray:
    """lambda (..., q) with corr_ij ~ lambda_i lambda_j off the diagonal, least squares (Hsu 1992): exact when
    corr has that form (q <= 2 always does). corr: (..., q, q)."""
    corr = np.asarray(corr, dtype=float)
    q = corr.shape[-1]
    off = corr * (1 - np.eye(q))  # (..., q, q) the diagonal left out
    if q == 1:
        return np.zeros(corr.shape[:-1])
    if q == 2:
        r = off[..., 0, 1]
        root = np.sqrt(np.abs(r))
        return np.stack([root, np.sign(r) * root], -1).clip(-MAX_LAMBDA, MAX_LAMBDA)
    if q == 3:  # three equations in three loadings: lambda_1^2 = r_12 r_13 / r_23, ... (all positive)
        r12, r13, r23 = off[..., 0, 1], off[..., 0, 2], off[..., 1, 2]
        if (np.minimum(np.minimum(r12, r13), r23) > 1e-6).all():
            return np.sqrt(np.stack([r12 * r13 / r23, r12 * r23 / r13, r13 * r23 / r12], -1)).clip(0, MAX_LAMBDA)
    lam = np.sqrt(np.clip(off.sum((-1, -2)) / (q * (q - 1)), 1e-4, None))[..., None].repeat(q, -1)  # (..., q)
    for _ in range(iterations):  # lambda_i = sum_j r_ij lambda_j / sum_j lambda_j^2 (j != i), damped
        new = (off @ lam[..., None])[..., 0] / np.clip((lam**2).sum(-1, keepdims=True) - lam**2, 1e-12, None)
        if np.allclose(new, lam, atol=1e-12, rtol=0):
            break
        lam = (lam + new) / 2
    return lam.clip(-MAX_LAMBDA, MAX_LAMBDA)


def _scale_nodes(df: np.ndarray) -> np.ndarray:
    """S = sqrt(chi2_df / df) at the quantile nodes: (..., S_NODES); 1 where df is infinite (a known variance)."""
    df = np.asarray(df, dtype=float)[..., None]
    finite = np.isfinite(df)
    nu = np.where(finite, df, 1.0)
    x = np.where(_U < 0.5, stats.chi2.ppf(_U, nu), stats.chi2.isf(_UBAR, nu))  # (..., 45) each tail exactly
    return np.where(finite, np.sqrt(x / nu), 1.0)


def max_abs_t_cdf(c: np.ndarray, lam: np.ndarray, df: np.ndarray) -> np.ndarray:
    """P(max_i |T_i| <= c) for each bound in c (..., m), T (..., q) multivariate t with correlation
    lambda_i lambda_j (lam: (..., q)) and df (...)."""
    c, lam = np.asarray(c, dtype=float), np.asarray(lam, dtype=float)
    if lam.shape[-1] == 1:  # one comparison: Student's t itself
        return 1 - 2 * stats.t.sf(c, np.asarray(df, dtype=float)[..., None])
    s = _scale_nodes(df)[..., None, :, None, None]  # (..., 1, S, 1, 1)
    sd = np.sqrt(1 - lam**2)[..., None, None, None, :]  # (..., 1, 1, 1, q)
    shift = lam[..., None, None, None, :] * _Z[:, None]  # (..., 1, 1, Z, q)
    cs = c[..., :, None, None, None] * s  # (..., m, S, 1, 1)
    inside = special.ndtr((cs - shift) / sd) - special.ndtr((-cs - shift) / sd)  # (..., m, S, Z, q)
    return (np.prod(inside, -1) @ _WZ) @ _WU  # (..., m)


def dunnett_p(t: np.ndarray, corr: np.ndarray, df: np.ndarray) -> np.ndarray:
    """Adjusted two-sided p-values (..., m) of the t statistics (..., m) in a family of q comparisons (corr:
    (..., q, q)): P(max_i |T_i| >= |t_j|)."""
    t = np.abs(np.asarray(t, dtype=float))
    p = 1 - max_abs_t_cdf(np.nan_to_num(t), one_factor(corr), df)
    return np.where(np.isnan(t), np.nan, np.clip(p, 0.0, 1.0))


def dunnett_critical(corr: np.ndarray, df: float, level: float = 0.95) -> float:
    """c with P(max_i |T_i| <= c) = level: the simultaneous interval's multiplier of se."""
    lam = one_factor(corr)
    return float(optimize.brentq(lambda c: max_abs_t_cdf(np.array([c]), lam, df)[0] - level, 0.0, 100.0,
                                 xtol=1e-10))


def tukey_p(t: np.ndarray, k: int, df: np.ndarray) -> np.ndarray:
    """Tukey-Kramer (Games-Howell with Welch df) adjusted p of pairwise t statistics among k means."""
    t = np.abs(np.asarray(t, dtype=float))
    return np.where(np.isnan(t), np.nan, stats.studentized_range.sf(np.nan_to_num(t) * math.sqrt(2), k, df))


def tukey_critical(k: int, df: float, level: float = 0.95) -> float:
    """The multiplier of a pair's se that gives simultaneous intervals for all k (k - 1) / 2 pairs."""
    return float(stats.studentized_range.ppf(level, k, df) / math.sqrt(2))


def holm(p: np.ndarray) -> np.ndarray:
    """Holm's step-down adjusted p-values along the last axis (..., q): the i-th smallest of the m finite ones
    times (m - i + 1), made monotone, at most 1; a p that is not finite (no test) stays NaN and is not counted."""
    p = np.asarray(p, dtype=float)
    finite = np.isfinite(p)
    m = finite.sum(-1, keepdims=True)  # (..., 1)
    order = np.argsort(np.where(finite, p, np.inf), -1, kind="stable")  # (..., q) finite ones first, ascending
    ranked = np.take_along_axis(np.where(finite, p, np.nan), order, -1)
    scaled = np.minimum(1.0, (m - np.arange(p.shape[-1])) * ranked)  # (..., q)
    running = np.fmax.accumulate(np.nan_to_num(scaled, nan=-1.0), -1)  # monotone over the finite prefix
    out = np.empty_like(p)
    np.put_along_axis(out, order, running, -1)
    return np.where(finite, out, np.nan)


def power(nc: np.ndarray, df: float, critical: float) -> np.ndarray:
    """P(|T| > critical) for T = (Z + nc) / S, S = sqrt(chi2_df / df), the noncentral t: the chance that a test
    rejecting at |estimate / se| > critical finds a true difference of nc standard errors. By the same nodes over S
    as max_abs_t_cdf (scipy's nct is NaN for some large nc)."""
    s = _scale_nodes(np.asarray(df, dtype=float))  # (S,)
    nc = np.asarray(nc, dtype=float)[..., None]
    return (special.ndtr(nc - critical * s) + special.ndtr(-nc - critical * s)) @ _WU


def detectable(se: float, df: float, critical: float, target: float = 0.8) -> float:
    """The smallest true difference that a test rejecting at |estimate / se| > critical finds with this power:
    power(delta / se) = target, solved for delta."""
    if not (se > 0 and df > 0 and math.isfinite(critical)):
        return math.nan
    high = critical + 4.0
    while power(high, df, critical) < target:  # heavy tails of few df: widen until the power is reached
        high *= 2
    return float(se * optimize.brentq(lambda nc: float(power(nc, df, critical)) - target, 0.0, high, xtol=1e-10))
