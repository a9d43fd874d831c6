"""Tables (markdown, CSV, LaTeX) of a study, computed only from what its trials stored.

One row per variant: the study metric's mean ± sample standard deviation over the seeds that finished (n), its
difference to the baseline row's mean on the seeds both rows have (Δ), the p-value and 95% CI of that difference on
those seeds, and their number (stats.py: Welch's t-test over the seeds, on each seed's sacreBLEU corpus score when
the metric is a final BLEU or chrF, with each seed's sacreBLEU paired bootstrap beside it in table.csv; fewer than 2
shared seeds, or no variance in either row: no test, and the p cell says why), then the columns the file chooses
(columns.py): parameters, training FLOPs per token, steps and tokens trained, tokens/s, wall time, any metric
(final/..., or the last value of a logged curve) and any config attribute (the paper's N, d_model, d_k, ...). Rows
are sorted best first for the metric's direction; rows whose difference is significant at the file's level are
marked with *, and the table says how many comparisons were made (Holm's correction over the rows with a test,
unless the file turns it off). The baseline is the file's baseline:, else the
variant whose varied fields equal the base experiment's own values, else the first variant, and the footnote says
so (see AblationSpec.baseline); a search has none.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from optuna.trial import FrozenTrial

from ..ablate.factors import fmt
from ..ablate.study import DONE, FAILED, INVALID, StudyHandle, final_scores, point_states, trial_value
from ..experiment import SECTIONS
from .columns import FINAL_METRIC, Column
from .hypotheses import read_lines
from .stats import Comparison, bootstrap_rows, holm, t_interval, version, welch

BUILT_IN_ATTRS = {"flops": "flops_per_token", "steps": "steps", "tokens": "tokens",
                  "tokens_per_s": "tokens_per_s", "wall": "wall_s"}


@dataclass
class Row:
    key: str
    variant: str
    trials: list[FrozenTrial]  # one per finished seed, in seed order
    values: list[float]  # the study metric of each
    baseline: bool = False
    delta: float | None = None
    comparison: Comparison | None = None
    significant: bool = False
    cells: dict[str, Any] = field(default_factory=dict)  # column source -> value (mean over seeds)
    baseline_seeds: list[int] = field(default_factory=list)  # the baseline row's seeds (compare sets them)
    refused: str = ""  # why the row is not compared with the baseline (its sacreBLEU signature differs)
    untested: str = ""  # why a row with 2 or more shared seeds has no test (compare sets it)
    short: list[str] = field(default_factory=list)  # its trials that stopped short of the study's budget

    @property
    def seeds(self) -> list[int]:
        return [int(t.user_attrs.get("seed", 0)) for t in self.trials]

    @property
    def by_seed(self) -> dict[int, float]:
        return dict(zip(self.seeds, self.values, strict=True))

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

    def attr_mean(self, key: str) -> float | None:
        return _mean([t.user_attrs.get(key) for t in self.trials])


def _mean(xs: list[Any]) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


# ---------------------------------------------------------------------------------------------- rows
def collect_rows(h: StudyHandle, tests: bool = True) -> tuple[list[Row], list[str]]:
    """Rows of finished variants, best first, each with its columns and (with `tests`) its comparison with the
    baseline, and notes on the points that are not in the table."""
    spec, attrs = h.spec, h.study.user_attrs
    groups: dict[str, list[tuple[FrozenTrial, float]]] = {}
    notes: list[str] = []
    for s in point_states(h).values():
        r = s.result
        if r is not None:
            value = trial_value(r, spec.metric, attrs)
            if value is None:
                how = "`attnlab ablate evaluate`" if spec.metric.startswith("final/") else "a longer budget"
                notes.append(f"{s.variant} (seed {s.seed}): done, but without {spec.metric} (see {how})")
                continue
            key = r.user_attrs.get("variant_key") or s.point_id  # a search's points are their own variants
            groups.setdefault(key, []).append((r, value))
        elif s.status in (INVALID, FAILED):
            notes.append(f"{s.variant} (seed {s.seed}): {s.status}: {s.reason.splitlines()[0] if s.reason else ''}")
        elif s.status != DONE:
            notes.append(f"{s.variant} (seed {s.seed}): {s.status}")
    baseline = attrs.get("baseline")
    rows = []
    for key, pairs in groups.items():
        pairs.sort(key=lambda p: p[0].user_attrs.get("seed", 0))
        trials = [t for t, _ in pairs]
        row = Row(key, str(trials[0].user_attrs.get("variant")), trials, [v for _, v in pairs], key == baseline)
        row.cells = {c.source: column_value(row, c, attrs) for c in spec.columns if c.source != "metric"}
        if spec.budget_steps is not None or spec.budget_flops is not None or spec.scale_budget:
            row.short = short_of_budget(trials)
            notes += [f"{row.variant} {x}: short of its budget (†)" for x in row.short]
        rows.append(row)
    base_row = next((r for r in rows if r.baseline), None)
    if base_row is not None and tests:
        compare(h, rows, base_row)
        notes += [f"{r.variant}: not compared with the baseline: {r.refused}" for r in rows if r.refused]
    if len(rows) > 1 and all(v == 0 for r in rows for v in r.values):  # a budget too short to score: BLEU 0
        for r in rows:
            r.significant = False
        notes.append(f"degenerate study: every trial scored 0 on {spec.metric}, so no row can differ from another: "
                     "no star (a larger budget would give scores)")
    rows.sort(key=lambda r: r.mean, reverse=spec.direction == "max")
    if baseline and base_row is None and rows:
        notes.insert(0, "the baseline variant has no finished trial: no differences shown")
    return rows, notes


def short_of_budget(trials: list[FrozenTrial]) -> list[str]:
    """The trials that trained fewer steps than their budget gave them (trainer.max_steps of the config they
    trained with): a time limit, a divergence stop or a crash ended them first."""
    out = []
    for t in trials:
        config = t.user_attrs.get("config") or {}
        steps, budget = t.user_attrs.get("steps"), config.get("trainer", {}).get("max_steps")
        if steps is not None and budget and steps < budget:
            out.append(f"(seed {t.user_attrs.get('seed', 0)}) stopped at step {steps:,} of {budget:,}")
    return out


def column_value(row: Row, column: Column, attrs: dict[str, Any]) -> Any:
    """A row's value in a column: the mean over its seeds (a config attribute: the first trial's)."""
    if column.kind == "metric":
        return _mean([trial_value(t, column.source, attrs) for t in row.trials])
    if column.kind == "config":
        section, _, name = column.source.partition(".")
        from_trials = [t.user_attrs.get("config") for t in row.trials if t.user_attrs.get("config")]
        if not from_trials:
            return None
        return getattr(SECTIONS[section].from_dict(from_trials[0][section]), name)
    if column.source == "train_flops":
        return _mean([t.user_attrs["flops_per_token"] * t.user_attrs["tokens"] for t in row.trials
                      if t.user_attrs.get("flops_per_token") and t.user_attrs.get("tokens")])
    if column.source == "params":
        return row.trials[0].user_attrs.get("n_params")
    return row.attr_mean(BUILT_IN_ATTRS[column.source])


def hypotheses(t: FrozenTrial, split: str, attrs: dict[str, Any]) -> tuple[list[str], list[str]] | None:
    """A trial's stored (hypotheses, references) of `split` (final.py writes them), or None."""
    eval_dir = Path(final_scores(t, attrs).get("eval_dir") or Path(t.user_attrs.get("run_dir", ".")) / "eval")
    hyp, ref = eval_dir / f"{split}.hyp", eval_dir / f"{split}.ref"
    return (read_lines(hyp), read_lines(ref)) if hyp.is_file() and ref.is_file() else None


