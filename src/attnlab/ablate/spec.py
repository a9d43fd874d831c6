"""An ablation file: a base experiment, what varies (a grid of axes, a list of variants, or an optuna
search), seeds, the metric and its direction, the budget and resources of one trial.

    name: block_variants                      # default: the file's stem
    base: ../experiments/demo_en_de.yaml      # relative to this file
    metric: {name: final/test_bleu, direction: max}    # or the last value of a curve: val/bleu, val/loss, ...
                                              # default: final/test_bleu for translation (beam search on
                                              # the averaged checkpoint, chrF beside it), else val/loss
    seeds: [1, 2]                             # or a count: 2 means [1, 2]; or {min: 2, max: 10}: rounds of
                                              # seeds until each comparison is decided (seeds.py)
    budget: {steps: 2000}                     # trainer.max_steps and the schedule's optim.max_steps;
                                              # {time_min: 30} sets trainer.max_time_min (a cosine or wsd
                                              # schedule then needs optim.max_steps under overrides:);
                                              # {flops: 1.0e15}: each variant the steps that spend that (budget.py)
    final_eval: true                          # evaluate each trial as its recipe says (final.py); the default
    columns: [metric, params, flops, steps, {PPL: final/valid_ppl}, {d_k: model.d_k}]   # of the table
    significance: {level: 0.05, resamples: 1000, seed: 12345, correction: dunnett, population: sample}
                                              # against the baseline row (attnlab.analysis.columns)
    baseline: ffn=relu                        # the baseline row (a variant's name); default: the base recipe's
    resources: {devices: 1}                   # per trial; devices also sets trainer.devices
    retries: 2                                # a failing point is tried 1 + retries times
    overrides: {trainer.val_every: 500}       # applied to every trial
    axes:                                     # a full grid: the product of the value lists
      model.norm: [layernorm, rmsnorm]
    variants:                                 # and/or a list of named one-off overrides (Table 3 style)
      - {name: "(A) h=1", model.n_heads: 1}

or, instead of axes/variants, a TPE search:

    search: optuna
    n_trials: 20
    distributions:
      optim.lr: {type: float, low: 1.0e-4, high: 3.0e-3, log: true}
      model.ffn: {type: categorical, choices: [gelu, swiglu]}

A key or value that can never run is an error here, naming it: unknown fields, an axis naming no config
field, a value the field cannot take. A *combination* that cannot run (attn_softcap with sdpa from two axes)
is not: its trial is recorded as invalid with the reason when the study runs.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..analysis.columns import (
    DEFAULT_COLUMNS,
    DEFAULT_TABLE,
    SIGNIFICANCE,
    Column,
    check_metric,
    parse_columns,
    parse_significance,
)
from ..analysis.columns import need as _need
from ..config import ConfigError, load_yaml
from ..experiment import TASKS, Experiment, apply_override, from_raw, load_raw
from .factors import (
    Distribution,
    Variant,
    coerce,
    fmt,
    parse_axes,
    parse_distributions,
    parse_lr,
    parse_overrides,
    parse_scale,
    parse_variants,
    short_key,
)
from .seeds import Rounds, parse_seeds

TOP_KEYS = ("name", "description", "base", "metric", "seeds", "budget", "resources", "retries", "overrides",
            "axes", "variants", "search", "n_trials", "distributions", "search_seed", "final_eval", "columns",
            "significance", "baseline", "scale", "lr")
HORIZON_SCHEDULES = ("cosine", "wsd")  # the schedules that decay towards optim.max_steps
RESOURCE_KEYS = ("devices", "nodes", "cpus", "mem_gb", "time_min", "partition")


@dataclass(frozen=True)
class Point:
    """One trial of a grid: a variant and a seed. `point_id` is stable across runs of the same file."""

    variant: Variant
    seed: int

    @property
    def point_id(self) -> str:
        return hashlib.sha1(f"{self.variant.key}|seed={self.seed}".encode()).hexdigest()[:12]


@dataclass(frozen=True)
class AblationSpec:
    name: str
    path: Path  # the ablation file
    base: Path  # the base experiment recipe
    metric: str
    direction: str  # max | min
    seeds: tuple[int, ...]
    budget_steps: int | None = None
    budget_time_min: float | None = None
    budget_flops: float | None = None  # training FLOPs per trial: steps per variant from the accounting (budget.py)
    final_eval: bool = True
    columns: tuple[Column, ...] = DEFAULT_TABLE
    significance: dict[str, Any] = field(default_factory=lambda: dict(SIGNIFICANCE))
    resources: dict[str, Any] = field(default_factory=dict)
    retries: int = 2
    overrides: dict[str, Any] = field(default_factory=dict)
    axes: dict[str, list[Any]] = field(default_factory=dict)
    variant_list: tuple[Variant, ...] = ()
    distributions: tuple[Distribution, ...] = ()
    n_trials: int = 0
    search_seed: int = 0
    description: str = ""
    baseline_name: str | None = None  # the file's baseline: (a variant's name or key)
    sizes: tuple[Variant, ...] = ()  # the scale: ladder (factors.parse_scale)
    scale_budget: dict[str, float] = field(default_factory=dict)  # each size's training budget (budget.py)
    lrs: tuple[float, ...] = ()  # the learning rates searched for every variant and size (factors.parse_lr)
    rounds: Rounds | None = None  # seeds: {min, max}: rounds of seeds until decided (seeds.py); seeds holds max
    lr_extend: bool = False  # lr: {extend_edges: true}: one more LR beyond an edge that is best (edges.py)

    @property
    def is_search(self) -> bool:
        return bool(self.distributions)

    # ----- what varies -----
    def variants(self) -> list[Variant]:
        """The grid's variants: explicit variants (or the base alone) x the scale ladder's sizes x the product of
        the axes x the learning rates searched, in file order."""
        listed = list(self.variant_list) or [Variant("base", {}, ())]
        keys = list(self.axes)
        out = []
        for v, size, values, lr in itertools.product(listed, list(self.sizes) or [None],
                                                     list(itertools.product(*(self.axes[k] for k in keys))),
                                                     list(self.lrs) or [None]):
            over = {**v.overrides, **(size.overrides if size else {}), **dict(zip(keys, values, strict=True))}
            parts = ([v.name] if self.variant_list else []) + ([f"scale={size.name}"] if size else []) + [
                f"{short_key(k, keys)}={fmt(x)}" for k, x in zip(keys, values, strict=True)]
            levels = v.levels + (size.levels if size else ()) + tuple(
                f"{k}={fmt(x)}" for k, x in zip(keys, values, strict=True))
            if lr is not None:
                over["optim.lr"] = lr
                parts.append(f"lr={fmt(lr)}")
                levels += (f"optim.lr={fmt(lr)}",)
            out.append(Variant(" ".join(parts) or v.name, over, levels))
        return out

    def varied_keys(self) -> set[str]:
        """The config fields that vary across trials: every override of a grid's variants, or a search's
        distributions."""
        if self.is_search:
            return {d.key for d in self.distributions}
        return {k for v in self.variants() for k in v.overrides}

    def points(self) -> list[Point]:
        """Every (variant, seed) of a grid, seed-major: each variant's first seed comes before any second."""
        variants = self.variants()
        return [Point(v, s) for s in self.seeds for v in variants]

    def baseline(self) -> Variant | None:
        """The variant the file names in baseline:, else the one whose varied fields all equal the base
        experiment's own values, else the first variant (the first value of each axis, or the first listed
        variant). None for a search."""
        return self._baseline()[0]

    def baseline_reason(self) -> str:
        """Why the baseline row is the first variant, when neither baseline: nor the base recipe chose it."""
        return self._baseline()[1]

    def _baseline(self) -> tuple[Variant | None, str]:
        if self.is_search:
            return None, ""
        variants = self.variants()
        if self.baseline_name is not None:
            return next(v for v in variants if self.baseline_name in (v.name, v.key)), ""
        base = flatten(self.experiment({}).to_dict())
        for v in variants:
            if all(base.get(k) == x for k, x in v.overrides.items()):
                return v, ""
        return variants[0], (f"no variant has the base recipe's own values of {', '.join(sorted(self.varied_keys()))}, "
                             f"so the first, {variants[0].name}, is the baseline (baseline: in the file chooses one)")

    # ----- configs -----
    def trial_overrides(self, variant_overrides: dict[str, Any], seed: int) -> dict[str, Any]:
        """Base <- the budget's schedule horizon and step intervals <- fixed overrides <- budget and resources <- the
        variant <- the seed.

        A steps budget is also the learning-rate schedule's horizon (optim.max_steps), unless the file sets that
        itself: a trial that stops at N steps must not compare its variants with the rate still near its peak."""
        out: dict[str, Any] = {}
        if self.budget_steps is not None:
            out["optim.max_steps"] = self.budget_steps
        if (self.budget_steps is not None or self.budget_flops is not None or self.scale_budget) and \
                self.budget_time_min is None:
            out["trainer.max_time_min"] = 0  # the budget, not the recipe's time limit, ends a trial
            # at a fixed step, so it validates and checkpoints at the recipe's steps, the same in every trial: were
            # they stretched by the timing of a trial's first steps (trainer.*_every_min: its variant, the machine's
            # load), trials would average the checkpoints of other steps and validate at other steps
            out["trainer.val_every_min"] = out["trainer.ckpt_every_min"] = 0
        out.update(self.overrides)
        if self.budget_steps is not None:
            out["trainer.max_steps"] = self.budget_steps
        if self.budget_time_min is not None:
            out["trainer.max_time_min"] = self.budget_time_min
        if "devices" in self.resources:
            out["trainer.devices"] = self.resources["devices"]
        out.update(variant_overrides)
        out["trainer.seed"] = seed
        return out

    def experiment(self, variant_overrides: dict[str, Any], seed: int | None = None) -> Experiment:
        """The Experiment of one trial (ConfigError when the combination cannot run)."""
        raw = copy.deepcopy(_base_raw(self.base))
        over = self.trial_overrides(variant_overrides, self.seeds[0] if seed is None else seed)
        for k, v in over.items():
            apply_override(raw, k, v)
        try:
            exp = from_raw(raw, str(self.base))
        except ConfigError as e:
            raise ConfigError(self._blame(str(e), variant_overrides)) from None
        horizon_unknown = "optim.max_steps" not in over and exp.optim.schedule in HORIZON_SCHEDULES
        if self.budget_time_min is not None and horizon_unknown:
            raise ConfigError(
                f"{self.path}: budget.time_min={self.budget_time_min:g} with optim.schedule={exp.optim.schedule}: the "
                f"schedule needs a horizon in steps, which a time budget does not give (the recipe's "
                f"optim.max_steps={exp.optim.max_steps} would be a guess). Set optim.max_steps under overrides:, "
                f"or give budget.steps, or use a schedule without a horizon (noam, inverse_sqrt, constant)")
        return exp

    def _blame(self, msg: str, variant_overrides: dict[str, Any]) -> str:
        """The error of a trial's config, against this file when a key it sets is named in it (overrides.<key>, or
        the variant's key): the base recipe itself is at fault only when none is."""
        body = msg.removeprefix(f"{self.base}: ")
        named = [k for k in {**self.overrides, **variant_overrides} if re.search(rf"(?<![\w.]){re.escape(k)}\b", body)]
        if not named:
            return msg
        keys = ", ".join(k if k in variant_overrides else f"overrides.{k}" for k in named)
        return f"{self.path}: {keys}: {body} (on the base recipe {self.base})"

    def to_dict(self) -> dict[str, Any]:
        """What a study stores about its spec (JSON), so status, tables and plots need no files."""
        return {"name": self.name, "path": str(self.path), "base": str(self.base), "metric": self.metric,
                "direction": self.direction, "seeds": list(self.seeds), "retries": self.retries,
                "search": self.is_search, "n_trials": self.n_trials, "final_eval": self.final_eval,
                "budget_flops": self.budget_flops, "rounds": self.rounds.to_dict(self.seeds) if self.rounds else None}


