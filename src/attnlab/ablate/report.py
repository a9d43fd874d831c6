"""Tables (markdown, CSV, LaTeX) and figures (PNG) of a study, computed only from what its trials stored.

One row per variant: the metric's mean ± sample standard deviation over the seeds that finished (n), the
difference of the mean to the baseline row's mean, parameters, median tokens/s and wall time (means over
seeds), sorted best first for the metric's direction. The baseline is the variant whose varied fields equal
the base experiment's own values, or else the first variant (see AblationSpec.baseline); a search has none.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from optuna.trial import TrialState

from .study import DONE, FAILED, INVALID, StudyHandle, point_states


@dataclass
class Row:
    key: str
    variant: str
    values: list[float]
    seeds: list[int]
    n_params: int | None
    tokens_per_s: float | None
    wall_s: float | None
    baseline: bool = False
    delta: float | None = None
    curves: list[dict[str, list[float]]] = field(default_factory=list)

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> float:
        return sum(self.values) / len(self.values)

    @property
    def std(self) -> float:
        """Sample standard deviation (n - 1); 0 for one seed."""
        if len(self.values) < 2:
            return 0.0
        m = self.mean
        return math.sqrt(sum((v - m) ** 2 for v in self.values) / (len(self.values) - 1))


def _mean(xs: list[Any]) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def collect_rows(h: StudyHandle) -> tuple[list[Row], list[str]]:
    """Rows of finished variants, best first, and notes on the points that are not in the table."""
    states = point_states(h)
    groups: dict[str, list] = {}
    notes: list[str] = []
    for s in states.values():
        r = s.result
        if r is not None and r.state == TrialState.COMPLETE:
            key = r.user_attrs.get("variant_key") or s.point_id  # a search's points are their own variants
            groups.setdefault(key, []).append(r)
        elif s.status in (INVALID, FAILED):
            notes.append(f"{s.variant} (seed {s.seed}): {s.status}: {s.reason.splitlines()[0] if s.reason else ''}")
        elif s.status != DONE:
            notes.append(f"{s.variant} (seed {s.seed}): {s.status}")
    baseline = h.study.user_attrs.get("baseline")
    rows = []
    for key, trials in groups.items():
        trials.sort(key=lambda t: t.user_attrs.get("seed", 0))
        rows.append(Row(
            key=key, variant=str(trials[0].user_attrs.get("variant")), values=[float(t.value) for t in trials],
            seeds=[int(t.user_attrs.get("seed", 0)) for t in trials],
            n_params=trials[0].user_attrs.get("n_params"),
            tokens_per_s=_mean([t.user_attrs.get("tokens_per_s") for t in trials]),
            wall_s=_mean([t.user_attrs.get("wall_s") for t in trials]),
            baseline=key == baseline, curves=[t.user_attrs.get("curve") or {} for t in trials],
        ))
    base_row = next((r for r in rows if r.baseline), None)
    for r in rows:
        r.delta = r.mean - base_row.mean if base_row is not None else None
    rows.sort(key=lambda r: r.mean, reverse=h.spec.direction == "max")
    if baseline and base_row is None and rows:
        notes.insert(0, "the baseline variant has no finished trial: no differences shown")
    return rows, notes


# ---------------------------------------------------------------------------------------------- formatting
def digits(x: float) -> int:
    """Decimals for a metric of this size: BLEU 27.31, loss 2.346, perplexity gaps 0.0123."""
    return 2 if abs(x) >= 10 else 3 if abs(x) >= 1 else 4


def params(n: int | None) -> str:
    if n is None:
        return ""
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.1f}K" if n >= 1e3 else str(n)


def duration(s: float | None) -> str:
    if s is None:
        return ""
    return f"{s / 3600:.2f} h" if s >= 3600 else f"{s / 60:.1f} min" if s >= 60 else f"{s:.1f} s"


def cells(r: Row) -> list[str]:
    d = digits(r.mean)  # mean, std and difference with the same decimals
    metric = f"{r.mean:.{d}f}" + (f" ± {r.std:.{d}f}" if r.n > 1 else "")
    delta = "baseline" if r.baseline else "" if r.delta is None else f"{r.delta:+.{d}f}"
    tps = f"{r.tokens_per_s:,.0f}" if r.tokens_per_s is not None else ""
    return [r.variant, metric, str(r.n), delta, params(r.n_params), tps, duration(r.wall_s)]


def header(h: StudyHandle) -> list[str]:
    arrow = "↑" if h.spec.direction == "max" else "↓"
    return ["variant", f"{h.spec.metric} {arrow}", "n", "Δ vs baseline", "params", "tokens/s", "wall"]


def markdown(h: StudyHandle, rows: list[Row], notes: list[str]) -> str:
    head = header(h)
    rule = "|" + "|".join("---" if i == 0 else "---:" for i in range(len(head))) + "|"
    lines = ["| " + " | ".join(head) + " |", rule]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in cells(r)) + " |" for r in rows]
    if not rows:
        lines.append("| (no finished trials yet) |" + " |" * (len(head) - 1))
    title = f"**{h.spec.name}**: {h.spec.metric}, mean ± std over seeds (n = seeds finished)"
    out = [title, "", *lines]
    if notes:
        out += ["", "Not in the table:", *[f"- {n}" for n in notes]]
    return "\n".join(out)


LATEX_CHARS = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "#": r"\#", "_": r"\_", "$": r"\$",
               "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\^{}", "±": r"$\pm$",
               "Δ": r"$\Delta$", "↑": r"$\uparrow$", "↓": r"$\downarrow$"}


def latex_escape(text: str) -> str:
    return "".join(LATEX_CHARS.get(c, c) for c in text)


def latex(h: StudyHandle, rows: list[Row]) -> str:
    head = header(h)
    lines = [r"\begin{tabular}{l" + "r" * (len(head) - 1) + "}", r"\toprule",
             " & ".join(latex_escape(c) for c in head) + r" \\", r"\midrule"]
    lines += [" & ".join(latex_escape(c) for c in cells(r)) + r" \\" for r in rows]
    lines += [r"\bottomrule", r"\end{tabular}"]
    return "\n".join(lines) + "\n"


def write_csv(path: Path, rows: list[Row], metric: str) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["variant", f"{metric} mean", f"{metric} std", "n", "delta_vs_baseline", "baseline",
                    "n_params", "tokens_per_s", "wall_s", "seeds", "values"])
        for r in rows:
            w.writerow([r.variant, r.mean, r.std, r.n, "" if r.delta is None else r.delta, r.baseline,
                        r.n_params, r.tokens_per_s, r.wall_s, " ".join(map(str, r.seeds)),
                        " ".join(repr(v) for v in r.values)])


def write_table(h: StudyHandle, out_dir: Path | None = None) -> tuple[str, list[Path]]:
    """The markdown table (returned) and table.md, table.csv, table.tex in out_dir (default: the study's)."""
    out_dir = Path(out_dir or h.dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows, notes = collect_rows(h)
    md = markdown(h, rows, notes)
    paths = [out_dir / "table.md", out_dir / "table.csv", out_dir / "table.tex"]
    paths[0].write_text(md + "\n", encoding="utf-8")
    write_csv(paths[1], rows, h.spec.metric)
    paths[2].write_text(latex(h, rows), encoding="utf-8")
    return md, paths


# ---------------------------------------------------------------------------------------------- figures
def mean_curve(curves: list[dict[str, list[float]]]) -> tuple[list[int], list[float], list[float]]:
    """Mean and std over seeds at each step that every seed's curve has."""
    per_seed = [dict(zip(c.get("step", []), c.get("value", []), strict=False)) for c in curves if c]
    if not per_seed:
        return [], [], []
    steps = sorted(set.intersection(*(set(c) for c in per_seed)))
    means, stds = [], []
    for s in steps:
        vals = [c[s] for c in per_seed]
        m = sum(vals) / len(vals)
        means.append(m)
        stds.append(math.sqrt(sum((v - m) ** 2 for v in vals) / (len(vals) - 1)) if len(vals) > 1 else 0.0)
    return steps, means, stds


def plot(h: StudyHandle, out_dir: Path | None = None) -> list[Path]:
    """curves.png (validation metric vs step, mean over seeds with a ±std band) and metric.png (final metric
    per variant with ±std error bars, best first, the baseline dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir or h.dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows, _ = collect_rows(h)
    metric = h.spec.metric
    paths = [out_dir / "curves.png", out_dir / "metric.png"]

    fig, ax = plt.subplots(figsize=(9, 5.5))
    cmap = plt.get_cmap("tab20" if len(rows) > 10 else "tab10")
    for i, r in enumerate(rows):
        steps, means, stds = mean_curve(r.curves)
        if not steps:
            continue
        color = cmap(i % cmap.N)
        ax.plot(steps, means, color=color, lw=2.2 if r.baseline else 1.3, ls="--" if r.baseline else "-",
                label=f"{r.variant} (n={r.n})" + (" [baseline]" if r.baseline else ""))
        if r.n > 1:
            ax.fill_between(steps, [m - s for m, s in zip(means, stds, strict=True)],
                            [m + s for m, s in zip(means, stds, strict=True)], color=color, alpha=0.15, lw=0)
    ax.set_xlabel("step")
    ax.set_ylabel(metric)
    ax.set_title(f"{h.spec.name}: {metric} during training (mean ± std over seeds)")
    ax.grid(alpha=0.3)
    if rows:
        ax.legend(fontsize=7 if len(rows) > 12 else 8, loc="upper left", bbox_to_anchor=(1.01, 1.0),
                  ncol=1 if len(rows) <= 24 else 2, frameon=False)
    fig.savefig(paths[0], dpi=120, bbox_inches="tight")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.32 * max(len(rows), 1)))
    ys = list(range(len(rows)))[::-1]
    ax.errorbar([r.mean for r in rows], ys, xerr=[r.std for r in rows], fmt="o", capsize=3,
                color="tab:blue", ecolor="tab:gray")
    ax.set_yticks(ys, [f"{r.variant} (n={r.n})" for r in rows], fontsize=8)
    base = next((r for r in rows if r.baseline), None)
    title = h.spec.name
    if base is not None:
        ax.axvline(base.mean, color="tab:red", ls="--", lw=1)
        title += f"   (dashed: baseline {base.variant})"
    arrow = "higher" if h.spec.direction == "max" else "lower"
    ax.set_xlabel(f"final {metric} ({arrow} is better; mean ± std over seeds)")
    ax.set_title(title, fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    fig.savefig(paths[1], dpi=120, bbox_inches="tight")
    plt.close(fig)
    return paths
