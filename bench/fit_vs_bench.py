"""A real run's training speed beside the benchmark's at the same shape, by the wall clock.

    python bench/fit_vs_bench.py RUN_DIR BENCH_JSON [--row encdec/attnlab] [--mode eager] [--warm-step N] [--json OUT]

The run's tokens/s (`fit_tokens_per_s`) is wall clock, from the run's own logs/metrics.csv: the target tokens trained
between a warm logged step and the last logged step (`train/tokens`, cumulative over every GPU) over the time between
them (`train/time`, the Unix time each logged step was counted at), divided by the run's GPUs. Everything the fit
spends in that window counts: data, validation, checkpoints, logging. The warm step is the first logged step at or
after --warm-step, by default the logged step after the first 10% of them (warm-up, compiling, first batches). The
benchmark's figure is its row's tokens_per_s (a fixed unpadded batch of one GPU). `fit_over_bench`, the ratio of
the two, is what a target such as "a real fit within 15% of its benchmark" is judged on.

Secondary: the median of the logged train/tokens_per_s after the first 10% of logged steps (`median_tokens_per_s`,
`median_over_bench`), each one step's tokens over its host-timed duration with validation left out: a step's
speed, not the fit's. And the run's fill: the real target tokens of a step (its logged train/tokens over its steps,
per GPU and micro-batch) over data.max_tokens, the slots a side of a step, all of which the benchmark's batch at a
recipe's shape (`--recipe`) fills. fit / benchmark / fill is then what the loop costs beyond the batches' padding.

A run logged before train/time existed has no wall clock: its fit_tokens_per_s and fit_over_bench are null.
The JSON carries the provenance of this comparison and the benchmark's (bench/harness.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import yaml
from harness import write_record

from attnlab.rundir import METRICS, run_metrics


def gpus(run_dir: Path) -> int | None:
    """The GPUs (processes) the run trained on, from its config.yaml; None where the file does not say."""
    path = run_dir / "config.yaml"
    cfg = yaml.safe_load(path.read_text(encoding="utf-8")) if path.is_file() else None
    if not cfg:
        return None
    devices, nodes = cfg["trainer"].get("devices"), cfg["trainer"].get("num_nodes", 1)
    if not (isinstance(devices, int) and devices > 0 and isinstance(nodes, int)):
        return None  # "auto" or a list: how many GPUs ran is not in the file
    return devices * nodes


def wall_clock(run_dir: Path, warm_step: int | None = None) -> dict | None:
    """Target tokens a second by the wall clock, per GPU, from a warm logged step to the last one:
    {"tokens_per_s", "from_step", "to_step", "seconds", "target_tokens", "gpus"}; None when the run logged no
    train/time. tokens_per_s is all GPUs' when their number is not in the run's config (gpus None)."""
    curves = run_metrics(run_dir)
    clock, tokens = dict(curves.get("train/time", [])), dict(curves.get("train/tokens", []))
    steps = []
    for s in sorted(set(clock) & set(tokens)):
        # a validation's row can repeat the last logged step's train values under its own step: not a new point
        if not steps or clock[s] != clock[steps[-1]]:
            steps.append(s)
    if not clock:
        return None
    if len(steps) < 2:
        raise SystemExit(f"{run_dir}: train/time and train/tokens logged together at {len(steps)} step(s); the wall "
                         "clock needs two (a longer run, or a smaller trainer.log_every)")
    if warm_step is None:
        first = max(1, len(steps) // 10)
    else:
        first = next((i for i, s in enumerate(steps) if s >= warm_step), len(steps))
    first = min(first, len(steps) - 2)  # at least one interval
    a, b = steps[first], steps[-1]
    seconds, n = clock[b] - clock[a], tokens[b] - tokens[a]
    if seconds <= 0:
        raise SystemExit(f"{run_dir}: train/time does not advance from step {a} to step {b} ({clock[a]} -> "
                         f"{clock[b]})")
    g = gpus(run_dir)
    return {"tokens_per_s": n / seconds / (g or 1), "from_step": a, "to_step": b, "seconds": round(seconds, 3),
            "target_tokens": int(n), "gpus": g}


def median_tokens_per_s(run_dir: Path) -> tuple[float, int]:
    """(median logged train/tokens_per_s after the first 10% of the logged steps, steps it is taken over)."""
    points = run_metrics(run_dir).get("train/tokens_per_s", [])
    if not points:
        raise SystemExit(f"{run_dir}: no train/tokens_per_s logged (did the run train a step?)")
    kept = [v for _, v in points[len(points) // 10:]]
    return statistics.median(kept), len(kept)


def fill(run_dir: Path) -> float | None:
    """Real target tokens a step of one GPU's micro-batch over data.max_tokens, from the run's logged train/tokens
    (all GPUs, cumulative) and its config.yaml; None where the run's number of GPUs is not written there."""
    points = run_metrics(run_dir).get("train/tokens", [])
    g = gpus(run_dir)
    if len(points) < 2 or g is None:
        return None
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8"))
    (s0, t0), (s1, t1) = points[0], points[-1]
    per_step = (t1 - t0) / max(s1 - s0, 1) / (g * cfg["optim"].get("accumulate", 1))
    return per_step / cfg["data"]["max_tokens"]


