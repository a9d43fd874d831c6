"""attnlab on a real SLURM cluster: `ablate submit`, `fit --slurm`, requeue on USR1, `ablate status`.

The first tests need no cluster: what reaches a generated script is validated or quoted, and --dry-run writes
and submits nothing. The others run against a single-node cluster this file starts: the session fixture
installs slurm-wlm and munge when they are missing and it can (root and apt-get; otherwise those tests skip
and say why), writes a configuration into a temporary folder (its own ports and munge socket, so it never
meets another cluster on the machine), starts munged, slurmctld and slurmd, and stops them by PID afterwards.
"""

from __future__ import annotations

import csv
import filecmp
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from optuna.trial import TrialState

from attnlab import cli
from attnlab.ablate.spec import load_spec
from attnlab.ablate.study import connect
from attnlab.analysis.report import write_table
from attnlab.cli import main
from attnlab.launch.slurm import Resources, check_path, check_study_name, render, time_seconds
from attnlab.rundir import run_metrics

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))
from conftest import apt_install_or_skip, free_port  # noqa: E402
from test_ablate_runner import GRID_4x2, fake_metric, write_lm_recipe, write_study  # noqa: E402

SRC = TESTS.parent / "src" / "attnlab"
FAKE = "test_ablate_runner:fake_fit"
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "squeue", "scontrol", "scancel", "sinfo")
EVIL = "x; touch PWNED $(touch PWNED2) `touch PWNED3`"  # a study name that runs commands if left unquoted


# ---------------------------------------------------------------------------------------------- no cluster
def test_values_that_reach_a_script_are_validated():
    for kwargs, key in [({"partition": "debug; touch /tmp/pwned"}, "--partition"), ({"account": "a b"}, "--account"),
                        ({"qos": "$(id)"}, "--qos"), ({"time": "1:00; id"}, "--time"), ({"mem": "8G\nid"}, "--mem"),
                        ({"nodes": 0}, "--nodes"), ({"time": "5", "signal_s": 300}, "--signal-seconds")]:
        with pytest.raises(ValueError, match=re.escape(key)):
            Resources("ok", **kwargs)
    Resources("ok", partition="gpu,gpu-long", account="proj_1", qos="high", time="2-00:00:00", mem="64G")
    assert [time_seconds(t) for t in ("90", "1:30", "01:00:00", "1-0", "1-01:00")] == [5400, 90, 3600, 86400, 90000]
    with pytest.raises(ValueError, match="name 'x; touch /tmp/pwned'.*one directory name"):
        check_study_name("x; touch /tmp/pwned")  # a '/' would make it a path, not a name
    assert check_study_name(EVIL) == EVIL  # allowed: it only ever appears quoted
    with pytest.raises(ValueError, match="may not contain"):
        check_path(Path('/tmp/a"b'), "--dir")
    with pytest.raises(ValueError, match=r"unknown placeholder\(s\) \['nope'\]"):
        render("#!/bin/bash\n{{ nope }}\n", {"command": "true"}, "t.sbatch")
    lines = Resources(EVIL, gpus_per_task=1, partition="gpu").directives(Path("/a b/c; d"), "w-%A_%a.log", "0-3%2")
    assert re.search(r"^#SBATCH --job-name=attnlab-x__touch_PWNED_[A-Za-z0-9_.+-]+$", lines, re.M), lines
    assert '#SBATCH --output="/a b/c; d/w-%A_%a.log"' in lines and "#SBATCH --array=0-3%2" in lines
    assert "#SBATCH --signal=USR1@300" in lines and "#SBATCH --requeue" in lines


