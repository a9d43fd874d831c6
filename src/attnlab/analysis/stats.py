"""Is a difference against the baseline real? The tests the tables use:

- BLEU and chrF with hypotheses, headline p and 95% CI of Δ: Welch's t-test over the seeds both rows have, on
  each seed's corpus score (sacreBLEU, the same test sentences for every seed and row). Each seed's corpus
  score already holds its own sentence noise, so the spread over seeds carries both sources of noise, seed to
  seed and sentence to sentence. It holds its size with 3 and 5 seeds at any seed SD (tests/test_ablate_stats.py
  simulates null studies); resampling the sentences of the concatenated seeds does not (it ignores the seed
  variance: 40-70% false positives at a seed SD of 1.3-3 BLEU). Dror et al. 2018 ("The Hitchhiker's Guide to
  Testing Statistical Significance in NLP"), Reimers & Gurevych 2017 (compare score distributions over seeds).
- Beside it, per seed: sacreBLEU's own paired bootstrap (`sacrebleu.significance.PairedTest`, test_type "bs";
  Koehn 2004): the p-value that `sacrebleu REF -i BASE SYS --paired-bs --paired-bs-n N` prints with
  SACREBLEU_SEED=seed. It measures sentence noise only, for that one seed's pair of models.
- Metrics without hypotheses (loss, perplexity, a logged val/ curve): over the seeds, Welch's t-test and the CI
  of the difference of the means on Welch-Satterthwaite's degrees of freedom (scipy.stats.ttest_ind); a mean's
  CI is a t interval.
- Several rows against one baseline: Holm's step-down correction (Holm 1979), when the file asks for it, over
  the rows that have a test (a row without one, e.g. every score of both rows the same, is not in the family).
- Rank correlation between two studies' variants (effects.py, scaling_report.py): Kendall's tau-b and Spearman's
  rho with permutation p-values, exact up to EXACT_UP_TO variants and Monte Carlo above (rank_correlation).
- Main effects and interactions of a grid (effects.py): ordinary least squares of the metric on the factors and
  the seed (a fixed effect), and the estimated marginal means of that model (Searle, Speed & Milliken 1980,
  "Population marginal means in the linear model"), with t intervals on the residual degrees of freedom.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import sacrebleu
from sacrebleu.metrics import BLEU, CHRF
from sacrebleu.significance import PairedTest, _bootstrap_resample
from scipy import stats


def scorer(metric: str, signature: str = "") -> BLEU | CHRF:
    """sacreBLEU's BLEU or chrF as the final evaluation's `signature` says: BLEU with the tokenizer of its `tok:`
    field (the one the target language picked, bleu.sacrebleu_bleu), so that resampling scores as it did."""
    if metric == "chrf":
        return CHRF()
    tok = dict(f.split(":", 1) for f in signature.split("|") if ":" in f).get("tok")
    return BLEU(tokenize=tok) if tok else BLEU()


@dataclass
class Comparison:
    """A row against the baseline: the p-value and the 95% CI of (row - baseline)."""

    method: str  # "Welch over seed scores" (hypotheses stored) or "Welch"
    p_value: float
    ci_low: float
    ci_high: float
    per_seed: dict[int, float] = field(default_factory=dict)  # sacreBLEU paired-bootstrap p of each shared seed
    per_seed_ci: dict[int, tuple[float, float]] = field(default_factory=dict)  # its 95% percentile interval
    seeds: tuple[int, ...] = ()  # the seeds it was computed on
    p_holm: float | None = None


@contextmanager
def sacrebleu_seed(seed: int) -> Iterator[None]:
    """sacreBLEU reads its resampling seed from the environment (SACREBLEU_SEED), as its command line does."""
    before = os.environ.get("SACREBLEU_SEED")
    os.environ["SACREBLEU_SEED"] = str(seed)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("SACREBLEU_SEED", None)
        else:
            os.environ["SACREBLEU_SEED"] = before


def paired_bootstrap(base_hyps: Sequence[str], hyps: Sequence[str], refs: Sequence[str], metric: str,
                     resamples: int, seed: int, signature: str = "") -> tuple[float, float, float]:
    """(p-value, CI low, CI high) of metric(hyps) - metric(base_hyps) by sacreBLEU's paired bootstrap. The CI is
    the percentile interval (Efron & Tibshirani 1993, ch. 13): the 2.5th and 97.5th percentiles (numpy's linear
    interpolation) of the resampled differences, both systems scored on the same resampled sentences (sacreBLEU's
    indices, `default_rng(seed).choice(n, (resamples, n))`). sacreBLEU's own `estimate_ci` gives the mean ± half
    the width between two order statistics instead, which is symmetric about the mean where the resampled
    differences are not."""
    if not len(base_hyps) == len(hyps) == len(refs):
        raise ValueError(f"paired bootstrap needs as many segments in each: baseline {len(base_hyps)}, "
                         f"system {len(hyps)}, references {len(refs)}")
    with sacrebleu_seed(seed):
        _, results = PairedTest([("baseline", list(base_hyps)), ("system", list(hyps))],
                                {metric: scorer(metric, signature)}, [list(refs)], test_type="bs",
                                n_samples=resamples)()
        name = next(k for k in results if k != "System")
        p_value = float(results[name][1].p_value)
        m = scorer(metric, signature)
        resampled = [_bootstrap_resample(m._extract_corpus_statistics(list(h), [list(refs)]), m, resamples)[1]
                     for h in (base_hyps, hyps)]
    diffs = np.array([s.score - b.score for b, s in zip(*resampled, strict=True)])
    if not diffs.any():  # the two score alike on every resample (the same hypotheses): no difference at all.
        p_value = 1.0  # sacreBLEU's count gives 1 / (resamples + 1) here, "significant"
    low, high = np.quantile(diffs, [0.025, 0.975])  # (resamples,) -> the percentile interval
    return p_value, float(low), float(high)


def welch(base: Sequence[float], values: Sequence[float]) -> tuple[float, float, float]:
    """(p-value, CI low, CI high) of mean(values) - mean(base) by Welch's t-test (scipy's). NaN, no test, with
    fewer than 2 each, or when neither row varies over its seeds: the difference's standard error is 0, so
    Welch-Satterthwaite's degrees of freedom are 0/0 and the seeds show no noise to test against (scipy would
    give p = 0 for any difference, however small: a star no seed noise supports)."""
    if len(base) < 2 or len(values) < 2 or (np.ptp(base) == 0 and np.ptp(values) == 0):
        return math.nan, math.nan, math.nan
    res = stats.ttest_ind(values, base, equal_var=False)
    ci = res.confidence_interval(0.95)
    return float(res.pvalue), float(ci.low), float(ci.high)


def t_interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float]:
    """The t-distribution CI of the mean of `values` (NaN for fewer than 2)."""
    n = len(values)
    if n < 2:
        return math.nan, math.nan
    mean, sd = float(np.mean(values)), float(np.std(values, ddof=1))
    low, high = stats.t.interval(level, n - 1, loc=mean, scale=sd / math.sqrt(n)) if sd > 0 else (mean, mean)
    return float(low), float(high)


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values (Holm 1979, "A simple sequentially rejective multiple test procedure"):
    the i-th smallest of the m p-values times (m - i + 1), made monotone, at most 1. A p-value that is not finite
    (NaN: no test) is not in the family: it stays NaN, and m counts the finite ones only."""
    family = [i for i, p in enumerate(p_values) if math.isfinite(p)]
    m = len(family)
    adjusted = [math.nan] * len(p_values)
    running = 0.0
    for rank, i in enumerate(sorted(family, key=lambda j: p_values[j])):
        running = max(running, min(1.0, (m - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted


def corpus_score(hyps: Sequence[str], refs: Sequence[str], metric: str, signature: str = "") -> float:
    """sacreBLEU's corpus BLEU or chrF of one seed's hypotheses."""
    return float(scorer(metric, signature).corpus_score(list(hyps), [list(refs)]).score)


def bootstrap_rows(base: dict[int, tuple[list[str], list[str]]], row: dict[int, tuple[list[str], list[str]]],
                   metric: str, resamples: int, seed: int, signature: str = "") -> Comparison | None:
    """{seed: (hypotheses, references)} of each row. Headline: `welch` on the corpus scores of the seeds both rows
    have (None with fewer than 2, or when Welch's p is NaN: both rows the same score on every seed, no variance to
    test; as report.compare's Welch path). Beside it, each shared seed's sacreBLEU paired bootstrap p-value."""
    seeds = tuple(sorted(set(base) & set(row)))
    if not seeds:
        return None
    for s in seeds:
        if base[s][1] != row[s][1]:
            raise ValueError(f"seed {s}: the two rows' references differ; they were not scored on the same split")
    each = {s: paired_bootstrap(base[s][0], row[s][0], row[s][1], metric, resamples, seed, signature)
            for s in seeds}
    if len(seeds) < 2:
        return None
    scores = [{s: corpus_score(d[s][0], d[s][1], metric, signature) for s in seeds} for d in (base, row)]
    p_value, low, high = welch([scores[0][s] for s in seeds], [scores[1][s] for s in seeds])
    if math.isnan(p_value):
        return None
    return Comparison("Welch over seed scores", p_value, low, high, {s: e[0] for s, e in each.items()},
                      {s: e[1:] for s, e in each.items()}, seeds)


@dataclass
class LinearFit:
    """y ~ X by ordinary least squares, for estimating linear combinations c·beta with t intervals."""

    beta: np.ndarray  # (p,) a least-squares solution (X may be rank deficient)
    xtx_pinv: np.ndarray  # (p, p) pseudo-inverse of X'X
    row_space: np.ndarray  # (p, p) projection onto X's row space: c is estimable iff c @ row_space == c
    sigma2: float  # residual variance, NaN without residual degrees of freedom
    df: int  # residual degrees of freedom: observations - rank(X)

    def estimate(self, c: np.ndarray, level: float = 0.95) -> tuple[float, float, float] | None:
        """(c·beta, CI low, CI high); None when c·beta is not estimable (the data cannot tell it, e.g. a cell with
        no observation in a model with that cell's interaction); NaN bounds without residual df."""
        if not np.allclose(c @ self.row_space, c, atol=1e-9):
            return None
        value = float(c @ self.beta)
        if self.df <= 0:
            return value, math.nan, math.nan
        half = stats.t.ppf(0.5 + level / 2, self.df) * math.sqrt(max(self.sigma2 * float(c @ self.xtx_pinv @ c), 0))
        return value, value - half, value + half


def fit_linear(x: np.ndarray, y: np.ndarray) -> LinearFit:
    """OLS of y (n,) on the design x (n, p)."""
    beta, _, rank, _ = np.linalg.lstsq(x, y, rcond=None)  # (p,)
    df = len(y) - int(rank)
    resid = y - x @ beta  # (n,)
    sigma2 = float(resid @ resid / df) if df > 0 else math.nan
    return LinearFit(beta, np.linalg.pinv(x.T @ x), np.linalg.pinv(x) @ x, sigma2, df)


def version() -> str:
    return sacrebleu.__version__


# ---------------------------------------------------------------------------------------------- rank correlation
MIN_RANKED = 5  # fewer shared variants: no p-value (3 or 4 items cannot reach p < 0.05 two-sided with tau's ties)
EXACT_UP_TO = 9  # every permutation (9! = 362,880: 0.3-0.4 s) up to this many items; Monte Carlo ones above
MONTE_CARLO = 20_000  # random orders above EXACT_UP_TO (rank_correlation)
MONTE_CARLO_SEED = 0


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
