"""A real run's training speed beside the benchmark's at the same shape.

    python bench/fit_vs_bench.py RUN_DIR BENCH_JSON [--row encdec/attnlab] [--mode eager] [--json OUT]

The run's tokens/s is the median of its logged train/tokens_per_s (target tokens of one rank's optimizer step over
the step's wall time) after the first 10% of logged steps (warm-up, compiling, first batches); the benchmark's is
its row's tokens_per_s (a fixed unpadded batch). The ratio run / benchmark says what the training loop, the data
and the padding of real batches cost on top of the step itself. To tell those apart it also gives the run's fill:
the real target tokens of a step (its logged train/tokens over its steps, per GPU and micro-batch) over
data.max_tokens, the slots a side of a step, all of which the benchmark's batch at a recipe's shape (`--recipe`)
fills. run / benchmark / fill is then what the loop costs beyond the batches' padding.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from attnlab.rundir import run_metrics


def fit_tokens_per_s(run_dir: Path) -> tuple[float, int]:
    """(median tokens/s after the first 10% of the logged steps, steps it is taken over)."""
    points = run_metrics(run_dir).get("train/tokens_per_s", [])
    if not points:
        raise SystemExit(f"{run_dir}: no train/tokens_per_s logged (did the run train a step?)")
    kept = [v for _, v in points[len(points) // 10:]]
    return statistics.median(kept), len(kept)


def fill(run_dir: Path) -> float | None:
    """Real target tokens a step of one GPU's micro-batch over data.max_tokens, from the run's logged train/tokens
    (all GPUs, cumulative) and its config.yaml; None where the run's number of GPUs is not written there."""
    import yaml

    points = run_metrics(run_dir).get("train/tokens", [])
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8")) if (run_dir / "config.yaml").is_file() \
        else None
    if len(points) < 2 or not cfg:
        return None
    devices, nodes = cfg["trainer"].get("devices"), cfg["trainer"].get("num_nodes", 1)
    if not (isinstance(devices, int) and devices > 0 and isinstance(nodes, int)):
        return None  # "auto" or a list: how many GPUs ran is not in the file
    (s0, t0), (s1, t1) = points[0], points[-1]
    per_step = (t1 - t0) / max(s1 - s0, 1) / (devices * nodes * cfg["optim"].get("accumulate", 1))
    return per_step / cfg["data"]["max_tokens"]


def bench_tokens_per_s(path: Path, row: str, mode: str) -> float:
    rows = json.loads(path.read_text(encoding="utf-8"))
    rows = rows.get("rows", rows) if isinstance(rows, dict) else rows
    task, model = row.split("/", 1)
    for r in rows:
        if (r.get("task"), r.get("model"), r.get("mode")) == (task, model, mode) and r.get("status") == "ok":
            return float(r["tokens_per_s"])
    raise SystemExit(f"{path}: no successful row {row} ({mode})")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("bench_json", type=Path)
    p.add_argument("--row", default="encdec/attnlab")
    p.add_argument("--mode", default="eager")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    fit, n = fit_tokens_per_s(args.run_dir)
    bench = bench_tokens_per_s(args.bench_json, args.row, args.mode)
    out = {"run_dir": str(args.run_dir), "fit_tokens_per_s": round(fit, 1), "fit_steps": n,
           "bench_row": f"{args.row} ({args.mode})", "bench_tokens_per_s": round(bench, 1),
           "fit_over_bench": round(fit / bench, 3)}
    print(f"fit {fit:,.0f} tokens/s (median of {n} steps) vs benchmark {bench:,.0f} tokens/s: "
          f"{100 * fit / bench:.0f}% of the benchmark")
    if (f := fill(args.run_dir)) is not None:
        out.update(fill=round(f, 3), fit_over_bench_over_fill=round(fit / bench / f, 3))
        print(f"the run's steps carry {100 * f:.1f}% of data.max_tokens as real target tokens; beyond that padding, "
              f"the loop runs at {100 * fit / bench / f:.0f}% of the benchmark")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2), encoding="utf-8")
    return out


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
