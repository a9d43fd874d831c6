"""`attnlab ablate submit`: a study as a SLURM array job, each array task one worker of the study's shared
optuna storage: --storage, else the one the study directory records, else a journal file there (the default of
`ablate run` too). A study kept in SQLite is refused, saying how to move it (`attnlab ablate move`).

A worker claims a point and runs it as an srun step of its allocation, one task per device, `--nodes` x
`--tasks-per-node` tasks (attnlab.launch.job). On USR1 before the time limit the trial checkpoints and the job
is requeued; the worker, killed with the job, records its trial as interrupted (not a failed attempt); when
the job starts again it claims the point again and the runner resumes it from the newest checkpoint of its run
directory (named by the config hash, so it is the same one). The rendering, the job-shape options and the
submission itself are attnlab.launch.slurm's, shared with `attnlab fit --slurm`.
"""

from __future__ import annotations

import argparse
import logging
import re
import shlex
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml
from optuna.trial import TrialState

from ..analysis.rounds import replayed, round_counts
from ..config import ConfigError, load_yaml
from ..experiment import load_raw
from ..launch.slurm import (
    check_path,
    check_study_name,
    new_submission,
    positive,
    read_template,
    render,
    resources_from,
    sbatch,
    script_values,
    snapshot_code,
)
from .budget import budget_warnings
from .runner import options_from, record_interrupted, worker_command
from .seeds import until_decided
from .spec import load_spec
from .study import connect, default_study_dir, free_journal, prepare_study, status_counts, storage_url

log = logging.getLogger("attnlab.ablate")

_FIT = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def submit_study(args: argparse.Namespace) -> int:
    """`attnlab ablate submit`: snapshot code and configs, render the worker array script, sbatch it. A study in
    rounds of seeds submits the round under way; with --wait this process then waits for the array and submits the
    next round, until every comparison is decided; else a chained job does that when the array ends (rounds.py)."""
    while True:
        code, job, spec = submit_round(args)
        if job is None or spec.rounds is None or not getattr(args, "wait", False):
            return code
        wait_job(job)
        args.after = job


def submit_round(args: argparse.Namespace) -> tuple[int, str | None, Any]:
    """One submission: the exit status, the array job's id (None when nothing was submitted) and the spec."""
    spec = load_run_spec(args)
    check_study_name(spec.name)
    for warning in budget_warnings(spec):
        log.warning(warning)
    for flag, value in (("--fit", args.fit), ("--evaluate", args.evaluate)):
        if not _FIT.match(value):
            raise ConfigError(f"{flag} {value!r}: expected module:function")
    study_dir = check_path(Path(args.dir).resolve() if args.dir else default_study_dir(spec).resolve(), "--dir")
    recorded = study_dir / "study.yaml"
    storage = storage_url(study_dir, args.storage)
    if storage.startswith("sqlite"):
        raise ConfigError(f"{spec.name} is kept in SQLite ({storage}), whose locking is not reliable on the network "
                          "file systems SLURM jobs share, and admits one writer at a time. Move it to a journal file "
                          f"(or a PostgreSQL URL) first: attnlab ablate move {shlex.quote(str(study_dir))} --to "
                          f"{shlex.quote(str(free_journal(study_dir)))}")
    varied = spec.varied_keys()
    for key in ("trainer.devices", "trainer.num_nodes"):
        if key in varied:
            raise ConfigError(f"{spec.path}: {key} varies across trials; one SLURM array has one job shape "
                              "(submit one study per shape)")
    base = spec.experiment({})
    if base.trainer.devices == -1 and args.tasks_per_node is None:
        raise ConfigError("trainer.devices=-1 (all visible) cannot size a SLURM job: give --tasks-per-node")
    res = resources_from(args, spec.name, spec.resources, base.trainer.devices, base.trainer.num_nodes)

    todo = len(spec.points()) if not spec.is_search else spec.n_trials
    if spec.rounds is not None:  # the first round: every variant at its min seeds
        todo = len(spec.variants()) * spec.rounds.min
    try:  # a study already in the storage: only what is still pending
        h = connect(spec, study_dir, storage) if recorded.exists() else None
    except ConfigError:  # recorded elsewhere, not (yet) in this storage
        h = None
    if h is not None:
        if getattr(args, "after", None) and not release_array(h, args.after):
            print(f"{spec.name}: the array job {args.after} ended without starting a trial; not submitting again (see "
                  f"its logs in {study_dir / 'slurm'})")
            return 1, None, spec
        spec = h.spec  # with the rounds it records
        counts = round_counts(h) or status_counts(h)  # in rounds: only what the round under way needs is pending
        todo = counts.get("pending", 0) + (spec.n_trials - sum(counts.values()) if spec.is_search else 0)
    if todo == 0 and not args.dry_run:
        r = replayed(h) if h is not None else None
        if r is not None and not r.done:
            print(f"{spec.name}: the round under way has nothing left to submit (its trials run); see `attnlab "
                  "ablate status`")
        else:
            print(f"{spec.name}: nothing to run (" + ("every comparison is decided" if r is not None else
                                                     "every point is done, invalid or failed") +
                  "); see `attnlab ablate status`")
        return 0, None, spec
    workers = positive(args.workers if args.workers is not None else max(1, todo), "--workers")
    array = f"0-{workers - 1}"
    if args.array_parallelism is not None:
        array += f"%{positive(args.array_parallelism, '--array-parallelism')}"

    root = study_dir / "slurm"
    snapshot = new_submission(root) if not args.dry_run else root / "submit-NNN"
    spec_copy = snapshot / "ablation.yaml"
    raw = load_yaml(spec.path)
    raw.update(name=spec.name, base="experiment.yaml")
    raw["resources"] = {**(raw.get("resources") or {}), "devices": res.tasks_per_node, "nodes": res.nodes}
    raw["overrides"] = {**(raw.get("overrides") or {}), "trainer.num_nodes": res.nodes}
    if spec.rounds is not None:  # --until-decided, or rounds the study recorded: the jobs run them too
        raw["seeds"] = {"min": spec.rounds.min, "max": spec.rounds.max, "step": spec.rounds.step,
                        "list": list(spec.seeds)}
    opts = options_from(args)
    if spec.rounds is not None:  # this array runs the round under way; the next round is an array of its own
        r = replayed(h) if h is not None else None
        opts = replace(opts, max_round=r.replay.rounds + 1 if r is not None else 1)
    worker = worker_command(spec_copy, study_dir, storage, opts, srun=True)
    template, source = read_template("ablate_worker.sbatch", args.template)
    directives = res.directives(snapshot / "logs", "worker-%A_%a.log", array)
    script = render(template, script_values(snapshot, directives, worker), source)
    if args.dry_run:
        print(script)
        print(f"# dry run: nothing written or submitted ({todo} point(s) to run, {workers} worker(s))",
              file=sys.stderr)
        return 0, None, spec
    snapshot_code(snapshot / "code")
    (snapshot / "logs").mkdir()
    (snapshot / "experiment.yaml").write_text(yaml.safe_dump(load_raw(spec.base), sort_keys=False), encoding="utf-8")
    spec_copy.write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
    snap_spec = load_spec(spec_copy)  # what the jobs will load: it must load here too
    prepare_study(snap_spec, study_dir, storage)
    path = snapshot / "worker.sbatch"
    path.write_text(script, encoding="utf-8")
    job = sbatch(path, root / "jobs.jsonl")
    print(f"submitted job {job}: {workers} worker(s) of study {spec.name} ({todo} point(s) to run)")
    print(f"  script:  {path}\n  logs:    {snapshot / 'logs'}\n  storage: {storage}")
    print(f"  status:  attnlab ablate status {shlex.quote(str(study_dir))}")
    if spec.rounds is not None and not args.wait and not args.no_chain:
        chain(args, res, spec, snapshot, spec_copy, study_dir, storage, job)
    return 0, job, spec


