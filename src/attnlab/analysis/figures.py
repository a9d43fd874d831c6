"""Figures of a study (PNG), from what its trials stored: curves.png and metric.png.

curves.png: the training loss at every `trainer.log_every` step (left) and the validation curve of the study's
metric (right: the metric itself when it is a logged curve, val/<score> for a final score), each the mean over
seeds with a band of ± one standard deviation. metric.png: the metric per variant, mean ± std, best first, the
baseline dashed. Drawn with matplotlib's object API (no pyplot state, no GUI backend).
"""

from __future__ import annotations

import math
from pathlib import Path

from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from ..ablate.study import StudyHandle
from .columns import FINAL_METRIC
from .report import table_rows
from .rows import Row

Curve = list[list[float]]  # [[step, value], ...] as the trials store them


def mean_curve(curves: list[Curve]) -> tuple[list[int], list[float], list[float]]:
    """Mean and sample std over seeds at each step that every seed's curve has."""
    per_seed = [{int(s): v for s, v in c} for c in curves if c]
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


def curve_name(metric: str) -> str:
    """The logged curve that shows a metric during training: itself, or val/<score> for final/<split>_<score>."""
    m = FINAL_METRIC.match(metric)
    return f"val/{m.group(2)}" if m else metric


def draw_curves(ax: Axes, rows: list[Row], name: str) -> None:
    cmap = colormaps["tab20" if len(rows) > 10 else "tab10"]
    for i, r in enumerate(rows):
        steps, means, stds = mean_curve([(t.user_attrs.get("curves") or {}).get(name, []) for t in r.trials])
        if not steps:
            continue
        color = cmap(i % cmap.N)
        ax.plot(steps, means, color=color, lw=2.2 if r.baseline else 1.3, ls="--" if r.baseline else "-",
                label=f"{r.variant} (n={r.n})" + (" [baseline]" if r.baseline else ""))
        if r.n > 1:
            ax.fill_between(steps, [m - s for m, s in zip(means, stds, strict=True)],
                            [m + s for m, s in zip(means, stds, strict=True)], color=color, alpha=0.15, lw=0)
    ax.set_xlabel("step")
    ax.set_ylabel(name)
    ax.grid(alpha=0.3)


def plot(h: StudyHandle, out_dir: Path | None = None) -> list[Path]:
    """curves.png and metric.png in out_dir (default: the study directory)."""
    out_dir = Path(out_dir or h.dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = table_rows(h).rows
    metric = h.spec.metric
    paths = [out_dir / "curves.png", out_dir / "metric.png"]

    fig = Figure(figsize=(15, 5.5))
    loss_ax, metric_ax = fig.subplots(1, 2)
    draw_curves(loss_ax, rows, "train/loss")
    loss_ax.set_title("training loss at every logged step (mean ± std over seeds)")
    draw_curves(metric_ax, rows, curve_name(metric))
    metric_ax.set_title(f"{curve_name(metric)} at each validation" + (f" (the study's metric: {metric})"
                                                                      if curve_name(metric) != metric else ""))
    for ax in (loss_ax, metric_ax):
        if not ax.get_legend_handles_labels()[0]:  # e.g. a study whose trials logged no validation curve
            ax.text(0.5, 0.5, "no curve logged", transform=ax.transAxes, ha="center", va="center", color="gray")
    # one legend, right of both panels: the metric's curves, else the loss's (beside the loss panel it would lie
    # under the metric's)
    handles, labels = metric_ax.get_legend_handles_labels()
    if not handles:
        handles, labels = loss_ax.get_legend_handles_labels()
    if handles:
        metric_ax.legend(handles, labels, fontsize=7 if len(rows) > 12 else 8, loc="upper left",
                         bbox_to_anchor=(1.01, 1.0), ncol=1 if len(rows) <= 24 else 2, frameon=False)
    fig.suptitle(h.spec.name)
    fig.savefig(paths[0], dpi=110, bbox_inches="tight")

    fig = Figure(figsize=(8, 1.2 + 0.32 * max(len(rows), 1)))
    ax = fig.subplots()
    ys = list(range(len(rows)))[::-1]
    ax.errorbar([r.mean for r in rows], ys, xerr=[r.std for r in rows], fmt="o", capsize=3,
                color="tab:blue", ecolor="tab:gray")
    ax.set_yticks(ys, [f"{r.variant} (n={r.n})" + ("*" if r.significant else "") for r in rows], fontsize=8)
    base = next((r for r in rows if r.baseline), None)
    title = h.spec.name
    if base is not None:
        ax.axvline(base.mean, color="tab:red", ls="--", lw=1)
        title += f"   (dashed: baseline {base.variant}; * significant)"
    arrow = "higher" if h.spec.direction == "max" else "lower"
    ax.set_xlabel(f"{metric} ({arrow} is better; mean ± std over seeds)")
    ax.set_title(title, fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    fig.savefig(paths[1], dpi=120, bbox_inches="tight")
    return paths
