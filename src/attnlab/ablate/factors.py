"""What varies in an ablation file: named variants, axes, a search's distributions, and the config fields they
set, parsed and checked (spec.py assembles them into the study's grid)."""

from __future__ import annotations

import json
import re
import typing
from dataclasses import dataclass
from typing import Any

from ..analysis.columns import need as _need
from ..config import ConfigError
from ..experiment import field_type

DIST_TYPES = ("float", "int", "log", "categorical")
_FLOAT_RE = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


@dataclass(frozen=True)
class Variant:
    """One configuration that differs from the base by `overrides` (dotted keys)."""

    name: str
    overrides: dict[str, Any]
    levels: tuple[str, ...] = ()  # the factor levels it is made of ("model.norm=rmsnorm", "variant=(A) h=1")

    @property
    def key(self) -> str:
        return canonical_key(self.overrides)


@dataclass(frozen=True)
class Distribution:
    key: str
    type: str
    low: float | int | None = None
    high: float | int | None = None
    step: float | int | None = None
    log: bool = False
    choices: tuple[Any, ...] = ()


def canonical_key(overrides: dict[str, Any]) -> str:
    return json.dumps(overrides, sort_keys=True, default=str)


def fmt(x: Any) -> str:
    if isinstance(x, bool):
        return str(x).lower()
    return f"{x:g}" if isinstance(x, float) else str(x)


def short_key(key: str, keys: list[str]) -> str:
    """`norm` for model.norm unless another axis has the same field name in another section."""
    tail = key.split(".", 1)[-1]
    return tail if sum(k.split(".", 1)[-1] == tail for k in keys) == 1 else key


def coerce(value: Any, tp: Any) -> Any:
    """YAML 1.1 reads 1e-4 as a string; a float field takes it as the number it means."""
    if isinstance(value, str) and _FLOAT_RE.match(value) and (tp is float or float in typing.get_args(tp)):
        return float(value)
    return value



# ---------------------------------------------------------------------------------------------- parsing
def parse_overrides(d: Any, where: str) -> dict[str, Any]:
    _need(isinstance(d, dict), f"{where} must be a mapping of section.field: value")
    return {k: coerce(v, field_type(k, where)) for k, v in d.items()}


def parse_axes(d: Any, src: str) -> dict[str, list[Any]]:
    _need(isinstance(d, dict), f"{src}: axes must be a mapping of section.field: [values]")
    out = {}
    for k, values in d.items():
        tp = field_type(k, f"{src}: axes")
        _need(isinstance(values, list) and values, f"{src}: axes.{k} must be a non-empty list of values")
        values = [coerce(v, tp) for v in values]
        _need(len({json.dumps(v, default=str) for v in values}) == len(values), f"{src}: axes.{k} repeats a value")
        out[k] = values
    return out


def parse_variants(items: Any, src: str) -> tuple[Variant, ...]:
    _need(isinstance(items, list), f"{src}: variants must be a list of {{name: ..., section.field: value}}")
    out, names = [], set()
    for i, item in enumerate(items):
        _need(isinstance(item, dict) and isinstance(item.get("name"), str) and item["name"],
              f"{src}: variants[{i}] needs a name: and section.field: value pairs")
        name = item["name"]
        _need(name not in names, f"{src}: variants: two variants are named {name!r}")
        names.add(name)
        over = parse_overrides({k: v for k, v in item.items() if k != "name"}, f"{src}: variants[{name!r}]")
        out.append(Variant(name, over, (f"variant={name}",)))
    keys = [v.key for v in out]
    dup = [v.name for v in out if keys.count(v.key) > 1]
    _need(not dup, f"{src}: variants {dup} have the same overrides")
    return tuple(out)


def parse_distributions(d: Any, src: str) -> tuple[Distribution, ...]:
    _need(isinstance(d, dict), f"{src}: distributions must be a mapping of section.field: {{type: ...}}")
    out = []
    for k, spec in d.items():
        tp = field_type(k, f"{src}: distributions")
        where = f"{src}: distributions.{k}"
        _need(isinstance(spec, dict) and spec.get("type") in DIST_TYPES,
              f"{where}: expected {{type: {'|'.join(DIST_TYPES)}, ...}}, got {spec!r}")
        allowed = {"type", "choices"} if spec["type"] == "categorical" else {"type", "low", "high", "step", "log"}
        bad = [x for x in spec if x not in allowed]
        _need(not bad, f"{where}: unknown key(s) {bad} for type {spec['type']}; expected {sorted(allowed)}")
        if spec["type"] == "categorical":
            choices = spec.get("choices")
            _need(isinstance(choices, list) and choices, f"{where}: categorical needs choices: [...]")
            out.append(Distribution(k, "categorical", choices=tuple(coerce(c, tp) for c in choices)))
            continue
        kind = "int" if spec["type"] == "int" else "float"
        try:
            num = int if kind == "int" else float
            low, high = num(spec["low"]), num(spec["high"])
            step = num(spec["step"]) if spec.get("step") is not None else None
        except (KeyError, TypeError, ValueError):
            raise ConfigError(f"{where}: needs numeric low: and high: (and step:), got {spec!r}") from None
        log = bool(spec.get("log", False)) or spec["type"] == "log"
        _need(low < high, f"{where}: low={low} must be < high={high}")
        _need(not (log and low <= 0), f"{where}: a log distribution needs low > 0")
        _need(not (log and step), f"{where}: log and step cannot be combined")
        out.append(Distribution(k, kind, low, high, step, log))
    return tuple(out)