# ---------------------------------------------------------------------------------------------- helpers
def flatten(d: dict[str, Any]) -> dict[str, Any]:
    return {f"{s}.{k}": v for s, sec in d.items() if isinstance(sec, dict) for k, v in sec.items()}


_RAW_CACHE: dict[tuple[Path, float], dict[str, Any]] = {}


def _base_raw(path: Path) -> dict[str, Any]:
    key = (path, path.stat().st_mtime)
    if key not in _RAW_CACHE:
        _RAW_CACHE[key] = load_raw(path)
    return _RAW_CACHE[key]


# ---------------------------------------------------------------------------------------------- loading
def load_spec(path: str | Path) -> AblationSpec:
    """Read and check an ablation file. Needs the base recipe, never the data."""
    path = Path(path).resolve()
    if not path.exists():
        raise ConfigError(f"ablation file not found: {path}")
    raw = load_yaml(path)
    src = str(path)
    unknown = [k for k in raw if k not in TOP_KEYS]
    _need(not unknown, f"{src}: unknown key(s) {unknown}; expected some of {', '.join(TOP_KEYS)}")
    _need("base" in raw, f"{src}: base: is required (a path to an experiments/ recipe, relative to this file)")
    base = (path.parent / str(raw["base"])).resolve()
    _need(base.exists(), f"{src}: base: {raw['base']} not found (looked for {base})")

    final_eval = raw.get("final_eval", True)
    _need(isinstance(final_eval, bool), f"{src}: final_eval={final_eval!r} must be true or false")
    arch = _base_raw(base).get("model", {}).get("arch", "encoder_decoder")
    translation = arch == "encoder_decoder" and final_eval  # what counts: the final test BLEU, chrF beside it
    metric = raw.get("metric", {"name": "final/test_bleu" if translation else "val/loss"})
    if isinstance(metric, str):
        metric = {"name": metric}
    _need(isinstance(metric, dict) and set(metric) <= {"name", "direction"} and "name" in metric,
          f"{src}: metric: expected {{name: val/bleu, direction: max}}, got {metric!r}")
    direction = metric.get("direction", "max" if str(metric["name"]).endswith(("bleu", "chrf")) else "min")
    _need(direction in ("max", "min"), f"{src}: metric.direction={direction!r} is not one of: max, min")
    task = TASKS.get(arch)  # what its trials log (a base without a task fails below, naming model.arch)
    check_metric(str(metric["name"]), final_eval, f"{src}: metric", task)

    seeds, rounds = parse_seeds(raw.get("seeds", [1]), src)  # a list, a count or rounds {min, max} (seeds.py)

    budget = raw.get("budget") or {}
    _need(isinstance(budget, dict) and set(budget) <= {"steps", "time_min", "flops"},
          f"{src}: budget: expected {{steps: N}}, {{flops: X}} and/or {{time_min: M}}, got {budget!r}")
    steps, time_min, flops = budget.get("steps"), budget.get("time_min"), coerce(budget.get("flops"), float)
    _need(steps is None or (isinstance(steps, int) and steps >= 1),
          f"{src}: budget.steps={steps!r} must be an int >= 1")
    _need(flops is None or (isinstance(flops, (int, float)) and not isinstance(flops, bool) and flops > 0),
          f"{src}: budget.flops={flops!r} must be a number > 0 (training FLOPs of each trial, e.g. 1.0e15)")
    _need(steps is None or flops is None, f"{src}: budget: give steps: or flops:, not both")
    _need(time_min is None or (isinstance(time_min, (int, float)) and time_min > 0),
          f"{src}: budget.time_min={time_min!r} must be a number > 0")

    resources = raw.get("resources") or {}
    _need(isinstance(resources, dict), f"{src}: resources must be a mapping")
    bad = [k for k in resources if k not in RESOURCE_KEYS]
    _need(not bad, f"{src}: unknown resources key(s) {bad}; expected some of {', '.join(RESOURCE_KEYS)}")
    retries = raw.get("retries", 2)
    _need(isinstance(retries, int) and retries >= 0, f"{src}: retries={retries!r} must be an int >= 0")

    overrides = parse_overrides(raw.get("overrides") or {}, f"{src}: overrides")
    axes = parse_axes(raw.get("axes") or {}, src)
    variant_list = parse_variants(raw.get("variants") or [], src)
    reserved = {"trainer.seed": "seeds:"}
    if steps is not None or flops is not None:
        reserved["trainer.max_steps"] = "budget.steps" if steps is not None else "budget.flops"
    if time_min is not None:
        reserved["trainer.max_time_min"] = "budget.time_min"
    for k in [*axes, *overrides, *(k for v in variant_list for k in v.overrides)]:
        if k in reserved:
            raise ConfigError(f"{src}: {k} is set by {reserved[k]}; do not vary or override it directly")
    clash = [k for v in variant_list for k in v.overrides if k in axes]
    _need(not clash, f"{src}: {sorted(set(clash))} appear in both axes: and variants:")

    sizes, scale_budget = parse_scale(raw["scale"], src) if "scale" in raw else ((), {})
    _need(not (scale_budget and (steps or flops or time_min)),
          f"{src}: scale.budget gives each size its budget; remove budget: (or scale: its budget)")
    base_lr = coerce({**flatten(_base_raw(base)), **overrides}.get("optim.lr", 1.0), float)
    lrs, lr_extend = parse_lr(raw["lr"], float(base_lr), src) if "lr" in raw else ((), False)
    sized = {k for v in sizes for k in v.overrides}
    clash = sorted(k for k in [*axes, *(k for v in variant_list for k in v.overrides)]
                   if k in sized or (lrs and k == "optim.lr"))
    _need(not clash, f"{src}: {clash} are set by scale: or lr: and cannot also vary in axes:/variants:")
    search = raw.get("search")
    dists = parse_distributions(raw.get("distributions") or {}, src)
    n_trials = raw.get("n_trials", 0)
    if search is not None:
        _need(search == "optuna", f"{src}: search={search!r}; the only search is 'optuna' (TPE)")
        _need(bool(dists), f"{src}: search: optuna needs distributions:")
        _need(not axes and not variant_list and not sizes and not lrs,
              f"{src}: search: optuna replaces axes:/variants:/scale:/lr:; give one or the other")
        _need(isinstance(n_trials, int) and n_trials >= 1, f"{src}: search: optuna needs n_trials >= 1")
        _need(len(seeds) == 1 and rounds is None, f"{src}: a search runs one seed per trial; give seeds: [N]")
    else:
        _need(not dists and "n_trials" not in raw, f"{src}: distributions:/n_trials: need search: optuna")
        _need(bool(axes or variant_list or sizes or lrs),
              f"{src}: nothing varies: give axes:, variants:, scale:, lr: or search: optuna")
    default_columns = list(DEFAULT_COLUMNS)
    if translation and str(metric["name"]) == "final/test_bleu":
        default_columns.insert(1, {"chrF": "final/test_chrf"})
    columns = parse_columns(raw.get("columns", default_columns), final_eval, src, task, str(metric["name"]))
    significance = parse_significance(raw.get("significance"), src)
    for name in [str(metric["name"]), *(c.source for c in columns if c.kind == "metric")]:
        _need(arch == "encoder_decoder" or not name.endswith(("bleu", "chrf")),
              f"{src}: {name} is scored for translation experiments only; base {raw['base']} has model.arch={arch}")
    spec = AblationSpec(
        name=str(raw.get("name", path.stem)), path=path, base=base, metric=str(metric["name"]), direction=direction,
        seeds=seeds, rounds=rounds, budget_steps=steps, budget_time_min=float(time_min) if time_min else None,
        budget_flops=float(flops) if flops else None, final_eval=final_eval, columns=columns,
        significance=significance, resources=dict(resources), retries=retries, overrides=overrides, axes=axes,
        variant_list=variant_list,
        distributions=dists, n_trials=n_trials if search else 0, search_seed=int(raw.get("search_seed", 0)),
        description=str(raw.get("description", "")), sizes=sizes, scale_budget=scale_budget, lrs=lrs,
        lr_extend=lr_extend,
        baseline_name=None if raw.get("baseline") is None else str(raw["baseline"]),
    )
    spec.experiment({})  # the base itself, with the fixed overrides and budget, must load
    check_spec(spec)
    _check_baseline(spec, src)
    return spec


