"""SLURM: a study as an array job of workers, a fit as one job; trials as srun steps; requeue on preemption.

    attnlab ablate submit ablations/block_variants.yaml --launcher slurm --partition gpu --gpus-per-task 1 \\
        --workers 16 --array-parallelism 8 --time 12:00:00          # --dry-run prints the script only
    attnlab fit -c experiments/wmt14_en_de_base.yaml --slurm --nodes 1 --gpus-per-task 1 --trainer.devices 8
    attnlab ablate status ablations/block_variants.yaml             # points, plus squeue / sacct states

A submission copies what its jobs run into a folder of its own, so editing the repository while jobs wait
in the queue changes nothing (`<study>/slurm/submit-NNN/`, or `<run dir>/slurm/submit-NNN/` for a fit):

    code/attnlab/        the package as it was; the script puts code/ first on PYTHONPATH, and every job
                         step checks that `attnlab` really is imported from there (ATTNLAB_CODE)
    ablation.yaml        the ablation file, its base: pointing at experiment.yaml (a study), or
    experiment.yaml      the base recipe with its base: chain resolved; config.yaml for a fit
    worker.sbatch        the rendered script (fit.sbatch for a fit): `sbatch` on it submits it again
    logs/                the jobs' output, appended to across requeues

Each array task is one worker (`attnlab ablate worker --srun`) of the study's shared optuna storage (a
journal file in the study directory unless --storage names another). The worker claims a point and runs
it as an srun step of its allocation, one task per device, `--nodes` x `--tasks-per-node` tasks; in each
task `train.make_trainer` takes devices and num_nodes from SLURM, so Lightning runs DDP across them
(gloo on CPU). Jobs ask for USR1 `--signal-seconds` before their time limit; Lightning's SLURM plugin
then saves `hpc_ckpt_N.ckpt` in the run directory and requeues the job (`scontrol requeue`). The worker,
killed with the job, records its trial as interrupted (not a failed attempt); when the job starts again it
claims the point again and the runner resumes it from the newest checkpoint of its run directory (the run
directory is named by the config hash, so it is the same one). USR1 sent to the batch shell only
(`scancel --signal=USR1 --batch`) is passed on: shell -> worker -> srun -> the trial's tasks.

Every value that reaches a script is validated (names, partitions, times, memory) or shell-quoted (paths,
commands); options that land in `#SBATCH` lines must match a strict pattern, and paths there are quoted
and may not hold `"`, `\\`, `%` or newlines. A study name must be usable as one directory name.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ..config import ConfigError, load_yaml

log = logging.getLogger("attnlab.ablate")

TEMPLATES = Path(__file__).resolve().parents[3] / "slurm"  # <repo>/slurm in a source checkout
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")  # partitions, accounts, QOS
_TIME = re.compile(r"^((\d+-)?\d+(:\d{1,2}){0,2}|UNLIMITED|INFINITE)$")
_MEM = re.compile(r"^\d+[KMGT]?$")
_FIT = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
_PLACEHOLDER = re.compile(r"\{\{\s*(\w+)\s*\}\}")
_RUNNING: list[subprocess.Popen] = []  # the srun step of the trial this worker runs now (for USR1)


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


def _positive(value: Any, key: str, minimum: int = 1) -> int:
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
        _positive(self.nodes, "--nodes")
        _positive(self.tasks_per_node, "--tasks-per-node")
        _positive(self.gpus_per_task, "--gpus-per-task", 0)
        _positive(self.signal_s, "--signal-seconds")
        if self.cpus_per_task is not None:
            _positive(self.cpus_per_task, "--cpus-per-task")
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
    import attnlab

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
def submit_study(args: argparse.Namespace) -> int:
    """`attnlab ablate submit`: snapshot code and configs, render the worker array script, sbatch it."""
    from .runner import connect, default_study_dir, prepare_study, status_counts, storage_url
    from .spec import load_spec

    spec = load_spec(args.spec)
    check_study_name(spec.name)
    if args.fit != DEFAULT_INNER and not _FIT.match(args.fit):
        raise ConfigError(f"--fit {args.fit!r}: expected module:function")
    study_dir = check_path(Path(args.dir).resolve() if args.dir else default_study_dir(spec).resolve(), "--dir")
    recorded = study_dir / "study.yaml"
    storage = args.storage or (load_yaml(recorded)["storage"] if recorded.exists() else str(study_dir / "journal.log"))
    storage = storage_url(study_dir, storage)
    varied = {k for v in spec.variants() for k in v.overrides} if not spec.is_search else \
        {d.key for d in spec.distributions}
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
    workers = _positive(args.workers if args.workers is not None else max(1, todo), "--workers")
    array = f"0-{workers - 1}"
    if args.array_parallelism is not None:
        array += f"%{_positive(args.array_parallelism, '--array-parallelism')}"

    root = study_dir / "slurm"
    snapshot = new_submission(root) if not args.dry_run else root / "submit-NNN"
    spec_copy = snapshot / "ablation.yaml"
    raw = load_yaml(spec.path)
    raw.update(name=spec.name, base="experiment.yaml")
    raw["resources"] = {**(raw.get("resources") or {}), "devices": res.tasks_per_node, "nodes": res.nodes}
    raw["overrides"] = {**(raw.get("overrides") or {}), "trainer.num_nodes": res.nodes}
    worker = [sys.executable, "-c", "import sys; from attnlab.ablate import main; sys.exit(main())", "ablate",
              "worker", str(spec_copy), "--dir", str(study_dir), "--storage", storage, "--fit", args.fit,
              "--heartbeat", str(args.heartbeat), "--grace", str(args.grace), "--poll", str(args.poll),
              "--srun", "--no-linger"]
    template, source = read_template("ablate_worker.sbatch", args.template)
    directives = res.directives(snapshot / "logs", "worker-%A_%a.log", array)
    script = render(template, script_values(snapshot, directives, worker), source)
    if args.dry_run:
        print(script)
        print(f"# dry run: nothing written or submitted ({todo} point(s) to run, {workers} worker(s))",
              file=sys.stderr)
        return 0
    from ..experiment import load_raw

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


def submit_fit(exp: Any, args: argparse.Namespace) -> int:
    """`attnlab fit ... --slurm`: one run as one job of nodes x tasks-per-node tasks, requeued on USR1."""
    trainer = exp.trainer
    if trainer.devices == -1 and args.tasks_per_node is None:
        raise ConfigError("trainer.devices=-1 (all visible) cannot size a SLURM job: give --tasks-per-node")
    res = resources_from(args, exp.name, {}, trainer.devices, trainer.num_nodes)
    exp = exp.replace(trainer=trainer.replace(devices=res.tasks_per_node, num_nodes=res.nodes,
                                              runs_dir=str(Path(trainer.runs_dir).resolve()), progress_bar=False))
    # named up front, as the ablation runner names trials (fit would name it after the tokenizer set the
    # vocabulary): the submission lives in it and a requeued job must find its checkpoints there
    exp = exp.replace(trainer=exp.trainer.replace(run_name=exp.trainer.run_name or f"{exp.name}-{exp.config_hash()}"))
    run_dir = check_path(exp.run_dir().resolve(), "trainer.runs_dir")
    root = run_dir / "slurm"
    snapshot = new_submission(root) if not args.dry_run else root / "submit-NNN"
    config = snapshot / "config.yaml"
    command = [*srun_prefix(res.gpus_per_task > 0), sys.executable, "-m", "attnlab.ablate.slurm", "task",
               str(config), "--ckpt_path", args.ckpt_path or "none"]
    template, source = read_template("fit.sbatch", args.template)
    values = script_values(snapshot, res.directives(snapshot / "logs", "fit-%j.log"), command)
    values["prepare"] = shlex.join([sys.executable, "-m", "attnlab.ablate.slurm", "prepare", str(config)])
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


def add_slurm_args(p: argparse.ArgumentParser) -> None:
    """The job-shape options of `ablate submit` and `fit --slurm`."""
    g = p.add_argument_group("SLURM")
    g.add_argument("--partition", default=None, help="partition(s) (default: the ablation file's resources)")
    g.add_argument("--account", default=None)
    g.add_argument("--qos", default=None)
    g.add_argument("--time", default=None, help="time limit per job, e.g. 12:00:00 or 2-00:00:00")
    g.add_argument("--nodes", type=int, default=None, help="nodes per trial (default: trainer.num_nodes)")
    g.add_argument("--tasks-per-node", type=int, default=None,
                   help="tasks (= devices) per node of a trial (default: trainer.devices)")
    g.add_argument("--gpus-per-task", type=int, default=0, help="GPUs per task: 1 for one task per GPU")
    g.add_argument("--cpus-per-task", type=int, default=None)
    g.add_argument("--mem", default=None, help="memory per node, e.g. 64G")
    g.add_argument("--signal-seconds", type=int, default=300,
                   help="USR1 this long before the time limit: checkpoint and requeue")
    g.add_argument("--template", default=None, help="an sbatch template instead of the one in slurm/")
    g.add_argument("--dry-run", action="store_true", help="print the script; write and submit nothing")


# ---------------------------------------------------------------------------------------------- in the job
def job_identity() -> tuple[str, int] | None:
    """(job key, restart count) inside a SLURM job: `<array job>_<task>` for an array task, else the job id."""
    if "SLURM_JOB_ID" not in os.environ:
        return None
    array = os.environ.get("SLURM_ARRAY_JOB_ID")
    key = f"{array}_{os.environ.get('SLURM_ARRAY_TASK_ID', '0')}" if array else os.environ["SLURM_JOB_ID"]
    return key, int(os.environ.get("SLURM_RESTART_COUNT") or 0)


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest of last.ckpt and Lightning's hpc_ckpt_N.ckpt (saved on the requeue signal), or None."""
    found = [p for p in [run_dir / "checkpoints" / "last.ckpt", *run_dir.glob("hpc_ckpt_*.ckpt")] if p.is_file()]
    return max(found, key=lambda p: p.stat().st_mtime_ns) if found else None


