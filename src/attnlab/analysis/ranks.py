"""Do two studies rank their variants alike? Kendall's tau-b (Kendall 1945) and Spearman's rho between the variants'
scores, with permutation p-values (exact up to EXACT_UP_TO variants, Monte Carlo above; rank_correlation) and
percentile intervals from resampling each study's seeds (rank_intervals), withheld under MIN_SEEDS seeds.
Used by `ablate compare` (transfer.py) and `ablate scaling`'s comparison of sizes (scaling_report.py)."""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import numpy as np
from scipy import stats

MIN_SEEDS = 5  # fewer seeds in a study: no interval (resampling 2-4 seeds covers the true tau and rho too rarely)
MIN_RANKED = 5  # fewer shared variants: no p-value (3 or 4 items cannot reach p < 0.05 two-sided with tau's ties)
EXACT_UP_TO = 9  # every permutation (9! = 362,880: 0.3-0.4 s) up to this many items; Monte Carlo ones above
MONTE_CARLO = 20_000  # random orders above EXACT_UP_TO (rank_correlation)
MONTE_CARLO_SEED = 0


def withheld(seeds: dict[str, int]) -> str:
    """Why rank_intervals is not used for studies with these numbers of seeds ({name: seeds}), or "". A percentile
    interval from resampling a handful of seeds is too narrow: it covers the true tau and rho in 59-89% of
    studies with 2-5 seeds (issue 41's simulation)."""
    few = {k: n for k, n in seeds.items() if n < MIN_SEEDS}
    if not few:
        return ""
    return (f"fewer than {MIN_SEEDS} seeds in " + ", ".join(f"{k} ({n})" for k, n in few.items()) +
            ": an interval from resampling so few seeds covers the true tau and rho too rarely")


def rank_intervals(a: np.ndarray, b: np.ndarray, resamples: int, seed: int, level: float = 0.95
                   ) -> dict[str, tuple[float, float]] | None:
    """Percentile intervals of Kendall's tau-b and Spearman's rho between two studies' variant scores, over their
    seeds: `a` (variants, seeds of study a) and `b` (variants, seeds of study b), NaN where a variant lacks a
    seed. Each resample draws each study's seeds with replacement (`default_rng(seed)`: a's indices (resamples,
    seeds of a), then b's), scores every variant by its mean over the drawn seeds it has, and ranks them; a
    resample in which some variant has none of the drawn seeds is left out. None when neither study has 2 seeds
    (no seed noise to resample)."""
    if a.shape[1] < 2 and b.shape[1] < 2:
        return None
    rng = np.random.default_rng(seed)
    idx_a, idx_b = rng.integers(0, a.shape[1], (resamples, a.shape[1])), rng.integers(0, b.shape[1],
                                                                                      (resamples, b.shape[1]))
    taus, rhos = [], []
    with warnings.catch_warnings():  # all-NaN slices are the resamples left out; tied resamples give NaN
        warnings.simplefilter("ignore", RuntimeWarning)
        warnings.simplefilter("ignore", stats.ConstantInputWarning)
        xs, ys = np.nanmean(a[:, idx_a], axis=2), np.nanmean(b[:, idx_b], axis=2)  # (variants, resamples) each
        for x, y in zip(xs.T, ys.T, strict=True):
            if np.isnan(x).any() or np.isnan(y).any():
                continue
            taus.append(stats.kendalltau(x, y).statistic)  # NaN where a resample ties every variant
            rhos.append(stats.spearmanr(x, y).statistic)
        q = [(1 - level) / 2, (1 + level) / 2]  # NaN bounds where no resample gives a statistic
        return {"tau": tuple(float(v) for v in np.nanquantile(taus, q)) if taus else (math.nan, math.nan),
                "rho": tuple(float(v) for v in np.nanquantile(rhos, q)) if rhos else (math.nan, math.nan)}


def correlation_text(r: dict, ci: dict | None, name: str) -> str:
    """`r[name]` (tau or rho, from rank_correlation) as printed, with its rank_intervals CI where it has one;
    "undefined" where every score of one side ties."""
    out = "undefined" if math.isnan(r[name]) else f"{r[name]:+.3f}"
    if ci and not math.isnan(ci[name][0]):
        out += f" [95% CI {ci[name][0]:+.2f}, {ci[name][1]:+.2f}]"
    return out


