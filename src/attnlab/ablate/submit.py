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
import sys
from pathlib import Path

import yaml

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
from .runner import options_from, worker_command
from .spec import load_spec
from .study import connect, default_study_dir, free_journal, prepare_study, status_counts, storage_url

log = logging.getLogger("attnlab.ablate")

_FIT = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def submit_study(args: argparse.Namespace) -> int:
    """`attnlab ablate submit`: snapshot code and configs, render the worker array script, sbatch it."""
    spec = load_spec(args.spec)
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
    try:  # a study already in the storage: only what is still pending
        counts = status_counts(connect(spec, study_dir, storage)) if recorded.exists() else None
    except ConfigError:  # recorded elsewhere, not (yet) in this storage
        counts = None
    if counts is not None:
        todo = counts.get("pending", 0) + (spec.n_trials - sum(counts.values()) if spec.is_search else 0)
    if todo == 0 and not args.dry_run:
        print(f"{spec.name}: nothing to run (every point is done, invalid or failed); see `attnlab ablate status`")
        return 0
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
    worker = worker_command(spec_copy, study_dir, storage, options_from(args), srun=True)
    template, source = read_template("ablate_worker.sbatch", args.template)
    directives = res.directives(snapshot / "logs", "worker-%A_%a.log", array)
    script = render(template, script_values(snapshot, directives, worker), source)
    if args.dry_run:
        print(script)
        print(f"# dry run: nothing written or submitted ({todo} point(s) to run, {workers} worker(s))",
              file=sys.stderr)
        return 0
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
    return 0