def test_dry_run_prints_a_valid_script_and_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    spec_path = write_study(tmp_path, f"name: '{EVIL}'\n" + GRID_4x2)
    study_dir = tmp_path / "a b; touch PWNED4" / "study"
    args = ["ablate", "submit", str(spec_path), "--launcher", "slurm", "--dir", str(study_dir), "--workers", "3",
            "--array-parallelism", "2", "--time", "1:00:00", "--gpus-per-task", "1", "--dry-run"]
    assert main(args) == 0
    script = capsys.readouterr().out
    assert "#SBATCH --array=0-2%2" in script and "#SBATCH --gpus-per-task=1" in script
    assert "--srun --no-linger" in script and shlex_quoted(study_dir) in script
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    assert not (tmp_path / "a b; touch PWNED4").exists(), "a dry run writes nothing"
    assert main(args[:-1] + ["--partition", "debug; touch PWNED", "--dry-run"]) == 2
    assert "--partition 'debug; touch PWNED'" in capsys.readouterr().err

    recipe = write_lm_recipe(tmp_path, max_steps=5)
    assert cli.main(["fit", "-c", str(recipe), "--slurm", "--dry-run", "--trainer.devices", "2", "--nodes", "2",
                     "--mem", "8G"]) == 0
    script = capsys.readouterr().out
    assert "#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=2\n#SBATCH --mem=8G" in script
    assert "-m attnlab.launch.job task" in script and not (tmp_path / "runs").exists()


# `scontrol -o show job` lines as Slurm 22.05 prints them (shortened): a job requeued after its node failed
# (pending, no node list, the scheduler's plan beside it), a running array task, a finished job whose command has
# arguments, and a pending array whose tasks are not split yet
PENDING = ("JobId=7 JobName=attnlab-fit UserId=root(0) JobState=PENDING Reason=BeginTime Requeue=1 Restarts=1 "
           "BatchFlag=1 ExitCode=0:0 Partition=debug AllocNode:Sid=host:9 ReqNodeList=(null) ExcNodeList=(null) "
           "NodeList= SchedNodeList=node[1-2] NumNodes=2-2 NumCPUs=2 ReqTRES=cpu=2,mem=8000M,node=2,billing=2 "
           "Socks/Node=* NtasksPerN:B:S:C=1:0:*:* Command=/tmp/r/job.sbatch WorkDir=/tmp/r Power=")
ARRAY_TASK = ("JobId=12 ArrayJobId=11 ArrayTaskId=1 JobName=attnlab-w JobState=RUNNING Reason=None "
              "ReqNodeList=(null) NodeList=node2 BatchHost=node2 NumNodes=1 Command=/tmp/s/w.sbatch Power=")
DONE = ("JobId=3 JobName=attnlab-fit JobState=COMPLETED Reason=None NodeList=node[1-2] "
        "Command=/tmp/a b/job.sbatch --flag value WorkDir=/tmp/a b Power=")
ARRAY_PENDING = "JobId=20 ArrayJobId=20 ArrayTaskId=0-1%2 JobState=PENDING Reason=None NodeList=(null) Power="


def test_scontrol_records_of_pending_running_finished_and_array_jobs():
    records = job_records("\n".join([PENDING, ARRAY_TASK, DONE, ARRAY_PENDING, ""]))
    assert [record_id(r) for r in records] == ["7", "11_1", "3", "20_0-1%2"]
    assert [r["JobState"] for r in records] == ["PENDING", "RUNNING", "COMPLETED", "PENDING"]
    pending, _, done, _ = records
    assert pending["NodeList"] == "" and pending["SchedNodeList"] == "node[1-2]" and pending["Power"] == ""
    assert pending["ReqTRES"] == "cpu=2,mem=8000M,node=2,billing=2" and pending["NtasksPerN:B:S:C"] == "1:0:*:*"
    assert done["Command"] == "/tmp/a b/job.sbatch --flag value" and done["WorkDir"] == "/tmp/a b"
    assert [nodelist(records, j) for j in ("7", "11_1", "3", "20_0-1%2")] == ["", "node2", "node[1-2]", ""]
    assert nodelist(job_records(PENDING), "7") == "", "a requeued job waiting for a node has none"
    assert job_records("") == [] and nodelist([], "7") == "", "a job the controller forgot"


def test_without_slurm_and_without_root_the_cluster_tests_skip_saying_why(monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "binary", lambda name: None)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(pytest.skip.Exception, match=r"SLURM is not installed \(munged, .*not root, so it cannot"):
        ensure_slurm()


