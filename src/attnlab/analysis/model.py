"""A study's rows in the one inference model (inference.py): what `ablate table`, `ablate effects` and
`ablate compare` all test with, so that the three print the same Δ, interval and p for the same pair.

The model holds every row of the study that can be compared with the baseline (a row whose sacreBLEU signature
differs is refused and left out): its score on each seed (for BLEU and chrF rescored by sacreBLEU from the
stored hypotheses), the fit (pooled over the rows with the seed as a block, else Welch with the reason), and,
when the test set is a sample (`significance.population: sample`, the default), the covariance that resampling
its sentences gives (testset.py). A study of one seed has no seed variance: each row against the baseline is
sacreBLEU's paired bootstrap of that seed (Koehn 2004), conditional on it, Holm-adjusted over the rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..ablate.study import StudyHandle, final_scores
from . import inference, multiple, testset
from .columns import FINAL_METRIC
from .rows import Row, hypotheses

FEW_SEEDS = 3  # rows with fewer seeds are flagged in the table


@dataclass
class Comparison:
    """A row against the baseline, as the table prints it."""

    method: str  # "pooled", "welch" or "paired bootstrap"
    estimate: float  # Δ: the model's difference to the baseline
    p_value: float  # the comparison alone
    p_adjusted: float  # adjusted for the family (Dunnett, Holm), the p cell; p_value when uncorrected
    ci_low: float  # the interval, simultaneous for the family when adjusted
    ci_high: float
    se: float
    df: float
    seeds: tuple[int, ...]  # the row's seeds in the model
    adjust: str
    per_seed: dict[int, float] = field(default_factory=dict)  # sacreBLEU paired-bootstrap p of each shared seed
    per_seed_ci: dict[int, tuple[float, float]] = field(default_factory=dict)  # its 95% percentile interval


@dataclass
class StudyModel:
    keys: list[str]  # the rows in the model, the reference (baseline) first
    seeds: list[int]
    y: np.ndarray  # (k, n) each row's score on each seed, NaN where it has none
    ystar: np.ndarray | None  # (B, k, n) the scores on resampled test sentences, when hypotheses are stored
    g: np.ndarray | None  # (k, k) the test set's sampling covariance; None: conditional on the test set
    population: str  # what the intervals cover: "sample" (seeds and test sentences) or "test_set" (seeds)
    population_why: str  # why the test set is held fixed when the file asked for a sample
    fit: inference.Fit | None  # the fit tested with (pooled or Welch); None without seed variance
    method: str  # "pooled", "welch", "paired bootstrap", or "" (no test)
    why: str  # why not pooled (the design, or Bartlett's test)
    variance_p: float  # Bartlett's p (NaN when not checked)
    refused: dict[str, str]  # key -> why the row is not in the model
    correction: str  # significance.correction
    level: float  # 1 - significance.level

    @property
    def k(self) -> int:
        return len(self.keys)

    def family(self, lin: np.ndarray, adjust: str, intervals: bool = True) -> inference.Tested:
        """The contrasts lin (q, k) of the row means tested as one family on the model's fit."""
        fit = inference.with_test_set(self.fit, self.g)
        return inference.family(fit, lin, adjust if self.method == "pooled" or adjust == "tukey" else
                                ("none" if adjust == "none" else "holm"), self.level, intervals)

    def means(self, lin: np.ndarray) -> inference.Tested:
        """Linear combinations lin (q, k) of the row means (marginal means), each with its own interval."""
        return inference.family(inference.with_test_set(self.fit, self.g), lin, "none", self.level)


def signature_of(h: StudyHandle, r: Row, score: str) -> list[str]:
    return sorted({final_scores(t, h.study.user_attrs).get(f"{score}_signature", "") for t in r.trials})


