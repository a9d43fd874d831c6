"""How often the table's test is wrong, and how often it finds a real difference: simulated studies pushed through
the functions the table uses (inference.against_baseline on each seed's corpus score, testset.test_set_cov on
the scores of resampled test sentences), thousands at once. `attnlab ablate power` prints the README's table
(docs/significance_power.md); tests/test_ablate_power.py runs a smaller one, and runs a few studies through the
whole text -> sacreBLEU -> table path to show that these functions are what the table computes.

A simulated study (issue 41): k variants (the first the baseline) x n seeds x m test sentences. Sentence i of
trial (variant v, seed s) scores
    difficulty_i + strength_{v,i} + shared_s + own_{v,s} + noise_{v,s,i} + delta_v,
a sentence's difficulty shared by every trial; a variant's per-sentence strengths that repeat on all its seeds,
zero on average over the sentence population, of an SD that gives the difference of two variants' corpus scores
the SD `sentence_effect_sd`; a seed part shared by every variant (data order, initialisation) and one of the
trial's own; sentence noise of SD `sentence_sd` (300 sentences at SD 10: 0.58 points in a corpus score). The
corpus score is the mean over sentences. The second variant is better by `delta`; the others equal the baseline.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from . import inference, multiple, testset
from .stats import welch

ALPHA = 0.05


@dataclass(frozen=True)
class Setting:
    seeds: int
    variants: int = 4
    shared_sd: float = 0.0  # the seed part every variant shares
    own_sd: float = 0.0  # each trial's own seed part
    sentence_effect_sd: float = 0.0  # SD of two variants' corpus difference from strengths repeating across seeds
    delta: float = 0.0  # the true effect of the second variant
    noisy_sd: float = 0.0  # when set, the last variant's own seed part has this SD instead (unequal variances)
    sentences: int = 300
    sentence_sd: float = 10.0
    population: str = "sample"

    @property
    def label(self) -> str:
        seed = f"shared {self.shared_sd:g} + own {self.own_sd:g}" if self.shared_sd else f"{self.own_sd:g}"
        return f"{self.seeds} seeds, seed SD {seed}, sentence effects {self.sentence_effect_sd:g}, Δ {self.delta:g}"


def simulate(rng: np.random.Generator, s: Setting, studies: int) -> np.ndarray:
    """Per-sentence scores (studies, variants, seeds, sentences) of the module docstring's model."""
    k, n, m = s.variants, s.seeds, s.sentences
    tau = s.sentence_effect_sd * math.sqrt(m / 2)  # Var(mean_i u_vi - mean_i u_0i) = 2 tau^2 / m
    x = rng.normal(0.0, s.sentence_sd, (studies, k, n, m))  # noise
    x += rng.normal(30.0, 8.0, (studies, 1, 1, m))  # difficulty
    if tau:  # zero on average over the sentence population, not over this test set
        x += rng.normal(0.0, tau, (studies, k, 1, m))
    own = np.full((k, 1, 1), s.own_sd)
    if s.noisy_sd:
        own[-1] = s.noisy_sd
    x += rng.normal(0.0, s.shared_sd, (studies, 1, n, 1)) + rng.normal(0.0, 1.0, (studies, k, n, 1)) * own
    x[:, 1] += s.delta
    return x


def analyse(x: np.ndarray, population: str = "sample", resamples: int = 200, seed: int = 12345,
            skip_above: float | None = ALPHA) -> tuple[np.ndarray, np.ndarray]:
    """The table's adjusted p-values (studies, variants - 1) of every variant against the first, and per study
    whether the pooled model was used: corpus scores, the test set's covariance from `resamples` resamples of
    the sentences (sacreBLEU's indices for `seed`), inference.against_baseline."""
    studies, k, n, m = x.shape
    y = x.mean(-1)  # (studies, k, n) each trial's corpus score
    g = None
    if population == "sample":
        counts = testset.resample_counts(m, resamples, seed).astype(float)  # (B, m)
        ystar = (x.reshape(-1, m) @ counts.T / m).reshape(studies, k, n, resamples)  # (studies, k, n, B)
        g = testset.test_set_cov(np.moveaxis(ystar, -1, 1))
    tested, use, _, _ = inference.against_baseline(y, np.ones((k, n), bool), 0, g, level=1 - ALPHA,
                                                   intervals=False, skip_above=skip_above)
    return tested.p, use


def today(x: np.ndarray) -> np.ndarray:
    """The table before issue 41: Welch's t-test of each variant's seed scores against the baseline's, unpaired,
    Holm over the variants (studies, variants - 1)."""
    y = x.mean(-1)
    p = np.stack([welch(y[:, 0], y[:, v])[0] for v in range(1, y.shape[1])], -1)
    return multiple.holm(p)


