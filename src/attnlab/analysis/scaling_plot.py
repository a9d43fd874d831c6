"""scaling.png: each variant's losses against training compute (log-log), its fit and 95% band to 100x the largest
run where it has one, the fit without the largest size (dashed) and its prediction of that size with the interval
(the held-out check), and each size's best-LR mean with its interval where there is no fit. Drawn with matplotlib's
object API (no pyplot state, no GUI backend)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from matplotlib.figure import Figure

from .scaling import interval, predict

if TYPE_CHECKING:
    from .scaling_stats import ScalingResult, ScalingStudy


def plot_scaling(path: Path, st: ScalingStudy, r: ScalingResult) -> Figure:
    fig = Figure(figsize=(7.2, 4.8))
    ax = fig.subplots()
    logc = np.log(st.data.compute)  # (V, K)
    grid = np.linspace(math.log(r.c_min), math.log(100 * r.c_max), 200)
    for v, name in enumerate(st.variants):
        color = f"C{v}"
        best = r.best_lr[0, v]  # (K,)
        pts = np.take_along_axis(st.data.loss[0, v], np.maximum(best, 0)[:, None, None], 1)[:, 0]  # (K, N)
        pts = np.where((best >= 0)[:, None], pts, np.nan)
        c = np.broadcast_to(np.exp(logc[v])[:, None], pts.shape)
        labels = [x for x, on in (("edge", r.edge[0, v].any()), ("held-out check failed: unreliable",
                                                                 r.failed[0, v]),
                                  ("no fit: < 4 sizes", not r.fitted[0, v]),
                                  ("no extrapolation: E not identified", r.fitted[0, v] and not r.identified[0, v]))
                  if on]
        ax.scatter(c, pts, s=12, color=color, label=name + (f" ({'; '.join(labels)})" if labels else ""))
        if np.isfinite(r.params[0, v]).all():
            fit = predict(r.params[0, v], grid[:, None], r.scale)[:, 0]
            inside = grid <= math.log(r.c_max)
            ax.plot(np.exp(grid[inside]), fit[inside], color=color, lw=1.4)
            ax.plot(np.exp(grid[~inside]), fit[~inside], color=color, lw=1.4 if not r.failed[0, v] else 0.9,
                    ls="-" if not r.failed[0, v] else ":")  # an extrapolation the held-out check contradicts: dotted
            draws = predict(r.draw_params[0, :, v][:, None, :], grid[None, :, None], r.scale)[..., 0]  # (D, G)
            lo, hi = interval(fit, draws.T, r.prob, r.n_seeds, r.exact)
            ax.fill_between(np.exp(grid), lo, hi, color=color, alpha=0.15, lw=0)
        else:  # no fit: each size's best-LR mean and its interval
            e = r.size_loss
            ok = np.isfinite(e.est[0, v])
            ax.errorbar(np.exp(logc[v][ok]), e.est[0, v][ok], yerr=np.abs(np.stack([e.est[0, v] - e.lo[0, v],
                                                                                   e.hi[0, v] - e.est[0, v]]))[:, ok],
                        color=color, lw=0.8, capsize=2)
        if r.fitted[0, v] and np.isfinite(r.held_params[0, v]).all():
            k = int(np.nonzero(np.isfinite(r.size_loss.est[0, v]))[0][-1])
            held = grid[grid <= logc[v, k] + 0.3]
            ax.plot(np.exp(held), predict(r.held_params[0, v], held[:, None], r.scale)[:, 0], color=color, lw=1,
                    ls="--")
            p = r.heldout_pred
            yerr = np.abs([[p.est[0, v] - p.lo[0, v]], [p.hi[0, v] - p.est[0, v]]])
            ax.errorbar([math.exp(logc[v, k]) * 1.04], [p.est[0, v]], yerr=None if np.isnan(yerr).any() else yerr,
                        fmt="x", color=color, capsize=3, ms=6)
    ax.axvline(r.c_max, color="grey", lw=0.8, ls=":")
    seen = st.data.loss[np.isfinite(st.data.loss)]
    fits = [predict(p, grid[:, None], r.scale)[:, 0] for p in r.params[0] if np.isfinite(p).all()]
    low = min([seen.min(), *(f.min() for f in fits)])
    ax.set_ylim(0.85 * low, 1.1 * seen.max())  # the bands may reach 0: the axis stays on the data and the fits
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("training compute C (FLOPs)")
    ax.set_ylabel(st.metric)
    mode = f"; {r.e_mode.label}" if r.e_mode.label else ""
    ax.set_title(f"{st.name}: fits and 95% bands to 100x (dotted: the held-out check failed); without the largest size "
                 f"(dashed) and its prediction (x){mode}", fontsize=8)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, which="both")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return fig
