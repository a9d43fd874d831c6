"""A study's rows: one per finished variant, its trials (one per seed) and their values of the study's metric and of
the table's other columns, computed only from what the trials stored; and a trial's stored hypotheses."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from optuna.trial import FrozenTrial

from ..ablate.study import DONE, FAILED, INVALID, StudyHandle, final_scores, point_states, trial_value
from ..experiment import SECTIONS
from .columns import Column
from .hypotheses import read_lines

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
    comparison: Any = None  # model.Comparison, set by model.compare
    significant: bool = False
    cells: dict[str, Any] = field(default_factory=dict)  # column source -> value (mean over seeds)
    baseline_seeds: list[int] = field(default_factory=list)  # the baseline row's seeds (compare sets them)
    refused: str = ""  # why the row is not compared with the baseline (its sacreBLEU signature differs)
    untested: str = ""  # why a row in the model has no test (model.compare sets it)
    short: list[str] = field(default_factory=list)  # its trials that stopped short of the study's budget
    decision: str = ""  # a study in rounds: the comparison's state and the round it stopped at (rounds.py)

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
def collect_rows(h: StudyHandle) -> tuple[list[Row], list[str]]:
    """Rows of finished variants, best first, each with its columns, and notes on the points that are not in the
    table (model.compare adds each row's comparison with the baseline)."""
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
    rows.sort(key=lambda r: r.mean, reverse=spec.direction == "max")
    if baseline and not any(r.baseline for r in rows) and rows:
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
