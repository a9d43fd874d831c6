"""`attnlab ablate scaling STUDY`: does the winner stay the winner as models grow? For a study with a `scale:` ladder
(and usually an `lr:` search): each variant's final validation loss at each size, at its best learning rate, with
intervals over seeds; where a variant has >= 4 sizes and its fit identifies E, the power law L(C) = E + A C^-alpha
in training compute (FLOPs per token x tokens trained, by the accounting), alpha, E, the loss at 10x and 100x the
largest run and where two variants cross, always beside the held-out check of the largest size (scaling_stats.py
says how each figure is made).

A point that did not finish leaves a hole: it is listed, and the fit uses the points there are. Narang et al. 2021
and Tay et al. 2022 ("Scaling Laws vs Model Architectures") are why: a modification that wins small, at one
learning rate, often does not win large.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np

from ..ablate.edges import candidates, scaling_metric
from ..ablate.study import DONE, StudyHandle, point_states, trial_value
from .ranks import correlation_text, rank_correlation, rank_intervals, withheld
from .report import latex_escape
from .scaling_plot import plot_scaling
from .scaling_stats import (
    EXTRAPOLATE_FROM,
    MULTIPLES,
    RELIABLE_SHARE,
    EMode,
    Estimate,
    ScalingData,
    ScalingResult,
    ScalingStudy,
    analyse,
)

RESAMPLES = 200  # random draws of the seeds where there are more than scaling.EXACT_SEEDS


def collect(h: StudyHandle) -> ScalingStudy:
    """Every finished trial's validation loss by (variant, size, LR, seed), its compute and parameters; the holes
    (points not finished). Trials of an lr.extend_edges extension count as any other LR of their cell."""
    spec = h.spec
    if not spec.sizes:
        raise ValueError(f"{spec.name}: no scale: ladder; `ablate scaling` fits curves over model sizes")
    by_key = {v.key: v for v in [*spec.variants(), *candidates(spec)]}
    metric, attrs = scaling_metric(spec), h.study.user_attrs
    cells: dict[tuple[str, str, float, int], tuple[float, float, float]] = {}
    holes = []
    for s in point_states(h).values():
        t = s.result
        value = trial_value(t, metric, attrs) if t is not None and s.status == DONE else None
        flops, tokens = (t.user_attrs.get("flops_per_token"), t.user_attrs.get("tokens")) if t else (None, None)
        if value is None or not flops or not tokens or t.user_attrs.get("variant_key") not in by_key:
            holes.append(f"{s.variant} (seed {s.seed}): {s.status}" + ("" if t is None or value is not None else
                                                                      f", without {metric}"))
            continue
        levels = dict(x.split("=", 1) for x in by_key[t.user_attrs["variant_key"]].levels)
        size, lr = levels.pop("scale"), levels.pop("optim.lr", None)
        # without an lr: search, the LR the trial trained with (a NaN key would split a size's seeds: nan != nan)
        config = t.user_attrs.get("config") or {}
        lr = float(lr) if lr is not None else float((config.get("optim") or {}).get("lr", 0))
        name = " ".join(f"{k.split('.')[-1]}={v}" if k != "variant" else v for k, v in levels.items()) or "base"
        cells[(name, size, lr, s.seed)] = (flops * tokens, value, float(t.user_attrs.get("n_params") or math.nan))
    if not cells:
        raise ValueError(f"{spec.name}: no finished trials with {metric} yet")
    variants = list(dict.fromkeys(k[0] for k in cells))
    sizes = [v.name for v in spec.sizes if any(k[1] == v.name for k in cells)]
    lrs = sorted({k[2] for k in cells})
    seeds = sorted({k[3] for k in cells})
    loss = np.full((1, len(variants), len(sizes), len(lrs), len(seeds)), np.nan)
    compute = np.full((len(variants), len(sizes)), np.nan)
    params = np.full((len(variants), len(sizes)), np.nan)
    for (name, size, lr, seed), (c, value, n) in cells.items():
        i, j = variants.index(name), sizes.index(size)
        loss[0, i, j, lrs.index(lr), seeds.index(seed)] = value
        compute[i, j], params[i, j] = c, n  # the same for every LR and seed of a (variant, size)
    data = ScalingData(loss, compute, np.array(lrs), tuple(spec.lrs))
    return ScalingStudy(spec.name, metric, variants, sizes, seeds, data, params, holes)


# ---------------------------------------------------------------------------------------------- text
def ci(e: Estimate, idx: tuple, fmt: str = ".4g", scale: float = 1.0) -> str:
    est, lo, hi = (float(x[idx]) * scale for x in (e.est, e.lo, e.hi))
    if not math.isfinite(est):
        return ""
    return f"{est:{fmt}}" + ("" if not math.isfinite(lo) else f" [{lo:{fmt}}, {hi:{fmt}}]")


def flags(r: ScalingResult, v: int) -> list[str]:
    """The labels every figure derived from variant v's fit carries."""
    out = ["edge"] if r.edge[0, v].any() else []
    if r.failed[0, v]:
        out.append("unreliable")
    if r.e_mode.label:
        out.append(r.e_mode.label)
    return out