def study_model(h: StudyHandle, rows: list[Row], base: Row | None = None) -> StudyModel:
    """The model of a study's rows, `base` (default: the first row) as the reference."""
    spec, sig, attrs = h.spec, h.spec.significance, h.study.user_attrs
    base = base or rows[0]
    final = FINAL_METRIC.match(spec.metric)
    score = final.group(2) if final and final.group(2) in ("bleu", "chrf") else ""
    refused = {}
    if score:
        want = signature_of(h, base, score)
        for r in rows:
            got = signature_of(h, r, score)
            if r is not base and (len(got) > 1 or got != want):
                refused[r.key] = (f"its sacreBLEU signature(s) {' ; '.join(got)} differ from the baseline's "
                                  f"{' ; '.join(want)} (scores made another way are not comparable)")
    kept = [base] + [r for r in rows if r is not base and r.key not in refused]
    seeds = sorted({s for r in kept for s in r.seeds})
    y = np.full((len(kept), len(seeds)), np.nan)
    for i, r in enumerate(kept):
        for s, v in r.by_seed.items():
            y[i, seeds.index(s)] = v
    ystar = None
    if score:
        texts = {(i, seeds.index(int(t.user_attrs.get("seed", 0)))): hypotheses(t, final.group(1), attrs)
                 for i, r in enumerate(kept) for t in r.trials}
        if texts and all(texts.values()):
            y, ystar, _ = rescored(texts, y.shape, score, signature_of(h, base, score)[0], sig["resamples"],
                                           sig["seed"])
    population, why_fixed, g = sig["population"], "", None
    if population == "sample":
        if ystar is None:
            why_fixed = (f"{spec.metric} has no per-sentence scores stored" if not score else
                         "some trials' hypotheses are not stored")
        else:
            g = testset.test_set_cov(ystar)
    model = fitted([r.key for r in kept], seeds, y, ystar, g, "none" if sig["correction"] == "none" else
                   "dunnett", 1 - sig["level"])
    model.refused, model.population_why = refused, why_fixed
    return model


def fitted(keys: list[str], seeds: list[int], y: np.ndarray, ystar: np.ndarray | None = None,
           g: np.ndarray | None = None, correction: str = "dunnett", level: float = 0.95) -> StudyModel:
    """The model of the scores y (k rows, n seeds; NaN where a row lacks a seed), the first row the reference:
    pooled when the seeds connect the rows and Bartlett's test lets it, else Welch, else (no row with 2 seeds)
    sacreBLEU's paired bootstrap when resampled scores ystar are there, else no test."""
    mask = np.isfinite(y)
    pool, wel, use, p_check, why = inference.choose(y, mask)
    variance_p = float(p_check) if np.ndim(p_check) == 0 else math.nan
    if pool is not None and bool(use):
        fit, method = pool, "pooled"
    else:
        if pool is not None:
            why = f"Bartlett's test says the rows' variances over their seeds differ (p = {variance_p:.3g})"
        fit, method = wel, "welch"
        if all(np.isnan(v).any() for v, _ in wel.parts):  # no row has 2 seeds: no seed variance at all
            fit, method = None, "paired bootstrap" if ystar is not None else ""
    return StudyModel(keys, seeds, y, ystar, g, "sample" if g is not None else "test_set", "", fit, method,
                      why, variance_p, {}, correction, level)