def shlex_quoted(path: Path) -> str:
    import shlex

    return shlex.quote(str(path))


# ---------------------------------------------------------------------------------------------- the cluster
@dataclass
class Cluster:
    dir: Path
    conf: Path

    def run(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
        r = subprocess.run(list(cmd), capture_output=True, text=True, timeout=60)
        if check and r.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)}: exit {r.returncode}: {r.stderr or r.stdout}")
        return r

    def records(self, job: str) -> list[dict[str, str]]:
        """`scontrol -o show job <job>`, parsed (job_records); [] once the controller forgot the job."""
        return job_records(self.run("scontrol", "-o", "show", "job", job, check=False).stdout)

    def states(self, job: str) -> dict[str, str]:
        """{job id (array tasks as <array>_<i>): state} from scontrol; {} once the controller forgot it."""
        return {record_id(r): r["JobState"] for r in self.records(job)}

    def nodelist(self, job: str) -> str:
        """The nodes `job` runs or ran on ("" while it is pending, as after a requeue)."""
        return nodelist(self.records(job), job)

    def wait(self, job: str, timeout: float, logs: Path, done=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")) -> dict:
        deadline = time.time() + timeout
        while time.time() < deadline:
            states = self.states(job)
            if states and all(s in done for s in states.values()):
                return states
            time.sleep(1)
        raise AssertionError(f"job {job} not done after {timeout} s: {self.states(job)}\n{read_logs(logs)}")


FIELD = re.compile(r"[A-Za-z][\w:/]*=")  # NodeList=, Socks/Node=, NtasksPerN:B:S:C=


def job_records(text: str) -> list[dict[str, str]]:
    """The output of `scontrol -o show job` (a line per job or array task) as {field: value}, the one parser of it
    the tests use. A value may be empty (a pending job prints `NodeList= SchedNodeList=node1`), may hold '='
    (`TRES=cpu=2,node=1`) or spaces (`Command=` with its arguments): a word that does not start with a field name
    continues the value before it."""
    out = []
    for line in text.splitlines():
        fields: dict[str, str] = {}
        key = None
        for word in line.split(" "):
            if FIELD.match(word):
                key, value = word.split("=", 1)
                fields[key] = value
            elif key is not None:
                fields[key] += " " + word
        if "JobId" in fields:
            out.append(fields)
    return out


def record_id(fields: dict[str, str]) -> str:
    """A record's job id as the tests name it: <job>, or <array>_<task> for an array task."""
    return f"{fields['ArrayJobId']}_{fields['ArrayTaskId']}" if "ArrayTaskId" in fields else fields["JobId"]


def nodelist(records: list[dict[str, str]], job: str) -> str:
    """The NodeList of `job`'s record (of the first record when none has that id): "" for a job not running."""
    r = next((r for r in records if record_id(r) == job), records[0] if records else {})
    value = r.get("NodeList", "")
    return "" if value == "(null)" else value


def binary(name: str) -> str | None:
    return shutil.which(name) or next((str(p) for p in (Path("/usr/sbin") / name, Path("/usr/bin") / name)
                                       if p.is_file()), None)


def ensure_slurm() -> None:
    """Install slurm-wlm and munge when missing and possible; otherwise skip, saying why."""
    missing = [b for b in DAEMONS + CLIENTS if binary(b) is None]
    if not missing:
        return
    apt_install_or_skip(f"SLURM is not installed ({', '.join(missing)} missing)", ["slurm-wlm", "munge"], "SLURM")


CONF = """\
ClusterName=attnlabtest
SlurmctldHost=localhost
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={dir}/munge/socket
CredType=cred/munge
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/log/slurmctld.log
SlurmdLogFile={dir}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
MpiDefault=none
KillWait=5
NodeName=localhost NodeHostname={host} NodeAddr=127.0.0.1 CPUs=2 RealMemory=4000 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def stop(procs: list[subprocess.Popen]) -> None:
    for p in reversed(procs):  # slurmd, slurmctld, munged: each by its own PID
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    ensure_slurm()
    d = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool", "log", "munge", "key"):
        (d / sub).mkdir()
    (d / "key").chmod(0o700)
    key = d / "key" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    host = subprocess.run(["hostname", "-s"], capture_output=True, text=True).stdout.strip() or socket.gethostname()
    conf = d / "slurm.conf"
    conf.write_text(CONF.format(dir=d, host=host, ctld_port=free_port(), d_port=free_port()), encoding="utf-8")
    old_conf = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(conf)  # every client (and job) of this session talks to this cluster
    procs: list[subprocess.Popen] = []
    cluster = Cluster(d, conf)
    try:
        log = open(d / "log" / "daemons.out", "w")
        procs.append(subprocess.Popen(
            [binary("munged"), "-F", "--force", f"--socket={d}/munge/socket", f"--key-file={key}",
             f"--pid-file={d}/munge/munged.pid", f"--seed-file={d}/munge/seed", f"--log-file={d}/log/munged.log"],
            stdout=log, stderr=subprocess.STDOUT))
        wait_for(lambda: (d / "munge" / "socket").exists(), 15, "munged did not create its socket", d)
        procs.append(subprocess.Popen([binary("slurmctld"), "-D", "-f", str(conf)], stdout=log,
                                      stderr=subprocess.STDOUT))
        procs.append(subprocess.Popen([binary("slurmd"), "-D", "-N", "localhost", "-f", str(conf)], stdout=log,
                                      stderr=subprocess.STDOUT))
        wait_for(lambda: cluster.run("sinfo", "-h", "-o", "%T", check=False).stdout.strip() == "idle", 45,
                 "the node never became idle", d)
        yield cluster
    finally:
        jobs = cluster.run("squeue", "-h", "-o", "%A", check=False).stdout.split() if procs else []
        if jobs:
            cluster.run("scancel", *sorted(set(jobs)), check=False)
            wait_for(lambda: not cluster.run("squeue", "-h", check=False).stdout.strip(), 30, None, d)
        stop(procs)
        if old_conf is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old_conf


def wait_for(cond, timeout: float, message: str | None, d: Path) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return True
        time.sleep(0.3)
    if message is None:
        return False
    logs = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}" for p in (d / "log").glob("*"))
    raise AssertionError(f"{message} within {timeout} s\n{logs}")


def read_logs(folder: Path) -> str:
    return "\n".join(f"--- {p}\n{p.read_text(errors='replace')[-6000:]}" for p in sorted(folder.rglob("*.log")))


def job_of(jobs_file: Path) -> str:
    return json.loads(jobs_file.read_text().splitlines()[-1])["job"]


# ---------------------------------------------------------------------------------------------- cluster tests
@pytest.mark.slow
def test_a_grid_runs_as_an_array_of_two_workers_and_its_table_is_right(slurm_cluster, tmp_path, monkeypatch, capsys):
    """4 points, 2 array tasks (one worker each), the fake fit of test_ablate_runner in srun steps. The study's
    name and directory hold shell syntax (and spaces): they must reach the script only quoted."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in [str(TESTS), os.environ.get("PYTHONPATH")] if p))
    monkeypatch.setenv("FAKE_SLEEP", "1")
    spec_path = write_study(tmp_path, f"name: '{EVIL}'\n" + GRID_4x2.replace("[1, 2]", "[1]"))
    study_dir = tmp_path / "my runs; touch PWNED4 $(touch PWNED5) 'q'" / "study"
    submitted = time.time()
    assert main(["ablate", "submit", str(spec_path), "--launcher", "slurm", "--dir", str(study_dir), "--workers", "2",
                 "--fit", FAKE, "--heartbeat", "1", "--grace", "30", "--poll", "0.5"]) == 0
    job = job_of(study_dir / "slurm" / "jobs.jsonl")
    snapshot = study_dir / "slurm" / "submit-001"
    capsys.readouterr()
    assert main(["ablate", "status", str(study_dir)]) == 0  # while the jobs are queued or running
    out = capsys.readouterr().out
    assert "4 points:" in out and len(re.findall(rf"^  {job}_[01] +(PENDING|RUNNING) ", out, re.M)) == 2, out
    states = slurm_cluster.wait(job, 180, snapshot / "logs")
    assert states == {f"{job}_0": "COMPLETED", f"{job}_1": "COMPLETED"}, read_logs(snapshot / "logs")
    assert not [p for p in tmp_path.rglob("PWNED*") if re.fullmatch(r"PWNED\d?", p.name)], "a command ran"

    spec = load_spec(spec_path)
    h = connect(spec, study_dir, str(study_dir / "journal.log"))
    trials = h.study.get_trials()
    assert sorted(t.user_attrs["point_id"] for t in trials) == sorted(p.point_id for p in spec.points())
    assert all(t.state == TrialState.COMPLETE for t in trials), "one finished trial per point, nothing else"
    assert {t.user_attrs["slurm_job"] for t in trials} == {f"{job}_0", f"{job}_1"}, "both workers ran points"
    for t in trials:  # the stored metric is what the fake fit computes for that point's config
        v = next(p.variant for p in spec.points() if p.point_id == t.user_attrs["point_id"])
        assert t.value == fake_metric(spec.experiment(v.overrides, t.user_attrs["seed"]))
    _, paths = write_table(h)
    rows = {r["variant"]: r for r in csv.DictReader(open(paths[1], encoding="utf-8"))}
    assert set(rows) == {v.name for v in spec.variants()}
    for t in trials:
        r = rows[t.user_attrs["variant"]]
        assert float(r["val/loss mean"]) == pytest.approx(t.value) and r["n"] == "1"
    means = [float(r["val/loss mean"]) for r in rows.values()]
    assert means == sorted(means), "best first"

    # the jobs ran the copy made at submission, which is the package as it was
    logs = read_logs(snapshot / "logs")
    assert logs.count(f"code {snapshot / 'code' / 'attnlab'};") == 4, logs
    for path in SRC.rglob("*.py"):  # files others edit while this runs may differ: they changed after the copy
        copy = snapshot / "code" / "attnlab" / path.relative_to(SRC)
        assert copy.is_file() and (path.stat().st_mtime > submitted - 1 or filecmp.cmp(path, copy, shallow=False))
    assert (snapshot / "worker.sbatch").is_file()

    capsys.readouterr()
    assert main(["ablate", "status", str(study_dir)]) == 0
    out = capsys.readouterr().out
    assert "4 points: 4 done" in out and f"SLURM jobs {job}:" in out
    assert "sacct: accounting storage is disabled; only squeue states shown" in out
    assert main(["ablate", "submit", str(spec_path), "--dir", str(study_dir), "--fit", FAKE]) == 0
    assert "nothing to run" in capsys.readouterr().out
    assert len((study_dir / "slurm" / "jobs.jsonl").read_text().splitlines()) == 1, "nothing was submitted again"


@pytest.mark.slow
def test_a_fit_with_two_slurm_tasks_runs_ddp_on_gloo_through_srun(slurm_cluster, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    recipe = write_lm_recipe(tmp_path, max_steps=6, ckpt_every=3)
    assert cli.main(["fit", "-c", str(recipe), "--slurm", "--trainer.devices", "2"]) == 0
    run_dir = next((tmp_path / "runs").iterdir())
    job = job_of(run_dir / "slurm" / "jobs.jsonl")
    logs = run_dir / "slurm" / "submit-001" / "logs"
    assert slurm_cluster.wait(job, 150, logs) == {job: "COMPLETED"}, read_logs(logs)
    log = read_logs(logs)
    assert "distributed_backend=gloo" in log and "Starting with 2 processes" in log, log
    assert "GLOBAL_RANK: 1, MEMBER: 2/2" in log and "[attnlab task 0/2]" in log
    # the data was prepared once, in the batch step, before the two tasks started
    assert log.count("trained BPE tokenizer") == 1 and log.index("data ready") < log.index("[attnlab task 0/2]")
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert ckpt["global_step"] == 6
    assert "devices: 2" in (run_dir / "config.yaml").read_text()


def submit_and_preempt(slurm_cluster, spec_path: Path, study_dir: Path, reach_s: float, spec_text: str):
    """Write and submit a one-worker study, wait until its first trial has checkpointed step 20, send USR1 to the
    job's batch shell (what SLURM sends before a preemption) and wait until SLURM has requeued the job.
    Returns the array task's job id, its log folder, the spec and the first trial's run directory."""
    spec_path.write_text(spec_text, encoding="utf-8")
    assert main(["ablate", "submit", str(spec_path), "--dir", str(study_dir), "--workers", "1", "--heartbeat", "2",
                 "--grace", "60", "--poll", "1"]) == 0
    job = f"{job_of(study_dir / 'slurm' / 'jobs.jsonl')}_0"
    logs = study_dir / "slurm" / "submit-001" / "logs"
    spec = load_spec(spec_path)
    first = spec.experiment(spec.points()[0].variant.overrides, 1)
    run_dir = study_dir / "runs" / f"{first.name}-{first.config_hash()}"
    def past_step_20() -> bool:  # step=20.ckpt itself may be rotated out (keep_checkpoints) before a poll sees it
        steps = [int(p.stem.removeprefix("step=")) for p in (run_dir / "checkpoints").glob("step=*.ckpt")]
        return max(steps, default=0) >= 20

    wait_for(past_step_20, reach_s, f"the first trial never reached step 20\n{read_logs(logs)}", slurm_cluster.dir)
    slurm_cluster.run("scancel", "--signal=USR1", "--batch", job)
    wait_for(lambda: slurm_cluster.states(job).get(job) == "PENDING", 60, f"{job} was not requeued\n"
             f"{read_logs(logs)}", slurm_cluster.dir)
    return job, logs, spec, run_dir


@pytest.mark.slow
def test_usr1_mid_trial_requeues_the_job_and_the_trial_resumes_from_its_checkpoint(slurm_cluster, tmp_path,
                                                                                   monkeypatch, capsys):
    """The preemption path: USR1 to the batch shell -> worker -> srun -> Lightning (hpc checkpoint, scontrol
    requeue); SLURM kills and requeues the job; it runs again and resumes the trial, then the next point."""
    monkeypatch.chdir(tmp_path)
    steps = 1000  # on an idle 2-core machine 200 steps took 3 s: done before the USR1 could land mid-trial
    recipe = write_lm_recipe(tmp_path, max_steps=steps, ckpt_every=10, val_every=500)
    study_dir = tmp_path / "study"
    job, logs, spec, run_dir = submit_and_preempt(
        slurm_cluster, tmp_path / "requeue.yaml", study_dir, 120,
        f"base: {recipe}\nmetric: {{name: val/loss, direction: min}}\nseeds: [1]\n"
        "axes:\n  model.norm: [layernorm, rmsnorm]\n")
    # a requeued job may start again only after 2 minutes (SLURM's requeue hold); a real cluster waits it out
    slurm_cluster.run("scontrol", "update", f"JobId={job}", "StartTime=now")
    assert slurm_cluster.wait(job, 180, logs) == {job: "COMPLETED"}, read_logs(logs)

    log = read_logs(logs)
    assert "restart 1" in log and (run_dir / "hpc_ckpt_1.ckpt").is_file(), log
    resumed = [int(n) for n in re.findall(r"resuming from \S+ \(global step (\d+)\)", log)]
    assert len(resumed) == 1 and 20 <= resumed[0] < steps, log
    h = connect(spec, study_dir, str(study_dir / "journal.log"))
    by_point: dict[str, list] = {}
    for t in h.study.get_trials():
        by_point.setdefault(t.user_attrs["point_id"], []).append(t)
    assert set(by_point) == {p.point_id for p in spec.points()}
    for ts in by_point.values():
        assert [t.state for t in ts].count(TrialState.COMPLETE) == 1, "exactly one finished result per point"
    interrupted, done = by_point[spec.points()[0].point_id]
    assert interrupted.state == TrialState.FAIL and interrupted.user_attrs["status"] == "interrupted"
    assert done.user_attrs["resumed"] is True and done.user_attrs["slurm_restart"] == 1
    assert len(by_point[spec.points()[1].point_id]) == 1
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert ckpt["global_step"] == steps
    # the second attempt logged from the resumed step on, not from step 0
    rows = list(csv.DictReader(open(run_dir / "logs" / "metrics.csv", encoding="utf-8")))
    assert min(int(float(r["step"])) for r in rows if r["step"]) >= resumed[0]


def test_usr1_requeues_a_two_task_ddp_trial_and_both_ranks_resume_to_the_uninterrupted_losses(slurm_cluster,
                                                                                              tmp_path, monkeypatch):
    """A trial of 2 DDP tasks (gloo) in one srun step gets USR1 mid-trial: both ranks stop at one step boundary and
    save there, the job is requeued, and when it runs again both ranks resume from the same checkpoint; every
    per-step loss of the trial then equals that of the same trial run without interruption (2 local DDP ranks)."""
    monkeypatch.chdir(tmp_path)
    steps = 240  # long enough that the USR1 lands mid-trial on an idle machine too
    recipe = write_lm_recipe(tmp_path, max_steps=steps, ckpt_every=10, val_every=120, log_every=1)
    study_dir = tmp_path / "study"
    job, logs, spec, run_dir = submit_and_preempt(
        slurm_cluster, tmp_path / "ddp.yaml", study_dir, 150,
        f"base: {recipe}\nmetric: {{name: val/loss, direction: min}}\nseeds: [1]\n"
        "overrides: {trainer.devices: 2}\nvariants:\n  - {name: ddp}\n")
    # while SLURM holds the requeued job: the same trial, uninterrupted, as 2 local DDP processes
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ref = subprocess.run([sys.executable, "-m", "attnlab.cli", "fit", "-c", str(run_dir / "trial.yaml"),
                          "--trainer.run_name", "reference", "--trainer.strategy", "ddp"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert ref.returncode == 0, ref.stdout[-2000:] + ref.stderr[-4000:]
    slurm_cluster.run("scontrol", "update", f"JobId={job}", "StartTime=now")
    assert slurm_cluster.wait(job, 240, logs) == {job: "COMPLETED"}, read_logs(logs)

    log = "\n".join(p.read_text(errors="replace") for p in sorted(logs.rglob("*.log")))  # whole, both runs
    assert (run_dir / "hpc_ckpt_1.ckpt").is_file(), log
    starts = re.findall(r"\[attnlab task (\d)/2\] .*?; (from step 0|resuming from (\S+) \(global step (\d+)\))", log)
    assert sorted(r for r, what, _, _ in starts if what == "from step 0") == ["0", "1"], log
    resumed = {r: (path, int(step)) for r, what, path, step in starts if what != "from step 0"}
    assert set(resumed) == {"0", "1"} and resumed["0"] == resumed["1"], f"the ranks resumed differently: {resumed}"
    path, step = resumed["0"]
    assert 20 <= step < steps and Path(path).parent in (run_dir, run_dir / "checkpoints"), resumed
    assert "Starting with 2 processes" in log and "distributed_backend=gloo" in log

    h = connect(spec, study_dir, str(study_dir / "journal.log"))
    interrupted, done = sorted(h.study.get_trials(), key=lambda t: t.number)
    assert interrupted.user_attrs["status"] == "interrupted" and done.state == TrialState.COMPLETE
    assert done.user_attrs["resumed"] is True and done.user_attrs["slurm_restart"] == 1
    trial, full = run_metrics(run_dir), run_metrics(study_dir / "runs" / "reference")
    assert [s for s, _ in trial["train/loss"]] == list(range(steps))
    for col in ("train/loss", "train/grad_norm", "val/loss"):
        assert trial[col] == full[col], col