def checkpoint_step(path: Path) -> int | str:
    import torch

    try:
        return int(torch.load(path, map_location="cpu", weights_only=True, mmap=True)["global_step"])
    except Exception as e:  # reported, not fatal: fit itself says what is wrong with the file
        return f"unknown ({type(e).__name__})"


def check_code() -> Path:
    """Where `attnlab` was imported from; with ATTNLAB_CODE set (by the scripts), it must be that snapshot."""
    import attnlab

    here = Path(attnlab.__file__).resolve().parent
    want = os.environ.get("ATTNLAB_CODE")
    if want and Path(want).resolve() not in here.parents:
        raise RuntimeError(f"attnlab was imported from {here}, not from the submission's copy {want}; "
                           "is PYTHONPATH overridden?")
    return here


def srun_prefix(gpus: bool | None = None) -> list[str]:
    """srun for one step over the whole allocation. With GPUs every task sees all of its node's GPUs
    (Lightning picks cuda:<local rank>), rather than only its own as cuda:0."""
    gpus = bool(os.environ.get("SLURM_GPUS_PER_TASK")) if gpus is None else gpus
    return ["srun", "--kill-on-bad-exit=1", *(["--gpu-bind=none"] if gpus else [])]


DEFAULT_INNER = "attnlab.train:fit"


