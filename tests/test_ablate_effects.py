"""Main effects and interactions of an ablation grid (attnlab.analysis.effects): a linear model of the metric on the
factors and the seed, checked against scipy's paired t-test where they must agree, against the answer a 2x2 grid
with a failed trial was built to have, and by simulation for the coverage of its intervals."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from scipy import stats

from attnlab.analysis import effects
from attnlab.analysis.columns import SIGNIFICANCE
from attnlab.analysis.effects import interaction, main_effects, missing_cells
from attnlab.analysis.report import Row

GRID = [{"A": a, "B": b} for a in ("a0", "a1") for b in ("b0", "b1")]  # the 2x2 grid's cells
SEED_EFFECT = {1: 0.0, 2: 1.5, 3: -2.0}


def two_by_two(rng: np.random.Generator, noise: float, lost: dict[tuple[str, str], set[int]],
               inter: float = 0.0) -> list[tuple[dict[str, str], dict[int, float]]]:
    """A has no effect, B adds +2, `inter` is added to the a1 x b1 cell; each seed shifts every cell alike; the
    seeds in `lost` failed in that cell."""
    table = []
    for g in GRID:
        values = {s: 30.0 + 2.0 * (g["B"] == "b1") + inter * (g == {"A": "a1", "B": "b1"}) + e
                  + rng.normal(0.0, noise) for s, e in SEED_EFFECT.items() if s not in lost.get((g["A"], g["B"]), ())}
        table.append((g, values))
    return table


def naive_gap(table, factor: str) -> float:
    """What averaging the finished seeds gives (the former method): per seed the mean over the cells at each
    value, then the mean over seeds; value 1 minus value 0."""
    out = []
    for value in sorted({g[factor] for g, _ in table}):
        per_seed: dict[int, list[float]] = {}
        for g, values in table:
            if g[factor] == value:
                for s, v in values.items():
                    per_seed.setdefault(s, []).append(v)
        out.append(np.mean([np.mean(v) for v in per_seed.values()]))
    return out[1] - out[0]


def test_a_failed_trial_does_not_bias_a_factor_with_no_effect():
    """The a1 x b1 cell lost 2 of its 3 seeds. Averaging the seeds that finished gives A an effect of -0.67 (its
    remaining seed has the +2 of b1 and a low seed effect); the linear model gives 0 within its interval, and B's
    +2 within B's; noise-free data give them exactly."""
    lost = {("a1", "b1"): {2, 3}}
    exact = main_effects(two_by_two(np.random.default_rng(0), 0.0, lost), GRID)
    assert exact["A"][1].vs_first[0] == pytest.approx(0.0, abs=1e-9)
    assert exact["B"][1].vs_first[0] == pytest.approx(2.0, abs=1e-9)
    assert exact["A"][0].mean == pytest.approx(31.0 + np.mean(list(SEED_EFFECT.values())))
    table = two_by_two(np.random.default_rng(1), 0.1, lost)
    assert naive_gap(two_by_two(np.random.default_rng(1), 0.0, lost), "A") == pytest.approx(-2 / 3)
    effects = main_effects(table, GRID)
    gap, low, high = effects["A"][1].vs_first
    assert low < 0.0 < high and abs(gap) < 0.3 and high - low < 1.0
    gap, low, high = effects["B"][1].vs_first
    assert low < 2.0 < high and abs(gap - 2.0) < 0.3
    assert [e.n_seeds for e in effects["A"]] == [3, 3]
    cells = {c.levels: c for c in interaction(table, GRID, "A", "B")}
    term, low, high = cells["a1", "b1"].interaction
    assert low < 0.0 < high


def test_the_difference_of_two_values_over_paired_seeds_is_scipys_paired_t_test():
    """One factor with 2 values and a seed effect: the model's difference and its 95% CI are those of the paired
    t-test over the seeds (scipy.stats.ttest_rel)."""
    rng = np.random.default_rng(5)
    base = rng.normal(20.0, 2.0, 5)
    other = base + 0.7 + rng.normal(0.0, 0.4, 5)
    table = [({"f": "x"}, dict(enumerate(base))), ({"f": "y"}, dict(enumerate(other)))]
    gap, low, high = main_effects(table, [{"f": "x"}, {"f": "y"}])["f"][1].vs_first
    ci = stats.ttest_rel(other, base).confidence_interval(0.95)
    assert (gap, low, high) == pytest.approx((np.mean(other - base), ci.low, ci.high), rel=1e-9)