def compare(h: StudyHandle, rows: list[Row], base: Row) -> None:
    """Δ, p-value and CI of every row against the baseline; Holm's correction over them when asked."""
    spec, sig, attrs = h.spec, h.spec.significance, h.study.user_attrs
    final = FINAL_METRIC.match(spec.metric)
    score = final.group(2) if final else ""
    texts = {}
    if score in ("bleu", "chrf"):
        texts = {r.key: {t.user_attrs.get("seed", 0): hypotheses(t, final.group(1), attrs) for t in r.trials}
                 for r in rows}
    signatures = {r.key: sorted({final_scores(t, attrs).get(f"{score}_signature", "") for t in r.trials})
                  for r in rows} if score in ("bleu", "chrf") else {}
    for r in rows:
        r.baseline_seeds = base.seeds
        shared = sorted(set(r.seeds) & set(base.seeds))
        if r is base or not shared:
            r.delta = r.mean - base.mean
            continue
        if signatures and (len(signatures[r.key]) > 1 or signatures[r.key] != signatures[base.key]):
            r.refused = (f"its sacreBLEU signature(s) {' ; '.join(signatures[r.key])} differ from the baseline's "
                         f"{' ; '.join(signatures[base.key])} (scores made another way are not comparable)")
            continue
        values, base_values = [r.by_seed[s] for s in shared], [base.by_seed[s] for s in shared]
        r.delta = sum(values) / len(shared) - sum(base_values) / len(shared)
        pairs = texts.get(r.key, {})
        if pairs and all(pairs.values()) and all(texts[base.key].values()):
            r.comparison = bootstrap_rows(texts[base.key], pairs, score, sig["resamples"], sig["seed"],
                                          signatures[r.key][0])
        else:
            p, low, high = welch(base_values, values)
            r.comparison = Comparison("Welch", p, low, high, seeds=tuple(shared)) if not math.isnan(p) else None
        if r.comparison is None and len(shared) >= 2:  # Welch's p is NaN: neither row varies over its seeds
            r.untested = "no variance in either row"
    tested = [r for r in rows if r.comparison is not None]
    for r, p in zip(tested, holm([r.comparison.p_value for r in tested]), strict=True):
        r.comparison.p_holm = p
        r.significant = (p if sig["holm"] else r.comparison.p_value) < sig["level"]