def prepare_data(exp: Any) -> None:
    """Tokenizer and token caches built (or found) by this one process before the step starts: otherwise every
    task of the step builds the same caches at once. Keep data.data_dir on the shared file system."""
    from ..train import make_datamodule

    t0 = time.perf_counter()
    make_datamodule(exp).prepare_data()
    log.info("data ready in %.1f s", time.perf_counter() - t0)


class SrunFit:
    """A fit(exp, ckpt_path) for workers inside a SLURM job: the trial runs as an srun step of the job's
    allocation (one task per device), each task running `inner` (module:function, train.fit by default)."""

    def __init__(self, inner: str) -> None:
        self.inner = inner
        check_code()

    def __call__(self, exp: Any, ckpt_path: str | None = None) -> Path:
        run_dir = exp.run_dir()
        run_dir.mkdir(parents=True, exist_ok=True)
        config = run_dir / "trial.yaml"
        tmp = config.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(exp.to_yaml(), encoding="utf-8")
        tmp.replace(config)
        if self.inner == DEFAULT_INNER:  # a custom fit prepares its own data
            prepare_data(exp)
        cmd = [*srun_prefix(), sys.executable, "-m", "attnlab.ablate.slurm", "task", str(config), "--fit",
               self.inner, "--ckpt_path", ckpt_path or "none"]
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
        _RUNNING.append(proc)
        try:
            code = proc.wait()
        except BaseException:  # SIGTERM (requeue, cancel, time limit): stop the step, let the runner record it
            proc.terminate()
            try:
                proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                pass
            raise
        finally:
            _RUNNING.remove(proc)
        if code != 0:
            raise RuntimeError(f"the trial's srun step exited with {code}; see this job's log")
        return run_dir


