"""Do conclusions transfer? `attnlab ablate compare A B` (Narang et al. 2021, "Do Transformer Modifications Transfer
Across Implementations and Applications?").

The variants present in both studies are joined on the config fields both of them vary (each study's other
factors averaged over; on the variant names when they share none) and printed side by side: each study's mean,
its difference to that study's baseline with the 95% interval and adjusted p of the study's own inference model
(model.py: the numbers `ablate table` prints for the same pair, Dunnett over the joined variants), and its rank.
Then the rank correlation of their scores, Kendall's tau and Spearman's rho (ranks.py), with exact permutation
p-values up to 9 variants, Monte Carlo ones above, none under 5 or when one study ties every variant, and 95%
percentile intervals from resampling each study's seeds when both have at least ranks.MIN_SEEDS. Each study's
scores are oriented so that higher is better before ranking (BLEU against loss correlates positively when the
same variants win).
"""

from __future__ import annotations

import math

import numpy as np

from ..ablate.factors import fmt
from ..ablate.study import StudyHandle
from .model import study_model
from .ranks import correlation_text, rank_correlation, rank_intervals, withheld
from .report import digits
from .rows import Row, collect_rows


def varied(h: StudyHandle) -> list[str]:
    """The config fields a study varies, in file order."""
    return list(dict.fromkeys(k for v in h.spec.variants() for k in v.overrides))


def joined_name(r: Row, keys: list[str]) -> str:
    """A row's values of `keys` (from the config it trained with), or its variant name when `keys` is empty."""
    if not keys:
        return r.variant
    config = r.trials[0].user_attrs.get("config") or {}
    return ", ".join(f"{k.split('.', 1)[1]}={fmt(config.get(k.split('.')[0], {}).get(k.split('.', 1)[1]))}"
                     for k in keys)


def joined_scores(rows: list[Row], keys: list[str]) -> dict[str, dict[int, float]]:
    """Each joined variant's score per seed, averaged over the rows that share its values of `keys`."""
    groups: dict[str, dict[int, list[float]]] = {}
    for r in rows:
        for seed, v in r.by_seed.items():
            groups.setdefault(joined_name(r, keys), {}).setdefault(seed, []).append(v)
    return {k: {s: sum(v) / len(v) for s, v in by_seed.items()} for k, by_seed in groups.items()}


def joined_deltas(h: StudyHandle, rows: list[Row], keys: list[str]) -> dict[str, str]:
    """Each joined variant's difference to the baseline's, from the study's model: the mean of its rows' means
    minus the baseline group's, Dunnett-adjusted over the groups (Holm where the model is Welch's), as printed."""
    base = next((r for r in rows if r.baseline), None)
    if base is None:
        return {}
    model = study_model(h, rows, base)
    if model.method not in ("pooled", "welch"):
        return {}
    groups: dict[str, list[int]] = {}
    for i, key in enumerate(model.keys):
        groups.setdefault(joined_name(next(r for r in rows if r.key == key), keys), []).append(i)
    ref = joined_name(base, keys)
    names = [n for n in groups if n != ref]
    lin = np.zeros((len(names), model.k))
    for m, n in enumerate(names):
        lin[m, groups[n]] += 1 / len(groups[n])
        lin[m, groups[ref]] -= 1 / len(groups[ref])
    tested = model.family(lin, model.correction)
    d = digits(float(np.nanmax(np.abs(model.y)))) if np.isfinite(model.y).any() else 2
    out = {ref: "baseline"}
    for m, n in enumerate(names):
        if math.isfinite(tested.p[m]):
            out[n] = (f"{tested.estimate[m]:+.{d}f} [{tested.low[m]:+.{d}f}, {tested.high[m]:+.{d}f}] "
                      f"p {tested.p[m]:.3g}" + ("*" if tested.p[m] < 1 - model.level else ""))
    return out


def oriented(h: StudyHandle, scores: dict[str, dict[int, float]], names: list[str]) -> np.ndarray:
    """(variants, seeds) of `names`' scores, NaN where a variant lacks a seed, signed so that higher is better."""
    seeds = sorted({s for n in names for s in scores[n]})
    sign = 1.0 if h.spec.direction == "max" else -1.0
    return np.array([[sign * scores[n].get(s, math.nan) for s in seeds] for n in names])


def compare_studies(a: StudyHandle, b: StudyHandle) -> str:
    """The side-by-side table of the variants in both studies, each with its difference to its study's baseline,
    and the rank correlation of their scores, with 95% intervals over each study's seeds (ranks.rank_intervals)."""
    keys = [k for k in varied(a) if k in set(varied(b))]
    rows_a, rows_b = collect_rows(a)[0], collect_rows(b)[0]
    sa, sb = joined_scores(rows_a, keys), joined_scores(rows_b, keys)
    shared = [k for k in sa if k in sb]
    on = f"the fields both vary ({', '.join(keys)}; other factors averaged over)" if keys else "variant names"
    lines = [f"{a.spec.name} vs {b.spec.name}: {len(shared)} variant(s) in both, joined on {on}"]
    if not shared:
        return "\n".join(lines)
    # oriented: higher is better in both, so that rank 1 is each study's best
    va, vb = oriented(a, sa, shared), oriented(b, sb, shared)  # (variants, seeds) each
    ma, mb = np.nanmean(va, axis=1), np.nanmean(vb, axis=1)  # (variants,)
    sign_a, sign_b = (1.0 if h.spec.direction == "max" else -1.0 for h in (a, b))
    ra, rb = ({k: i + 1 for i, k in enumerate(sorted(shared, key=lambda k, m=m: -m[shared.index(k)]))}
              for m in (ma, mb))
    da, db = joined_deltas(a, rows_a, keys), joined_deltas(b, rows_b, keys)
    head = [f"{h.spec.name}: {h.spec.metric} {'↑' if h.spec.direction == 'max' else '↓'} | Δ [95% CI] p | rank"
            for h in (a, b)]
    lines += ["", f"| variant | {head[0]} | {head[1]} |", "|---|---:|---:|---:|---:|---:|---:|"]
    for k in sorted(shared, key=lambda k: ra[k]):
        x, y = sign_a * ma[shared.index(k)], sign_b * mb[shared.index(k)]
        lines.append(f"| {k} | {x:.{digits(x)}f} | {da.get(k, '')} | {ra[k]} | {y:.{digits(y)}f} | {db.get(k, '')} "
                     f"| {rb[k]} |")
    if da or db:
        lines.append("Δ: each study's difference to its baseline from its own model (as `ablate table` prints it), "
                     "adjusted over its joined variants; * adjusted p below its level")
    if len(shared) < 3:
        lines.append(f"\n{len(shared)} shared variant(s): too few for a rank correlation")
        return "\n".join(lines)
    r = rank_correlation(ma, mb)
    sig = a.spec.significance
    why = withheld({a.spec.name: va.shape[1], b.spec.name: vb.shape[1]})
    ci = None if why else rank_intervals(va, vb, sig["resamples"], sig["seed"])

    def stat(name: str, p: float | None) -> str:
        return correlation_text(r, ci, name) + (f" (p = {p:.3g})" if p is not None else "")

    lines.append(f"\nKendall's tau = {stat('tau', r['tau_p'])}, Spearman's rho = {stat('rho', r['rho_p'])}, "
                 f"n = {r['n']}" + (f": {r['why']}" if r["why"] else f"; {r['p_method']}"))
    lines.append("scores oriented so that higher is better in both; " + (
        f"CIs: percentile intervals over {sig['resamples']} resamples of each study's seeds" if ci is not None
        else f"no CI: {why}"))
    return "\n".join(lines)

