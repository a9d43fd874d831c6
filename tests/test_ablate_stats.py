"""The significance tests of the ablation tables (attnlab.analysis.stats) on synthetic systems whose true effect is
known: sacreBLEU's paired bootstrap (its command line gives the same p-values), Welch's t-test, t intervals and
Holm's correction against their formulas."""

from __future__ import annotations

import math
import os
import random
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import sacrebleu
from sacrebleu.metrics import BLEU
from scipy import stats

from attnlab.ablate.final import write_lines
from attnlab.analysis.columns import SIGNIFICANCE
from attnlab.analysis.model import compare
from attnlab.analysis.multiple import holm as multiple_holm
from attnlab.analysis.ranks import rank_intervals
from attnlab.analysis.report import Table, footnote, metric_cells
from attnlab.analysis.rows import Row
from attnlab.analysis.stats import t_interval
from attnlab.analysis.testset import corpus_score, paired_bootstrap
from conftest import make_pairs

REFS = [de for _, de in make_pairs(150, seed=3)]


def strengths(drop: float, variant: str, seed: str, sd: float = 0.15) -> list[str]:
    """system() with per-sentence strengths of the variant that repeat on its every seed: sentence i's drop
    probability is drop plus an offset of SD `sd` drawn once for the variant."""
    offsets = random.Random(variant)
    rng = random.Random(seed)
    out = []
    for r in REFS:
        p = min(max(drop + offsets.gauss(0, sd), 0.0), 0.95)
        out.append(" ".join(w for w in r.split() if rng.random() >= p))
    return out


def system(drop: float, seed: str, refs: list[str] = REFS) -> list[str]:
    """The references with each word dropped with probability `drop`: quality set by `drop`, noise by `seed`."""
    rng = random.Random(seed)
    return [" ".join(w for w in r.split() if rng.random() >= drop) for r in refs]


def sacrebleu_cli(ref: Path, base: Path, hyp: Path, resamples: int, seed: int) -> dict[str, float]:
    """p-values that `sacrebleu REF -i BASE HYP --paired-bs` prints, by metric."""
    out = subprocess.run([sys.executable, "-m", "sacrebleu", str(ref), "-i", str(base), str(hyp), "--paired-bs",
                          "--paired-bs-n", str(resamples), "-m", "bleu", "chrf", "-f", "text"],
                         capture_output=True, text=True, check=True, env={**os.environ, "SACREBLEU_SEED": str(seed)})
    p = [float(x) for x in re.findall(r"\(p = ([0-9.]+)\)", out.stdout)]
    assert len(p) == 2, out.stdout
    return {"bleu": p[0], "chrf": p[1]}


def test_per_seed_column_is_sacrebleus_command_line_and_the_headline_is_the_paired_model(tmp_path):
    """Two rows of 3 seeds as stored files, each variant with per-sentence strengths that repeat on its seeds: each
    seed's p-value equals what sacreBLEU's own command line prints on those files. The headline with the test set
    held fixed (population: test_set) is scipy's paired t-test on each seed's `sacrebleu` corpus score, the seed a
    block (also when the row ran a fourth seed the baseline lacks); with the test set a sample it adds the
    covariance of resampled sentences between different seeds, recomputed here by scoring each resample's texts
    with `sacrebleu.corpus_bleu` (sacreBLEU's indices), on the seeds' 2 degrees of freedom, and the interval
    widens."""
    hyps = {name: {s: strengths(drop, name, f"{name}{s}") for s in (1, 2, 3)}
            for name, drop in (("base", 0.3), ("row", 0.25))}
    fixed = compared(bleu_rows(tmp_path / "b", hyps), "final/test_bleu", population="test_set", resamples=40)[1]
    sample = compared(bleu_rows(tmp_path / "b", hyps), "final/test_bleu", resamples=40)[1]
    hyps["row"][4] = strengths(0.25, "row", "row4")  # a seed the baseline lacks: in the model, in no pair
    fixed4 = compared(bleu_rows(tmp_path / "a", hyps), "final/test_bleu", population="test_set", resamples=40)[1]
    for s in (1, 2, 3):
        base, row = (tmp_path / "a" / f"{name}{s}" / "test.hyp" for name in ("base", "row"))
        cli = sacrebleu_cli(tmp_path / "a" / "base1" / "test.ref", base, row, 40, SIGNIFICANCE["seed"])
        assert round(fixed4.comparison.per_seed[s], 4) == cli["bleu"], s
    assert set(fixed4.comparison.per_seed) == {1, 2, 3}  # seed 4: the baseline has none
    y = np.array([[sacrebleu.corpus_bleu(hyps[name][s], [REFS]).score for s in (1, 2, 3)] for name in ("base", "row")])
    res = stats.ttest_rel(y[1], y[0])  # seed 4 is the row's alone: a block of one cell adds nothing
    ci = res.confidence_interval()
    for c in (fixed.comparison, fixed4.comparison):
        assert (c.p_adjusted, c.ci_low, c.ci_high) == pytest.approx((res.pvalue, ci.low, ci.high), rel=1e-9)
    assert c.method == "pooled" and c.p_value == pytest.approx(c.p_adjusted, rel=1e-9)
    idx = np.random.default_rng(SIGNIFICANCE["seed"]).choice(len(REFS), (40, len(REFS)))  # sacreBLEU's draw
    star = np.array([[[sacrebleu.corpus_bleu([hyps[name][s][j] for j in i], [[REFS[j] for j in i]]).score
                       for s in (1, 2, 3)] for name in ("base", "row")] for i in idx])  # (40, 2, 3)
    cov = lambda a, b: np.cov(a, b)[0, 1]  # noqa: E731
    g = [[np.mean([cov(star[:, r, j], star[:, q, jj]) for j in range(3) for jj in range(3) if j != jj])
          for q in range(2)] for r in range(2)]
    test_part = max(g[0][0] + g[1][1] - 2 * g[0][1], 0.0)
    d = y[1] - y[0]
    seed_part = d.var(ddof=1) / 3
    se = math.sqrt(seed_part + test_part)
    # sacreBLEU scores a resample from float32 sums, corpus_bleu from ints: they agree to about 1e-7
    assert test_part > 0 and sample.comparison.se == pytest.approx(se, rel=1e-6)
    # on the 2 degrees of freedom of the seeds' part (conservative: the test set's part is nearly known)
    assert sample.comparison.p_adjusted == pytest.approx(2 * stats.t.sf(abs(d.mean()) / se, 2), rel=1e-5)
    assert sample.comparison.ci_high - sample.comparison.ci_low > c.ci_high - c.ci_low


