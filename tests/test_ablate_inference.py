"""The one inference model of the ablation tables (attnlab.analysis.inference, multiple, testset) against scipy's own
procedures on non-trivial data: Dunnett's many-to-one test (scipy.stats.dunnett), Tukey's all pairs
(scipy.stats.tukey_hsd), Bartlett's test, the paired t-test that a 2-row block model is, an explicit least-squares
fit of metric ~ variant + seed with a missing cell, and the test set's covariance against its definition."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from attnlab.analysis import inference, multiple, testset
from attnlab.analysis.model import fitted
from attnlab.analysis.ranks import MIN_SEEDS, withheld


def one_way(groups: list[np.ndarray]) -> inference.Fit:
    """Dunnett's and Tukey's own design: independent groups, one variance pooled within them (df N - k)."""
    n = np.array([len(g) for g in groups])
    s2 = sum(((g - g.mean()) ** 2).sum() for g in groups) / (n.sum() - len(groups))
    df = np.array(float(n.sum() - len(n)))
    return inference.Fit(np.array([g.mean() for g in groups]), [(s2 * np.diag(1 / n), df)], "pooled",
                         np.ones((len(n), len(n)), bool))


GROUPS = [np.random.default_rng(4).normal(10.0, 2.0, n) + d for n, d in ((6, 0.0), (4, 1.5), (5, 3.0), (7, -1.0))]


def test_dunnett_is_scipys_many_to_one_test():
    """Unequal groups (6 controls; 4, 5, 7 treated): the adjusted p-values equal scipy.stats.dunnett's within its
    quasi-Monte Carlo noise (its spread over 8 seeds is about 3e-5), and the simultaneous interval's multiplier
    is the exact one: the multivariate t probability of the bound, computed by scipy with 4 million points, is
    0.95 within 1e-6 (scipy's own root-finding tolerance leaves its bound 1e-3 off)."""
    tested = inference.family(one_way(GROUPS), inference.versus(4, 0, [1, 2, 3]), "dunnett")
    runs = [stats.dunnett(*GROUPS[1:], control=GROUPS[0], rng=np.random.default_rng(s)) for s in range(8)]
    scipy_p = np.mean([r.pvalue for r in runs], 0)
    assert tested.p == pytest.approx(scipy_p, abs=1e-4)
    assert 0.05 < tested.p.min() < tested.p.max() < 1  # a non-trivial family: neither 0 nor 1
    ci = runs[0].confidence_interval(0.95)
    assert tested.low == pytest.approx(ci.low, abs=5e-3) and tested.high == pytest.approx(ci.high, abs=5e-3)
    n0, n = len(GROUPS[0]), np.array([len(g) for g in GROUPS[1:]])
    lam = 1 / np.sqrt(n0 / n + 1)  # Dunnett's correlations: lambda_i lambda_j
    corr = np.outer(lam, lam) + np.diag(1 - lam**2)
    c = tested.critical[0]
    mvt = stats.multivariate_t(shape=corr, df=sum(map(len, GROUPS)) - 4, seed=1)
    assert mvt.cdf(np.full(3, c), lower_limit=np.full(3, -c), maxpts=1_000_000) == pytest.approx(0.95, abs=2e-6)


def test_the_multivariate_t_probability_is_exact_to_1e_6():
    """The quadrature against Student's t (one comparison) and scipy's multivariate t at a million points (four
    comparisons with a one-factor correlation): |error| < 2e-6 from 2 degrees of freedom up."""
    c = np.array([0.5, 1.0, 2.0, 3.0, 5.0])
    for df in (2, 3, 6, 12, 300, math.inf):
        want = 1 - 2 * stats.t.sf(c, df)
        assert multiple.max_abs_t_cdf(c, np.zeros(1), df) == pytest.approx(want, abs=1e-6)
    lam = np.array([0.3, 0.9, 0.6, 0.7])
    corr = np.outer(lam, lam) + np.diag(1 - lam**2)
    assert multiple.one_factor(corr) == pytest.approx(lam, abs=1e-9)
    for df, x in ((2, 1.5), (12, 2.5)):
        got = multiple.max_abs_t_cdf(np.array([x]), lam, df)
        want = stats.multivariate_t(shape=corr, df=df, seed=1).cdf(np.full(4, x), lower_limit=np.full(4, -x),
                                                                   maxpts=1_000_000)
        assert got == pytest.approx([want], abs=2e-6)


def test_tukey_is_scipys_tukey_hsd():
    """All 6 pairs of the 4 unequal groups: Tukey-Kramer p-values and simultaneous intervals equal
    scipy.stats.tukey_hsd's to 1e-9."""
    which, lin = inference.pairs([0, 1, 2, 3], 4)
    tested = inference.family(one_way(GROUPS), lin, "tukey")
    res = stats.tukey_hsd(*GROUPS)
    ci = res.confidence_interval(0.95)
    for m, (i, j) in enumerate(which):  # ours: mean_j - mean_i; scipy's [j, i] is the same difference
        assert tested.p[m] == pytest.approx(res.pvalue[j, i], abs=1e-9)
        assert (tested.low[m], tested.high[m]) == pytest.approx((ci.low[j, i], ci.high[j, i]), abs=1e-9)
    assert 0.001 < tested.p.min() < 0.5 < tested.p.max()


def test_two_rows_with_seeds_as_blocks_are_the_paired_t_test():
    """metric ~ variant + seed with 2 variants is scipy's paired t-test: the same p and 95% interval."""
    rng = np.random.default_rng(1)
    y = rng.normal(30, 1, (2, 5)) + rng.normal(0, 2, 5) + np.array([[0.0], [0.8]])
    tested = inference.family(inference.pooled(y, np.ones((2, 5), bool))[0], inference.versus(2, 0, [1]), "dunnett")
    res = stats.ttest_rel(y[1], y[0])
    ci = res.confidence_interval()
    assert (tested.p[0], tested.low[0], tested.high[0]) == pytest.approx((res.pvalue, ci.low, ci.high), rel=1e-9)


def test_the_block_model_is_least_squares_of_variant_plus_seed_with_a_missing_cell():
    """4 variants x 4 seeds, one trial failed: the model's differences, their standard errors and degrees of
    freedom ((cells - 1) - (k - 1) - (n - 1) = 8) equal an explicit least-squares fit with treatment-coded dummies;
    complete, its residual variance equals scipy.stats.dunnett's on the seed-centred scores rescaled from its
    k (n - 1) degrees of freedom to the model's (k - 1)(n - 1)."""
    rng = np.random.default_rng(7)
    y = 20 + rng.normal(0, 1, (4, 4)) + rng.normal(0, 3, 4) + np.array([[0.0], [1.0], [0.5], [-0.3]])
    mask = np.ones((4, 4), bool)
    mask[2, 3] = False
    fit, _, sigma2 = inference.pooled(np.where(mask, y, np.nan), mask)
    rows, seeds = np.nonzero(mask)
    x = np.column_stack([np.ones(len(rows))] + [rows == v for v in (1, 2, 3)] + [seeds == s for s in (1, 2, 3)])
    beta, ss, _, _ = np.linalg.lstsq(x.astype(float), y[mask], rcond=None)
    cov = ss[0] / 8 * np.linalg.inv(x.T @ x)
    est, c, _, df = fit.contrasts(inference.versus(4, 0, [1, 2, 3]))
    assert est == pytest.approx(beta[1:4], rel=1e-10) and np.diag(c) == pytest.approx(np.diag(cov)[1:4], rel=1e-10)
    assert sigma2 == pytest.approx(ss[0] / 8) and df[0] == pytest.approx([8, 8, 8])
    full, _, s2 = inference.pooled(y, np.ones((4, 4), bool))
    centred = y - y.mean(0)
    scipy = stats.dunnett(*centred[1:], control=centred[0], rng=0)
    t = full.contrasts(inference.versus(4, 0, [1, 2, 3]))[0] / np.sqrt(2 * s2 / 4)
    assert t == pytest.approx(scipy.statistic * np.sqrt(3 * 3 / (4 * 3)), rel=1e-10)


def test_bartlett_is_scipys_and_decides_the_fallback_to_welch():
    """Bartlett's p equals scipy's, with unequal seeds per row too; rows whose variances differ (one row 8 times
    the others' SD, 5 seeds) go to Welch with the reason; rows that share no seed go to Welch; no seed shared by
    2 rows: no pooled model."""
    rng = np.random.default_rng(2)
    y = rng.normal(0, 1, (4, 5)) * np.array([[1.0], [2.0], [0.5], [1.0]])
    assert inference.bartlett(y) == pytest.approx(stats.bartlett(*y).pvalue, rel=1e-12)
    y[1, 3:] = np.nan
    assert inference.bartlett(y) == pytest.approx(stats.bartlett(*[r[np.isfinite(r)] for r in y]).pvalue, rel=1e-12)
    noisy = 30 + rng.normal(0, 0.3, (4, 5)) * np.array([[1.0], [1.0], [1.0], [8.0]])
    m = fitted(list("abcd"), [1, 2, 3, 4, 5], noisy)
    assert m.method == "welch" and "Bartlett's test says the rows' variances over their seeds differ" in m.why
    assert fitted(list("abcd"), [1, 2, 3, 4, 5], 30 + rng.normal(0, 0.3, (4, 5))).method == "pooled"
    apart = np.array([[1.0, 2.0, np.nan, np.nan], [np.nan, np.nan, 3.0, 4.5]])
    m = fitted(["a", "b"], [1, 2, 3, 4], apart)
    assert m.method == "welch" and "the rows do not share their seeds" in m.why
    assert fitted(["a", "b"], [1], np.array([[1.0], [2.0]])).method == ""  # 1 seed, no texts: no test


def test_holm_adjusts_along_the_last_axis_and_leaves_no_test_out():
    # sorted 0.005, 0.01, 0.03, 0.04 times 4, 3, 2, 1 = 0.02, 0.03, 0.06, 0.04 -> monotone: 0.06 for the last
    assert multiple.holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert list(multiple.holm([0.5, 0.9])) == [1.0, 1.0]
    for ps, want in (([math.nan, 0.001, 0.002], [math.nan, 0.002, 0.002]),
                     ([0.01, math.inf, 0.04, math.nan], [0.02, math.nan, 0.04, math.nan])):
        assert multiple.holm(ps) == pytest.approx(want, nan_ok=True), ps
    batch = multiple.holm(np.array([[0.01, 0.04, 0.03, 0.005], [0.5, 0.9, math.nan, 0.2]]))
    assert batch[1] == pytest.approx([1.0, 1.0, math.nan, 0.6], nan_ok=True)


def test_the_test_sets_covariance_is_the_repeated_part_and_drops_each_seeds_own_sentence_noise():
    """Linear scores of 300 sentences: each variant's strengths repeat on its 3 seeds (SD 5 a sentence: its
    corpus score's part has variance 25 / 300), each seed adds its own sentence noise (SD 10). Over 400 studies,
    G's contrast variance of two variants averages 2 x 25 / 300 (not the 2 x 125 / 300 the same-seed covariance
    would give), and G equals its definition: the mean covariance, over the resamples, of cells of different
    seeds."""
    rng = np.random.default_rng(0)
    studies, k, n, m = 400, 2, 3, 300
    x = rng.normal(0, 5, (studies, k, 1, m)) + rng.normal(0, 10, (studies, k, n, m))
    counts = testset.resample_counts(m, 200, 3).astype(float)
    ystar = np.moveaxis((x.reshape(-1, m) @ counts.T / m).reshape(studies, k, n, 200), -1, 1)  # (S, B, k, n)
    g = testset.test_set_cov(ystar)
    contrast = g[:, 0, 0] + g[:, 1, 1] - 2 * g[:, 0, 1]
    assert contrast.mean() == pytest.approx(2 * 25 / 300, rel=0.1)
    one = ystar[0]  # (B, k, n)
    by_hand = np.mean([np.cov(one[:, 0, j], one[:, 1, jj])[0, 1] for j in range(n) for jj in range(n) if j != jj])
    assert g[0, 0, 1] == pytest.approx(by_hand, rel=1e-10)


def test_the_minimum_detectable_difference_is_found_80_percent_of_the_time():
    """4 variants x 5 seeds, residual SD 1: the detectable Δ the footnote prints, put into 2,500 simulated
    studies as one variant's effect, is found by the table's test in 80% of them (± 3 points)."""
    rng = np.random.default_rng(5)
    y = rng.normal(0, 1, (4, 5))
    model = fitted(list("abcd"), [1, 2, 3, 4, 5], y)
    tested = model.family(inference.versus(4, 0, [1, 2, 3]), "dunnett")
    se_true = math.sqrt(2 / 5)
    crit = multiple.dunnett_critical(np.full((3, 3), 0.5) + 0.5 * np.eye(3), 12)
    assert tested.critical[0] == pytest.approx(crit, rel=1e-6)  # the table's own multiplier at 4 x 5
    delta = multiple.detectable(se_true, 12, crit)
    nc = delta / se_true  # scipy's noncentral t: the power of |T| > crit at that difference is 80%, which pins delta
    assert stats.nct.sf(crit, 12, nc) + stats.nct.cdf(-crit, 12, nc) == pytest.approx(0.8, abs=1e-6)
    sims = rng.normal(0, 1, (2500, 4, 5)) + np.array([0.0, delta, 0.0, 0.0])[:, None]
    p = inference.against_baseline(sims, np.ones((4, 5), bool), 0, intervals=False, skip_above=0.05)[0].p
    assert np.mean(p[:, 0] < 0.05) == pytest.approx(0.8, abs=0.03)


def test_rank_intervals_are_withheld_below_5_seeds():
    """Percentile intervals of tau and rho from resampling 2-5 seeds cover the truth in 59-89% of studies (issue 41's
    simulation): below MIN_SEEDS seeds in either study the interval is withheld and the reason given."""
    assert MIN_SEEDS == 5 and "fewer than 5 seeds in a (3)" in withheld({"a": 3, "b": 6})
    assert withheld({"a": 5, "b": 6}) == ""
