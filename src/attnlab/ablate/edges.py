"""`lr: {extend_edges: true}`: a (variant, size) whose best learning rate is an edge of the searched grid gets one
more, a factor step beyond that edge, once every seed of every LR of that cell has finished.

The best LR of a cell is the one with the lowest mean validation loss over its seeds (`scaling_metric`, the loss
`ablate scaling` fits). When it is the smallest or the largest searched, the optimum may lie outside the range and
the loss the scaling fit gets for that size is an upper bound; one more LR at smallest / step (or largest x step,
the step the grid's own ratio at that edge: `spread` for `{points, spread}`) tells. One step only: the table flags a
best LR that is still at the (extended) edge. The extension's points are (variant, seed) points like any other
(their point_id from their overrides), claimed by workers after the grid's points of the cell
(study.extension_points, runner.claim_next); a worker that exits when nothing is pending (a SLURM array task,
`--no-linger`) can miss them, and the next `ablate run` runs them.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .factors import Variant, canonical_key, fmt
from .spec import AblationSpec, Point

LR = "optim.lr"


def scaling_metric(spec: AblationSpec) -> str:
    """The validation loss a scaling study is read on (and its LRs are picked on): the final evaluation's, else the
    last logged val/loss."""
    return "final/valid_loss" if spec.final_eval else "val/loss"


def cell_key(v: Variant) -> str:
    """A grid variant's (variant, size) cell: its overrides without the learning rate."""
    return canonical_key({k: x for k, x in v.overrides.items() if k != LR})


def beyond(spec: AblationSpec) -> dict[float, float]:
    """Each edge LR of the grid -> the LR one factor step beyond it (the grid's ratio at that edge)."""
    lrs = sorted(spec.lrs)
    if not spec.lr_extend or len(lrs) < 2:
        return {}
    return {lrs[0]: float(f"{lrs[0] * lrs[0] / lrs[1]:.6g}"), lrs[-1]: float(f"{lrs[-1] * lrs[-1] / lrs[-2]:.6g}")}


def extended(v: Variant, lr: float) -> Variant:
    """The grid variant `v` (at an edge LR) at learning rate `lr` instead: same cell, name and levels with lr=."""
    old = fmt(v.overrides[LR])
    name = v.name.replace(f"lr={old}", f"lr={fmt(lr)}")
    levels = tuple(f"{LR}={fmt(lr)}" if x == f"{LR}={old}" else x for x in v.levels)
    return Variant(name, {**v.overrides, LR: lr}, levels)


def candidates(spec: AblationSpec) -> list[Variant]:
    """Every extension the grid can grow (one per cell and edge), run or not: what the analysis reads trials by."""
    step = beyond(spec)
    return [extended(v, step[v.overrides[LR]]) for v in spec.variants() if v.overrides.get(LR) in step]


def lr_extensions(spec: AblationSpec, finished: Callable[[Point], tuple[bool, float | None]]) -> list[Point]:
    """The extension points due: for each cell whose grid points have all finished (`finished(point)` ->
    (finished, its validation loss or None)), the points of the LR beyond its best when that is an edge."""
    step = beyond(spec)
    if not step:
        return []
    cells: dict[str, list[Variant]] = {}
    for v in spec.variants():
        cells.setdefault(cell_key(v), []).append(v)
    out = []
    for variants in cells.values():
        means, done = {}, True
        for v in variants:
            results = [finished(Point(v, s)) for s in spec.seeds]
            done &= all(f for f, _ in results)
            values = [x for _, x in results if x is not None]
            if values:
                means[v.overrides[LR]] = float(np.mean(values))
        if not done or not means:
            continue
        best = min(means, key=means.get)
        if best in step:
            edge = next(v for v in variants if v.overrides[LR] == best)
            out += [Point(extended(edge, step[best]), s) for s in spec.seeds]
    return out
