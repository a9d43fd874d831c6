"""`attnlab ablate scaling STUDY`: does the winner stay the winner as models grow? For a study with a `scale:`
ladder (and usually an `lr:` search), each variant's final validation loss against its training compute
(FLOPs per token x tokens trained, by the accounting), fitted as a power law (scaling.py), with intervals over
seeds, extrapolated to 10x and 100x the largest run, and the compute at which two variants' curves cross.

Each (variant, size) is taken at its own best learning rate: the one with the lowest mean final validation loss
over its seeds (never the test split), flagged when it lies at the edge of the searched range (the optimum may
lie beyond it). A point that did not finish leaves a hole: it is listed, and the fit uses the points there are.
Narang et al. 2021 and Tay et al. 2022 ("Scaling Laws vs Model Architectures") are why: a modification that wins
small, at one learning rate, often does not win large.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from ..ablate.study import DONE, StudyHandle, point_states, trial_value
from .ranks import correlation_text, rank_correlation, rank_intervals, withheld
from .report import latex_escape
from .scaling import PowerLaw, crossing, fit_power_law, resample_seeds, seed_interval

Points = dict[int, tuple[float, float]]  # seed -> (training FLOPs, final validation loss)
RESAMPLES = 200


@dataclass
class Curve:
    """One variant over the ladder: its points at each size's best LR, the fit and its resampled fits."""

    name: str
    best_lr: dict[str, float] = field(default_factory=dict)  # size -> chosen LR
    edge: dict[str, bool] = field(default_factory=dict)  # size -> the chosen LR is the smallest or largest tried
    lr_losses: dict[str, dict[float, float]] = field(default_factory=dict)  # size -> LR -> mean loss over seeds
    points: dict[str, Points] = field(default_factory=dict)  # size -> its points at the best LR
    fit: PowerLaw | None = None
    resampled: list[PowerLaw | None] = field(default_factory=list)

    def arrays(self, seeds: list[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(compute, loss) of every point, or of the drawn `seeds` (a seed drawn twice counts twice)."""
        pts = [p[s] for p in self.points.values() for s in (seeds if seeds is not None else sorted(p)) if s in p]
        return np.array([c for c, _ in pts]), np.array([v for _, v in pts])


def metric_of(h: StudyHandle) -> str:
    return "final/valid_loss" if h.spec.final_eval else "val/loss"


def collect_curves(h: StudyHandle) -> tuple[dict[str, Curve], list[str], list[str], list[int]]:
    """Every variant's curve, the holes (points not finished), the sizes in ladder order and the seeds that have
    a point in some curve (not the file's seeds: one that never finished is not resampled or counted)."""
    spec = h.spec
    if not spec.sizes:
        raise ValueError(f"{spec.name}: no scale: ladder; `ablate scaling` fits curves over model sizes")
    by_key = {v.key: v for v in spec.variants()}
    metric, attrs = metric_of(h), h.study.user_attrs
    cells: dict[str, dict[str, dict[float, Points]]] = {}
    holes = []
    for s in point_states(h).values():
        t = s.result
        value = trial_value(t, metric, attrs) if t is not None and s.status == DONE else None
        flops, tokens = (t.user_attrs.get("flops_per_token"), t.user_attrs.get("tokens")) if t else (None, None)
        if value is None or not flops or not tokens:
            holes.append(f"{s.variant} (seed {s.seed}): {s.status}" + ("" if t is None or value is not None else
                                                                      f", without {metric}"))
            continue
        levels = dict(x.split("=", 1) for x in by_key[t.user_attrs["variant_key"]].levels)
        size, lr = levels.pop("scale"), levels.pop("optim.lr", None)
        # without an lr: search, the LR the trial trained with (a NaN key would split a size's seeds: nan != nan)
        config = t.user_attrs.get("config") or {}
        lr = float(lr) if lr is not None else float((config.get("optim") or {}).get("lr", 0))
        name = " ".join(f"{k.split('.')[-1]}={v}" if k != "variant" else v for k, v in levels.items()) or "base"
        cells.setdefault(name, {}).setdefault(size, {}).setdefault(lr, {})[s.seed] = (flops * tokens, value)
    curves = {}
    for name, by_size in cells.items():
        c = Curve(name)
        for size in [v.name for v in spec.sizes if v.name in by_size]:
            means = {lr: float(np.mean([v for _, v in pts.values()])) for lr, pts in by_size[size].items()}
            best = min(means, key=means.get)
            c.best_lr[size], c.lr_losses[size], c.points[size] = best, means, by_size[size][best]
            c.edge[size] = len(spec.lrs) >= 2 and best in (min(spec.lrs), max(spec.lrs))
        curves[name] = c
    # the seeds with a point in some curve: a seed with no finished trial has nothing to resample, and counting it
    # in n (scaling.seed_interval) would narrow every interval
    seeds = sorted({s for c in curves.values() for points in c.points.values() for s in points})
    return curves, holes, [v.name for v in spec.sizes], seeds


def fit_curves(curves: dict[str, Curve], seeds: list[int], resamples: int = RESAMPLES, seed: int = 0) -> None:
    """Fit each curve and refit it on `resamples` draws of the seeds, the same draws for every curve (so two
    curves' crossing is resampled as a pair)."""
    draws = resample_seeds(seeds, resamples, seed)
    for c in curves.values():
        compute, loss = c.arrays()
        if len(np.unique(compute)) < 2:
            continue  # fewer than 2 sizes finished: nothing to fit
        c.fit = fit_power_law(compute, loss)
        three = c.fit.form.startswith("E")
        c.resampled = []
        for draw in draws:
            rc, rl = c.arrays(draw)
            ok = len(np.unique(rc)) >= (4 if three else 2)
            c.resampled.append(fit_power_law(rc, rl, three, near=c.fit) if ok else None)


def interval(estimate: float, values: list[float | None], n: int) -> str:
    low, high = seed_interval(estimate, values, n)
    return f"{estimate:.4g}" + ("" if math.isnan(low) else f" [{low:.4g}, {high:.4g}]")


def scaling_report(h: StudyHandle, out_dir: Path | None = None, resamples: int = RESAMPLES
                   ) -> tuple[str, list[Path]]:
    """The text printed, and scaling.md, scaling.csv, scaling.tex and scaling.png in out_dir (default: the
    study's directory)."""
    curves, holes, sizes, seeds = collect_curves(h)
    if not curves:
        raise ValueError(f"{h.spec.name}: no finished trials with {metric_of(h)} yet")
    fit_curves(curves, seeds, resamples, h.spec.significance["seed"])
    fitted = [c for c in curves.values() if c.fit is not None]
    c_max = max(cc for c in fitted for cc in c.arrays()[0]) if fitted else math.nan
    c_min = min(cc for c in fitted for cc in c.arrays()[0]) if fitted else math.nan
    n = len(seeds)
    rows, lines = [], [f"{h.spec.name}: {metric_of(h)} against training compute C (FLOPs), each (variant, size) at "
                       f"its best learning rate on the validation split; 95% CIs over {n} seeds "
                       f"({resamples} resamples; scaling.seed_interval)"]
    if holes:
        lines.append(f"holes ({len(holes)}), fitted without: " + "; ".join(holes))
    for c in curves.values():
        lrs = ", ".join(f"{s}: {c.best_lr[s]:.3g}" + (" (edge)" if c.edge[s] else "") for s in c.best_lr)
        row = {"variant": c.name, "best_lr": lrs}
        if c.fit is None:
            row.update(fit="too few sizes finished")
        else:
            f, r = c.fit, c.resampled
            row.update(fit=f"L = {f.form}".replace("E + A", "E + A"),
                       alpha=interval(f.alpha, [x.alpha if x else None for x in r], n),
                       E=interval(f.e, [x.e if x else None for x in r], n) if f.form.startswith("E") else
                       "0 (2-parameter form)",
                       L10=interval(float(f(10 * c_max)), [float(x(10 * c_max)) if x else None for x in r], n),
                       L100=interval(float(f(100 * c_max)), [float(x(100 * c_max)) if x else None for x in r], n))
        rows.append(row)
    head = ["variant", "fit", "alpha", "E", "L at 10x", "L at 100x", "best LR per size"]
    keys = ["variant", "fit", "alpha", "E", "L10", "L100", "best_lr"]
    md = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    md += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in rows]
    lines += ["", *md, "", f"largest run: C = {c_max:.3g} FLOPs; (edge): the best LR is the smallest or largest "
              "searched, so the optimum may lie outside the range",
              "2-parameter form L = A C^-alpha where fewer than 4 sizes finished (3 parameters would interpolate)"]
    pairs = []
    names = [c.name for c in fitted]
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            fa, fb = curves[a], curves[b]
            at = crossing(fa.fit, fb.fit, c_min, 100 * c_max)
            resampled = [crossing(x, y, c_min, 100 * c_max) if x and y else None
                         for x, y in zip(fa.resampled, fb.resampled, strict=True)]
            share = sum(r is not None for r in resampled) / max(1, len(resampled))
            if at is None:
                text = f"no crossing in range [{c_min:.3g}, {100 * c_max:.3g}] ({share:.0%} of resamples cross)"
            else:
                logs = [math.log10(r) if r else None for r in resampled]
                low, high = seed_interval(math.log10(at), logs, n)
                ci = "" if math.isnan(low) else f" [{10 ** low:.3g}, {10 ** high:.3g}]"
                text = f"C = {at:.3g}{ci} ({share:.0%} of resamples cross in range)"
            pairs.append((a, b, at, text))
            lines.append(f"{a} vs {b}: {text}")
    lines.append("\n" + size_transfer(h, curves, sizes))
    out_dir = Path(out_dir or h.dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"scaling.{x}" for x in ("md", "csv", "tex", "png")]
    paths[0].write_text("\n".join(md) + "\n", encoding="utf-8")
    with open(paths[1], "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(["kind", *keys, "crossing_compute"])
        w.writerows(["variant", *[r.get(k, "") for k in keys], ""] for r in rows)
        w.writerows(["crossing", f"{a} vs {b}", text, "", "", "", "", "", "" if at is None else at]
                    for a, b, at, text in pairs)
    tex = [r"\begin{tabular}{l" + "l" * (len(head) - 1) + "}", r"\toprule", " & ".join(head) + r" \\", r"\midrule"]
    tex += [" & ".join(latex_escape(str(r.get(k, ""))) for k in keys) + r" \\" for r in rows]
    paths[2].write_text("\n".join([*tex, r"\bottomrule", r"\end{tabular}"]) + "\n", encoding="utf-8")
    plot_scaling(paths[3], h, curves, c_min, c_max, n)
    return "\n".join(lines), paths


def size_transfer(h: StudyHandle, curves: dict[str, Curve], sizes: list[str]) -> str:
    """The rank correlation of the variants between the smallest and the largest size of the ladder (each at
    its best LR), as `ablate compare` gives it between two studies."""
    small, large = sizes[0], sizes[-1]
    names = [c.name for c in curves.values() if small in c.points and large in c.points]
    head = f"transfer from the smallest size ({small}) to the largest ({large}): {len(names)} variant(s) at both"
    if len(names) < 3:
        return head + ": too few for a rank correlation"
    seeds = sorted({s for n in names for size in (small, large) for s in curves[n].points[size]})

    def matrix(size: str) -> np.ndarray:  # (variants, seeds), -loss: higher is better
        return np.array([[-curves[n].points[size].get(s, (0, math.nan))[1] for s in seeds] for n in names])

    a, b = matrix(small), matrix(large)
    r = rank_correlation(np.nanmean(a, 1), np.nanmean(b, 1))
    why = withheld({f"size {small} and {large}": len(seeds)})
    ci = None if why else rank_intervals(a, b, RESAMPLES, h.spec.significance["seed"])
    stat = {k: correlation_text(r, ci, k) for k in ("tau", "rho")}
    p = r["why"] or f"p = {r['tau_p']:.3g} (tau), {r['rho_p']:.3g} (rho); {r['p_method']}"
    return (f"{head}: Kendall's tau = {stat['tau']}, Spearman's rho = {stat['rho']}, n = {r['n']}: {p}" +
            (f"; no CI: {why}" if why else ""))


def plot_scaling(path: Path, h: StudyHandle, curves: dict[str, Curve], c_min: float, c_max: float,
                 n_seeds: int) -> None:
    """Log-log: each variant's points (every seed, at each size's best LR), its fit over [C_min, 100 C_max] and
    its 95% band, pointwise as the table's intervals are made (scaling.seed_interval over the resampled fits)."""
    fig = Figure(figsize=(6.4, 4.4))
    ax = fig.subplots()
    grid = np.geomspace(c_min, 100 * c_max, 200) if np.isfinite(c_max) else np.array([])
    for i, c in enumerate(curves.values()):
        color = f"C{i}"
        compute, loss = c.arrays()
        ax.scatter(compute, loss, s=14, color=color, label=c.name)
        if c.fit is not None:
            ax.plot(grid, c.fit(grid), color=color, lw=1.4)
            preds = np.array([x(grid) for x in c.resampled if x is not None])  # (resamples, points)
            if len(preds) >= 2 and n_seeds >= 2:
                fit = c.fit(grid)
                bounds = np.array([seed_interval(float(f), list(col), n_seeds) for f, col in zip(fit, preds.T,
                                                                                                 strict=True)])
                ax.fill_between(grid, bounds[:, 0], bounds[:, 1], color=color, alpha=0.15, lw=0)
    if np.isfinite(c_max):
        ax.axvline(c_max, color="grey", lw=0.8, ls=":")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("training compute C (FLOPs)")
    ax.set_ylabel(metric_of(h))
    ax.set_title(f"{h.spec.name}: fits and extrapolation to 100x (95% bands over seeds)", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, which="both")
    fig.savefig(path, dpi=110, bbox_inches="tight")