def test_a_large_effect_is_found_with_a_ci_around_it():
    base, better = system(0.35, "a"), system(0.15, "b")
    p, low, high = paired_bootstrap(base, better, REFS, "bleu", 1000, 3)
    assert p < 0.01 and 0 < low < high
    observed = BLEU().corpus_score(better, [REFS]).score - BLEU().corpus_score(base, [REFS]).score
    assert low < observed < high
    # the same systems the other way round: the same p, the CI mirrored
    p2, low2, high2 = paired_bootstrap(better, base, REFS, "bleu", 1000, 3)
    assert p2 == p and low2 == pytest.approx(-high) and high2 == pytest.approx(-low)
    # a system against itself: no difference at all (sacreBLEU's own count would say p = 1/201)
    assert paired_bootstrap(base, base, REFS, "chrf", 200, 3) == (1.0, 0.0, 0.0)


def test_no_effect_gives_spread_p_values_and_cis_that_cover_zero():
    """40 pairs of systems from the same process. sacreBLEU's paired bootstrap (Koehn 2004) counts resampled
    |delta| - mean |delta| above the observed |delta|, so with no effect its p-values spread over [0, about 0.45],
    not [0, 1]: measured over 300 pairs, 9.7% fell below 0.05 and the median was 0.20. Its paired 95% CI of the
    difference covered 0 in 93% of 100 pairs."""
    p, covered = [], []
    for i in range(40):
        pi, low, high = paired_bootstrap(system(0.3, f"x{i}"), system(0.3, f"y{i}"), REFS, "bleu", 200, 5)
        p.append(pi)
        covered.append(low <= 0 <= high)
    p = np.array(p)
    assert 0.12 < np.median(p) < 0.3 and p.max() > 0.35 and p.min() < 0.05
    assert (p < 0.05).mean() <= 0.2 and np.mean(covered) >= 0.85


def test_per_seed_interval_is_the_percentile_interval_of_the_resampled_differences():
    """Recomputed by hand: sacreBLEU's resample indices for the seed, each resample's two corpora scored from
    their text by `sacrebleu.corpus_bleu`, then the 2.5th and 97.5th percentiles of the differences by linear
    interpolation between order statistics (not the mean ± half their distance)."""
    base, row = system(0.3, "pa"), system(0.22, "pb")
    resamples, seed, n = 100, 7, len(REFS)
    p, low, high = paired_bootstrap(base, row, REFS, "bleu", resamples, seed)
    idx = np.random.default_rng(seed).choice(n, size=(resamples, n), replace=True)  # sacreBLEU's draw
    diffs = sorted(sacrebleu.corpus_bleu([row[j] for j in i], [[REFS[j] for j in i]]).score
                   - sacrebleu.corpus_bleu([base[j] for j in i], [[REFS[j] for j in i]]).score for i in idx)

    def percentile(q: float) -> float:
        at = q * (resamples - 1)
        lo = math.floor(at)
        return diffs[lo] + (at - lo) * (diffs[lo + 1] - diffs[lo])

    assert (low, high) == pytest.approx((percentile(0.025), percentile(0.975)), rel=1e-6, abs=1e-9)
    mean = sum(diffs) / resamples
    assert mean - low != pytest.approx(high - mean, rel=1e-3)  # skewed: not a symmetric interval


