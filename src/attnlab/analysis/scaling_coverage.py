"""How often `ablate scaling`'s intervals hold: synthetic studies with known laws, through scaling_stats.analyse
(the code behind every figure the report prints), vectorised over studies.

Each synthetic study is a demo-sized ladder: `sizes` model sizes spread evenly in log compute over 1e11 to 3e12
FLOPs, 3 learning rates a factor 2 apart, `seeds` seeds, and two variants whose losses follow known laws
L(C) = E + A C^-alpha (E > 0) at their best LR, times 1 + 0.03 log2(lr / lr*)^2 away from it (lr* off the grid
for one variant), times a log-normal seed noise of 1.5% (about the demo's spread between seeds). Two truths:
`inside`, whose curves cross inside the ladder, and `beyond`, whose curves cross between the largest run and 100x
it. A printed interval covers when it holds the true value (a crossing printed where the truth has none in range
misses); the held-out check's interval of the error holds 0 when the law is right, so its coverage is 1 minus its
false-alarm rate. `attnlab ablate scaling-coverage` prints the table (docs/scaling.md shows it).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from .scaling_stats import MULTIPLES, RELIABLE_SHARE, EMode, ScalingData, ScalingResult, analyse

LADDER = (1e11, 3e12)  # the compute range of the synthetic ladders (the demo's, about)
LRS = np.array([1.5e-3, 3e-3, 6e-3])
NOISE = 0.015  # sd of log L between seeds
LR_CURVE = 0.03  # loss x (1 + LR_CURVE log2(lr / lr*)^2)
# name -> ((E, A, alpha) of each variant, C in FLOPs; each variant's best LR)
TRUTHS = {
    "inside": (((2.0, 3.0 * 1e11 ** 0.27, 0.27), (2.3, 3.0 * 1e11 ** 0.40, 0.40)), (3e-3, 4e-3)),
    "beyond": (((2.0, 3.0 * 1e11 ** 0.27, 0.27), (1.5, 3.8 * 1e11 ** 0.22, 0.22)), (3e-3, 4e-3)),
}
REGIMES = ((3, 2, NOISE), (4, 2, NOISE), (5, 2, NOISE), (5, 3, NOISE), (4, 2, 2 * NOISE), (5, 3, 2 * NOISE))


def law(p: tuple[float, float, float], c: np.ndarray | float) -> np.ndarray:
    e, a, alpha = p
    return e + a * np.power(c, -alpha)


def effective(truth: str) -> list[tuple[float, float, float]]:
    """The laws of each variant at its best LR on the grid: the true law times that LR's penalty (E and A alike)."""
    laws, best = TRUTHS[truth]
    pen = (1 + LR_CURVE * np.log2(LRS[None] / np.array(best)[:, None]) ** 2).min(-1)  # (V,)
    return [(e * q, a * q, alpha) for (e, a, alpha), q in zip(laws, pen, strict=True)]


def true_crossing(laws, lo: float, hi: float) -> float:
    """log10 of the first compute in [lo, hi] where the two laws cross, NaN if none (a fine grid and bisection)."""
    grid = np.geomspace(lo, hi, 4001)
    d = law(laws[0], grid) - law(laws[1], grid)
    change = np.nonzero(np.sign(d[:-1]) * np.sign(d[1:]) <= 0)[0]
    if not len(change):
        return math.nan
    a, b = math.log(grid[change[0]]), math.log(grid[change[0] + 1])
    for _ in range(60):
        m = (a + b) / 2
        same = np.sign(law(laws[0], math.exp(m)) - law(laws[1], math.exp(m))) == np.sign(d[change[0]])
        a, b = (m, b) if same else (a, m)
    return (a + b) / 2 / math.log(10)


def simulate(truth: str, sizes: int, seeds: int, studies: int, rng: np.random.Generator,
             noise: float = NOISE) -> ScalingData:
    laws, best = TRUTHS[truth]
    compute = np.geomspace(*LADDER, sizes)[None].repeat(len(laws), 0)  # (V, K)
    mean = np.stack([law(p, compute[i]) for i, p in enumerate(laws)])  # (V, K)
    pen = 1 + LR_CURVE * np.log2(LRS[None] / np.array(best)[:, None]) ** 2  # (V, R)
    loss = mean[:, :, None, None] * pen[:, None, :, None] * np.exp(
        rng.normal(0, noise, (studies, len(laws), sizes, len(LRS), seeds)))
    return ScalingData(loss, compute, LRS, tuple(LRS))


