"""A run directory, `<trainer.runs_dir>/<name>-<config hash>/`, and the one way its metrics are kept and read.

    config.yaml          the resolved experiment (the vocabulary the tokenizer gave it included)
    git.txt              commit and whether the tree was dirty
    tokenizer/           what translate / generate load beside a checkpoint
    checkpoints/         step=N.ckpt (the last trainer.keep_checkpoints), last.ckpt (a copy of its step's)
    logs/metrics.csv     Lightning's CSVLogger: one row per logged step
    logs/metrics.partK.csv   the earlier attempts of a resumed run (see `keep_metrics`)
    tensorboard/         the same metrics for TensorBoard
    fit_done.json        written last by a fit that ran to its end (`mark_fit_done`); removed when a fit starts
    previous/K/          an earlier run's files, moved aside by a fresh fit in the same directory

Lightning's CSVLogger starts metrics.csv afresh in every process that logs to it. A resume therefore first
moves the file to metrics.part<K>.csv, and `run_metrics` joins the parts: every attempt's rows up to the step
where the next one took over, then the next one's.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import shutil
import subprocess
from pathlib import Path

log = logging.getLogger("attnlab")

METRICS = Path("logs") / "metrics.csv"
FIT_DONE = "fit_done.json"
Curves = dict[str, list[tuple[int, float]]]  # column -> (step, value) pairs in step order


def git_state() -> str:
    root = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "commit: unknown\ndirty: unknown\n"
    if commit.returncode != 0:
        return "commit: unknown (not a git checkout)\ndirty: unknown\n"
    return f"commit: {commit.stdout.strip()}\ndirty: {bool(dirty.stdout.strip())}\n"


def write_run_dir(run_dir: Path, config_yaml: str, tokenizer) -> None:
    """config.yaml, git.txt and the tokenizer of a run."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(config_yaml, encoding="utf-8")
    (run_dir / "git.txt").write_text(git_state(), encoding="utf-8")
    tokenizer.save(run_dir / "tokenizer")


def archive_previous(run_dir: Path) -> Path | None:
    """A fresh fit in a run directory that already holds checkpoints or logs (same recipe, same config hash) moves
    them to <run_dir>/previous/<k>/, so checkpoint averaging never mixes two runs' files."""
    parts = [run_dir / n for n in ("checkpoints", "logs", "tensorboard", "sacrebleu_signature.txt")]
    parts = [p for p in parts if p.exists()]
    if not parts:
        return None
    k = 0
    while (run_dir / "previous" / str(k)).exists():
        k += 1
    dest = run_dir / "previous" / str(k)
    dest.mkdir(parents=True)
    for p in parts:
        shutil.move(str(p), str(dest / p.name))
    log.warning("%s held an earlier run; moved its %s to %s (resume instead with --ckpt_path last)",
                run_dir, ", ".join(p.name for p in parts), dest)
    return dest


def mark_fit_done(run_dir: Path, step: int) -> None:
    """The last thing a fit that ran to its end does: fit_done.json, written whole (temporary file, fsync, rename).
    An ablation worker that takes up a trial whose earlier worker died after this line collects and evaluates
    the run instead of fitting it again (ablate/runner.run_claim)."""
    tmp = run_dir / f".{FIT_DONE}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"step": step}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, run_dir / FIT_DONE)


def fit_done(run_dir: Path) -> dict | None:
    """What `mark_fit_done` recorded in run_dir, or None when no fit there ran to its end since it last started."""
    try:
        return json.loads((run_dir / FIT_DONE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None


def clear_fit_done(run_dir: Path) -> None:
    """A fit starts in run_dir: until it ends, the run is not finished (a resume may train further)."""
    (run_dir / FIT_DONE).unlink(missing_ok=True)


def keep_metrics(run_dir: Path) -> Path | None:
    """Before a resume: move logs/metrics.csv to logs/metrics.part<K>.csv (the next free K), so the resumed
    attempt's logger, which starts the file afresh, loses none of it. Returns the part written, if any."""
    path = run_dir / METRICS
    if not path.exists():
        return None
    k = 0
    while (part := path.with_name(f"metrics.part{k}.csv")).exists():
        k += 1
    path.rename(part)
    return part


def read_metrics(path: Path) -> Curves:
    """Every logged column of one CSVLogger file as (step, value) pairs, in step order."""
    curves: Curves = {}
    with open(path, newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            if not row.get("step"):
                continue
            step = int(float(row["step"]))
            for k, v in row.items():
                if k not in ("step", "epoch") and v not in ("", None):
                    curves.setdefault(k, []).append((step, float(v)))
    return {k: sorted(v, key=lambda x: x[0]) for k, v in curves.items()}


def run_metrics(run_dir: Path) -> Curves:
    """Every column of a run's metrics across its attempts: earlier parts first, each later one replacing the
    earlier rows from its own first step of that column on (what was logged after the checkpoint it resumed)."""
    logs = run_dir / METRICS.parent
    parts = sorted(logs.glob("metrics.part*.csv"), key=lambda p: int(p.stem.removeprefix("metrics.part")))
    if (run_dir / METRICS).exists():
        parts.append(run_dir / METRICS)
    if not parts:
        raise FileNotFoundError(f"{run_dir / METRICS}: the run wrote no metrics")
    curves: Curves = {}
    for part in parts:
        for k, points in read_metrics(part).items():
            start = points[0][0]
            curves[k] = [p for p in curves.get(k, []) if p[0] < start] + points
    return curves