def tagged(text: str, labels: list[str]) -> str:
    return text + (f" ({', '.join(labels)})" if text and labels else "")


def why_not(st: ScalingStudy, r: ScalingResult, v: int) -> str:
    """Why variant v has no extrapolation (alpha, E, L at kx, crossings), or ""."""
    if not r.fitted[0, v]:
        return (f"{int(r.sizes[0, v])} size(s) with a result: a fit needs >= {EXTRAPOLATE_FROM} (with 3, its "
                f"three parameters pass through three means, and E = 0 extrapolates too low)")
    if not r.identified[0, v]:
        return ("the fit puts E at 0: these sizes do not bend towards an irreducible loss, so E is not identified and "
                "a pure power law would extrapolate too low (larger sizes, or --e shared / --e-prior)")
    return ""


def size_rows(st: ScalingStudy, r: ScalingResult) -> tuple[list[str], list[list[str]]]:
    """The per-size comparison: each size's best-LR loss per variant (at which LR) and the difference from the first
    variant."""
    head = ["size", "params", *st.variants] + [f"{b} - {st.variants[0]}" for b in st.variants[1:]]
    rows = []
    for k, size in enumerate(st.sizes):
        p = st.params[:, k]
        p = p[np.isfinite(p)]
        row = [size, "" if not len(p) else "/".join(f"{x / 1e3:.0f}K" for x in dict.fromkeys(p))]
        for v in range(len(st.variants)):
            b = int(r.best_lr[0, v, k])
            notes_ = [x for x, on in (("edge", r.edge[0, v, k]), ("extended", r.extended[0, v, k])) if on]
            row.append("" if b < 0 else tagged(f"{ci(r.size_loss, (0, v, k))} at LR {st.data.lrs[b]:.3g}", notes_))
        row += [ci(r.size_diff, (0, v, k), "+.3g") for v in range(1, len(st.variants))]
        rows.append(row)
    return head, rows


def fit_rows(st: ScalingStudy, r: ScalingResult) -> tuple[list[str], list[list[str]]]:
    """The fit of each variant with >= EXTRAPOLATE_FROM sizes and its held-out check."""
    head = ["variant", "alpha", "E", *[f"L at {m}x" for m in MULTIPLES], "held-out size: predicted", "measured",
            "error %", "check"]
    rows = []
    for v, name in enumerate(st.variants):
        if not r.fitted[0, v]:
            continue
        labels = flags(r, v)
        e = ci(r.e, (0, v)) if r.e_mode.kind != "prior" or r.e_mode.sd else f"{r.e_mode.mean:g} (fixed)"
        why = why_not(st, r, v)
        cells = [f"withheld: {why}", "", *[""] * len(MULTIPLES)] if why else [
            tagged(ci(r.alpha, (0, v)), labels), tagged(e, labels),
            *[tagged(ci(r.at[m], (0, v)), labels) for m in MULTIPLES]]
        check = ("FAILED: the error's interval excludes 0" if r.failed[0, v] else "passed: its interval holds 0"
                 if np.isfinite(r.heldout_err.lo[0, v]) else "no interval (1 seed): neither passed nor failed")
        held = [tagged(ci(r.heldout_pred, (0, v)), [x for x in labels if x != "unreliable"]),
                ci(r.heldout_meas, (0, v)), ci(r.heldout_err, (0, v), "+.2f"), check]
        rows.append([name, *cells, *held])
    return head, rows


def crossing_lines(st: ScalingStudy, r: ScalingResult) -> list[tuple[str, str, float, dict]]:
    """(pair, text, crossing compute or NaN, CSV fields) for each pair of variants."""
    out = []
    rng = f"[{r.c_min:.3g}, {100 * r.c_max:.3g}]"
    for p, (i, j) in enumerate(r.pairs):
        pair = f"{st.variants[i]} vs {st.variants[j]}"
        share = float(r.cross_share[0, p])
        est, lo, hi = (float(x[0, p]) for x in (r.cross.est, r.cross.lo, r.cross.hi))
        labels = list(dict.fromkeys(flags(r, i) + flags(r, j)))
        bounds = {k: 10 ** x if math.isfinite(x) else math.nan
                  for k, x in (("estimate", est), ("low", lo), ("high", hi))}
        fields = {"share": share, "flags": ";".join(labels), **bounds}
        if math.isnan(share):
            text, at = "no crossing given: it needs both variants' fits with E identified", math.nan
        elif math.isfinite(est) and share >= RELIABLE_SHARE:
            interval = "" if not math.isfinite(lo) else f" [{10 ** lo:.3g}, {10 ** hi:.3g}]"
            text, at = tagged(f"cross at C = {10 ** est:.3g}{interval} ({share:.0%} of draws cross in {rng})",
                              labels), 10 ** est
        else:
            where = f"the full data cross at {10 ** est:.3g}; " if math.isfinite(est) else ""
            text, at = f"no reliable crossing ({where}{share:.0%} of draws cross in {rng}, < {RELIABLE_SHARE:.0%})", \
                math.nan
        out.append((pair, text, at, fields))
    return out


