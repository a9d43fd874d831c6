"""Which factor matters? `attnlab ablate effects`: main effects of a grid and a two-way interaction, from the study's
one inference model (model.py), the one the table tests with.

Each variant is a cell of the grid, and its mean is the model's row mean (metric ~ variant + seed: a seed that
failed in one cell does not bias it, and the cells may interact however they do). A factor's marginal mean at a
value is the average of the cells with that value over every other factor's values, the estimated marginal mean
of the cell-means model (Searle, Speed & Milliken 1980, "Population marginal means in the linear model"); with
every cell finished it is the plain mean of the table's rows at that value. Its difference to the baseline's
value is a contrast of those cells tested on the model's variance (pooled over every variant, with the test
set's sampling when the file says so), Dunnett-adjusted over the factor's values: for a study of one factor these
are the table's Δ, interval and p. A factor of 3 or more values also gets every pair of values, Tukey-adjusted.

A marginal mean that averages over a cell with no finished trial is not estimated, and the cell is named: an
additive model (factors + seed) would fill the cell by assuming the factors do not interact, and where they do
that biases the effect (a true +1 read as 0.60 or 1.40 with one cell missing; tests/test_ablate_effects.py).
A two-way interaction (`--pair A B`) gives each cell of A x B (averaged over the other factors) its mean, its
difference to the baseline's cell (Dunnett over the cells: the table's numbers when A and B are the only
factors), and its interaction term, cell - row mean - column mean + grand mean, with a 95% interval.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from ..ablate.study import StudyHandle
from . import inference
from .model import StudyModel, fitted, study_model
from .report import digits
from .rows import collect_rows

Levels = dict[str, str]  # factor -> value, e.g. {"model.norm": "rmsnorm", "variant": "(A) h=1"}


@dataclass
class Effect:
    levels: tuple[str, ...]  # the value of each factor asked for
    mean: float  # NaN when not estimated
    low: float
    high: float
    n_seeds: int  # seeds with a finished trial at these values
    vs_base: tuple[float, float, float, float] | None = None  # Δ to the baseline's value, its interval, adjusted p
    interaction: tuple[float, float, float] | None = None  # two-way cells only: the term and its 95% CI
    why: str = ""  # why the mean is not estimated (NaN)


@dataclass
class Grid:
    """A study's grid in its model: each variant's factor values and its row in the model."""

    names: list[str]  # the factors
    cells: list[Levels]  # every variant's values, in the file's order
    rows: list[int | None]  # each cell's row in the model (None: no finished trial, or refused)
    seeds: list[set[int]]  # the seeds that finished in each cell
    reference: Levels  # the baseline's values (the first cell's when there is no baseline)
    model: StudyModel

    def values(self, f: str) -> list[str]:
        return list(dict.fromkeys(c[f] for c in self.cells))

    def matching(self, where: Levels) -> list[int]:
        return [i for i, c in enumerate(self.cells) if all(c[k] == v for k, v in where.items())]

    def average(self, where: Levels) -> tuple[np.ndarray | None, str]:
        """The contrast (k,) of the model's rows that averages the cells at `where`, or None and why."""
        idx = self.matching(where)
        holes = [i for i in idx if self.rows[i] is None]
        if holes:
            named = "; ".join(", ".join(f"{k}={v}" for k, v in self.cells[i].items()) for i in holes)
            return None, (f"it averages over {named}, with no finished trial (an additive fill-in would assume "
                          "the factors do not interact)")
        c = np.zeros(self.model.k)
        for i in idx:
            c[self.rows[i]] += 1 / len(idx)
        return c, ""

    def n_seeds(self, where: Levels) -> int:
        return len(set().union(*(self.seeds[i] for i in self.matching(where))))


def levels_of(levels: tuple[str, ...]) -> Levels:
    return dict(level.split("=", 1) for level in levels)


def study_grid(h: StudyHandle) -> Grid:
    """The study's grid with its model (every finished variant; the baseline's values the reference)."""
    rows, _ = collect_rows(h)
    if not rows:
        raise ValueError(f"{h.spec.name}: no finished trials yet")
    base = next((r for r in rows if r.baseline), None)
    model = study_model(h, rows, base or rows[0])
    variants = h.spec.variants()
    by_key = {r.key: r for r in rows}
    cells = [levels_of(v.levels) for v in variants]
    in_model = [v.key if v.key in model.keys else None for v in variants]
    reference = next((c for c, v in zip(cells, variants, strict=True) if base and v.key == base.key), cells[0])
    return Grid(list(cells[0]), cells, [model.keys.index(k) if k else None for k in in_model],
                [set(by_key[v.key].seeds) if v.key in by_key else set() for v in variants], reference, model)


