"""Which factor matters, and do conclusions transfer? `attnlab ablate effects` and `attnlab ablate compare`.

Main effects of a grid: for each factor (an axis, or `variant` for a variants: list), the metric at each of its
values averaged over every other factor and the seeds, with a 95% CI, and each value's difference to the first.
They come from a linear model fitted by least squares to every finished (variant, seed) trial: the metric on
each factor and the seed, a fixed effect (stats.fit_linear), whose estimated marginal means (Searle, Speed &
Milliken 1980) average the model's prediction over the whole grid and the seeds. With every cell finished this is
the plain mean of the table's rows at that value. A trial that failed leaves a hole the model fills from the
others, so a factor's effect is not biased by which seeds are missing (averaging the seeds that finished would
be), and the missing (variant, seed) cells are listed. A two-way interaction adds the pair's interaction to the
model: each cell's mean and its interaction term, cell - its row's mean - its column's mean + the grand mean
(0 everywhere when the two add up), each with its 95% CI; a cell with no finished trial cannot be estimated.
Intervals are t intervals on the model's residual degrees of freedom, conditional on the seeds run.

Transfer between studies (Narang et al. 2021, "Do Transformer Modifications Transfer Across Implementations and
Applications?"): the variants present in both studies are joined on the config fields both of them vary (each
study's other factors averaged over; on the variant names when they share none), printed side by side, and the
rank correlation of their scores, Kendall's tau and Spearman's rho, with exact permutation p-values up to 9
variants, Monte Carlo permutation ones above, and none under 5 or when one study ties every variant
(`stats.rank_correlation`), and 95% percentile intervals from resampling each study's
seeds (`stats.rank_intervals`). Each study's
scores are oriented so that higher is better before ranking (BLEU against loss correlates positively when the
same variants win).
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from ..ablate.factors import fmt
from ..ablate.study import StudyHandle
from .report import Row, collect_rows, digits
from .stats import correlation_text, fit_linear, rank_correlation, rank_intervals

Levels = dict[str, str]  # factor -> value, e.g. {"model.norm": "rmsnorm", "variant": "(A) h=1"}


@dataclass
class Effect:
    levels: tuple[str, ...]  # the value of each factor asked for
    mean: float  # NaN when the model cannot estimate it
    low: float
    high: float
    n_seeds: int  # seeds with a finished trial at these values
    vs_first: tuple[float, float, float] | None = None  # difference to the factor's first value, 95% CI
    interaction: tuple[float, float, float] | None = None  # two-way cells only: the term and its 95% CI
    why: str = ""  # why the mean is not estimable (NaN)


def level_table(h: StudyHandle, rows: list[Row]) -> list[tuple[Levels, dict[int, float]]]:
    """Each finished variant's factor values and its metric per seed, in the file's order of variants."""
    by_key = {r.key: r for r in rows}
    out = []
    for v in h.spec.variants():
        if v.key in by_key:
            r = by_key[v.key]
            out.append((levels_of(v.levels), dict(zip(r.seeds, r.values, strict=True))))
    return out


def levels_of(levels: tuple[str, ...]) -> Levels:
    return dict(level.split("=", 1) for level in levels)


def factors(table: list[tuple[Levels, dict[int, float]]]) -> list[str]:
    return list(table[0][0]) if table else []


def missing_cells(h: StudyHandle, table: list[tuple[Levels, dict[int, float]]]) -> list[str]:
    """The (variant, seed) cells of the grid without a finished trial."""
    done = {(tuple(lv.items()), s) for lv, values in table for s in values}
    return [f"{v.name} (seed {s})" for v in h.spec.variants() for s in h.spec.seeds
            if (tuple(levels_of(v.levels).items()), s) not in done]


class EffectModel:
    """metric ~ intercept + each factor (+ the pair's interaction) + seed, by least squares over every finished
    trial; `grid` (every variant's levels) and the seeds that finished are what the marginal means average over."""

    def __init__(self, table: list[tuple[Levels, dict[int, float]]], grid: list[Levels],
                 pair: tuple[str, str] | None = None):
        self.names, self.grid, self.pair = factors(table), grid, pair
        self.values = {f: list(dict.fromkeys(g[f] for g in grid)) for f in self.names}
        self.seeds = sorted({s for _, values in table for s in values})
        self.table = table
        x = np.array([self.row(lv, s) for lv, values in table for s in values])  # (trials, params)
        y = np.array([v for _, values in table for v in values.values()])  # (trials,)
        self.fit = fit_linear(x, y)

    def row(self, levels: Levels, seed: int) -> list[float]:
        """The design row of a trial: treatment-coded factors, the pair's products, the seed."""
        out = [1.0]
        for f in self.names:
            out += [float(levels[f] == v) for v in self.values[f][1:]]
        if self.pair:
            a, b = self.pair
            out += [float(levels[a] == x and levels[b] == y) for x in self.values[a][1:] for y in self.values[b][1:]]
        return out + [float(seed == s) for s in self.seeds[1:]]

    def mean_of(self, where: Levels) -> np.ndarray:
        """The contrast of the marginal mean at `where`: the design rows of the grid's cells that match it, over
        every seed, averaged."""
        return np.mean([self.row(g, s) for g in self.grid if all(g[k] == v for k, v in where.items())
                        for s in self.seeds], axis=0)

    def effect(self, where: Levels, first: Levels | None = None) -> Effect:
        est = self.fit.estimate(self.mean_of(where))
        n = len({s for lv, values in self.table if all(lv[k] == v for k, v in where.items()) for s in values})
        e = Effect(tuple(where.values()), *(est or (math.nan,) * 3), n, why="" if est else self.why_not(where, n))
        if first is not None and first != where:
            e.vs_first = self.fit.estimate(self.mean_of(where) - self.mean_of(first))
        return e


    def why_not(self, where: Levels, n: int) -> str:
        """Why the mean at `where` is not estimable: no finished trial there, or none at a value of another factor
        that the mean averages over, or the finished trials confound it with the other factors."""
        if n == 0:
            return f"no finished trial with {', '.join(f'{k}={v}' for k, v in where.items())}"
        unseen = [f"{f}={v}" for f in self.names if f not in where for v in self.values[f]
                  if not any(lv[f] == v and values for lv, values in self.table)]
        if unseen:
            return (f"{n} seed(s) finished here, but no trial with {', '.join(unseen)} finished, and the mean "
                    "averages over it")
        return f"{n} seed(s) finished here, but the finished trials cannot separate it from the other factors"


def main_effects(table: list[tuple[Levels, dict[int, float]]], grid: list[Levels]) -> dict[str, list[Effect]]:
    """Each factor's marginal mean at each value, and its difference to the first value (additive model)."""
    m = EffectModel(table, grid)
    return {f: [m.effect({f: v}, {f: m.values[f][0]}) for v in m.values[f]] for f in m.names}


def interaction(table: list[tuple[Levels, dict[int, float]]], grid: list[Levels], a: str, b: str) -> list[Effect]:
    """Cells of factors a x b (model with their interaction), each with its interaction term and 95% CI."""
    m = EffectModel(table, grid, (a, b))
    out = []
    for x in m.values[a]:
        for y in m.values[b]:
            e = m.effect({a: x, b: y})
            e.interaction = m.fit.estimate(m.mean_of({a: x, b: y}) - m.mean_of({a: x}) - m.mean_of({b: y})
                                           + m.mean_of({}))
            out.append(e)
    return out


def fmt_ci(value: float, low: float, high: float, d: int, sign: str = "", why: str = "") -> str:
    if math.isnan(value):
        return f"not estimable ({why or 'the finished trials cannot tell it'})"
    ci = "(no residual df: no CI)" if math.isnan(low) else f"[{low:{sign}.{d}f}, {high:{sign}.{d}f}]"
    return f"{value:{sign}.{d}f} {ci}"


def effects_report(h: StudyHandle, pair: tuple[str, str] | None = None, out_dir: Path | None = None
                   ) -> tuple[str, list[Path]]:
    """The main effects of every factor and the interaction of `pair` (default: the first two factors): the text
    printed, and effects.csv, effects.png in out_dir (default: the study directory)."""
    if h.spec.is_search:
        raise ValueError(f"{h.spec.name} is a search: main effects need a grid (axes: or variants:)")
    rows, _ = collect_rows(h, tests=False)  # the effects need the rows' values, not their tests
    table = level_table(h, rows)
    names = factors(table)
    if not names:
        raise ValueError(f"{h.spec.name}: no finished trials yet")
    pair = pair or (tuple(names[:2]) if len(names) >= 2 else None)
    if pair is not None and any(p not in names for p in pair):
        raise ValueError(f"--pair {' '.join(pair)}: the factors of {h.spec.name} are {', '.join(names)}")
    if pair is not None and pair[0] == pair[1]:
        raise ValueError(f"--pair {' '.join(pair)}: an interaction needs two different factors; "
                         f"the factors of {h.spec.name} are {', '.join(names)}")
    d = digits(rows[0].mean)
    grid = [levels_of(v.levels) for v in h.spec.variants()]
    main = main_effects(table, grid)
    trials = sum(len(values) for _, values in table)
    lines = [f"{h.spec.name}: main effects on {h.spec.metric} ({h.spec.direction} is better): each value averaged "
             f"over the other factors and the seeds, from a linear model (factors + seed) fitted to {trials} "
             "finished trial(s); 95% CI on its residual degrees of freedom"]
    holes = missing_cells(h, table)
    if holes:
        lines.append(f"missing cells ({len(holes)}), filled by the model: " + ", ".join(holes))
    for f, effects in main.items():
        lines.append(f"\n{f}")
        width = max(len(e.levels[0]) for e in effects)
        for e in effects:
            gap = f"  ({fmt_ci(*e.vs_first, d, '+')} vs {effects[0].levels[0]})" if e.vs_first else ""
            lines.append(f"  {e.levels[0]:<{width}}  {fmt_ci(e.mean, e.low, e.high, d, why=e.why)}{gap}")
    cells = interaction(table, grid, *pair) if pair else []
    if pair:
        lines.append(f"\ninteraction {pair[0]} x {pair[1]}: mean [95% CI]; interaction term = cell - row mean - "
                     "column mean + grand mean [95% CI]")
        for c in cells:
            term = f"  interaction {fmt_ci(*c.interaction, d, '+')}" if c.interaction else ""
            lines.append(f"  {c.levels[0]} x {c.levels[1]}:  {fmt_ci(c.mean, c.low, c.high, d, why=c.why)}{term}")
    else:
        lines.append("\n(one factor: no interaction)")
    out_dir = Path(out_dir or h.dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "effects.csv", out_dir / "effects.png"]
    with open(paths[0], "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(["factor", "level", "mean", "ci_low", "ci_high", "n_seeds", "delta_vs_first", "delta_ci_low",
                    "delta_ci_high", "interaction", "interaction_ci_low", "interaction_ci_high"])
        for f, effects in main.items():
            w.writerows([f, e.levels[0], e.mean, e.low, e.high, e.n_seeds, *(e.vs_first or ("", "", "")), "", "", ""]
                        for e in effects)
        for c in cells:
            w.writerow([" x ".join(pair), " x ".join(c.levels), c.mean, c.low, c.high, c.n_seeds, "", "", "",
                        *(c.interaction or ("", "", ""))])
    plot_effects(paths[1], h, main, pair, cells)
    return "\n".join(lines), paths


def plot_effects(path: Path, h: StudyHandle, main: dict[str, list[Effect]], pair: tuple[str, str] | None,
                 cells: list[Effect]) -> None:
    """One panel per factor (mean and 95% CI at each value) and an interaction plot of the pair."""
    panels = len(main) + (pair is not None)
    fig = Figure(figsize=(3.6 * panels, 3.8))
    axes = fig.subplots(1, panels, squeeze=False)[0]
    for ax, (f, effects) in zip(axes, main.items(), strict=False):
        xs = range(len(effects))
        ax.errorbar(xs, [e.mean for e in effects], capsize=4, fmt="o-",
                    yerr=[[0 if math.isnan(e.low) else e.mean - e.low for e in effects],
                          [0 if math.isnan(e.high) else e.high - e.mean for e in effects]])
        ax.set_xticks(list(xs), [e.levels[0] for e in effects], rotation=30, fontsize=8)
        ax.set_title(f, fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(h.spec.metric)
    if pair is not None:
        ax = axes[-1]
        xs = list(dict.fromkeys(c.levels[0] for c in cells))
        for y in dict.fromkeys(c.levels[1] for c in cells):
            pts = {c.levels[0]: c for c in cells if c.levels[1] == y}
            ax.plot([xs.index(x) for x in pts], [c.mean for c in pts.values()], "o-", label=f"{pair[1]}={y}")
        ax.set_xticks(range(len(xs)), xs, rotation=30, fontsize=8)
        ax.set_title(f"{pair[0]} x {pair[1]}", fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle(f"{h.spec.name}: main effects on {h.spec.metric} (95% CI over seeds)", fontsize=10)
    fig.savefig(path, dpi=110, bbox_inches="tight")


# ---------------------------------------------------------------------------------------------- transfer
def varied(h: StudyHandle) -> list[str]:
    """The config fields a study varies, in file order."""
    return list(dict.fromkeys(k for v in h.spec.variants() for k in v.overrides))


def joined_scores(h: StudyHandle, rows: list[Row], keys: list[str]) -> dict[str, dict[int, float]]:
    """Each variant's score per seed by its values of `keys` (from the config it trained with), averaged over the
    rows that share them; by variant name when `keys` is empty."""
    groups: dict[str, dict[int, list[float]]] = {}
    for r in rows:
        config = r.trials[0].user_attrs.get("config") or {}
        if keys:
            name = ", ".join(f"{k.split('.', 1)[1]}={fmt(config.get(k.split('.')[0], {}).get(k.split('.', 1)[1]))}"
                             for k in keys)
        else:
            name = r.variant
        for seed, v in r.by_seed.items():
            groups.setdefault(name, {}).setdefault(seed, []).append(v)
    return {k: {s: sum(v) / len(v) for s, v in by_seed.items()} for k, by_seed in groups.items()}


def oriented(h: StudyHandle, scores: dict[str, dict[int, float]], names: list[str]) -> np.ndarray:
    """(variants, seeds) of `names`' scores, NaN where a variant lacks a seed, signed so that higher is better."""
    seeds = sorted({s for n in names for s in scores[n]})
    sign = 1.0 if h.spec.direction == "max" else -1.0
    return np.array([[sign * scores[n].get(s, math.nan) for s in seeds] for n in names])


def compare_studies(a: StudyHandle, b: StudyHandle) -> str:
    """The side-by-side table of the variants in both studies and the rank correlation of their scores, with
    95% intervals over each study's seeds (stats.rank_intervals)."""
    keys = [k for k in varied(a) if k in set(varied(b))]
    sa, sb = joined_scores(a, collect_rows(a, tests=False)[0], keys), \
        joined_scores(b, collect_rows(b, tests=False)[0], keys)
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
    head = [f"{h.spec.name}: {h.spec.metric} {'↑' if h.spec.direction == 'max' else '↓'} | rank" for h in (a, b)]
    lines += ["", f"| variant | {head[0]} | {head[1]} |", "|---|---:|---:|---:|---:|"]
    for k in sorted(shared, key=lambda k: ra[k]):
        x, y = sign_a * ma[shared.index(k)], sign_b * mb[shared.index(k)]
        lines.append(f"| {k} | {x:.{digits(x)}f} | {ra[k]} | {y:.{digits(y)}f} | {rb[k]} |")
    if len(shared) < 3:
        lines.append(f"\n{len(shared)} shared variant(s): too few for a rank correlation")
        return "\n".join(lines)
    r = rank_correlation(ma, mb)
    sig = a.spec.significance
    ci = rank_intervals(va, vb, sig["resamples"], sig["seed"])

    def stat(name: str, p: float | None) -> str:
        return correlation_text(r, ci, name) + (f" (p = {p:.3g})" if p is not None else "")

    lines.append(f"\nKendall's tau = {stat('tau', r['tau_p'])}, Spearman's rho = {stat('rho', r['rho_p'])}, "
                 f"n = {r['n']}" + (f": {r['why']}" if r["why"] else f"; {r['p_method']}"))
    lines.append("scores oriented so that higher is better in both; " + (
        f"CIs: percentile intervals over {sig['resamples']} resamples of each study's seeds" if ci is not None
        else "no CI: each study has 1 seed"))
    return "\n".join(lines)
