"""What varies in an ablation file: named variants, axes, a search's distributions, and the config fields they
set, parsed and checked (spec.py assembles them into the study's grid)."""

from __future__ import annotations

import dataclasses
import difflib
import json
import re
import typing
from dataclasses import dataclass
from typing import Any

from ..config import ConfigError
from ..experiment import SECTIONS
from .columns import need as _need

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


def field_type(dotted: str, where: str) -> Any:
    """The type hint of a config field; ConfigError naming `where` when `dotted` names no field."""
    section, _, name = dotted.partition(".")
    if section not in SECTIONS or not name or "." in name:
        valid = ", ".join(f"{s}.<field>" for s in SECTIONS)
        raise ConfigError(f"{where}: {dotted!r} names no config field; expected one of {valid}")
    hints = typing.get_type_hints(SECTIONS[section])
    names = [f.name for f in dataclasses.fields(SECTIONS[section])]
    if name not in names:
        close = difflib.get_close_matches(name, names, n=1)
        hint = f" (did you mean {section}.{close[0]}?)" if close else ""
        raise ConfigError(f"{where}: {dotted} names no config field{hint}")
    return hints[name]


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