def scaling_report(h: StudyHandle, out_dir: Path | None = None, resamples: int = RESAMPLES,
                   mode: EMode | None = None) -> tuple[str, list[Path]]:
    """The text printed, and scaling.md, scaling.csv, scaling.tex and scaling.png in out_dir (default: the
    study's directory)."""
    mode = mode or EMode()
    st = collect(h)
    r = analyse(st.data, mode, resamples, h.spec.significance["seed"])
    n = len(st.seeds)
    draws = (f"every one of the {r.n_draws} multisets of the {n} seeds" if r.exact else f"{r.n_draws} resamples "
             "of the seeds")
    p = st.params[np.isfinite(st.params)]
    lines = [f"{st.name}: {st.metric} against training compute C (FLOPs), each (variant, size) at its best learning "
             f"rate; {len(st.sizes)} sizes ({p.min():,.0f} to {p.max():,.0f} parameters by count_parameters), "
             f"{n} seed(s); 95% CIs: the full data's estimate ± t x SE over {draws}, the best LR re-picked in each"]
    if mode.label:
        lines.append(f"{mode.label}: every figure that depends on E (alpha, E, L at kx, held-out, crossings) is "
                     f"labelled with it")
    if st.holes:
        lines.append(f"holes ({len(st.holes)}), fitted without: " + "; ".join(st.holes))
    s_head, s_rows = size_rows(st, r)
    f_head, f_rows = fit_rows(st, r)
    md_size = markdown(s_head, s_rows)
    md_fit = markdown(f_head, f_rows)
    lines += ["", "Per size (best-LR loss [95% CI] at its LR; the difference from the first variant):", "", *md_size,
              ""]
    if f_rows:
        lines += [f"Fit L = E + A C^-alpha (largest run: C = {r.c_max:.3g} FLOPs) and the held-out check (each "
                  "variant refitted without its largest size, predicting it):", "", *md_fit, ""]
    lines += [f"{name}: no fit: {why_not(st, r, v)}" for v, name in enumerate(st.variants) if not r.fitted[0, v]]
    crosses = crossing_lines(st, r)
    lines += [f"{pair}: {text}" for pair, text, _, _ in crosses]
    lines += notes(st, r)
    lines.append("\n" + size_transfer(h, st, r))
    out_dir = Path(out_dir or h.dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"scaling.{x}" for x in ("md", "csv", "tex", "png")]
    paths[0].write_text("\n".join([*md_size, "", *(md_fit if f_rows else []), "",
                                   *[f"{a}: {b}" for a, b, _, _ in crosses]]) + "\n", encoding="utf-8")
    write_csv(paths[1], st, r, crosses)
    head, rows = (f_head, f_rows) if f_rows else (s_head, s_rows)  # the fit's table, else the per-size one
    tex = [r"\begin{tabular}{l" + "l" * (len(head) - 1) + "}", r"\toprule", " & ".join(head) + r" \\", r"\midrule"]
    tex += [" & ".join(latex_escape(c) for c in row) + r" \\" for row in rows]
    paths[2].write_text("\n".join([*tex, r"\bottomrule", r"\end{tabular}"]) + "\n", encoding="utf-8")
    plot_scaling(paths[3], st, r)
    return "\n".join(lines), paths


def markdown(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows]


def notes(st: ScalingStudy, r: ScalingResult) -> list[str]:
    out = ["", "(edge): the best LR is the smallest or largest the cell tried, so the optimum may lie outside the "
               "range and the loss is an upper bound; every figure from that variant's fit carries the flag"]
    if r.extended[0].any():
        out.append("(extended): lr.extend_edges added one LR a factor step beyond the grid's edge for that size")
    if r.failed[0].any():
        out.append("(unreliable): the held-out check failed (its error's interval excludes 0): alpha, L at kx and "
                   "crossings of that variant are extrapolations the data contradict (Besiroglu et al. 2024)")
    if r.fitted[0].any() and not r.failed[0][r.fitted[0]].any() and np.isfinite(r.heldout_err.lo[0][r.fitted[0]]).all():
        out.append("held-out check passed: refitted without the largest size, each fit predicts it within its "
                   "interval; this supports interpolation and one size step beyond, and nothing about 100x")
    return out


