"""What an ablation file says about its results: the metric (a final score or a logged curve), the columns of
its table, and the significance test against the baseline row. Parsed here for spec.py; report.py reads them."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ..config import ConfigError
from ..experiment import SECTIONS
from ..lit import TASK_MODULES

FINAL_METRIC = re.compile(r"^final/(valid|test)_(loss|ppl|bleu|chrf)$")  # what a final evaluation stores
# table columns that are neither a metric nor a config attribute, with their headers
BUILT_IN_COLUMNS = {"metric": "", "params": "params", "flops": "FLOPs/token", "train_flops": "train FLOPs",
                    "steps": "steps", "tokens": "tokens", "tokens_per_s": "tokens/s", "wall": "wall"}
DEFAULT_COLUMNS = ("metric", "params", "tokens_per_s", "wall")
# correction: dunnett (Dunnett 1955 over the rows against the baseline; Holm 1979 where Welch's fallback or a
# 1-seed study's bootstrap is used) or none; population: sample (seeds and the test set's sentences) or test_set
# (seeds only, conditional on this test set); seeds until decided (`seeds: {min, max}`, sequential.py): equivalence
# (eps: a comparison within +-eps is decided as equivalent, TOST) and the alpha-spending function of the rounds
SIGNIFICANCE = {"level": 0.05, "resamples": 1000, "seed": 12345, "correction": "dunnett", "population": "sample",
                "equivalence": None, "spending": "obrien_fleming"}
CHOICES = {"correction": ("dunnett", "none"), "population": ("sample", "test_set"),
           "spending": ("obrien_fleming", "pocock")}


@dataclass(frozen=True)
class Column:
    """A column of the table: its header and what it shows: a BUILT_IN_COLUMNS name, a metric (final/..., or the
    last value of a logged curve such as val/ppl) or an attribute of a trial's config (model.d_ff, model.d_k)."""

    label: str
    source: str

    @property
    def kind(self) -> str:
        if self.source in BUILT_IN_COLUMNS:
            return "built_in"
        return "metric" if "/" in self.source else "config"


DEFAULT_TABLE = tuple(Column(BUILT_IN_COLUMNS[c], c) for c in DEFAULT_COLUMNS)


def kept_curve(name: str) -> bool:
    """Whether a trial keeps this logged curve among its results (results.collect), for tables and plots."""
    return name.startswith(("val/", "test/")) or name == "train/loss"


def check_metric(name: str, final_eval: bool, where: str, task: str | None = None, kept: bool = False) -> None:
    """final/<valid|test>_<loss|ppl|bleu|chrf> (needs final_eval), or a curve a fit of `task` logs (the task's
    LightningModule's curves(): val/loss, train/loss, ...; with `kept`, only those a trial keeps: a column)."""
    if name.startswith("final/"):
        need(FINAL_METRIC.match(name) is not None,
             f"{where}: {name} is not a final score; expected final/<valid|test>_<loss|ppl|bleu|chrf>")
        need(final_eval, f"{where}: {name} needs the final evaluation; remove final_eval: false")
        return
    need(name.count("/") == 1 and all(name.split("/")),
         f"{where}: {name!r} is neither final/<split>_<score> nor a logged curve such as val/loss")
    if task not in TASK_MODULES:
        return
    logged = [c for c in TASK_MODULES[task].curves() if kept_curve(c) or not kept]
    if name in logged:
        return
    if task != "translation" and name in TASK_MODULES["translation"].curves():
        raise ConfigError(f"{where}: {name} is scored for translation experiments only; this base trains {task}")
    split, _, score = name.partition("/")
    hint = (f"; the test split is scored by the final evaluation: final/test_{score}" if split == "test" and
            f"val/{score}" in logged and score in ("loss", "ppl", "bleu", "chrf") else "")
    raise ConfigError(f"{where}: {name} is never logged by a {task} trial{hint}; expected "
                      f"final/<valid|test>_<loss|ppl|bleu|chrf> or one of {', '.join(logged)}")


def parse_columns(items: Any, final_eval: bool, src: str, task: str | None = None, metric: str = ""
                  ) -> tuple[Column, ...]:
    """`columns:` entries: a name (params, final/test_bleu, model.d_ff) or {header: name}; `metric`: the study's
    (a curve a trial logs but keeps only as its metric, such as train/lr, is a valid column when it is that)."""
    need(isinstance(items, list) and items, f"{src}: columns must be a non-empty list")
    out = []
    for i, item in enumerate(items):
        if isinstance(item, dict) and len(item) == 1:
            label, source = next(iter(item.items()))
        elif isinstance(item, str):
            label, source = BUILT_IN_COLUMNS.get(item, item), item
        else:
            raise ConfigError(f"{src}: columns[{i}]={item!r}: expected a name or {{header: name}}")
        column = Column(str(label), str(source))
        where = f"{src}: columns[{i}] ({source})"
        if column.kind == "metric":
            check_metric(column.source, final_eval, where, task, kept=column.source != metric)
        elif column.kind == "config":
            section, _, attr = column.source.partition(".")
            need(section in SECTIONS and attr and not callable(getattr(SECTIONS[section], attr, len)),
                 f"{where}: expected one of {', '.join(BUILT_IN_COLUMNS)}, a metric (final/test_bleu, val/ppl) "
                 "or a config attribute (model.d_ff, model.ffn_dim, model.d_k)")
        out.append(column)
    need(sum(c.source == "metric" for c in out) <= 1, f"{src}: columns: metric appears twice")
    if not any(c.source == "metric" for c in out):
        out.insert(0, Column("", "metric"))  # the study's metric, its difference and significance: always shown
    return tuple(out)


def parse_significance(raw: Any, src: str) -> dict[str, Any]:
    """`significance: {level, resamples, seed, correction, population, equivalence, spending}` over the defaults in
    SIGNIFICANCE."""
    raw = raw or {}
    need(not isinstance(raw, dict) or "holm" not in raw,
         f"{src}: significance.holm is now significance.correction: dunnett (the default: Dunnett's many-to-one "
         "adjustment, Holm's where Welch's fallback is used) or none")
    bad = [k for k in raw if k not in SIGNIFICANCE] if isinstance(raw, dict) else ["(not a mapping)"]
    need(not bad, f"{src}: significance: unknown key(s) {bad}; expected some of {', '.join(SIGNIFICANCE)}")
    out = {**SIGNIFICANCE, **raw}
    level = out["level"]
    need(isinstance(level, (int, float)) and not isinstance(level, bool) and 0 < level < 1,
         f"{src}: significance.level={level!r} must be in (0, 1)")
    for k in ("resamples", "seed"):  # sacreBLEU takes seed 0 for "no seed": a reproducible test needs >= 1
        need(isinstance(out[k], int) and not isinstance(out[k], bool) and out[k] >= 1,
             f"{src}: significance.{k}={out[k]!r} must be an int >= 1")
    eps = out["equivalence"]
    need(eps is None or (isinstance(eps, (int, float)) and not isinstance(eps, bool) and eps > 0),
         f"{src}: significance.equivalence={eps!r} must be a number > 0 (the margin eps of |Δ| < eps) or null")
    for k, allowed in CHOICES.items():
        need(out[k] in allowed, f"{src}: significance.{k}={out[k]!r}: expected one of {', '.join(allowed)}")
    return {**out, "level": float(level), "equivalence": None if eps is None else float(eps)}


def need(cond: bool, msg: str) -> None:
    """ConfigError(msg) unless cond: the check every key of an ablation file goes through."""
    if not cond:
        raise ConfigError(msg)