def all_orders(n: int) -> np.ndarray:
    """(n!, n) every permutation of range(n), as int8: the orders of range(k) with k inserted at each place."""
    orders = np.zeros((1, 0), dtype=np.int8)
    for k in range(n):
        orders = np.concatenate([np.insert(orders, place, k, axis=1) for place in range(k + 1)])
    return orders


def permutation_stats(x: np.ndarray, y: np.ndarray, orders: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Kendall's tau-b and Spearman's rho of x against y reordered by each row of `orders` (k, n) of indices."""
    n = len(x)
    i, j = np.triu_indices(n, 1)  # the n(n-1)/2 pairs
    sx, sy = np.sign(x[i] - x[j]), np.sign(y[:, None] - y[None, :])  # (P,), (n, n)
    syp = sy.ravel()[orders[:, i].astype(np.int32) * n + orders[:, j]]  # (k, P); y's ties: the same in every order
    # tau-b (Kendall 1945): tied pairs leave the numerator and shrink the denominator
    taus = (syp @ sx) / math.sqrt(np.count_nonzero(sx) * np.count_nonzero(sy[i, j]))  # (k,)
    rx, ry = stats.rankdata(x), stats.rankdata(y)  # average ranks for ties; an order permutes y's ranks
    rxc, ryc = rx - rx.mean(), ry - ry.mean()
    rhos = (ryc[orders] @ rxc) / math.sqrt((rxc**2).sum() * (ryc**2).sum())  # (k,) Pearson of the ranks
    return taus, rhos


def rank_correlation(x: Sequence[float], y: Sequence[float]) -> dict:
    """Kendall's tau-b and Spearman's rho of the paired scores x, y, each with a two-sided permutation p-value: the
    share of orders of y whose |statistic| reaches the observed one. Up to EXACT_UP_TO items every one of the n!
    orders (exact); above, MONTE_CARLO random orders from default_rng(MONTE_CARLO_SEED), p = (b + 1) / (m + 1)
    with b of the m orders reaching it (Phipson & Smyth 2010, "Permutation p-values should never be zero"; its
    Monte Carlo SE at p = 0.05 is 0.0015). scipy's asymptotic p-values are not used: its Spearman t-approximation
    rejects 5.9% at alpha 0.05 with 9 items, and gives rho = 1 with p = 0 for 3, where the exact p is 1/3.
    None (`why` says why): under MIN_RANKED items, or every score tied on one side (tau and rho undefined)."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    n = len(x)
    out = {"n": n, "tau": math.nan, "rho": math.nan, "tau_p": None, "rho_p": None, "p_method": None, "why": ""}
    if n >= 2 and (np.ptp(x) == 0 or np.ptp(y) == 0):
        out["why"] = "no p-value: all scores tied in one study (or size): tau and rho are undefined"
        return out
    tau, rho = stats.kendalltau(x, y).statistic, stats.spearmanr(x, y).statistic
    out.update(tau=float(tau), rho=float(rho))
    if n < MIN_RANKED:
        out["why"] = f"no p-value with {n} shared variants (fewer than {MIN_RANKED})"
        return out
    eps = 1e-12  # the observed order itself reaches the observed statistic; float noise must not drop it
    if n <= EXACT_UP_TO:
        taus, rhos = permutation_stats(x, y, all_orders(n))
        out.update(tau_p=float(np.mean(np.abs(taus) >= abs(tau) - eps)),
                   rho_p=float(np.mean(np.abs(rhos) >= abs(rho) - eps)),
                   p_method=f"exact permutation p-values ({len(taus):,} orders)")
        return out
    rng, reach = np.random.default_rng(MONTE_CARLO_SEED), np.zeros(2)
    for k in range(0, MONTE_CARLO, 10_000):  # chunks of orders: (chunk, n(n-1)/2) signs at a time
        orders = rng.permuted(np.tile(np.arange(n), (min(10_000, MONTE_CARLO - k), 1)), axis=1)  # (chunk, n)
        taus, rhos = permutation_stats(x, y, orders)
        reach += [np.sum(np.abs(taus) >= abs(tau) - eps), np.sum(np.abs(rhos) >= abs(rho) - eps)]
    tau_p, rho_p = (reach + 1) / (MONTE_CARLO + 1)
    out.update(tau_p=float(tau_p), rho_p=float(rho_p),
               p_method=f"Monte Carlo permutation p-values ({MONTE_CARLO:,} random orders, seed {MONTE_CARLO_SEED})")
    return out