def write_csv(path: Path, st: ScalingStudy, r: ScalingResult, crosses: list) -> None:
    """Long format: kind, variant (or pair), size, quantity, estimate, low, high, flags, note."""
    rows = []
    for v, name in enumerate(st.variants):
        for k, size in enumerate(st.sizes):
            b = int(r.best_lr[0, v, k])
            if b < 0:
                continue
            notes_ = ";".join(x for x, on in (("edge", r.edge[0, v, k]), ("extended", r.extended[0, v, k])) if on)
            rows.append(["size", name, size, "loss", *_num(r.size_loss, (0, v, k)), notes_,
                         f"lr={st.data.lrs[b]:g}; params={st.params[v, k]:.0f}; compute={st.data.compute[v, k]:.4g}"])
            if v:
                rows.append(["size", name, size, f"minus {st.variants[0]}", *_num(r.size_diff, (0, v, k)), "", ""])
        why = why_not(st, r, v)
        labels = ";".join(flags(r, v))
        if why:
            rows.append(["fit", name, "", "withheld", "", "", "", "", why])
        else:
            for q, e in [("alpha", r.alpha), ("E", r.e), *[(f"L at {m}x", r.at[m]) for m in MULTIPLES]]:
                fixed = q == "E" and r.e_mode.kind == "prior" and r.e_mode.sd == 0  # given, not estimated
                rows.append(["fit", name, "", q, *(_num(e, (0, v))[:1] + ["", ""] if fixed else _num(e, (0, v))),
                             labels, "fixed" if fixed else ""])
        if r.fitted[0, v]:
            check = "failed" if r.failed[0, v] else "passed" if np.isfinite(r.heldout_err.lo[0, v]) else "no interval"
            for q, e in (("predicted", r.heldout_pred), ("measured", r.heldout_meas), ("error %", r.heldout_err)):
                rows.append(["heldout", name, st.sizes[int(np.nonzero(np.isfinite(r.size_loss.est[0, v]))[0][-1])],
                             q, *_num(e, (0, v)), check, ""])
    for pair, text, _, fields in crosses:
        share = f"share={fields['share']:.3f}; " if math.isfinite(fields["share"]) else ""
        rows.append(["crossing", pair, "", "compute", *(f"{fields[x]:.6g}" if math.isfinite(fields[x]) else ""
                                                         for x in ("estimate", "low", "high")), fields["flags"],
                     share + text])
    with open(path, "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(["kind", "variant", "size", "quantity", "estimate", "low", "high", "flags", "note"])
        w.writerows(rows)


def _num(e: Estimate, idx: tuple) -> list[str]:
    return [f"{float(x[idx]):.6g}" if math.isfinite(float(x[idx])) else "" for x in (e.est, e.lo, e.hi)]


def size_transfer(h: StudyHandle, st: ScalingStudy, r: ScalingResult | None = None) -> str:
    """The rank correlation of the variants between the smallest and the largest size of the ladder (each at
    its best LR), as `ablate compare` gives it between two studies."""
    small, large = st.sizes[0], st.sizes[-1]
    loss = st.data.loss[0]  # (V, K, R, N)
    have = np.isfinite(loss)
    means = np.where(have.any(-1), np.where(have, loss, 0).sum(-1) / np.maximum(have.sum(-1), 1), np.inf)
    best = np.argmin(means, -1)  # (V, K) each size's best LR (a variant's seeds' mean)
    at = np.take_along_axis(loss, best[..., None, None], 2)[:, :, 0]  # (V, K, N)
    ok = np.isfinite(at).any(-1)  # (V, K)
    names = [i for i in range(len(st.variants)) if ok[i, 0] and ok[i, -1]]
    head = f"transfer from the smallest size ({small}) to the largest ({large}): {len(names)} variant(s) at both"
    if len(names) < 3:
        return head + ": too few for a rank correlation"
    a, b = -at[names, 0], -at[names, -1]  # (variants, seeds), -loss: higher is better
    rc = rank_correlation(np.nanmean(a, 1), np.nanmean(b, 1))
    why = withheld({f"size {small} and {large}": len(st.seeds)})
    interval = None if why else rank_intervals(a, b, RESAMPLES, h.spec.significance["seed"])
    stat = {k: correlation_text(rc, interval, k) for k in ("tau", "rho")}
    p = rc["why"] or f"p = {rc['tau_p']:.3g} (tau), {rc['rho_p']:.3g} (rho); {rc['p_method']}"
    return (f"{head}: Kendall's tau = {stat['tau']}, Spearman's rho = {stat['rho']}, n = {rc['n']}: {p}" +
            (f"; no CI: {why}" if why else ""))