def rescored(texts: dict[tuple[int, int], tuple[list[str], list[str]]], shape: tuple[int, int], score: str,
             signature: str, resamples: int, seed: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Each cell's corpus score (k, n), its scores on `resamples` resamples of the test sentences (B, k, n), the
    same sentences for every cell, and the number of sentences; the cells' references must be the same split."""
    refs = next(iter(texts.values()))[1]
    for (i, j), (_, r) in texts.items():
        if r != refs:
            raise ValueError(f"row {i}, seed position {j}: its references differ from the others'; the rows were "
                             "not scored on the same split")
    counts = testset.resample_counts(len(refs), resamples, seed)
    y, ystar = np.full(shape, np.nan), np.full((resamples,) + shape, np.nan)
    for (i, j), (hyps, r) in texts.items():
        stats = testset.sentence_stats(hyps, r, score, signature)
        y[i, j] = testset.corpus(stats, score, signature)
        ystar[:, i, j] = testset.resampled(stats, counts, score, signature)
    return y, ystar, len(refs)


def compare(h: StudyHandle, rows: list[Row], base: Row) -> StudyModel:
    """Every row against the baseline in the study's model: sets each row's comparison, Δ, star and why it has no
    test; returns the model (the table's footnote reads it)."""
    model = study_model(h, rows, base)
    by_key = {r.key: r for r in rows}
    for r in rows:
        r.baseline_seeds = base.seeds
        r.refused = model.refused.get(r.key, "")
        r.delta = r.mean - base.mean
    others = model.keys[1:]
    if not others:
        return model
    per_seed = paired_by_seed(model)
    if model.method in ("pooled", "welch"):
        tested = model.family(inference.versus(model.k, 0, list(range(1, model.k))), model.correction)
        for m, key in enumerate(others, start=1):
            r = by_key[key]
            r.delta = float(tested.estimate[m - 1])
            if not np.isfinite(tested.p[m - 1]):
                r.untested = untested_reason(model, m, float(tested.se[m - 1]))
                continue
            each = [float(x[m - 1]) for x in (tested.p_raw, tested.p, tested.low, tested.high, tested.se, tested.df)]
            r.comparison = Comparison(model.method, r.delta, *each, tuple(r.seeds), tested.adjust,
                                      *per_seed.get(key, ({}, {})))
    elif model.method == "paired bootstrap":
        one_seed(model, by_key, per_seed)
    else:
        for key in others:
            by_key[key].untested = "1 seed: no seed variance to test against (a test needs 2)"
    family = [by_key[k] for k in others if by_key[k].comparison is not None]
    for r in family:
        r.significant = r.comparison.p_adjusted < 1 - model.level
    return model


def untested_reason(model: StudyModel, m: int, se: float) -> str:
    if se == 0:
        return "no variance in either row" if model.method == "welch" else "no variance: the model fits every seed"
    if model.method == "welch":
        return f"{int(np.isfinite(model.y[m]).sum())} seed(s) and no pooled variance ({model.why}): a test needs 2"
    return "not estimable: its seeds do not connect it to the baseline"


def paired_by_seed(model: StudyModel) -> dict[str, tuple[dict[int, float], dict[int, tuple[float, float]]]]:
    """sacreBLEU's paired bootstrap of every row against the baseline on each seed both have (table.csv)."""
    if model.ystar is None:
        return {}
    out = {}
    for i, key in enumerate(model.keys[1:], start=1):
        p, ci = {}, {}
        for j, s in enumerate(model.seeds):
            if np.isfinite(model.y[0, j]) and np.isfinite(model.y[i, j]):
                p[s], low, high = testset.paired_p(model.ystar[:, 0, j], model.ystar[:, i, j], model.y[0, j],
                                                   model.y[i, j])
                ci[s] = (low, high)
        out[key] = (p, ci)
    return out


def one_seed(model: StudyModel, by_key: dict[str, Row], per_seed: dict) -> None:
    """A study of one seed: each row's sacreBLEU paired bootstrap on the seed it shares with the baseline, its
    percentile interval, Holm over the rows (conditional on that seed: no seed variance is measured)."""
    found = []
    for key in model.keys[1:]:
        p, ci = per_seed.get(key, ({}, {}))
        if not p:
            by_key[key].untested = "no seed shared with the baseline"
            continue
        s = min(p)
        i = model.keys.index(key)
        j = model.seeds.index(s)
        found.append((key, Comparison("paired bootstrap", float(model.y[i, j] - model.y[0, j]), p[s], math.nan,
                                      *ci[s], math.nan, math.nan, (s,), "holm", p, ci)))
    adjusted = multiple.holm(np.array([c.p_value for _, c in found])) if model.correction != "none" else \
        np.array([c.p_value for _, c in found])
    for (key, c), p in zip(found, adjusted, strict=True):
        c.p_adjusted = float(p)
        c.adjust = "holm" if model.correction != "none" else "none"
        by_key[key].comparison = c
        by_key[key].delta = c.estimate


def detectable(model: StudyModel) -> float:
    """The minimum detectable Δ at 80% power of the family against the baseline: the noncentral t's answer from
    the model's own variance (the median comparison's se, the family's critical value and degrees of freedom)."""
    if model.method not in ("pooled", "welch") or model.k < 2:
        return math.nan
    tested = model.family(inference.versus(model.k, 0, list(range(1, model.k))), model.correction)
    ok = np.isfinite(tested.se) & (tested.se > 0) & np.isfinite(tested.critical)
    if not ok.any():
        return math.nan
    return multiple.detectable(float(np.median(tested.se[ok])), float(np.min(tested.df[ok])),
                               float(np.median(tested.critical[ok])))
