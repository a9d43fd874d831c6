"""Main effects and interactions of an ablation grid (attnlab.analysis.effects): the study's one inference model (the
cell-means model metric ~ variant + seed, each variant its own mean), checked against scipy's paired t-test where
they must agree, against the answer a 2x2 grid with failed trials was built to have, against the additive model's
bias when factors interact, and by simulation for the coverage of its intervals."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from scipy import stats

from attnlab.analysis import transfer
from attnlab.analysis.columns import SIGNIFICANCE
from attnlab.analysis.effects import all_pairs, fmt_ci, interaction, main_effects, missing_cells, table_grid
from attnlab.analysis.rows import Row

GRID = [{"A": a, "B": b} for a in ("a0", "a1") for b in ("b0", "b1")]  # the 2x2 grid's cells
SEED_EFFECT = {1: 0.0, 2: 1.5, 3: -2.0}


def two_by_two(rng: np.random.Generator, noise: float, lost: dict[tuple[str, str], set[int]],
               inter: float = 0.0, a_effect: float = 0.0) -> list[tuple[dict[str, str], dict[int, float]]]:
    """B adds +2, A adds a_effect averaged over B, `inter` is added to a1 x b1 and taken from a1 x b0 (so A's
    effect averaged over B stays a_effect); each seed shifts every cell alike; the seeds in `lost` failed."""
    table = []
    for g in GRID:
        cell = 30.0 + 2.0 * (g["B"] == "b1") + a_effect * (g["A"] == "a1")
        cell += inter * (g["A"] == "a1") * (1 if g["B"] == "b1" else -1)
        values = {s: cell + e + rng.normal(0.0, noise) for s, e in SEED_EFFECT.items()
                  if s not in lost.get((g["A"], g["B"]), ())}
        table.append((g, values))
    return table


def additive_gap(table, factor: str) -> float:
    """What the additive model (metric ~ A + B + seed by least squares, the former `effects`) gives as the
    factor's effect."""
    rows = [(g, s, v) for g, values in table for s, v in values.items()]
    x = np.array([[1.0, g["A"] == "a1", g["B"] == "b1", s == 2, s == 3] for g, s, _ in rows], dtype=float)
    beta = np.linalg.lstsq(x, np.array([v for _, _, v in rows]), rcond=None)[0]
    return float(beta[1 if factor == "A" else 2])


def test_failed_trials_do_not_bias_a_factor_when_the_factors_interact():
    """A has a true effect of +1 (averaged over B) and interacts with B (±0.8); the a1 x b1 cell lost 2 of its 3
    seeds. The additive model (A + B + seed, the former `effects`) reads A's +1 as 0.68 (1.32 with the interaction
    reversed): it weighs the cells by their finished seeds. The cell-means model gives +1 exactly on noise-free data,
    and B's effect averaged over A (2 ± 0.8) too, and with noise covers both within its intervals."""
    lost = {("a1", "b1"): {2, 3}}
    for inter, biased in ((0.8, 0.68), (-0.8, 1.32)):
        clean = two_by_two(np.random.default_rng(0), 0.0, lost, inter=inter, a_effect=1.0)
        assert additive_gap(clean, "A") == pytest.approx(biased, abs=1e-9)
        exact = main_effects(table_grid(clean, GRID))
        assert exact["A"][1].vs_base[0] == pytest.approx(1.0, abs=1e-9)
        assert exact["B"][1].vs_base[0] == pytest.approx(2.0 + inter, abs=1e-9)  # B's averaged over A
    assert exact["A"][0].mean == pytest.approx(31.0 + np.mean(list(SEED_EFFECT.values())))
    effects = main_effects(table_grid(two_by_two(np.random.default_rng(1), 0.1, lost, 0.8, 1.0), GRID))
    gap, low, high, p = effects["A"][1].vs_base
    assert low < 1.0 < high and abs(gap - 1.0) < 0.3 and p < 0.05
    gap, low, high, _ = effects["B"][1].vs_base
    assert low < 2.8 < high and abs(gap - 2.8) < 0.3
    assert [e.n_seeds for e in effects["A"]] == [3, 3]


def test_the_difference_of_two_values_over_paired_seeds_is_scipys_paired_t_test():
    """One factor with 2 values and a seed effect: the model's difference and its 95% CI are those of the paired
    t-test over the seeds (scipy.stats.ttest_rel), and its p too (a family of one)."""
    rng = np.random.default_rng(5)
    base = rng.normal(20.0, 2.0, 5)
    other = base + 0.7 + rng.normal(0.0, 0.4, 5)
    table = [({"f": "x"}, dict(enumerate(base))), ({"f": "y"}, dict(enumerate(other)))]
    gap, low, high, p = main_effects(table_grid(table, [{"f": "x"}, {"f": "y"}]))["f"][1].vs_base
    res = stats.ttest_rel(other, base)
    ci = res.confidence_interval(0.95)
    assert (gap, low, high, p) == pytest.approx((np.mean(other - base), ci.low, ci.high, res.pvalue), rel=1e-9)