def test_t_interval_against_its_formula():
    values = [2.0, 2.4, 2.9]
    low, high = t_interval(values)
    half = stats.t.ppf(0.975, 2) * np.std(values, ddof=1) / math.sqrt(3)
    assert (low, high) == pytest.approx((np.mean(values) - half, np.mean(values) + half))
    assert all(math.isnan(x) for x in t_interval([1.0]))


def test_rank_intervals_resample_each_studys_seeds():
    """By hand from the same draws: each study's seeds drawn with replacement (a's indices, then b's), each
    variant scored by its mean over the drawn seeds it has, scipy's tau-b and rho, their 2.5th and 97.5th
    percentiles. Seeds that agree give a point; seed noise larger than the gaps gives a wide interval around 0;
    one seed in each study gives none."""
    rng = np.random.default_rng(0)
    truth = np.array([1.0, 2.0, 2.0, 4.0, 3.0, 6.0])  # a tie and a non-monotone order
    a = truth[:, None] + rng.normal(0, 0.8, (6, 3))  # (variants, seeds)
    b = truth[::-1, None] * 0.5 + rng.normal(0, 0.8, (6, 2))
    a[2, 1] = np.nan  # a variant without one seed
    ci = rank_intervals(a, b, 300, 4)
    draws = np.random.default_rng(4)
    ia, ib = draws.integers(0, 3, (300, 3)), draws.integers(0, 2, (300, 2))
    taus, rhos = [], []
    for i, j in zip(ia, ib, strict=True):
        x = [np.nanmean(a[v, i]) for v in range(6)]
        y = [b[v, j].mean() for v in range(6)]
        if not np.isnan(x).any():
            taus.append(stats.kendalltau(x, y).statistic)
            rhos.append(stats.spearmanr(x, y).statistic)
    assert len(taus) < 300  # the resamples that drew only a[2]'s missing seed were left out
    assert ci["tau"] == pytest.approx(tuple(np.nanquantile(taus, [0.025, 0.975])))
    assert ci["rho"] == pytest.approx(tuple(np.nanquantile(rhos, [0.025, 0.975])))
    same = np.repeat(truth[:, None], 3, 1)
    point = stats.kendalltau(truth, truth[::-1]).statistic
    assert rank_intervals(same, same[::-1], 200, 1)["tau"] == pytest.approx((point, point))
    noisy = rank_intervals(truth[:, None] + rng.normal(0, 20, (6, 5)), truth[:, None] + rng.normal(0, 20, (6, 5)),
                           300, 2)
    assert noisy["tau"][0] < 0 < noisy["tau"][1] and noisy["rho"][1] - noisy["rho"][0] > 1
    assert rank_intervals(a[:, :1], b[:, :1], 100, 1) is None


def test_resampling_scores_with_the_tokenizer_of_the_final_evaluations_signature():
    """Chinese text: BLEU with sacreBLEU's zh tokenizer (what `-l en-zh` and a zh recipe pick) differs from 13a;
    the table's scores take the tokenizer from the stored signature."""
    refs = ["我们今天去公园散步。", "这个文件不存在。", "请输入你的密码。"] * 10
    hyps = ["我们今天去公园。", "这个文件不存在。", "请输入密码。"] * 10
    zh = sacrebleu.corpus_bleu(hyps, [refs], tokenize="zh").score
    assert zh != pytest.approx(sacrebleu.corpus_bleu(hyps, [refs]).score)
    bleu = sacrebleu.BLEU(tokenize="zh")
    bleu.corpus_score(hyps, [refs])
    signature = str(bleu.get_signature())
    assert "tok:zh" in signature
    assert corpus_score(hyps, refs, "bleu", signature) == pytest.approx(zh)
    p, _, _ = paired_bootstrap(refs, hyps, refs, "bleu", 50, 1, signature)
    assert p < 0.05