# ---------------------------------------------------------------------------------------------- scale and lr
SCALE_BUDGETS = ("tokens", "tokens_per_param", "flops", "flops_per_param")


def parse_scale(raw: Any, src: str) -> tuple[tuple[Variant, ...], dict[str, float]]:
    """`scale: {sizes: [{name: S, model.d_model: 64, model.n_dec_layers: 2, ...}, ...], d_ff_ratio: 4,
    budget: {tokens_per_param: 20}}`: the ladder of model sizes (each a named set of model fields; d_ff_ratio sets
    model.d_ff = ratio * d_model where a size does not give d_ff) and each size's training budget (budget.py)."""
    _need(isinstance(raw, dict) and isinstance(raw.get("sizes"), list) and len(raw["sizes"]) >= 2,
          f"{src}: scale: expected {{sizes: [at least 2 sizes], budget: {{tokens_per_param: 20}}}}, got {raw!r}")
    bad = [k for k in raw if k not in ("sizes", "d_ff_ratio", "budget")]
    _need(not bad, f"{src}: scale: unknown key(s) {bad}; expected sizes, d_ff_ratio, budget")
    ratio = raw.get("d_ff_ratio")
    _need(ratio is None or (isinstance(ratio, (int, float)) and ratio > 0), f"{src}: scale.d_ff_ratio={ratio!r}")
    sizes = []
    for i, item in enumerate(raw["sizes"]):
        where = f"{src}: scale.sizes[{i}]"
        _need(isinstance(item, dict) and isinstance(item.get("name"), str) and item["name"],
              f"{where} needs a name: and model.<field>: value pairs")
        over = parse_overrides({k: v for k, v in item.items() if k != "name"}, where)
        _need(over and all(k.startswith("model.") for k in over), f"{where}: a size sets model.<field>s only")
        if ratio is not None and "model.d_ff" not in over:
            _need("model.d_model" in over, f"{where}: scale.d_ff_ratio needs model.d_model in every size")
            over["model.d_ff"] = int(round(ratio * over["model.d_model"]))
        sizes.append(Variant(item["name"], over, (f"scale={item['name']}",)))
    _need(len({v.name for v in sizes}) == len(sizes), f"{src}: scale.sizes: two sizes have the same name")
    _need(len({v.key for v in sizes}) == len(sizes), f"{src}: scale.sizes: two sizes have the same fields")
    budget = raw.get("budget") or {}
    _need(isinstance(budget, dict) and len(budget) == 1 and next(iter(budget)) in SCALE_BUDGETS,
          f"{src}: scale.budget: expected one of {{tokens: N}}, {{tokens_per_param: k}}, {{flops: X}}, "
          f"{{flops_per_param: k}}, got {budget!r}")
    key, value = next(iter(budget.items()))
    value = coerce(value, float)
    _need(isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0,
          f"{src}: scale.budget.{key}={value!r} must be a number > 0")
    return tuple(sizes), {key: float(value)}


def parse_lr(raw: Any, base_lr: float, src: str) -> tuple[tuple[float, ...], bool]:
    """`lr: {values: [1e-3, 2e-3]}`, `{factors: [0.5, 1, 2]}` (times the recipe's optim.lr) or `{points: 3,
    spread: 2}` (log-spaced: the recipe's LR times spread^k for k centred on 0, here 0.5, 1, 2); the LRs and
    `extend_edges` (default false: one more LR beyond an edge that is best, ablate/edges.py)."""
    _need(isinstance(raw, dict), f"{src}: lr: expected a mapping, got {raw!r}")
    extend = raw.get("extend_edges", False)
    _need(isinstance(extend, bool), f"{src}: lr.extend_edges must be true or false, got {extend!r}")
    raw = {k: v for k, v in raw.items() if k != "extend_edges"}
    _need(len(raw) in (1, 2), f"{src}: lr: expected {{values: [...]}}, {{factors: [...]}} "
          f"or {{points: 3, spread: 2}} (and extend_edges: true), got {raw!r}")
    if "values" in raw or "factors" in raw:
        _need(len(raw) == 1, f"{src}: lr: give values: or factors:, alone")
        key = "values" if "values" in raw else "factors"
        items = [coerce(x, float) for x in raw[key]] if isinstance(raw[key], list) else []
        _need(len(items) >= 2 and all(isinstance(x, (int, float)) and x > 0 for x in items),
              f"{src}: lr.{key} must be a list of at least 2 numbers > 0, got {raw[key]!r}")
        out = items if key == "values" else [base_lr * f for f in items]
    else:
        _need(set(raw) == {"points", "spread"}, f"{src}: lr: expected {{points: 3, spread: 2}}, got {raw!r}")
        n, spread = raw["points"], coerce(raw["spread"], float)
        _need(isinstance(n, int) and n >= 2 and isinstance(spread, (int, float)) and spread > 1,
              f"{src}: lr: points must be an int >= 2 and spread a number > 1, got {raw!r}")
        out = [base_lr * spread ** (k - (n - 1) / 2) for k in range(n)]
    out = sorted(float(f"{x:.6g}") for x in out)
    _need(len(set(out)) == len(out), f"{src}: lr: repeats a value: {out}")
    return tuple(out), extend
