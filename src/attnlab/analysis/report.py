"""Tables (markdown, CSV, LaTeX) of a study, computed only from what its trials stored.

One row per variant: the study metric's mean ± sample standard deviation over the seeds that finished (n, with ‡
under 3), its difference to the baseline row (Δ), the p-value and 95% interval of that difference, then the
columns the file chooses (columns.py): parameters, training FLOPs per token, steps and tokens trained, tokens/s,
wall time, any metric (final/..., or the last value of a logged curve) and any config attribute (the paper's N,
d_model, d_k, ...). Δ, p and the interval come from the study's inference model (model.py, inference.py): the
metric ~ variant + seed with the residual variance pooled over every row, Dunnett-adjusted against the
baseline with simultaneous intervals, the test set a sample of sentences unless the file says otherwise; the p
cell is the adjusted p, and the footnote names the model, what the intervals cover, the number of comparisons
and the smallest difference the study can find. Rows are sorted best first for the metric's direction; rows whose
adjusted p is below the file's level are marked with *. The baseline is the file's baseline:, else the
variant whose varied fields equal the base experiment's own values, else the first variant, and the footnote says
so (see AblationSpec.baseline); a search has none.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..ablate.factors import fmt
from ..ablate.study import StudyHandle
from .columns import Column
from .model import FEW_SEEDS, StudyModel, compare, detectable
from .rounds import Rounds, compare_rounds
from .rounds import footnote as rounds_footnote
from .rows import Row, collect_rows
from .stats import t_interval
from .testset import version


@dataclass
class Table:
    rows: list[Row]  # best first
    notes: list[str]  # the points not in the table, and why
    model: StudyModel | None  # the inference model (None without a baseline row)
    rounds: Rounds | None = None  # a study in rounds of seeds: its sequential tests replace the model's (rounds.py)


def table_rows(h: StudyHandle) -> Table:
    """The study's rows, each compared with the baseline in the study's model."""
    rows, notes = collect_rows(h)
    base = next((r for r in rows if r.baseline), None)
    model = compare(h, rows, base) if base is not None else None
    rounds = compare_rounds(h, rows, base) if base is not None and h.spec.rounds is not None else None
    if rounds is not None:  # the seeds no round has asked for (yet) are not missing from the table
        notes = [n for n in notes if not n.endswith(": pending")]
    notes += [f"{r.variant}: not compared with the baseline: {r.refused}" for r in rows if r.refused]
    if len(rows) > 1 and all(v == 0 for r in rows for v in r.values):  # a budget too short to score: BLEU 0
        for r in rows:
            r.significant = False
        notes.append(f"degenerate study: every trial scored 0 on {h.spec.metric}, so no row can differ from "
                     "another: no star (a larger budget would give scores)")
    return Table(rows, notes, model, rounds)


def method_text(h: StudyHandle, m: StudyModel, q: int) -> str:
    """What the p cell and the interval are: the model, its adjustment and its degrees of freedom."""
    sig = h.spec.significance
    k, n = m.k, len(m.seeds)
    adjusted = sig["correction"] != "none"
    if m.method == "pooled":
        df = m.fit.parts[0][1].reshape(-1)[0]
        out = (f"p and 95% CI of Δ: {h.spec.metric} ~ variant + seed by least squares (the seed a block: seed s "
               f"of every row shares its data order and initialisation), the residual variance pooled over the "
               f"study's {k} rows and {n} seeds ({df:g} degrees of freedom)")
        out += (f"; p adjusted by Dunnett's many-to-one procedure over the {q} comparison(s), the interval "
                "simultaneous (Dunnett 1955)" if adjusted else "; p and interval of each comparison alone")
        return out + (". Welch's unpooled test is the fallback when the seeds are not shared or Bartlett's test "
                      "says the rows' variances over their seeds differ.")
    if m.method == "welch":
        out = f"p and 95% CI of Δ: Welch's t-test over each row's own seeds, unpooled ({m.why})"
        return out + (f"; p adjusted by Holm's step-down method over the {q} comparison(s), Bonferroni intervals."
                      if adjusted else "; p and interval of each comparison alone.")
    seed = m.seeds[0] if m.seeds else ""
    return (f"1 seed: p and 95% CI of Δ are sacreBLEU's paired bootstrap of seed {seed} alone "
            f"({sig['resamples']} resamples of the test sentences, seed {sig['seed']}; Koehn 2004), conditional on "
            "that seed: they say whether these trained models differ on sentences like these, not whether the "
            "variants do (seed-to-seed variation is not measured)" +
            (f"; p adjusted by Holm over the {q} comparison(s)." if adjusted else "."))


def population_text(h: StudyHandle, m: StudyModel) -> str:
    if m.method == "paired bootstrap":
        return ""
    if m.population == "sample":
        return (f"The intervals cover seed-to-seed variation and the test set's sampling (its sentences resampled "
                f"{h.spec.significance['resamples']} times, the same sentences for every row and seed; "
                "significance.population: sample): a star says the variant differs over sentences like these.")
    why = m.population_why or "significance.population: test_set"
    return (f"The intervals cover seed-to-seed variation on this test set only ({why}): a star says the variant "
            "differs on these sentences, not on others like them.")


def footnote(h: StudyHandle, table: Table) -> str:
    """What Δ, p and the CI are, what population they cover, how many comparisons were made, and what the study
    could find."""
    rows, m = table.rows, table.model
    if m is None:
        return ""
    why = f" Baseline: {h.spec.baseline_reason()}." if h.spec.baseline_reason() else ""
    tested = [r.comparison for r in rows if r.comparison is not None]
    if table.rounds is not None:
        return rounds_footnote(h, table.rounds, len(rows) - 1) + why
    few = any(r.n < FEW_SEEDS for r in rows)
    flag = f" ‡ fewer than {FEW_SEEDS} seeds: too few to see the seed-to-seed variation." if few else ""
    if not tested:
        return "Δ: difference of the means to the baseline row; no test (the p column says why)." + flag + why
    sig = h.spec.significance
    parts = ["Δ: the model's difference to the baseline row (seed effects removed; the difference of the means "
             "when both have every seed)." if m.method == "pooled" else "Δ: difference of the means to the "
             "baseline row.", method_text(h, m, len(tested)) + (f" Scores: sacreBLEU {version()} on the stored "
                                                                   "hypotheses." if m.ystar is not None else "")]
    population = population_text(h, m)
    if population:
        parts.append(population)
    if m.ystar is not None and m.method != "paired bootstrap":
        parts.append("table.csv's paired_bootstrap_p_per_seed: sacreBLEU's paired bootstrap of each shared seed "
                     f"alone ({sig['resamples']} resamples, seed {sig['seed']}; sentence noise only), "
                     "paired_bootstrap_ci_per_seed its 95% percentile interval.")
    adjusted = "adjusted p" if sig["correction"] != "none" else "p (not corrected for multiple comparisons)"
    parts.append(f"* {adjusted} < {sig['level']:g}; {len(tested)} comparison(s) against the baseline.")
    mdd = detectable(m)
    if math.isfinite(mdd):
        parts.append(f"Minimum detectable Δ at 80% power: ±{mdd:.{digits(mdd)}f} (from this study's own variance).")
    return " ".join(parts) + flag + why


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


def count(x: float | None) -> str:
    """Tokens and FLOPs: 3 significant digits with a K/M/G/T/P/E suffix."""
    if x is None:
        return ""
    for power, suffix in ((18, "E"), (15, "P"), (12, "T"), (9, "G"), (6, "M"), (3, "K")):
        if abs(x) >= 10**power:
            return f"{x / 10**power:.3g}{suffix}"
    return f"{x:.3g}"


def column_digits(rows: list[Row], source: str) -> int:
    """One number of decimals for a metric column: the one its largest value needs (digits)."""
    values = [abs(r.mean if source == "metric" else r.cells[source]) for r in rows
              if source == "metric" or r.cells.get(source) is not None]
    return digits(max(values)) if values else 2


def cell(column: Column, value: Any, d: int = 2) -> str:
    if value is None:
        return ""
    if column.kind == "metric":
        return f"{value:.{d}f}"
    if column.kind == "config":
        return fmt(value)
    if column.source == "params":
        return params(value)
    if column.source == "wall":
        return duration(value)
    if column.source in ("tokens_per_s", "steps"):
        return f"{value:,.0f}"
    return count(value)


def metric_cells(r: Row, with_test: bool | str, d: int) -> list[str]:
    """mean ± std, n (‡ under FEW_SEEDS), and against the baseline Δ, the adjusted p and the CI of Δ, with d
    decimals (with_test "rounds": and the decision of a study in rounds)."""
    out = [f"{r.mean:.{d}f}" + (f" ± {r.std:.{d}f}" if r.n > 1 else ""), f"{r.n}" + (" ‡" if r.n < FEW_SEEDS else "")]
    if not with_test:
        return out
    out.append("baseline" if r.baseline else "" if r.delta is None else f"{r.delta:+.{d}f}")
    c = r.comparison
    shared = len(set(r.seeds) & set(r.baseline_seeds))
    if c is not None:
        out.append(f"{c.p_adjusted:.3g}" + ("*" if r.significant else "") + f" (n={len(c.seeds)})")
    elif r.refused:
        out.append("none: sacreBLEU signatures differ")
    elif r.untested:
        out.append(f"none: {r.untested}")
    else:
        out.append("" if r.baseline else f"none: {shared} shared seed{'s' * (shared != 1)}")
    out.append("" if c is None else f"[{c.ci_low:+.{d}f}, {c.ci_high:+.{d}f}]")
    return out + ([r.decision] if with_test == "rounds" else [])


def header(h: StudyHandle, with_test: bool) -> list[str]:
    out = ["variant"]
    for c in h.spec.columns:
        if c.source == "metric":
            arrow = "↑" if h.spec.direction == "max" else "↓"
            out += [f"{c.label or h.spec.metric} {arrow}", "n"] + (["Δ vs baseline", "p", "95% CI of Δ"]
                                                                  if with_test else []) + (
                ["decision"] if with_test and h.spec.rounds is not None else [])
        else:
            out.append(c.label)
    return out


def cells(h: StudyHandle, r: Row, with_test: bool, decimals: dict[str, int]) -> list[str]:
    out = [r.variant + (" †" if r.short else "")]
    for c in h.spec.columns:
        d = decimals.get(c.source, 2)
        test = "rounds" if with_test and h.spec.rounds is not None else with_test
        out += metric_cells(r, test, d) if c.source == "metric" else [cell(c, r.cells.get(c.source), d)]
    return out


def decimals_of(h: StudyHandle, rows: list[Row]) -> dict[str, int]:
    return {c.source: column_digits(rows, c.source) for c in h.spec.columns if c.source == "metric" or
            c.kind == "metric"}


def markdown(h: StudyHandle, table: Table) -> str:
    rows, notes = table.rows, table.notes
    with_test = any(r.baseline for r in rows)
    head = header(h, with_test)
    rule = "|" + "|".join("---" if i == 0 else "---:" for i in range(len(head))) + "|"
    lines = ["| " + " | ".join(head) + " |", rule]
    dec = decimals_of(h, rows)
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in cells(h, r, with_test, dec)) + " |" for r in rows]
    if not rows:
        lines.append("| (no finished trials yet) |" + " |" * (len(head) - 1))
    title = f"**{h.spec.name}**: {h.spec.metric}, mean ± std over seeds (n = seeds finished)"
    out = [title, "", *lines]
    note = footnote(h, table)
    if note:
        out += ["", note]
    if notes:
        out += ["", "Not in the table:", *[f"- {n}" for n in notes]]
    return "\n".join(out)


LATEX_CHARS = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "#": r"\#", "_": r"\_", "$": r"\$",
               "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\^{}", "±": r"$\pm$",
               "Δ": r"$\Delta$", "↑": r"$\uparrow$", "↓": r"$\downarrow$", "ε": r"$\epsilon$", "‡": r"$\ddagger$"}


def latex_escape(text: str) -> str:
    return "".join(LATEX_CHARS.get(c, c) for c in text)


def latex(h: StudyHandle, table: Table) -> str:
    rows = table.rows
    with_test = any(r.baseline for r in rows)
    head = header(h, with_test)
    lines = [r"\begin{tabular}{l" + "r" * (len(head) - 1) + "}", r"\toprule",
             " & ".join(latex_escape(c) for c in head) + r" \\", r"\midrule"]
    dec = decimals_of(h, rows)
    lines += [" & ".join(latex_escape(c) for c in cells(h, r, with_test, dec)) + r" \\" for r in rows]
    lines += [r"\bottomrule", r"\end{tabular}"]
    note = footnote(h, table)
    return "\n".join(lines + ([f"% {latex_escape(note)}"] if note else [])) + "\n"


def write_csv(path: Path, h: StudyHandle, table: Table) -> None:
    rows, m = table.rows, table.model
    metric = h.spec.metric
    extra = [c for c in h.spec.columns if c.source != "metric"]
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["variant", f"{metric} mean", f"{metric} std", "n", f"{metric} ci_low", f"{metric} ci_high",
                    "delta_vs_baseline", "p_value", "delta_ci_low", "delta_ci_high", "p_adjusted", "significant",
                    "test", "adjust", "se", "df", "population", "paired_bootstrap_p_per_seed",
                    "paired_bootstrap_ci_per_seed", "baseline",
                    *[c.label or c.source for c in extra], "n_params", "tokens_per_s", "wall_s", "seeds", "values",
                    "decision"])
        for r in rows:
            c = r.comparison
            test = [c.p_value, c.ci_low, c.ci_high, c.p_adjusted, r.significant, c.method, c.adjust, c.se, c.df,
                    m.population if c.method != "paired bootstrap" else f"seed {c.seeds[0]}",
                    " ".join(f"{s}:{p!r}" for s, p in c.per_seed.items()),
                    " ".join(f"{s}:[{lo!r},{hi!r}]" for s, (lo, hi) in c.per_seed_ci.items())] if c else [""] * 12
            w.writerow([r.variant, r.mean, r.std, r.n, *t_interval(r.values), "" if r.delta is None else r.delta,
                        *test, r.baseline, *["" if r.cells.get(x.source) is None else r.cells[x.source] for x in extra],
                        r.trials[0].user_attrs.get("n_params"), r.attr_mean("tokens_per_s"), r.attr_mean("wall_s"),
                        " ".join(map(str, r.seeds)), " ".join(repr(v) for v in r.values), r.decision])


def write_table(h: StudyHandle, out_dir: Path | None = None) -> tuple[str, list[Path]]:
    """The markdown table (returned) and table.md, table.csv, table.tex in out_dir (default: the study's)."""
    out_dir = Path(out_dir or h.dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    table = table_rows(h)
    md = markdown(h, table)
    paths = [out_dir / "table.md", out_dir / "table.csv", out_dir / "table.tex"]
    paths[0].write_text(md + "\n", encoding="utf-8")
    write_csv(paths[1], h, table)
    paths[2].write_text(latex(h, table), encoding="utf-8")
    return md, paths