def bleu_rows(tmp: Path, hyps: dict[str, dict[int, list[str]]]) -> list[Row]:
    """Rows of fake trials (the baseline first) whose final test BLEU and stored hypotheses are `hyps`' (report.compare
    reads them as it does a study's)."""
    bleu = BLEU()
    bleu.corpus_score(REFS[:2], [REFS[:2]])
    signature, rows = str(bleu.get_signature()), []
    for name, by_seed in hyps.items():
        trials, values = [], []
        for s, h in by_seed.items():
            write_lines(tmp / f"{name}{s}" / "test.hyp", h)
            write_lines(tmp / f"{name}{s}" / "test.ref", REFS)
            values.append(sacrebleu.corpus_bleu(h, [REFS]).score)
            trials.append(SimpleNamespace(number=len(rows) * 10 + s, user_attrs={"seed": s, "final": {
                "eval_dir": str(tmp / f"{name}{s}"), "test_bleu": values[-1], "bleu_signature": signature}}))
        rows.append(Row(name, name, trials, values, baseline=not rows))
    return rows


def compared(rows: list[Row], metric: str, **significance) -> list[Row]:
    """The rows compared with the first in the study's model (model.compare, what `ablate table` does)."""
    h = SimpleNamespace(spec=SimpleNamespace(metric=metric, significance={**SIGNIFICANCE, "resamples": 50,
                                                                          **significance}),
                        study=SimpleNamespace(user_attrs={}))
    compare(h, rows, rows[0])
    return rows


def test_a_row_with_no_variance_leaves_the_family_and_says_why(tmp_path):
    """A baseline at BLEU 0 on every seed, a dead row also at 0 and a good row far better: Bartlett's test sees
    rows that do not vary beside one that does, so each row keeps its own variance (Welch). The dead row gets no
    test and its p cell says why; the good row keeps its star, in a family of 1. Rows that are all constant, without
    hypotheses: no test (scipy's Welch would say p = 0 for two constants 0.001 apart)."""
    empty = [""] * len(REFS)
    seeds = (1, 2, 3)
    rows = compared(bleu_rows(tmp_path, {"base": {s: empty for s in seeds}, "dead": {s: empty for s in seeds},
                                         "good": {s: system(0.1 + 0.02 * s, f"g{s}") for s in seeds}}),
                    "final/test_bleu")
    base, dead, good = rows
    assert dead.comparison is None and good.comparison.method == "welch"
    assert good.comparison.p_adjusted == good.comparison.p_value < 0.01 and good.significant  # a family of 1
    assert metric_cells(dead, True, 2)[3] == "none: no variance in either row"
    flat = [Row(k, k, [SimpleNamespace(user_attrs={"seed": s}) for s in v], list(v.values()), baseline=k == "base")
            for k, v in (("base", dict.fromkeys(seeds, 2.0)), ("same", dict.fromkeys(seeds, 2.0)),
                         ("apart", dict.fromkeys(seeds, 2.001)), ("one", {1: 2.5}))]
    _, same, apart, one = compared(flat, "val/loss")
    assert stats.ttest_ind([2.001] * 3, [2.0] * 3, equal_var=False).pvalue == 0.0
    for r in (same, apart, one):
        assert r.comparison is None and not r.significant
        assert metric_cells(r, True, 3)[3] == "none: no variance: the model fits every seed"


def test_a_one_seed_study_keeps_sacrebleus_paired_bootstrap_conditional_on_its_seed(tmp_path):
    """One seed: no seed variance, so each row's p and interval are sacreBLEU's paired bootstrap of that seed (the
    p its command line prints), Holm-adjusted over the rows, and the footnote says the inference is conditional on
    seed 7; the rows are flagged (fewer than 3 seeds)."""
    rows = compared(bleu_rows(tmp_path, {"base": {7: system(0.3, "b")}, "close": {7: system(0.29, "c")},
                                         "far": {7: system(0.1, "f")}}), "final/test_bleu")
    base, close, far = rows
    cli = {r.key: sacrebleu_cli(tmp_path / "base7" / "test.ref", tmp_path / "base7" / "test.hyp",
                                tmp_path / f"{r.key}7" / "test.hyp", 50, SIGNIFICANCE["seed"])["bleu"]
           for r in (close, far)}
    assert {r.key: round(r.comparison.p_value, 4) for r in (close, far)} == cli
    want = multiple_holm([close.comparison.p_value, far.comparison.p_value])
    assert [close.comparison.p_adjusted, far.comparison.p_adjusted] == pytest.approx(want)
    assert far.significant and far.comparison.method == "paired bootstrap" and far.comparison.ci_low > 0
    h = SimpleNamespace(spec=SimpleNamespace(metric="final/test_bleu", significance={**SIGNIFICANCE, "resamples": 50},
                                             baseline_reason=lambda: ""))
    model = compare(SimpleNamespace(spec=h.spec, study=SimpleNamespace(user_attrs={})), rows, base)
    note = footnote(h, Table(rows, [], model))
    assert "paired bootstrap of seed 7 alone" in note and "conditional on that seed" in note
    assert "‡ fewer than 3 seeds" in note and metric_cells(far, True, 2)[1] == "1 ‡"