def test_intervals_cover_the_true_effects_with_failed_trials():
    """300 simulated 2x2 studies (3 seeds, noise SD 0.5, a +0.8 interaction in a1 x b1, a1 x b1 lost 2 seeds and
    a0 x b0 lost 1): A's effect in the additive model averages the interaction over B, +0.4; the intervals of A's
    effect and of the a1 x b1 interaction term (+0.2 with a 2x2's four cells) cover the truth in >= 93%
    (measured over 1,000: 96.4% and 95.2%)."""
    rng = np.random.default_rng(9)
    lost = {("a1", "b1"): {2, 3}, ("a0", "b0"): {1}}
    cover_a, cover_i = [], []
    for _ in range(300):
        table = two_by_two(rng, 0.5, lost, inter=0.8)
        _, low, high = main_effects(table, GRID)["A"][1].vs_first
        cover_a.append(low <= 0.4 <= high)
        _, low, high = {c.levels: c for c in interaction(table, GRID, "A", "B")}["a1", "b1"].interaction
        cover_i.append(low <= 0.2 <= high)
    assert np.mean(cover_i) >= 0.93 and np.mean(cover_a) >= 0.93


def test_a_cell_with_no_finished_trial_is_listed_and_not_estimated_in_the_interaction():
    table = [(g, v) for g, v in two_by_two(np.random.default_rng(2), 0.1, {("a1", "b1"): {1, 2, 3}}) if v]
    cells = {c.levels: c for c in interaction(table, GRID, "A", "B")}
    assert np.isnan(cells["a1", "b1"].mean) and cells["a1", "b1"].interaction is None
    assert cells["a0", "b0"].interaction is None  # every term involves the empty cell's mean
    additive = main_effects(table, GRID)  # the additive model still estimates both factors
    assert additive["A"][1].vs_first[0] == pytest.approx(0.0, abs=0.3)
    variants = [SimpleNamespace(name=f"A={g['A']} B={g['B']}", levels=(f"A={g['A']}", f"B={g['B']}")) for g in GRID]
    h = SimpleNamespace(spec=SimpleNamespace(variants=lambda: variants, seeds=(1, 2, 3)))
    assert missing_cells(h, table) == ["A=a1 B=b1 (seed 1)", "A=a1 B=b1 (seed 2)", "A=a1 B=b1 (seed 3)"]


def test_a_mean_not_estimable_says_why():
    """ffn=relu had a finished trial, yet its mean printed "not estimable (no finished trial there)": the reason
    was another factor's value with no finished trial, which the mean averages over."""
    rng = np.random.default_rng(3)
    no_b1 = [(g, v) for g, v in two_by_two(rng, 0.1, {("a0", "b1"): {1, 2, 3}, ("a1", "b1"): {1, 2, 3}}) if v]
    a0 = main_effects(no_b1, GRID)["A"][0]
    assert np.isnan(a0.mean) and a0.n_seeds == 3
    text = effects.fmt_ci(a0.mean, a0.low, a0.high, 2, why=a0.why)
    assert "no finished trial there" not in text and "B=b1" in text and "3 seed(s) finished here" in text, text
    diagonal = [(g, v) for g, v in two_by_two(rng, 0.1, {}) if g in (GRID[0], GRID[3])]  # a0 x b0, a1 x b1 only
    a1 = main_effects(diagonal, GRID)["A"][1]
    assert np.isnan(a1.mean) and "cannot separate it from the other factors" in a1.why
    empty = {c.levels: c for c in interaction(no_b1, GRID, "A", "B")}[("a0", "b1")]
    assert np.isnan(empty.mean) and empty.why == "no finished trial with A=a0, B=b1"


def test_compare_with_a_study_whose_variants_all_tie_prints_why_there_is_no_p_value(monkeypatch):
    """6 shared variants; study a scores every variant 0 on every seed (a budget too short to score). tau and rho
    are undefined, so no p-value and the reason is printed (the exact permutation count said p = 0 here)."""
    def handle(name: str, scores: dict[str, list[float]]) -> SimpleNamespace:
        spec = SimpleNamespace(name=name, metric="final/test_bleu", direction="max", variants=lambda: [],
                               significance=dict(SIGNIFICANCE, resamples=50))
        return SimpleNamespace(spec=spec, scores=scores)

    def rows(h, tests=True):
        trials = [SimpleNamespace(user_attrs={"seed": s}) for s in (1, 2)]
        return [Row(k, k, trials, v) for k, v in h.scores.items()], []

    monkeypatch.setattr(effects, "collect_rows", rows)
    a = handle("a", {f"v{i}": [0.0, 0.0] for i in range(6)})
    b = handle("b", {f"v{i}": [20.0 + i, 20.5 + i] for i in range(6)})
    out = effects.compare_studies(a, b)
    assert "6 variant(s) in both" in out
    assert "Kendall's tau = undefined, Spearman's rho = undefined, n = 6: no p-value: all scores tied" in out
    assert "p = " not in out and "nan" not in out