def test_intervals_cover_the_true_effects_with_failed_trials():
    """150 simulated 2x2 studies (3 seeds, noise SD 0.5, an interaction of ±0.8 in a1 x b1 and a1 x b0, a1 x b1
    lost 2 seeds and a0 x b0 lost 1): A has no effect averaged over B; the intervals of A's effect and of the
    a1 x b1 interaction term (+0.4) cover the truth in >= 93%."""
    rng = np.random.default_rng(9)
    lost = {("a1", "b1"): {2, 3}, ("a0", "b0"): {1}}
    cover_a, cover_i = [], []
    for _ in range(150):
        grid = table_grid(two_by_two(rng, 0.5, lost, inter=0.8), GRID)
        _, low, high, _ = main_effects(grid)["A"][1].vs_base
        cover_a.append(low <= 0.0 <= high)
        _, low, high = {c.levels: c for c in interaction(grid, "A", "B")}["a1", "b1"].interaction
        cover_i.append(low <= 0.4 <= high)
    assert np.mean(cover_i) >= 0.93 and np.mean(cover_a) >= 0.93


def test_a_cell_with_no_finished_trial_is_named_and_nothing_averaging_over_it_is_estimated():
    """a1 x b1 has no finished trial: A's mean at a1 and B's at b1 average over it, so they and the differences to
    them are not estimated, and the reason names the cell (an additive fill-in would assume no interaction); the
    means that do not touch it are; every interaction term involves it. The missing (variant, seed) cells are
    listed."""
    grid = table_grid([(g, v) for g, v in two_by_two(np.random.default_rng(2), 0.1, {("a1", "b1"): {1, 2, 3}}) if v],
                      GRID)
    effects = main_effects(grid)
    a1, b1, a0 = effects["A"][1], effects["B"][1], effects["A"][0]
    for e in (a1, b1):
        assert np.isnan(e.mean) and e.vs_base is None and "A=a1, B=b1, with no finished trial" in e.why
        assert "A=a1, B=b1" in fmt_ci(e.mean, e.low, e.high, 2, why=e.why)
    assert np.isfinite(a0.mean) and a0.low < a0.mean < a0.high
    cells = {c.levels: c for c in interaction(grid, "A", "B")}
    assert np.isnan(cells["a1", "b1"].mean) and all(c.interaction is None for c in cells.values())
    assert cells["a0", "b1"].vs_base[0] == pytest.approx(2.0, abs=0.3)  # a cell against the baseline's cell
    variants = [SimpleNamespace(name=f"A={g['A']} B={g['B']}", levels=(f"A={g['A']}", f"B={g['B']}")) for g in GRID]
    h = SimpleNamespace(spec=SimpleNamespace(variants=lambda: variants, seeds=(1, 2, 3)))
    assert missing_cells(h, grid) == ["A=a1 B=b1 (seed 1)", "A=a1 B=b1 (seed 2)", "A=a1 B=b1 (seed 3)"]


def test_a_factor_of_three_values_gets_every_pair_by_tukey():
    """One factor, 3 values x 4 seeds: the pairs' differences, intervals and p are the model's Tukey family (the
    pooled variance on (3 - 1)(4 - 1) df, the studentized range of 3 means)."""
    rng = np.random.default_rng(3)
    seeds = rng.normal(0, 2, 4)
    table = [({"f": v}, {s: 10 + d + seeds[s] + rng.normal(0, 0.3) for s in range(4)})
             for v, d in (("x", 0.0), ("y", 0.5), ("z", 1.5))]
    grid = table_grid(table, [{"f": v} for v in "xyz"])
    pairs = all_pairs(grid, "f")
    y = np.array([list(v.values()) for _, v in table])
    resid = y - y.mean(1, keepdims=True) - y.mean(0) + y.mean()
    se = np.sqrt(2 * (resid**2).sum() / 6 / 4)
    for x, z, gap, low, high, p in pairs:
        i, j = "xyz".index(x), "xyz".index(z)
        assert gap == pytest.approx(y[j].mean() - y[i].mean())
        assert p == pytest.approx(stats.studentized_range.sf(abs(gap) / se * np.sqrt(2), 3, 6), rel=1e-9)
        half = stats.studentized_range.ppf(0.95, 3, 6) / np.sqrt(2) * se
        assert (low, high) == pytest.approx((gap - half, gap + half), rel=1e-9)
    assert [(x, z) for x, z, *_ in pairs] == [("x", "y"), ("x", "z"), ("y", "z")] and pairs[1][-1] < 0.05


def test_compare_with_a_study_whose_variants_all_tie_prints_why_there_is_no_p_value(monkeypatch):
    """6 shared variants; study a scores every variant 0 on every seed (a budget too short to score). tau and rho
    are undefined, so no p-value and the reason is printed (the exact permutation count said p = 0 here); with 2
    seeds no interval either, and why."""
    def handle(name: str, scores: dict[str, list[float]]) -> SimpleNamespace:
        spec = SimpleNamespace(name=name, metric="final/test_bleu", direction="max", variants=lambda: [],
                               significance=dict(SIGNIFICANCE, resamples=50))
        return SimpleNamespace(spec=spec, scores=scores)

    def rows(h):
        trials = [SimpleNamespace(user_attrs={"seed": s}) for s in (1, 2)]
        return [Row(k, k, trials, v) for k, v in h.scores.items()], []

    monkeypatch.setattr(transfer, "collect_rows", rows)
    a = handle("a", {f"v{i}": [0.0, 0.0] for i in range(6)})
    b = handle("b", {f"v{i}": [20.0 + i, 20.5 + i] for i in range(6)})
    out = transfer.compare_studies(a, b)
    assert "6 variant(s) in both" in out
    assert "Kendall's tau = undefined, Spearman's rho = undefined, n = 6: no p-value: all scores tied" in out
    assert "p = " not in out and "nan" not in out and "no CI: fewer than 5 seeds in a (2), b (2)" in out