def coverage(res: ScalingResult, truth: str, data: ScalingData) -> dict[str, tuple[float, float, int]]:
    """Each printed quantity -> (share of the cells it could be printed in where it is: (study, variant), (study,
    variant, size) or (study, pair); coverage among the printed; how many are printed)."""
    laws = effective(truth)
    c = data.compute
    true_size = np.stack([law(p, c[i]) for i, p in enumerate(laws)])  # (V, K)
    gated = res.fitted & res.identified  # (S, V): alpha, E, L at kx and crossings are given
    out = {}

    def add(name: str, e, truth_value, printed, of=None) -> None:
        of = np.broadcast_to(True, e.est.shape) if of is None else np.broadcast_to(of, e.est.shape)
        printed = printed & np.isfinite(e.lo) & of
        hit = (e.lo <= truth_value) & (truth_value <= e.hi)
        n = int(printed.sum())
        out[name] = (float(printed.sum() / of.sum()), float(hit[printed].mean()) if n else math.nan, n)

    full = np.broadcast_to(True, res.size_loss.est.shape) & np.isfinite(res.size_loss.est)
    add("loss per size", res.size_loss, true_size[None], full)
    diff = true_size - true_size[:1]
    second = (np.arange(len(laws)) > 0)[None, :, None]  # the first variant's difference from itself is not printed
    add("difference per size", res.size_diff, diff[None], full, of=second)
    add("alpha", res.alpha, np.array([p[2] for p in laws])[None], gated)
    add("E", res.e, np.array([p[0] for p in laws])[None], gated)
    for m in MULTIPLES:
        add(f"L at {m}x", res.at[m], np.array([law(p, m * res.c_max) for p in laws])[None], gated)
    last = c[:, -1]
    held = res.fitted
    add("held-out predicted", res.heldout_pred, np.array([law(p, last[i]) for i, p in enumerate(laws)])[None], held)
    add("held-out measured", res.heldout_meas, true_size[None, :, -1], held)
    add("held-out error (holds 0)", res.heldout_err, np.zeros((1, len(laws))), held)
    t = true_crossing(laws, res.c_min, 100 * res.c_max)
    stated = np.isfinite(res.cross.est) & (res.cross_share >= RELIABLE_SHARE)  # (S, P)
    hit = (res.cross.lo <= t) & (t <= res.cross.hi) if np.isfinite(t) else np.zeros_like(stated)
    n = int((stated & np.isfinite(res.cross.lo)).sum())
    out["crossing"] = (float(stated.mean()), float(hit[stated & np.isfinite(res.cross.lo)].mean()) if n else math.nan,
                       n)
    out["withheld"] = (float((~gated).mean()), math.nan, int((~gated).sum()))
    return out


def coverage_table(studies: int = 400, seed: int = 0, mode: EMode | None = None) -> tuple[str, dict]:
    """Markdown: every regime x truth, each printed quantity's share printed and coverage (scaling_coverage)."""
    rng = np.random.default_rng(seed)
    rows, raw = [], {}
    for sizes, seeds, noise in REGIMES:
        for truth in TRUTHS:
            data = simulate(truth, sizes, seeds, studies, rng, noise)
            res = analyse(data, mode, seed=seed)
            cov = coverage(res, truth, data)
            raw[f"{sizes}x{seeds} noise {noise} {truth}"] = cov
            rows.append((f"{sizes} sizes x {seeds} seeds, {noise:.1%} noise", truth, cov))
    names = list(rows[0][2])
    head = "| regime | truth | " + " | ".join(names) + " |"
    lines = [head, "|" + "---|" * (len(names) + 2)]
    for regime, truth, cov in rows:
        cells = [("withheld" if math.isnan(c) and p == 0 else f"{c:.2f} ({p:.0%})") if k != "withheld" else
                 f"{p:.0%}" for k, (p, c, n) in cov.items()]
        lines.append(f"| {regime} | {truth} | " + " | ".join(cells) + " |")
    return "\n".join(lines), raw


def write_coverage(studies: int, out: Path, command: str, seed: int = 0) -> str:
    """The table as printed (docs/scaling.md shows it), the raw numbers in `out` (JSON)."""
    table, raw = coverage_table(studies, seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": command, "studies": studies, "coverage": raw}, indent=1), encoding="utf-8")
    return (f"Coverage of ablate scaling's 95% intervals, {studies} synthetic studies a row (`{command}`): each cell "
            "the share of printed intervals that hold the truth (the held-out error's: 0), in brackets the share of "
            "the cells where it is printed; withheld: the share of (study, variant) cells with no extrapolation."
            "\n\n"
            f"{table}\n\nwritten: {out}")