def rates(p: np.ndarray, effect: bool, delta_at: int = 0) -> dict[str, float]:
    """Rejection rates at ALPHA: of a null comparison (per comparison, and the highest of any one comparison),
    of any null one in a study (family-wise), and of the comparison at index delta_at (power; null too when
    there is no effect, and then counted in the others)."""
    reject = np.nan_to_num(p, nan=1.0) < ALPHA
    nulls = reject if not effect else np.delete(reject, delta_at, 1)
    return {"size": float(nulls.mean()), "worst": float(nulls.mean(0).max()), "familywise": float(nulls.any(1).mean()),
            "power": float(reject[:, delta_at].mean())}


def run(settings: list[Setting], studies: int, seed: int = 0, chunk: int = 1000, resamples: int = 200,
        compare_today: bool = True) -> list[dict]:
    """Each setting's rates over `studies` simulated studies (in chunks), the new table's and today's."""
    out = []
    for i, s in enumerate(settings):
        rng = np.random.default_rng([seed, i])
        new, old, pooled = [], [], []
        for start in range(0, studies, chunk):
            x = simulate(rng, s, min(chunk, studies - start))
            p, use = analyse(x, s.population, resamples)
            new.append(p)
            pooled.append(use)
            if compare_today:
                old.append(today(x))
        row = {"setting": asdict(s), "studies": studies, "new": rates(np.concatenate(new), bool(s.delta)),
               "pooled_share": float(np.concatenate(pooled).mean())}
        if compare_today:
            row["today"] = rates(np.concatenate(old), bool(s.delta))
        out.append(row)
    return out


def readme_settings() -> list[Setting]:
    """The README's table: the null grid of issue 41 (seed SD 0 / 1.3 / 3, per-variant sentence effects 0 / 0.41
    / 0.82, 2 / 3 / 5 seeds, 4 variants), the power targets (Δ 1.5 with a shared seed part of SD 1.2 and an own
    one of 0.5; with independent seed noise of SD 1.3), the test set held fixed (population: test_set) under
    sentence effects, and one variant whose seeds vary 6 times as much as the others' (unequal variances)."""
    null = [Setting(n, own_sd=sd, sentence_effect_sd=e) for n in (2, 3, 5) for sd in (0.0, 1.3, 3.0)
            for e in (0.0, 0.41, 0.82)]
    shared = [Setting(n, shared_sd=1.2, own_sd=0.5) for n in (3, 5)]
    power = [replace(s, delta=1.5) for s in shared] + [Setting(n, own_sd=1.3, delta=1.5) for n in (3, 5)]
    fixed = [Setting(5, own_sd=1.3, sentence_effect_sd=e, population="test_set") for e in (0.41, 0.82)]
    unequal = [Setting(n, shared_sd=sh, own_sd=0.5, noisy_sd=3.0) for sh in (0.0, 1.2) for n in (3, 5)]
    return null + shared + power + fixed + unequal


def markdown(results: list[dict], command: str, seconds: float) -> str:
    """The README's table of `results` (run's)."""
    lines = [f"`{command}`: {results[0]['studies']:,} simulated studies per row, 4 variants, 300 test sentences "
             f"(0.58 points of sentence noise in a corpus score), α = {ALPHA}; {seconds / 60:.1f} min. Size: how "
             "often a variant with no true difference is starred (over the null comparisons; the worst single "
             "comparison beside it); family-wise: studies with any such star; power: how often the variant "
             "with a true +Δ is starred. Now: the table's test (pooled model, Dunnett; the test set a sample "
             "unless the row says test_set); before: Welch's test of each row's seeds with Holm, the table before "
             "issue 41.", "",
             "| seeds | seed SD (shared + own) | sentence effects SD | population | Δ | size | worst | family-wise | "
             "power | pooled | size, before | family-wise, before | power, before |",
             "|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    def pct(d: dict, k: str) -> str:
        return f"{100 * d[k]:.1f}%" if k in d else ""

    for r in results:
        s, new, old = r["setting"], r["new"], r.get("today", {})
        sd = f"{s['shared_sd']:g} + {s['own_sd']:g}" if s["shared_sd"] else f"{s['own_sd']:g}"
        sd += f" (one variant {s['noisy_sd']:g})" if s["noisy_sd"] else ""

        def power(d: dict, s: dict = s) -> str:
            return pct(d, "power") if s["delta"] else ""

        lines.append(f"| {s['seeds']} | {sd} | {s['sentence_effect_sd']:g} | {s['population']} | {s['delta']:g} | "
                     f"{pct(new, 'size')} | {pct(new, 'worst')} | {pct(new, 'familywise')} | {power(new)} | "
                     f"{100 * r['pooled_share']:.0f}% | {pct(old, 'size')} | {pct(old, 'familywise')} | "
                     f"{power(old)} |")
    return "\n".join(lines)


def power_table(studies: int, out: Path | None, command: str) -> str:
    """Run the README's settings and write the table (markdown) and the raw numbers (JSON) beside it."""
    t0 = time.perf_counter()
    results = run(readme_settings(), studies)
    text = markdown(results, command, time.perf_counter() - t0)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n", encoding="utf-8")
        out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    return text