def bench_row(path: Path, row: str, mode: str) -> tuple[float, dict | None]:
    """(the row's tokens_per_s, the benchmark file's provenance or None)."""
    data = json.loads(path.read_text(encoding="utf-8"))
    rows = data.get("rows", data) if isinstance(data, dict) else data
    task, model = row.split("/", 1)
    for r in rows:
        if (r.get("task"), r.get("model"), r.get("mode")) == (task, model, mode) and r.get("status") == "ok":
            return float(r["tokens_per_s"]), data.get("provenance") if isinstance(data, dict) else None
    raise SystemExit(f"{path}: no successful row {row} ({mode})")


def main(argv: list[str] | None = None) -> dict:
    started = time.time()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("bench_json", type=Path)
    p.add_argument("--row", default="encdec/attnlab")
    p.add_argument("--mode", default="eager")
    p.add_argument("--warm-step", type=int, default=None,
                   help="the wall clock starts at the first logged step at or after this one (default: the logged "
                        "step after the first 10%% of them)")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    clock = wall_clock(args.run_dir, args.warm_step)
    median, n = median_tokens_per_s(args.run_dir)
    bench, bench_provenance = bench_row(args.bench_json, args.row, args.mode)
    fit = clock["tokens_per_s"] if clock else None
    out = {"run_dir": str(args.run_dir), "bench_json": str(args.bench_json), "bench_row": f"{args.row} ({args.mode})",
           "fit_tokens_per_s": None if fit is None else round(fit, 1),
           "fit_window": None if clock is None else {k: v for k, v in clock.items() if k != "tokens_per_s"},
           "bench_tokens_per_s": round(bench, 1), "fit_over_bench": None if fit is None else round(fit / bench, 3),
           "median_tokens_per_s": round(median, 1), "median_steps": n,
           "median_over_bench": round(median / bench, 3), "bench_provenance": bench_provenance}
    if clock is None:
        print(f"{args.run_dir / METRICS}: no train/time logged (a run from before the wall clock was logged): "
              "no wall-clock figure")
    else:
        per = f"per GPU ({clock['gpus']})" if clock["gpus"] else "all GPUs (their number is not in config.yaml)"
        print(f"fit {fit:,.0f} target tokens/s by the wall clock, {per}, steps {clock['from_step']}-"
              f"{clock['to_step']} ({clock['target_tokens']:,} tokens in {clock['seconds']:,.1f} s) vs benchmark "
              f"{bench:,.0f} tokens/s: {100 * fit / bench:.0f}% of the benchmark")
    print(f"(median of {n} logged steps' own rates: {median:,.0f} tokens/s, {100 * median / bench:.0f}%)")
    if (f := fill(args.run_dir)) is not None:
        out["fill"] = round(f, 3)
        out["fit_over_bench_over_fill"] = None if fit is None else round(fit / bench / f, 3)
        print(f"the run's steps carry {100 * f:.1f}% of data.max_tokens as real target tokens"
              + ("" if fit is None else f"; beyond that padding, the loop runs at {100 * fit / bench / f:.0f}% of "
                 "the benchmark by the wall clock"))
    if args.json:
        write_record(args.json, out, sys.argv if argv is None else argv, None, started)
    return out


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