def footnote(h: StudyHandle, rows: list[Row]) -> str:
    """What Δ, p and the CI are, and how many comparisons were made."""
    tested = [r.comparison for r in rows if r.comparison is not None]
    if not any(r.baseline for r in rows):
        return ""
    why = f" Baseline: {h.spec.baseline_reason()}." if h.spec.baseline_reason() else ""
    if not tested:
        return "Δ: difference of the means to the baseline row; no test (the p column says why)." + why
    sig = h.spec.significance
    methods = {c.method for c in tested}
    parts = ["Δ: difference of the means to the baseline row, on the seeds both rows have (n)."]
    if "Welch over seed scores" in methods:
        parts.append(f"p and 95% CI of Δ for {h.spec.metric}: Welch's t-test over the seeds both rows have, on "
                     f"each seed's corpus score (sacreBLEU {version()}), so seed and sentence noise both count; "
                     "n is the number of shared seeds. table.csv's paired_bootstrap_p_per_seed: sacreBLEU's paired "
                     f"bootstrap of each shared seed alone ({sig['resamples']} resamples, seed {sig['seed']}; "
                     "sentence noise only), paired_bootstrap_ci_per_seed its 95% percentile interval.")
    if "Welch" in methods:
        parts.append("p: Welch's t-test over seeds; 95% CI of Δ: t distribution, Welch-Satterthwaite df.")
    holm_text = "Holm-corrected" if sig["holm"] else "not corrected for multiple comparisons"
    parts.append(f"* p < {sig['level']:g} ({holm_text}); {len(tested)} comparison(s) against the baseline.")
    return " ".join(parts) + why


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


def metric_cells(r: Row, with_test: bool, d: int) -> list[str]:
    """mean ± std, n, and against the baseline Δ, p and the CI of Δ, with d decimals."""
    out = [f"{r.mean:.{d}f}" + (f" ± {r.std:.{d}f}" if r.n > 1 else ""), str(r.n)]
    if not with_test:
        return out
    out.append("baseline" if r.baseline else "" if r.delta is None else f"{r.delta:+.{d}f}")
    c = r.comparison
    shared = len(set(r.seeds) & set(r.baseline_seeds))
    if c is not None:
        out.append(f"{c.p_value:.3g}" + ("*" if r.significant else "") + f" (n={len(c.seeds)})")
    elif r.refused:
        out.append("none: sacreBLEU signatures differ")
    elif r.untested:
        out.append(f"none: {r.untested}")
    else:
        out.append("" if r.baseline else f"none: {shared} shared seed{'s' * (shared != 1)}, a test needs 2")
    out.append("" if c is None else f"[{c.ci_low:+.{d}f}, {c.ci_high:+.{d}f}]")
    return out


def header(h: StudyHandle, with_test: bool) -> list[str]:
    out = ["variant"]
    for c in h.spec.columns:
        if c.source == "metric":
            arrow = "↑" if h.spec.direction == "max" else "↓"
            out += [f"{c.label or h.spec.metric} {arrow}", "n"] + (["Δ vs baseline", "p", "95% CI of Δ"]
                                                                  if with_test else [])
        else:
            out.append(c.label)
    return out


