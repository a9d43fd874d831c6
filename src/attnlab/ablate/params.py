"""A point's factor values as optuna params and a search's distributions: what optuna-dashboard and
optuna.visualization slice trials by, and what a TPE search samples from (runner.py records them)."""

from __future__ import annotations

from typing import Any

from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution

from .edges import beyond
from .factors import Variant
from .spec import AblationSpec


def grid_params(spec: AblationSpec, variant: Variant) -> tuple[dict[str, Any], dict[str, BaseDistribution]]:
    """A grid point's factor values as optuna params: each axis (its values the choices), for a variants: list
    `variant` (the listed names the choices), for a scale: ladder `scale` (the sizes) and the lr: search."""
    params: dict[str, Any] = {}
    dists: dict[str, BaseDistribution] = {}
    for level in variant.levels:
        key, _, name = level.partition("=")
        if key == "variant":
            params[key], dists[key] = name, CategoricalDistribution([v.name for v in spec.variant_list])
        elif key == "scale":
            params[key], dists[key] = name, CategoricalDistribution([v.name for v in spec.sizes])
        elif key == "optim.lr" and spec.lrs:
            lrs = sorted({*spec.lrs, *beyond(spec).values()})  # with the LRs lr.extend_edges may add
            params[key], dists[key] = variant.overrides[key], CategoricalDistribution(lrs)
        else:
            params[key], dists[key] = variant.overrides[key], CategoricalDistribution(spec.axes[key])
    return params, dists


def optuna_distributions(spec: AblationSpec) -> dict[str, BaseDistribution]:
    out: dict[str, BaseDistribution] = {}
    for d in spec.distributions:
        if d.type == "categorical":
            out[d.key] = CategoricalDistribution(list(d.choices))
        elif d.type == "int":
            out[d.key] = IntDistribution(int(d.low), int(d.high), log=d.log, step=int(d.step or 1))  # type: ignore[arg-type]
        else:
            out[d.key] = FloatDistribution(float(d.low), float(d.high), log=d.log, step=d.step)  # type: ignore[arg-type]
    return out