def _check_baseline(spec: AblationSpec, src: str) -> None:
    if spec.baseline_name is None:
        return
    _need(not spec.is_search, f"{src}: baseline: a search has no baseline row")
    names = [v.name for v in spec.variants()]
    _need(any(spec.baseline_name in (v.name, v.key) for v in spec.variants()),
          f"{src}: baseline: {spec.baseline_name!r} is not a variant; expected one of {names}")


def check_spec(spec: AblationSpec) -> None:
    """Every factor level must be able to run in at least one combination: a level that fails in all of them
    (model.norm: bogus, or attn_softcap with no axis that could make it valid) is an error naming key=value."""
    if spec.is_search:
        for d in spec.distributions:
            values = list(d.choices) if d.type == "categorical" else [d.low, d.high]
            for v in values:
                try:
                    spec.experiment({d.key: v})
                except ConfigError as e:
                    why = str(e).removeprefix(f"{spec.path}: ")
                    raise ConfigError(f"{spec.path}: distributions.{d.key}: value {v!r} cannot run: {why}") from None
        return
    errors: dict[str, str] = {}
    ok: set[str] = set()
    for v in spec.variants():
        try:
            spec.experiment(v.overrides)
            ok.update(v.levels)
        except ConfigError as e:
            for level in v.levels:
                errors.setdefault(level, str(e).removeprefix(f"{spec.path}: "))
    for level, reason in errors.items():
        if level not in ok:
            key, _, value = level.partition("=")
            where = f"variants: {value!r}" if key == "variant" else f"axes.{key}: value {value!r}"
            raise ConfigError(f"{spec.path}: {where} cannot run in any combination: {reason}")
