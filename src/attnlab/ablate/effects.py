"""Which factor matters, and do conclusions transfer? `attnlab ablate effects` and `attnlab ablate compare`.

Main effects of a grid: for each factor (an axis, or `variant` for a variants: list), the metric at each of its
values averaged over every other factor, with a 95% CI. Per seed, the mean over the variants at that value; then
the mean of those per-seed means and its t interval over the seeds (the other factors are averaged over by
design, so what repeats is the seed). With every cell of the grid finished, an effect is the mean of the table's
rows at that value. A two-way interaction: the same for each pair of values of two factors, and each cell's
interaction term, cell - its row's mean - its column's mean + the grand mean (0 everywhere when the two add up).

Transfer between studies (Narang et al. 2021, "Do Transformer Modifications Transfer Across Implementations and
Applications?"): the variants present in both studies are joined on the config fields both of them vary (each
study's other factors averaged over; on the variant names when they share none), printed side by side, and the
rank correlation of their scores, Kendall's tau and Spearman's rho, with exact permutation p-values up to 8
variants and none under 5 (`stats.rank_correlation`). Each study's
scores are oriented so that higher is better before ranking (BLEU against loss correlates positively when the
same variants win).
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

from matplotlib.figure import Figure

from .report import Row, collect_rows, digits
from .spec import fmt
from .stats import rank_correlation, t_interval
from .study import StudyHandle

Levels = dict[str, str]  # factor -> value, e.g. {"model.norm": "rmsnorm", "variant": "(A) h=1"}


@dataclass
class Effect:
    levels: tuple[str, ...]  # the value of each factor asked for
    mean: float
    low: float
    high: float
    n_seeds: int
    interaction: float | None = None  # two-way cells only


def level_table(h: StudyHandle, rows: list[Row]) -> list[tuple[Levels, dict[int, float]]]:
    """Each finished variant's factor values and its metric per seed, in the file's order of variants."""
    by_key = {r.key: r for r in rows}
    out = []
    for v in h.spec.variants():
        if v.key in by_key:
            r = by_key[v.key]
            out.append((dict(level.split("=", 1) for level in v.levels), dict(zip(r.seeds, r.values, strict=True))))
    return out


def factors(table: list[tuple[Levels, dict[int, float]]]) -> list[str]:
    return list(table[0][0]) if table else []


def marginal(table: list[tuple[Levels, dict[int, float]]], names: tuple[str, ...]) -> list[Effect]:
    """The metric at each combination of values of `names`, averaged over the other factors (module docstring)."""
    per: dict[tuple[str, ...], dict[int, list[float]]] = {}
    for levels, values in table:
        cell = per.setdefault(tuple(levels[f] for f in names), {})
        for seed, v in values.items():
            cell.setdefault(seed, []).append(v)
    out = []
    for key, seeds in per.items():
        means = [sum(vs) / len(vs) for vs in seeds.values()]
        out.append(Effect(key, sum(means) / len(means), *t_interval(means), len(means)))
    return out


def interaction(table: list[tuple[Levels, dict[int, float]]], a: str, b: str) -> list[Effect]:
    """Cells of factors a x b, each with its interaction term."""
    cells = marginal(table, (a, b))
    mean = {c.levels: c.mean for c in cells}
    rows = {x for x, _ in mean}
    cols = {y for _, y in mean}
    if len(mean) == len(rows) * len(cols):  # a complete two-way table
        grand = sum(mean.values()) / len(mean)
        row_mean = {x: sum(mean[x, y] for y in cols) / len(cols) for x in rows}
        col_mean = {y: sum(mean[x, y] for x in rows) / len(rows) for y in cols}
        for c in cells:
            x, y = c.levels
            c.interaction = c.mean - row_mean[x] - col_mean[y] + grand
    return cells


def fmt_effect(e: Effect, d: int) -> str:
    ci = f"[{e.low:.{d}f}, {e.high:.{d}f}]" if e.n_seeds > 1 else "(1 seed: no CI)"
    return f"{e.mean:.{d}f} {ci}"


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
    d = digits(rows[0].mean)
    main = {f: marginal(table, (f,)) for f in names}
    lines = [f"{h.spec.name}: main effects on {h.spec.metric} ({h.spec.direction} is better): each value averaged "
             "over the other factors, 95% CI over seeds"]
    for f, effects in main.items():
        lines.append(f"\n{f}")
        width = max(len(e.levels[0]) for e in effects)
        for e in effects:
            gap = e.mean - effects[0].mean
            lines.append(f"  {e.levels[0]:<{width}}  {fmt_effect(e, d)}"
                         + (f"  ({gap:+.{d}f} vs {effects[0].levels[0]})" if e is not effects[0] else ""))
    cells = interaction(table, *pair) if pair else []
    if pair:
        lines.append(f"\ninteraction {pair[0]} x {pair[1]}: mean [95% CI]; interaction term = cell - row mean - "
                     "column mean + grand mean")
        for c in cells:
            term = "" if c.interaction is None else f"  interaction {c.interaction:+.{d}f}"
            lines.append(f"  {c.levels[0]} x {c.levels[1]}:  {fmt_effect(c, d)}{term}")
    else:
        lines.append("\n(one factor: no interaction)")
    out_dir = Path(out_dir or h.dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "effects.csv", out_dir / "effects.png"]
    with open(paths[0], "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(["factor", "level", "mean", "ci_low", "ci_high", "n_seeds", "interaction"])
        for f, effects in main.items():
            w.writerows([f, e.levels[0], e.mean, e.low, e.high, e.n_seeds, ""] for e in effects)
        for c in cells:
            w.writerow([" x ".join(pair), " x ".join(c.levels), c.mean, c.low, c.high, c.n_seeds,
                        "" if c.interaction is None else c.interaction])
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
                    yerr=[[e.mean - e.low if e.n_seeds > 1 else 0 for e in effects],
                          [e.high - e.mean if e.n_seeds > 1 else 0 for e in effects]])
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


def joined_scores(h: StudyHandle, rows: list[Row], keys: list[str]) -> dict[str, float]:
    """Each variant's score by its values of `keys` (from the config it trained with), averaged over the rows that
    share them; by variant name when `keys` is empty."""
    groups: dict[str, list[float]] = {}
    for r in rows:
        config = r.trials[0].user_attrs.get("config") or {}
        if keys:
            name = ", ".join(f"{k.split('.', 1)[1]}={fmt(config.get(k.split('.')[0], {}).get(k.split('.', 1)[1]))}"
                             for k in keys)
        else:
            name = r.variant
        groups.setdefault(name, []).append(r.mean)
    return {k: sum(v) / len(v) for k, v in groups.items()}


def compare_studies(a: StudyHandle, b: StudyHandle) -> str:
    """The side-by-side table of the variants in both studies and the rank correlation of their scores."""
    keys = [k for k in varied(a) if k in set(varied(b))]
    sa, sb = joined_scores(a, collect_rows(a, tests=False)[0], keys), \
        joined_scores(b, collect_rows(b, tests=False)[0], keys)
    shared = [k for k in sa if k in sb]
    on = f"the fields both vary ({', '.join(keys)}; other factors averaged over)" if keys else "variant names"
    lines = [f"{a.spec.name} vs {b.spec.name}: {len(shared)} variant(s) in both, joined on {on}"]
    if not shared:
        return "\n".join(lines)
    # oriented: higher is better in both, so that rank 1 is each study's best
    xa = {k: (1.0 if a.spec.direction == "max" else -1.0) * sa[k] for k in shared}
    xb = {k: (1.0 if b.spec.direction == "max" else -1.0) * sb[k] for k in shared}
    ra, rb = ({k: i + 1 for i, k in enumerate(sorted(shared, key=lambda k, x=x: -x[k]))} for x in (xa, xb))
    head = [f"{h.spec.name}: {h.spec.metric} {'↑' if h.spec.direction == 'max' else '↓'} | rank" for h in (a, b)]
    lines += ["", f"| variant | {head[0]} | {head[1]} |", "|---|---:|---:|---:|---:|"]
    for k in sorted(shared, key=lambda k: ra[k]):
        lines.append(f"| {k} | {sa[k]:.{digits(sa[k])}f} | {ra[k]} | {sb[k]:.{digits(sb[k])}f} | {rb[k]} |")
    if len(shared) < 3:
        lines.append(f"\n{len(shared)} shared variant(s): too few for a rank correlation")
        return "\n".join(lines)
    r = rank_correlation([xa[k] for k in shared], [xb[k] for k in shared])
    if r["why"]:
        lines.append(f"\nKendall's tau = {r['tau']:+.3f}, Spearman's rho = {r['rho']:+.3f}, n = {r['n']}: {r['why']}")
    else:
        lines.append(f"\nKendall's tau = {r['tau']:+.3f} (p = {r['tau_p']:.3g}), Spearman's rho = {r['rho']:+.3f} "
                     f"(p = {r['rho_p']:.3g}), n = {r['n']}; {r['p_method']}")
    lines.append("scores oriented so that higher is better in both")
    return "\n".join(lines)

