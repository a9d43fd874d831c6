"""The front page's picture: `make demo` on the 2-core CPU, fresh runs side by side, drawn from their raw files in
bench/results/ (each run's `attnlab demo` results, cpu_demo_<date>_run<N>.json, and its logged metrics,
cpu_demo_<date>_run<N>_metrics.csv).

    python bench/demo_plot.py                  # docs/demo_runs.png from the newest date's runs
    python bench/demo_plot.py --date 2026-11-26 --out docs/demo_runs.png

Left: the training loss (label-smoothed, every 50 steps) against the step. Right: the validation BLEU that training
logs (greedy, about 200 sentences) against the step, and at each run's last step its test BLEU: beam 4 on the 918
test sentences of the averaged last 5 checkpoints, what `make demo` prints.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

BENCH = Path(__file__).resolve().parent
RAW = BENCH / "results"


def runs(date: str) -> list[tuple[str, list[dict], dict]]:
    """(name, metrics rows, demo results) of each run of `date`, in run order."""
    out = []
    for path in sorted(RAW.glob(f"cpu_demo_{date}_run*.json")):
        metrics = list(csv.DictReader(open(path.with_name(path.stem + "_metrics.csv"), encoding="utf-8")))
        out.append((path.stem.rsplit("_", 1)[1], metrics, json.loads(path.read_text(encoding="utf-8"))))
    return out


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pairs = [(int(r["step"]), float(r[key])) for r in rows if r.get(key)]
    return [s for s, _ in pairs], [v for _, v in pairs]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--date", default=None, help="the runs' date (default: the newest of bench/results/cpu_demo_*)")
    p.add_argument("--out", type=Path, default=BENCH.parent / "docs" / "demo_runs.png")
    args = p.parse_args(argv)
    dates = sorted({m.group(1) for f in RAW.glob("cpu_demo_*_run*.json")
                    if (m := re.match(r"cpu_demo_(\d{4}-\d\d-\d\d)_run", f.name))})
    date = args.date or dates[-1]
    found = runs(date)
    fig, (loss_ax, bleu_ax) = plt.subplots(1, 2, figsize=(10, 3.4))
    for (name, rows, result), color in zip(found, ("tab:blue", "tab:orange", "tab:green", "tab:red"), strict=False):
        steps, loss = series(rows, "train/loss")
        loss_ax.plot(steps, loss, color=color, lw=0.8, alpha=0.8, label=name)
        steps, bleu = series(rows, "val/bleu")
        bleu_ax.plot(steps, bleu, color=color, marker=".", lw=1)
        last = int(re.search(r"step=(\d+)", result["checkpoints_averaged"][-1])[1])  # the run's last step
        bleu_ax.plot([last], [result["bleu"]], color=color, marker="*", ms=12, ls="none",
                     label=f"{name}: test {result['bleu']:.2f} at step {last:,}")
    loss_ax.set(xlabel="step", ylabel="training loss", title="make demo: training loss")
    loss_ax.legend(fontsize=8)
    bleu_ax.set(xlabel="step", ylabel="BLEU", title="validation BLEU; ★ test BLEU (beam 4, 5 checkpoints averaged)")
    bleu_ax.title.set_fontsize(9)
    bleu_ax.legend(fontsize=8, loc="lower right")
    bleu_ax.grid(alpha=0.3)
    fig.suptitle(f"{len(found)} fresh `make demo` runs, 10 minutes each on a 2-core CPU ({date})", fontsize=10)
    fig.tight_layout()
    fig.savefig(args.out, dpi=100)
    print(f"written: {args.out} ({len(found)} runs of {date})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