def load_run_spec(args: argparse.Namespace) -> Any:
    """The ablation file of `run` or `submit`, in rounds with --until-decided (seeds.until_decided)."""
    spec = load_spec(args.spec)
    if getattr(args, "until_decided", False):
        return until_decided(spec, args.min_seeds, args.max_seeds, args.seed_step)
    if any(getattr(args, k, None) is not None for k in ("min_seeds", "max_seeds", "seed_step")):
        raise ConfigError("--min-seeds, --max-seeds and --seed-step go with --until-decided")
    return spec


def release_array(h: Any, job: str) -> int:
    """The chained job of a study in rounds starts once the array `job` has ended: its trials still RUNNING (their
    workers killed with it) are recorded as interrupted, so the next round takes them up at once. Returns how many
    trials the array started (0: its workers failed before any; submitting again would fail again)."""
    started = 0
    for t in h.study.get_trials(deepcopy=False):
        if str(t.user_attrs.get("slurm_job", "")).partition("_")[0] != job:
            continue
        started += 1
        if t.state == TrialState.RUNNING:
            record_interrupted(h, t._trial_id, f"its array job {job} ended")
    return started


def chain(args: argparse.Namespace, res: Any, spec: Any, snapshot: Path, spec_copy: Path, study_dir: Path,
          storage: str, job: str) -> str:
    """Submit the job that runs `ablate submit` again when the array `job` has ended (afterany): it looks at the
    round and submits the next one (and its own successor), or stops once every comparison is decided."""
    command = [sys.executable, "-m", "attnlab", "ablate", "submit", str(spec_copy), "--dir", str(study_dir),
               "--storage", storage, "--fit", args.fit, "--evaluate", args.evaluate, "--heartbeat", str(args.heartbeat),
               "--grace", str(args.grace), "--poll", str(args.poll), "--after", job]
    for flag in ("partition", "account", "qos", "time", "nodes", "tasks_per_node", "gpus_per_task", "cpus_per_task",
                 "mem", "signal_seconds", "workers", "array_parallelism"):
        value = getattr(args, flag, None)
        if value is not None:
            command += [f"--{flag.replace('_', '-')}", str(value)]
    template, source = read_template("ablate_worker.sbatch", args.template)
    kept = snapshot / "ablate_worker.sbatch"  # the template the next rounds render: the code copy has no slurm/
    kept.write_text(template, encoding="utf-8")
    command += ["--template", str(kept)]
    small = replace(res, job_name=f"{spec.name}-next", nodes=1, tasks_per_node=1, gpus_per_task=0, cpus_per_task=None,
                    mem=None)
    directives = small.directives(snapshot / "logs", "next-%j.log") + f"\n#SBATCH --dependency=afterany:{int(job)}"
    path = snapshot / "next.sbatch"
    path.write_text(render(template, script_values(snapshot, directives, command), source), encoding="utf-8")
    nxt = sbatch(path, study_dir / "slurm" / "jobs.jsonl")
    print(f"  next:    job {nxt} submits the next round when {job} ends (afterany)")
    return nxt


def wait_job(job: str, poll_s: float = 10.0) -> None:
    """Until the job (every task of an array) has left the queue."""
    while True:
        r = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True, timeout=60)
        if (r.returncode == 0 and not r.stdout.strip()) or "invalid job id" in r.stderr.lower():
            return
        time.sleep(poll_s)
