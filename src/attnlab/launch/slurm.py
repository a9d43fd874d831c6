"""SLURM: a fit as one job, a study as an array job of workers; requeue on preemption; job states.

    attnlab fit -c experiments/wmt14_en_de_base.yaml --slurm --nodes 1 --gpus-per-task 1 --trainer.devices 8
    attnlab ablate submit ablations/block_variants.yaml --launcher slurm --partition gpu --gpus-per-task 1 \\
        --workers 16 --array-parallelism 8 --time 12:00:00          # --dry-run prints the script only
    attnlab ablate status ablations/block_variants.yaml             # points, plus squeue / sacct states

This module renders and submits the jobs (`submit_fit` here; `attnlab.ablate.submit` for a study); what runs
inside them is `attnlab.launch.job`. A submission copies what its jobs run into a folder of its own, so
editing the repository while jobs wait in the queue changes nothing (`<run dir>/slurm/submit-NNN/` for a fit,
`<study>/slurm/submit-NNN/` for a study):

    code/attnlab/        the package as it was; the script puts code/ first on PYTHONPATH, and every job
                         step checks that `attnlab` really is imported from there (ATTNLAB_CODE)
    config.yaml          the resolved recipe (a fit), or
    ablation.yaml        the ablation file, its base: pointing at experiment.yaml (a study)
    fit.sbatch           the rendered script (worker.sbatch for a study): `sbatch` on it submits it again
    logs/                the jobs' output, appended to across requeues

A fit runs as one srun step of nodes x tasks-per-node tasks, one per device; in each task
`train.make_trainer` takes devices and num_nodes from SLURM, so Lightning runs DDP across them (gloo on CPU).
Jobs ask for USR1 `--signal-seconds` before their time limit; every task then saves `hpc_ckpt_N.ckpt` in the
run directory at the next step boundary and the job is requeued (`scontrol requeue`; attnlab.launch.requeue);
the restarted job resumes every task from the newest checkpoint that loads. USR1 sent to the batch shell
only (`scancel --signal=USR1 --batch`) is passed on.

Every value that reaches a script is validated (names, partitions, times, memory) or shell-quoted (paths,
commands); options that land in `#SBATCH` lines must match a strict pattern, and paths there are quoted
and may not hold `"`, `\\`, `%` or newlines.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import attnlab

from ..config import ConfigError
from ..experiment import Experiment
from .job import prepare_command, task_command

TEMPLATES = Path(__file__).resolve().parents[3] / "slurm"  # <repo>/slurm in a source checkout
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")  # partitions, accounts, QOS
_TIME = re.compile(r"^((\d+-)?\d+(:\d{1,2}){0,2}|UNLIMITED|INFINITE)$")
_MEM = re.compile(r"^\d+[KMGT]?$")
_PLACEHOLDER = re.compile(r"\{\{\s*(\w+)\s*\}\}")


# ---------------------------------------------------------------------------------------------- validation
def check_name(value: str, key: str) -> str:
    """Partition / account / QOS names (a comma list for partitions): letters, digits, _ . + - only."""
    if not all(_NAME.match(part) for part in str(value).split(",")):
        raise ConfigError(f"{key} {value!r}: expected a SLURM name of letters, digits and _ . + - "
                          f"(comma-separated for several), e.g. gpu")
    return str(value)


def check_study_name(name: str) -> str:
    """A study name becomes one directory name and part of the job name."""
    bad = [c for c in name if c == "/" or not c.isprintable()]
    if not name or name in (".", "..") or bad or len(name) > 128:
        raise ConfigError(f"name {name!r}: a study name must be one directory name (no '/', no control "
                          f"characters, not '.' or '..', at most 128 characters)")
    return name


def check_path(path: Path, key: str) -> Path:
    """Absolute paths that go into `#SBATCH` lines (quoted there) and the script body (shell-quoted)."""
    text = str(path)
    bad = sorted({c for c in text if c in '"\\%' or not c.isprintable()})
    if bad:
        raise ConfigError(f"{key} {text!r}: a path in a SLURM script may not contain {bad} "
                          f"(sbatch reads % as a file name pattern); choose another directory")
    return path


def time_seconds(value: str) -> int | None:
    """SLURM --time (minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS) in seconds; None = no limit."""
    if value in ("UNLIMITED", "INFINITE"):
        return None
    days, _, rest = value.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    if days:  # D-HH[:MM[:SS]]
        parts += [0] * (3 - len(parts))
        return int(days) * 86400 + parts[0] * 3600 + parts[1] * 60 + parts[2]
    return {1: lambda p: p[0] * 60, 2: lambda p: p[0] * 60 + p[1],
            3: lambda p: p[0] * 3600 + p[1] * 60 + p[2]}[len(parts)](parts)


def positive(value: Any, key: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{key} {value!r}: expected an integer >= {minimum}")
    return value


@dataclass(frozen=True)
class Resources:
    """What one job asks for. A trial runs nodes x tasks_per_node tasks, one per device."""

    job_name: str
    nodes: int = 1
    tasks_per_node: int = 1
    gpus_per_task: int = 0
    cpus_per_task: int | None = None
    mem: str | None = None
    time: str | None = None
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    signal_s: int = 300

    def __post_init__(self) -> None:
        positive(self.nodes, "--nodes")
        positive(self.tasks_per_node, "--tasks-per-node")
        positive(self.gpus_per_task, "--gpus-per-task", 0)
        positive(self.signal_s, "--signal-seconds")
        if self.cpus_per_task is not None:
            positive(self.cpus_per_task, "--cpus-per-task")
        if self.mem is not None and not _MEM.match(self.mem):
            raise ConfigError(f"--mem {self.mem!r}: expected a size such as 64G, 500M or 16000 (MB)")
        if self.time is not None:
            if not _TIME.match(self.time):
                raise ConfigError(f"--time {self.time!r}: expected minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or "
                                  "D-HH:MM:SS")
            limit = time_seconds(self.time)
            if limit is not None and self.signal_s >= limit:
                raise ConfigError(f"--signal-seconds {self.signal_s} must be shorter than --time {self.time} "
                                  f"({limit} s): the job needs time to checkpoint before the limit")
        for key in ("partition", "account", "qos"):
            if getattr(self, key) is not None:
                check_name(getattr(self, key), f"--{key}")

    def directives(self, log_dir: Path, log_name: str, array: str | None = None) -> str:
        """The `#SBATCH` lines. Values are checked tokens; the output path is quoted (sbatch reads quotes)
        and log_name is a fixed pattern such as worker-%A_%a.log."""
        output = check_path(log_dir, "log directory") / log_name
        job = "attnlab-" + re.sub(r"[^A-Za-z0-9_.+-]", "_", self.job_name)[:64]
        lines = [f"--job-name={job}", f"--nodes={self.nodes}", f"--ntasks-per-node={self.tasks_per_node}"]
        if self.gpus_per_task:
            lines.append(f"--gpus-per-task={self.gpus_per_task}")
        optional = {"cpus-per-task": self.cpus_per_task, "mem": self.mem, "time": self.time,
                    "partition": self.partition, "account": self.account, "qos": self.qos, "array": array}
        lines += [f"--{k}={v}" for k, v in optional.items() if v is not None]
        lines += [f"--signal=USR1@{self.signal_s}", "--requeue", "--open-mode=append", f'--output="{output}"']
        return "\n".join(f"#SBATCH {line}" for line in lines)


def resources_from(args: argparse.Namespace, name: str, defaults: dict[str, Any], tasks: int, nodes: int
                   ) -> Resources:
    """Command-line options over the ablation file's `resources:` over the recipe's trainer.devices/num_nodes."""
    mem_gb = defaults.get("mem_gb")
    minutes = defaults.get("time_min")
    return Resources(
        job_name=name,
        nodes=args.nodes if args.nodes is not None else nodes,
        tasks_per_node=args.tasks_per_node if args.tasks_per_node is not None else tasks,
        gpus_per_task=args.gpus_per_task,
        cpus_per_task=args.cpus_per_task if args.cpus_per_task is not None else defaults.get("cpus"),
        mem=args.mem if args.mem is not None else (f"{mem_gb}G" if mem_gb is not None else None),
        time=args.time if args.time is not None else (str(math.ceil(minutes)) if minutes else None),
        partition=args.partition if args.partition is not None else defaults.get("partition"),
        account=args.account, qos=args.qos, signal_s=args.signal_seconds,
    )


# ---------------------------------------------------------------------------------------------- rendering
def render(template: str, values: dict[str, str], source: str) -> str:
    """Fill `{{ name }}` placeholders; values must already be quoted for where they go."""
    names = set(_PLACEHOLDER.findall(template))
    unknown = sorted(names - set(values))
    if unknown:
        raise ConfigError(f"{source}: unknown placeholder(s) {unknown}; known: {sorted(values)}")
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], template)


def read_template(name: str, override: str | None) -> tuple[str, str]:
    path = Path(override) if override else TEMPLATES / name
    if not path.is_file():
        raise ConfigError(f"--template {path}: not found" if override else
                          f"SLURM template {path} not found (it ships in the repository's slurm/ folder; "
                          f"give --template PATH)")
    return path.read_text(encoding="utf-8"), str(path)


def snapshot_code(dest: Path) -> Path:
    """Copy the attnlab package that is running now into dest/attnlab; returns dest (for PYTHONPATH)."""
    src = Path(attnlab.__file__).resolve().parent
    shutil.copytree(src, dest / "attnlab", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dest


def new_submission(root: Path) -> Path:
    """root/submit-NNN, the next free number (mkdir is atomic, so two submissions never share one)."""
    root.mkdir(parents=True, exist_ok=True)
    n = 1 + max([int(p.name[7:]) for p in root.glob("submit-*") if p.name[7:].isdigit()] + [0])
    while True:
        path = root / f"submit-{n:03d}"
        try:
            path.mkdir()
            return path
        except FileExistsError:
            n += 1


def script_values(snapshot: Path, directives: str, command: list[str]) -> dict[str, str]:
    return {"directives": directives, "workdir": shlex.quote(str(Path.cwd())),
            "code": shlex.quote(str(snapshot / "code")), "command": shlex.join(command)}


def sbatch(script: Path, jobs_file: Path) -> str:
    """Submit a rendered script; record the job id in jobs_file; return the id."""
    if shutil.which("sbatch") is None:
        raise ConfigError("sbatch not found: submit from a SLURM login node (or use --dry-run)")
    r = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise ConfigError(f"sbatch {script} failed ({r.returncode}): {(r.stderr or r.stdout).strip()}")
    job = r.stdout.strip().split(";")[0]
    with open(jobs_file, "a", encoding="utf-8") as f:
        f.write(json.dumps({"job": job, "script": str(script), "submitted": time.time()}) + "\n")
    return job


# ---------------------------------------------------------------------------------------------- submit
def submit_fit(exp: Experiment, args: argparse.Namespace) -> int:
    """`attnlab fit ... --slurm`: one run as one job of nodes x tasks-per-node tasks, requeued on USR1."""
    trainer = exp.trainer
    if trainer.devices == -1 and args.tasks_per_node is None:
        raise ConfigError("trainer.devices=-1 (all visible) cannot size a SLURM job: give --tasks-per-node")
    res = resources_from(args, exp.name, {}, trainer.devices, trainer.num_nodes)
    exp = exp.replace(trainer=trainer.replace(devices=res.tasks_per_node, num_nodes=res.nodes,
                                              runs_dir=str(Path(trainer.runs_dir).resolve())))
    # named up front, as the ablation runner names trials (fit would name it after the tokenizer set the
    # vocabulary): the submission lives in it and a requeued job must find its checkpoints there
    exp = exp.replace(trainer=exp.trainer.replace(run_name=exp.run_dir().name))
    run_dir = check_path(exp.run_dir().resolve(), "trainer.runs_dir")
    root = run_dir / "slurm"
    snapshot = new_submission(root) if not args.dry_run else root / "submit-NNN"
    config = snapshot / "config.yaml"
    command = task_command(config, ckpt_path=args.ckpt_path, gpus=res.gpus_per_task > 0)
    template, source = read_template("fit.sbatch", args.template)
    values = script_values(snapshot, res.directives(snapshot / "logs", "fit-%j.log"), command)
    values["prepare"] = shlex.join(prepare_command(config))
    script = render(template, values, source)
    if args.dry_run:
        print(script)
        print("# dry run: nothing written or submitted", file=sys.stderr)
        return 0
    snapshot_code(snapshot / "code")
    (snapshot / "logs").mkdir()
    config.write_text(exp.to_yaml(), encoding="utf-8")
    path = snapshot / "fit.sbatch"
    path.write_text(script, encoding="utf-8")
    job = sbatch(path, root / "jobs.jsonl")
    print(f"submitted job {job}: fit {exp.name} on {res.nodes} node(s) x {res.tasks_per_node} task(s)")
    print(f"  script:  {path}\n  log:     {snapshot / 'logs' / f'fit-{job}.log'}\n  run dir: {run_dir}")
    return 0


def add_slurm_args(p: argparse.ArgumentParser, target: str) -> None:
    """The job-shape options of `attnlab fit --slurm` (target "fit": one run) and `attnlab ablate submit`
    (target "study": every trial of an array job), with help in the words of each."""
    trial = "the run" if target == "fit" else "each trial"
    file = "the cluster's default" if target == "fit" else "the ablation file's resources"
    g = p.add_argument_group("SLURM" + (" (with --slurm)" if target == "fit" else ""))
    g.add_argument("--partition", default=None, help=f"partition(s) (default: {file})")
    g.add_argument("--account", default=None)
    g.add_argument("--qos", default=None)
    g.add_argument("--time", default=None, help="time limit per job, e.g. 12:00:00 or 2-00:00:00"
                   + ("" if target == "fit" else " (default: the ablation file's resources.time_min)"))
    g.add_argument("--nodes", type=int, default=None, help=f"nodes for {trial} (default: trainer.num_nodes)")
    g.add_argument("--tasks-per-node", type=int, default=None,
                   help=f"tasks (= devices) per node for {trial} (default: trainer.devices)")
    g.add_argument("--gpus-per-task", type=int, default=0, help="GPUs per task: 1 for one task per GPU")
    g.add_argument("--cpus-per-task", type=int, default=None)
    g.add_argument("--mem", default=None, help="memory per node, e.g. 64G")
    g.add_argument("--signal-seconds", type=int, default=300,
                   help="USR1 this long before the time limit: checkpoint and requeue")
    g.add_argument("--template", default=None, help="an sbatch template instead of the one in slurm/")
    if target != "fit":  # fit has a --dry-run of its own, with or without --slurm
        g.add_argument("--dry-run", action="store_true", help="print the script; write and submit nothing")


# ---------------------------------------------------------------------------------------------- status
def _run(cmd: list[str]) -> tuple[int, str, str]:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return 127, "", f"{type(e).__name__}: {e}"
    return r.returncode, r.stdout, r.stderr


def slurm_status(jobs_file: Path) -> str:
    """The SLURM states of a study's (or run's) submitted jobs: squeue, and sacct where accounting exists."""
    jobs = [json.loads(line)["job"] for line in jobs_file.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not jobs:
        return "SLURM: no jobs submitted"
    ids = ",".join(jobs)
    lines = [f"SLURM jobs {ids}:"]
    if shutil.which("squeue") is None:
        return "\n".join(lines + ["  squeue not found: SLURM states not shown (run this on a login node)"])
    code, out, err = _run(["squeue", "-h", "-r", "-j", ids, "-o", "%i|%T|%M|%R"])
    gone = code != 0 and "invalid job id" in err.lower()  # every job has left the queue
    if code != 0 and not gone:
        lines.append(f"  squeue failed: {err.strip()}")
    queued = [row.split("|", 3) for row in out.splitlines() if row.strip()] if code == 0 else []
    for job, state, elapsed, where in queued:
        lines.append(f"  {job:<12} {state:<11} {elapsed:>10}  {where}")
    if gone or (code == 0 and not queued):
        lines.append("  none in the queue (finished, or purged from squeue)")
    code, out, err = _run(["sacct", "-n", "-P", "-X", "-j", ids, "-o", "JobID,State,Elapsed,ExitCode"])
    if code != 0:
        why = "accounting storage is disabled" if "accounting storage is disabled" in (out + err).lower() \
            else (err.strip() or out.strip() or f"exit {code}")
        lines.append(f"sacct: {why}; only squeue states shown")
    else:
        lines.append("sacct:")
        for row in out.splitlines():
            if row.strip():
                job, state, elapsed, exit_code = (row.split("|") + ["", "", "", ""])[:4]
                lines.append(f"  {job:<12} {state:<11} {elapsed:>10}  exit {exit_code}")
    return "\n".join(lines)
