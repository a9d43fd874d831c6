"""A study's storage under load: N `attnlab ablate worker` processes through T trials of a fake fit of a few
milliseconds, on the journal file and on PostgreSQL (issue 45).

    python bench/storage_load.py                                        # 16 and 32 workers, 1,000 trials, journal
    python bench/storage_load.py --pg postgresql://u@127.0.0.1:5432/db  # and PostgreSQL (a database of its own)
    python bench/storage_load.py --workers 4 --trials 40                # a quick run

For each storage and worker count it prints and records (bench/results/storage_load_<date>.json): the wall time
from the first worker's start to the last one's exit, trials a second over the span of the fits (first fit's
start to last fit's end: the workers' imports excluded), the p50 and p99 turnaround of a worker between two fits
(recording the last result and claiming the next point: what the storage's locks and writes cost a trial), the
duplicate claims and lost points (both must be 0), the fits that ran twice, and the storage's size at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from datetime import date
from pathlib import Path

BENCH = Path(__file__).resolve().parent
FIT = "storage_load:fake_fit"


def fake_fit(exp, ckpt_path=None):
    """The fit the workers run: STORAGE_FIT_MS milliseconds of sleep, then the files a fit leaves (a metrics.csv
    with val/loss, config.yaml, fit_done.json); its start and end go to <study>/calls.jsonl."""
    from attnlab.rundir import mark_fit_done

    run_dir = exp.run_dir()
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    calls = Path(exp.trainer.runs_dir).parent / "calls.jsonl"
    start = time.time()
    time.sleep(float(os.environ.get("STORAGE_FIT_MS", "5")) / 1000)
    loss = 3.0 + 0.001 * exp.trainer.seed
    (run_dir / "logs" / "metrics.csv").write_text(f"epoch,step,train/loss,val/loss\n0,9,{loss + 1},\n0,9,,{loss}\n",
                                                  encoding="utf-8")
    (run_dir / "config.yaml").write_text(exp.to_yaml(), encoding="utf-8")
    mark_fit_done(run_dir, exp.trainer.max_steps)
    with open(calls, "a", encoding="utf-8") as f:  # one line, one write: whole under O_APPEND
        f.write(json.dumps({"hash": exp.config_hash(), "pid": os.getpid(), "start": start, "end": time.time()}) + "\n")
    return run_dir


def write_study(d: Path, name: str, trials: int) -> Path:
    (d / "corpus.txt").write_text("".join(f"the cat {i} sat on the mat.\n\n" for i in range(200)), encoding="utf-8")
    (d / "base.yaml").write_text(f"""\
name: storage_load
model: {{arch: decoder_only, d_model: 32, n_heads: 2, n_dec_layers: 1, d_ff: 64, max_seq_len: 64}}
data: {{corpus: {d / 'corpus.txt'}, vocab_size: 300, seq_len: 32, max_tokens: 256, data_dir: {d / 'cache'}}}
trainer: {{accelerator: cpu, max_steps: 10, progress_bar: false, runs_dir: {d / 'runs'}}}
""", encoding="utf-8")
    spec = d / "study.yaml"
    spec.write_text(f"name: {name}\nbase: {d / 'base.yaml'}\nfinal_eval: false\n"
                    "metric: {name: val/loss, direction: min}\n"
                    f"seeds: {trials}\nvariants:\n  - {{name: base}}\n", encoding="utf-8")
    return spec


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def storage_size(kind: str, study_dir: Path, url: str) -> int:
    if kind == "journal":
        return (study_dir / "journal.log").stat().st_size
    import sqlalchemy

    with sqlalchemy.create_engine(url).connect() as c:
        return int(c.execute(sqlalchemy.text("select pg_database_size(current_database())")).scalar())


def run(kind: str, url: str | None, workers: int, trials: int, fit_ms: float) -> dict:
    from optuna.trial import TrialState

    from attnlab.ablate.runner import Options, worker_command
    from attnlab.ablate.spec import load_spec
    from attnlab.ablate.study import connect, prepare_study

    d = Path(tempfile.mkdtemp(prefix=f"storage_load_{kind}_{workers}_"))
    spec = load_spec(write_study(d, f"storage_load_{workers}_{os.getpid()}", trials))  # a study of its own
    study_dir = d / "study"
    h = prepare_study(spec, study_dir, url)
    cmd = worker_command(h.spec.path, h.dir, h.url, Options(fit=FIT, heartbeat_s=5, grace_s=120, poll_s=0.5))
    env = {**os.environ, "STORAGE_FIT_MS": str(fit_ms), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in [str(BENCH), os.environ.get("PYTHONPATH")] if p)}
    (d / "logs").mkdir()
    t0 = time.time()
    procs = [subprocess.Popen(cmd, env=env, stdout=open(d / "logs" / f"{i:02d}.log", "w"), stderr=subprocess.STDOUT)
             for i in range(workers)]
    codes = [p.wait() for p in procs]
    wall = time.time() - t0
    calls = [json.loads(x) for x in (study_dir / "calls.jsonl").read_text().splitlines()]
    by_pid: dict[int, list[dict]] = {}
    for c in sorted(calls, key=lambda c: c["start"]):
        by_pid.setdefault(c["pid"], []).append(c)
    gaps = [b["start"] - a["end"] for cs in by_pid.values() for a, b in zip(cs, cs[1:], strict=False)]
    span = max(c["end"] for c in calls) - min(c["start"] for c in calls)
    got = connect(spec, study_dir, url).study.get_trials(deepcopy=False)
    complete: dict[str, int] = {}
    for t in got:
        if t.state == TrialState.COMPLETE:
            complete[t.user_attrs["point_id"]] = complete.get(t.user_attrs["point_id"], 0) + 1
    points = {p.point_id for p in spec.points()}
    fits: dict[str, int] = {}
    for c in calls:
        fits[c["hash"]] = fits.get(c["hash"], 0) + 1
    return {"storage": kind, "workers": workers, "trials": trials, "fit_ms": fit_ms, "exit_codes_nonzero":
            sum(c != 0 for c in codes), "wall_s": round(wall, 1), "fits_span_s": round(span, 1),
            "trials_per_s": round(len(calls) / span, 1) if span else None,
            "turnaround_p50_ms": round(1000 * percentile(gaps, 0.5), 1),
            "turnaround_p99_ms": round(1000 * percentile(gaps, 0.99), 1),
            "duplicates": sum(t.user_attrs.get("status") == "duplicate" for t in got)
            + sum(n - 1 for n in complete.values()),
            "lost": len(points - set(complete)), "fits_twice": sum(n > 1 for n in fits.values()),
            "storage_bytes": storage_size(kind, study_dir, h.url), "dir": str(d)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, nargs="+", default=[16, 32])
    ap.add_argument("--trials", type=int, default=1000)
    ap.add_argument("--fit-ms", type=float, default=5.0)
    ap.add_argument("--pg", help="a PostgreSQL URL (an empty database): also run on it")
    ap.add_argument("--out", type=Path, default=BENCH / "results" / f"storage_load_{date.today()}.json")
    args = ap.parse_args()
    rows = []
    for kind, url in [("journal", None)] + ([("postgresql", args.pg)] if args.pg else []):
        for n in args.workers:
            rows.append(run(kind, url, n, args.trials, args.fit_ms))
            print(json.dumps(rows[-1]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"host_cpus": os.cpu_count(), "load_avg": os.getloadavg(), "rows": rows},
                                   indent=1) + "\n", encoding="utf-8")
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