def table_grid(table: list[tuple[Levels, dict[int, float]]], cells: list[Levels], reference: Levels | None = None,
               correction: str = "dunnett") -> Grid:
    """A grid from (levels, {seed: value}) of its finished cells, for tests and simulations; the reference (default
    the first cell) must have finished."""
    reference = reference or cells[0]
    done = [(lv, v) for lv, v in table if v]
    done.sort(key=lambda t: t[0] != reference)  # the reference first: the model's baseline row
    seeds = sorted({s for _, v in done for s in v})
    y = np.array([[v.get(s, np.nan) for s in seeds] for _, v in done])
    model = fitted([str(i) for i in range(len(done))], seeds, y, correction=correction)
    row_of = [next((i for i, (lv, _) in enumerate(done) if lv == c), None) for c in cells]
    return Grid(list(cells[0]), cells, row_of, [set(done[i][1]) if i is not None else set() for i in row_of],
                reference, model)


def main_effects(grid: Grid) -> dict[str, list[Effect]]:
    """Each factor's marginal mean at each value, and its difference to the baseline's value (Dunnett over the
    factor's values)."""
    out = {}
    for f in grid.names:
        values, ref = grid.values(f), grid.reference[f]
        out[f] = tested_levels(grid, [{f: v} for v in values], {f: ref})
    return out


def tested_levels(grid: Grid, wheres: list[Levels], ref: Levels) -> list[Effect]:
    """The marginal means at `wheres`, and each one's difference to the one at `ref`, as one Dunnett family."""
    m = grid.model
    effects, contrasts = [], []
    base, _ = grid.average(ref)
    for where in wheres:
        c, why = grid.average(where)
        e = Effect(tuple(where.values()), math.nan, math.nan, math.nan, grid.n_seeds(where), why=why)
        if c is not None and m.fit is not None:
            t = m.means(c[None])
            e.mean, e.low, e.high = float(t.estimate[0]), float(t.low[0]), float(t.high[0])
            if base is not None and where != ref:
                contrasts.append((e, c - base))
        effects.append(e)
    if contrasts and m.fit is not None:
        t = m.family(np.array([c for _, c in contrasts]), m.correction)
        for i, (e, _) in enumerate(contrasts):
            e.vs_base = (float(t.estimate[i]), float(t.low[i]), float(t.high[i]), float(t.p[i]))
    return effects


def interaction(grid: Grid, a: str, b: str) -> list[Effect]:
    """Cells of factors a x b: each mean, its difference to the baseline's cell (Dunnett over the cells) and its
    interaction term with a 95% interval."""
    wheres = [{a: x, b: y} for x in grid.values(a) for y in grid.values(b)]
    cells = tested_levels(grid, wheres, {a: grid.reference[a], b: grid.reference[b]})
    m = grid.model
    for where, e in zip(wheres, cells, strict=True):
        parts = [grid.average(w)[0] for w in (where, {a: where[a]}, {b: where[b]}, {})]
        if m.fit is None or any(p is None for p in parts):
            continue
        t = m.means((parts[0] - parts[1] - parts[2] + parts[3])[None])
        e.interaction = (float(t.estimate[0]), float(t.low[0]), float(t.high[0]))
    return cells


def all_pairs(grid: Grid, f: str) -> list[tuple[str, str, float, float, float, float]]:
    """Every pair of f's values (x, y, y - x, interval, Tukey-adjusted p; Games-Howell under Welch's model), for the
    values whose marginal means are estimated."""
    m = grid.model
    values = [v for v in grid.values(f) if grid.average({f: v})[0] is not None]
    if len(values) < 3 or m.fit is None:
        return []
    means = np.array([grid.average({f: v})[0] for v in values])  # (values, k)
    which, lin = inference.pairs(list(range(len(values))), len(values))
    t = m.family(lin @ means, "tukey")
    return [(values[i], values[j], float(t.estimate[n]), float(t.low[n]), float(t.high[n]), float(t.p[n]))
            for n, (i, j) in enumerate(which)]


def fmt_ci(value: float, low: float, high: float, d: int, sign: str = "", why: str = "") -> str:
    if math.isnan(value):
        return f"not estimated ({why or 'the finished trials cannot tell it'})"
    ci = "(no variance: no CI)" if math.isnan(low) else f"[{low:{sign}.{d}f}, {high:{sign}.{d}f}]"
    return f"{value:{sign}.{d}f} {ci}"


def fmt_delta(vs: tuple[float, float, float, float] | None, d: int, level: float) -> str:
    if vs is None:
        return ""
    star = "*" if vs[3] < level else ""
    return f"  Δ {fmt_ci(*vs[:3], d, '+')} p {vs[3]:.3g}{star}" if math.isfinite(vs[3]) else \
        f"  Δ {vs[0]:+.{d}f} (no test)"


def missing_cells(h: StudyHandle, grid: Grid) -> list[str]:
    """The (variant, seed) cells of the grid without a finished trial."""
    return [f"{v.name} (seed {s})" for v, seeds in zip(h.spec.variants(), grid.seeds, strict=True)
            for s in h.spec.seeds if s not in seeds]