def install_worker_signals() -> None:
    """SIGTERM ends a worker like Ctrl-C (its trial is recorded as interrupted, which is no failed attempt);
    USR1 (sent to the batch shell and passed on by it) goes to the running trial's srun step, whose tasks
    checkpoint and requeue; between trials the worker requeues its job itself."""

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    def on_usr1(signum: int, frame: Any) -> None:
        if _RUNNING:
            log.warning("USR1: passing it on to the trial's srun step (checkpoint and requeue)")
            for proc in list(_RUNNING):
                proc.send_signal(signal.SIGUSR1)
            return
        me = job_identity()
        if me is not None:
            log.warning("USR1 between trials: requeueing job %s", me[0])
            subprocess.call(["scontrol", "requeue", me[0]])

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGUSR1, on_usr1)


def task_main(argv: list[str] | None = None) -> int:
    """One srun task of a trial or a fit: load the resolved config, resume when there is a checkpoint, fit."""
    p = argparse.ArgumentParser(prog="python -m attnlab.ablate.slurm task")
    p.add_argument("config", help="a resolved experiment (trial.yaml / config.yaml)")
    p.add_argument("--fit", default=DEFAULT_INNER, help="module:function with train.fit's signature")
    p.add_argument("--ckpt_path", default="none",
                   help="none | last | PATH; in a requeued job (SLURM_RESTART_COUNT > 0) the newest checkpoint")
    args = p.parse_args(argv)
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logging.getLogger("attnlab").addHandler(handler)  # Lightning prints its own messages once, with its handler
    logging.getLogger("attnlab").setLevel(logging.INFO)
    logging.getLogger("attnlab").propagate = False
    from ..experiment import from_raw
    from .runner import resolve_fit

    code = check_code()
    exp = from_raw(load_yaml(Path(args.config)), args.config)
    run_dir = exp.run_dir()
    ckpt: str | None = None if args.ckpt_path == "none" else args.ckpt_path
    me = job_identity()
    if me is not None and me[1] > 0 and latest_checkpoint(run_dir) is not None:
        ckpt = str(latest_checkpoint(run_dir))  # a requeued fit continues where its checkpoint left it
    rank, world = os.environ.get("SLURM_PROCID", "0"), os.environ.get("SLURM_NTASKS", "1")
    if rank == "0":
        path = run_dir / "checkpoints" / "last.ckpt" if ckpt == "last" else Path(ckpt) if ckpt else None
        what = f"resuming from {path} (global step {checkpoint_step(path)})" if path else "from step 0"
        print(f"[attnlab task {rank}/{world}] {datetime.datetime.now():%F %T} code {code}; run {run_dir}; {what}",
              flush=True)
    resolve_fit(args.fit)(exp, ckpt_path=ckpt)
    return 0


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


def prepare_main(argv: list[str]) -> int:
    """`prepare CONFIG`: the data of a resolved experiment, built once in the batch step before srun."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    logging.getLogger("attnlab").setLevel(logging.INFO)
    from ..experiment import from_raw

    check_code()
    if len(argv) != 1:
        raise SystemExit("usage: python -m attnlab.ablate.slurm prepare CONFIG")
    prepare_data(from_raw(load_yaml(Path(argv[0])), argv[0]))
    return 0


if __name__ == "__main__":
    commands = {"task": task_main, "prepare": prepare_main}
    if sys.argv[1:2] == [] or sys.argv[1] not in commands:
        sys.exit("usage: python -m attnlab.ablate.slurm task CONFIG [--fit module:function] [--ckpt_path P]\n"
                 "       python -m attnlab.ablate.slurm prepare CONFIG")
    sys.exit(commands[sys.argv[1]](sys.argv[2:]))