def cells(h: StudyHandle, r: Row, with_test: bool, decimals: dict[str, int]) -> list[str]:
    out = [r.variant + (" †" if r.short else "")]
    for c in h.spec.columns:
        d = decimals.get(c.source, 2)
        out += metric_cells(r, with_test, d) if c.source == "metric" else [cell(c, r.cells.get(c.source), d)]
    return out


def decimals_of(h: StudyHandle, rows: list[Row]) -> dict[str, int]:
    return {c.source: column_digits(rows, c.source) for c in h.spec.columns if c.source == "metric" or
            c.kind == "metric"}


def markdown(h: StudyHandle, rows: list[Row], notes: list[str]) -> str:
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
    note = footnote(h, rows)
    if note:
        out += ["", note]
    if notes:
        out += ["", "Not in the table:", *[f"- {n}" for n in notes]]
    return "\n".join(out)


LATEX_CHARS = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "#": r"\#", "_": r"\_", "$": r"\$",
               "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\^{}", "±": r"$\pm$",
               "Δ": r"$\Delta$", "↑": r"$\uparrow$", "↓": r"$\downarrow$", "ε": r"$\epsilon$"}


def latex_escape(text: str) -> str:
    return "".join(LATEX_CHARS.get(c, c) for c in text)


def latex(h: StudyHandle, rows: list[Row]) -> str:
    with_test = any(r.baseline for r in rows)
    head = header(h, with_test)
    lines = [r"\begin{tabular}{l" + "r" * (len(head) - 1) + "}", r"\toprule",
             " & ".join(latex_escape(c) for c in head) + r" \\", r"\midrule"]
    dec = decimals_of(h, rows)
    lines += [" & ".join(latex_escape(c) for c in cells(h, r, with_test, dec)) + r" \\" for r in rows]
    lines += [r"\bottomrule", r"\end{tabular}"]
    note = footnote(h, rows)
    return "\n".join(lines + ([f"% {latex_escape(note)}"] if note else [])) + "\n"


def write_csv(path: Path, h: StudyHandle, rows: list[Row]) -> None:
    metric = h.spec.metric
    extra = [c for c in h.spec.columns if c.source != "metric"]
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["variant", f"{metric} mean", f"{metric} std", "n", f"{metric} ci_low", f"{metric} ci_high",
                    "delta_vs_baseline", "p_value", "delta_ci_low", "delta_ci_high", "p_holm", "significant", "test",
                    "paired_bootstrap_p_per_seed", "paired_bootstrap_ci_per_seed", "baseline",
                    *[c.label or c.source for c in extra], "n_params", "tokens_per_s", "wall_s", "seeds", "values"])
        for r in rows:
            c = r.comparison
            test = [c.p_value, c.ci_low, c.ci_high, c.p_holm, r.significant, c.method,
                    " ".join(f"{s}:{p!r}" for s, p in c.per_seed.items()),
                    " ".join(f"{s}:[{lo!r},{hi!r}]" for s, (lo, hi) in c.per_seed_ci.items())] if c else [""] * 8
            w.writerow([r.variant, r.mean, r.std, r.n, *t_interval(r.values), "" if r.delta is None else r.delta,
                        *test, r.baseline, *["" if r.cells.get(x.source) is None else r.cells[x.source] for x in extra],
                        r.trials[0].user_attrs.get("n_params"), r.attr_mean("tokens_per_s"), r.attr_mean("wall_s"),
                        " ".join(map(str, r.seeds)), " ".join(repr(v) for v in r.values)])


def write_table(h: StudyHandle, out_dir: Path | None = None) -> tuple[str, list[Path]]:
    """The markdown table (returned) and table.md, table.csv, table.tex in out_dir (default: the study's)."""
    out_dir = Path(out_dir or h.dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows, notes = collect_rows(h)
    md = markdown(h, rows, notes)
    paths = [out_dir / "table.md", out_dir / "table.csv", out_dir / "table.tex"]
    paths[0].write_text(md + "\n", encoding="utf-8")
    write_csv(paths[1], h, rows)
    paths[2].write_text(latex(h, rows), encoding="utf-8")
    return md, paths