def effects_report(h: StudyHandle, pair: tuple[str, str] | None = None, out_dir: Path | None = None
                   ) -> tuple[str, list[Path]]:
    """The main effects of every factor and the interaction of `pair` (default: the first two factors): the text
    printed, and effects.csv, effects.png in out_dir (default: the study directory)."""
    if h.spec.is_search:
        raise ValueError(f"{h.spec.name} is a search: main effects need a grid (axes: or variants:)")
    grid = study_grid(h)
    names, m = grid.names, grid.model
    pair = pair or (tuple(names[:2]) if len(names) >= 2 else None)
    if pair is not None and any(p not in names for p in pair):
        raise ValueError(f"--pair {' '.join(pair)}: the factors of {h.spec.name} are {', '.join(names)}")
    if pair is not None and pair[0] == pair[1]:
        raise ValueError(f"--pair {' '.join(pair)}: an interaction needs two different factors; "
                         f"the factors of {h.spec.name} are {', '.join(names)}")
    d = digits(float(np.nanmax(np.abs(m.y))))
    alpha = 1 - m.level
    main = main_effects(grid)
    how = {"pooled": "metric ~ variant + seed, the residual variance pooled over every variant",
           "welch": f"each variant's own variance over its seeds (Welch: {m.why})",
           "paired bootstrap": "1 seed: no seed variance, no interval", "": "no test"}[m.method]
    lines = [f"{h.spec.name}: main effects on {h.spec.metric} ({h.spec.direction} is better): each value averaged "
             f"over the other factors, from the study's model ({how}; {int(np.isfinite(m.y).sum())} finished "
             f"trial(s)); 95% CI; Δ: difference to the baseline's value, simultaneous 95% CI and p adjusted over "
             f"the factor's values ({'Dunnett' if m.method == 'pooled' else 'Holm'}; * p < {alpha:g})"]
    holes = missing_cells(h, grid)
    if holes:
        lines.append(f"missing cells ({len(holes)}), left out of the model: " + ", ".join(holes))
    pairs_of = {}
    for f, effects in main.items():
        lines.append(f"\n{f}")
        width = max(len(e.levels[0]) for e in effects)
        for e in effects:
            ref = "  (baseline)" if e.levels[0] == grid.reference[f] and math.isfinite(e.mean) else ""
            lines.append(f"  {e.levels[0]:<{width}}  {fmt_ci(e.mean, e.low, e.high, d, why=e.why)}"
                         f"{fmt_delta(e.vs_base, d, alpha)}{ref}")
        pairs_of[f] = all_pairs(grid, f)
        if pairs_of[f]:
            lines.append("  all pairs (Tukey" + ("" if m.method == "pooled" else "-Games-Howell") + "): " + "; ".join(
                f"{y} - {x} {fmt_ci(v, lo, hi, d, '+')} p {p:.3g}{'*' if p < alpha else ''}"
                for x, y, v, lo, hi, p in pairs_of[f]))
    cells = interaction(grid, *pair) if pair else []
    if pair:
        lines.append(f"\ninteraction {pair[0]} x {pair[1]}: mean [95% CI]; Δ to the baseline's cell (adjusted over "
                     "the cells); interaction term = cell - row mean - column mean + grand mean [95% CI]")
        for c in cells:
            term = f"  interaction {fmt_ci(*c.interaction, d, '+')}" if c.interaction else ""
            lines.append(f"  {c.levels[0]} x {c.levels[1]}:  {fmt_ci(c.mean, c.low, c.high, d, why=c.why)}"
                         f"{fmt_delta(c.vs_base, d, alpha)}{term}")
    else:
        lines.append("\n(one factor: no interaction)")
    out_dir = Path(out_dir or h.dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "effects.csv", out_dir / "effects.png"]
    write_effects(paths[0], main, pair, cells, pairs_of)
    plot_effects(paths[1], h, main, pair, cells)
    return "\n".join(lines), paths


def write_effects(path: Path, main: dict[str, list[Effect]], pair: tuple[str, str] | None, cells: list[Effect],
                  pairs_of: dict[str, list]) -> None:
    blank = ("", "", "", "")
    with open(path, "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(["factor", "level", "mean", "ci_low", "ci_high", "n_seeds", "delta_vs_baseline", "delta_ci_low",
                    "delta_ci_high", "p_adjusted", "interaction", "interaction_ci_low", "interaction_ci_high"])
        for f, effects in main.items():
            w.writerows([f, e.levels[0], e.mean, e.low, e.high, e.n_seeds, *(e.vs_base or blank), "", "", ""]
                        for e in effects)
        for c in cells:
            w.writerow([" x ".join(pair), " x ".join(c.levels), c.mean, c.low, c.high, c.n_seeds,
                        *(c.vs_base or blank), *(c.interaction or ("", "", ""))])
        for f, pairs in pairs_of.items():
            w.writerows([f"{f} (pair, Tukey)", f"{y} - {x}", "", "", "", "", v, lo, hi, p, "", "", ""]
                        for x, y, v, lo, hi, p in pairs)


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
