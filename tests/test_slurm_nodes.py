"""attnlab on a SLURM cluster of two nodes: a fit as DDP (gloo) across both, its preemption and requeue, studies
whose trials need both nodes or spread over them, sharing the suite's PostgreSQL server.

The cluster (netns_cluster.py) is started once for this module: slurmctld and two slurmd, each in a network
namespace of its own with its own address and hostname, on a bridge whose addresses exist only on this machine.
Where namespaces cannot be made (not Linux, not root, no iproute2), the tests skip and say why.
"""

from __future__ import annotations

import itertools
import os
import re
import signal
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
from attnlab.cli import main
from attnlab.rundir import run_metrics

TESTS = Path(__file__).resolve().parent
# slurmctld's SlurmdTimeout for this module's cluster: a node stopped for less (the retry test's node1, up to its 100 s
# deadline) is not marked DOWN. At 30 s, a stop made 50 s long took the woken case 206 s instead of 94 (slurmctld
# requeued node1's task and ran it again), past the final wait on a loaded machine (netns_cluster.CONF's note)
SLURMD_TIMEOUT = 120
sys.path.insert(0, str(TESTS))
from netns_cluster import CONF, IFNAME, NODES, Network, Relay, can_make_namespaces, in_namespace  # noqa: E402
from test_ablate_runner import fake_fit, fake_metric, read_calls, write_lm_recipe, write_study  # noqa: E402
from test_slurm import Cluster, binary, ensure_slurm, job_of, read_logs, stop, wait_for  # noqa: E402

FAKE = "test_ablate_runner:fake_fit"
STEPS = 100  # enough steps for USR1 to land mid-run after step 20


@dataclass
class TwoNodes(Cluster):
    net: Network = None  # type: ignore[assignment]
    hosts: Path = None  # type: ignore[assignment]
    log: object = None
    daemons: list = None  # type: ignore[assignment]

    def node_states(self) -> dict[str, str]:
        out = self.run("sinfo", "-h", "-N", "-o", "%N %T", check=False).stdout.split("\n")
        return dict(line.split() for line in out if line.strip())

    def start_slurmd(self, node: str) -> subprocess.Popen:
        proc = subprocess.Popen(in_namespace(self.net, node, self.hosts, [binary("slurmd"), "-D", "-N", node, "-f",
                                                                          str(self.conf)]),
                                stdout=self.log, stderr=subprocess.STDOUT)
        self.daemons.append(proc)
        return proc


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory, request):
    why = can_make_namespaces()
    if why:
        pytest.skip(f"the two-node SLURM tests need network namespaces: {why}")
    ensure_slurm()
    net = Network()
    try:
        net.create()
    except OSError as e:
        net.remove()
        pytest.skip(f"the two-node SLURM tests need network namespaces, and making them failed: {e}")
    d = tmp_path_factory.mktemp("slurm2")
    for sub in ("state", "log", "munge", "key", *(f"spool_{n}" for n in NODES)):
        (d / sub).mkdir()
    (d / "key").chmod(0o700)
    key = d / "key" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    conf = d / "slurm.conf"
    timeout = getattr(request.module, "SLURMD_TIMEOUT", 30)  # netns_cluster.CONF's note
    conf.write_text(CONF.format(dir=d, prefix=net.prefix, slurmd_timeout=timeout), encoding="utf-8")
    old_conf = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(conf)  # every client (and job) of this module talks to this cluster
    log = open(d / "log" / "daemons.out", "w")
    procs: list[subprocess.Popen] = []
    cluster = TwoNodes(d, conf, net, net.hosts_file(d / "hosts"), log, procs)
    try:
        procs.append(subprocess.Popen(
            [binary("munged"), "-F", "--force", f"--socket={d}/munge/socket", f"--key-file={key}",
             f"--pid-file={d}/munge/munged.pid", f"--seed-file={d}/munge/seed", f"--log-file={d}/log/munged.log"],
            stdout=log, stderr=subprocess.STDOUT))
        wait_for(lambda: (d / "munge" / "socket").exists(), 15, "munged did not create its socket", d)
        procs.append(subprocess.Popen(in_namespace(net, "ctl", cluster.hosts, [binary("slurmctld"), "-D", "-f",
                                                                              str(conf)]),
                                      stdout=log, stderr=subprocess.STDOUT))
        for n in NODES:
            cluster.start_slurmd(n)  # appended to procs
        wait_for(lambda: cluster.node_states() == {n: "idle" for n in NODES}, 60, "the nodes never became idle", d)
        yield cluster
    finally:
        jobs = cluster.run("squeue", "-h", "-o", "%A", check=False).stdout.split() if procs else []
        if jobs:
            cluster.run("scancel", *sorted(set(jobs)), check=False)
            wait_for(lambda: not cluster.run("squeue", "-h", check=False).stdout.strip(), 30, None, d)
        stop(procs)
        net.remove()
        log.close()
        if old_conf is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old_conf


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The recipe the 2-node fits run, and its metrics from 2 local DDP processes (gloo) on this host."""
    d = tmp_path_factory.mktemp("ddp2")
    recipe = write_lm_recipe(d, max_steps=STEPS, ckpt_every=10, val_every=75, log_every=1)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "attnlab.cli", "fit", "-c", str(recipe), "--trainer.run_name",
                        "reference", "--trainer.devices", "2", "--trainer.strategy", "ddp"], cwd=d, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return recipe, run_metrics(d / "runs" / "reference")


def submit_fit(tmp_path: Path, recipe: Path) -> tuple[str, Path, Path]:
    """`attnlab fit --slurm --nodes 2` (1 task each); returns the job id, the run directory and its log folder."""
    assert cli.main(["fit", "-c", str(recipe), "--slurm", "--nodes", "2", "--trainer.devices", "1",
                     "--trainer.runs_dir", str(tmp_path / "runs")]) == 0
    run_dir = next((tmp_path / "runs").iterdir())
    return job_of(run_dir / "slurm" / "jobs.jsonl"), run_dir, run_dir / "slurm" / "submit-001" / "logs"


def assert_same_curves(run_dir: Path, ref: dict) -> None:
    got = run_metrics(run_dir)
    assert [s for s, _ in got["train/loss"]] == list(range(STEPS))
    for col in ("train/loss", "train/grad_norm", "val/loss"):
        assert got[col] == ref[col], col


def assert_ran_on_both_nodes(log: str) -> None:
    """Both tasks started, one per node, in one DDP world of 2 over gloo."""
    assert "Starting with 2 processes" in log and "distributed_backend=gloo" in log, log
    assert "GLOBAL_RANK: 1, MEMBER: 2/2" in log and "[attnlab task 0/2]" in log and "[attnlab task 1/2]" in log


def test_master_port_is_15000_plus_the_job_ids_last_four_digits_unless_set(monkeypatch):
    """What the README and the job scripts say of Lightning's MASTER_PORT under SLURM."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    monkeypatch.delenv("MASTER_PORT", raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "123456")
    assert SLURMEnvironment().main_port == 18456
    monkeypatch.setenv("SLURM_JOB_ID", "3456")
    assert SLURMEnvironment().main_port == 18456, "ids that end alike share a port"
    monkeypatch.setenv("MASTER_PORT", "23456")
    assert SLURMEnvironment().main_port == 23456


@pytest.mark.slow
def test_a_fit_on_two_nodes_is_ddp_across_them_and_equals_two_local_processes(two_nodes, reference, tmp_path,
                                                                              monkeypatch):
    monkeypatch.chdir(tmp_path)
    # what the job scripts tell a user to set on a cluster with several networks (sbatch passes them on)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", IFNAME)
    monkeypatch.setenv("MASTER_PORT", str(20000 + os.getpid() % 10000))
    recipe, ref = reference
    job, run_dir, logs = submit_fit(tmp_path, recipe)
    assert two_nodes.wait(job, 240, logs) == {job: "COMPLETED"}, read_logs(logs)
    assert two_nodes.nodelist(job) == "node[1-2]"
    log = read_logs(logs)
    assert_ran_on_both_nodes(log)
    assert "num_nodes: 2" in (run_dir / "config.yaml").read_text()
    assert_same_curves(run_dir, ref)


@pytest.mark.slow
def test_usr1_requeues_the_two_node_fit_and_it_resumes_to_the_uninterrupted_losses(two_nodes, reference, tmp_path,
                                                                                   monkeypatch):
    """USR1 to the batch shell (what SLURM sends before a preemption) reaches both tasks on both nodes through
    srun; they save hpc_ckpt_1 at one step, the job is requeued, runs again on both nodes, and every rank resumes
    from that checkpoint: every logged loss equals the uninterrupted 2-process run's."""
    monkeypatch.chdir(tmp_path)
    recipe, ref = reference
    job, run_dir, logs = submit_fit(tmp_path, recipe)
    wait_for(lambda: (run_dir / "checkpoints" / "step=20.ckpt").exists(), 180,
             f"the fit never reached step 20\n{read_logs(logs)}", two_nodes.dir)
    two_nodes.run("scancel", "--signal=USR1", "--batch", job)
    wait_for(lambda: two_nodes.states(job).get(job) == "PENDING", 60, f"{job} was not requeued\n{read_logs(logs)}",
             two_nodes.dir)
    two_nodes.run("scontrol", "update", f"JobId={job}", "StartTime=now")  # SLURM's requeue hold is 2 minutes
    assert two_nodes.wait(job, 240, logs) == {job: "COMPLETED"}, read_logs(logs)
    assert two_nodes.nodelist(job) == "node[1-2]"

    log = "\n".join(p.read_text(errors="replace") for p in sorted(logs.rglob("*.log")))
    assert (run_dir / "hpc_ckpt_1.ckpt").is_file() and "restart 1" in log, log
    starts = re.findall(r"\[attnlab task (\d)/2\] .*?; (from step 0|resuming from (\S+) \(global step (\d+)\))", log)
    assert sorted(r for r, what, _, _ in starts if what == "from step 0") == ["0", "1"], log
    resumed = {r: (path, int(step)) for r, what, path, step in starts if what != "from step 0"}
    assert set(resumed) == {"0", "1"} and resumed["0"] == resumed["1"], f"the ranks resumed differently: {resumed}"
    assert 20 <= resumed["0"][1] < STEPS, resumed
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert ckpt["global_step"] == STEPS
    assert_same_curves(run_dir, ref)
    print(f"\n[figures] 2-node fit preempted (USR1) and requeued: 2 starts on node[1-2], both ranks resumed from "
          f"step {resumed['0'][1]}; {STEPS} train losses, grad norms and val losses equal the uninterrupted run's")


# ---------------------------------------------------------------------------------------------- studies
DATABASES = itertools.count()  # one count for every module whose cluster uses pg_url (one server per session)


@pytest.fixture(scope="module")
def pg_url(two_nodes, postgres):
    """New databases on the suite's PostgreSQL server (`postgres`: on the host, listening on 127.0.0.1 only), which
    the jobs reach over the bridge address through a relay: postgresql://attnlab@<bridge>:<relay port>/<db>."""
    relay = Relay(two_nodes.net.host_addr, ("127.0.0.1", postgres.port))
    relay.start()
    try:
        yield lambda: postgres.new_database(f"two_nodes_{os.getpid()}_{next(DATABASES)}").replace(
            f"127.0.0.1:{postgres.port}", f"{two_nodes.net.host_addr}:{relay.port}")
    finally:
        relay.stop()


def trials_by_point(h) -> dict[str, list]:
    out: dict[str, list] = {}
    for t in h.study.get_trials():
        out.setdefault(t.user_attrs["point_id"], []).append(t)
    return out


@pytest.mark.slow
def test_a_study_of_two_node_trials_runs_every_point_once_on_postgresql(two_nodes, pg_url, tmp_path, monkeypatch):
    """`ablate submit --nodes 2`: one worker, each trial an srun step of 2 tasks, one per node (DDP over gloo)."""
    monkeypatch.chdir(tmp_path)
    recipe = write_lm_recipe(tmp_path, max_steps=6, ckpt_every=3, log_every=1)
    spec_path = tmp_path / "two_node.yaml"
    spec_path.write_text(f"base: {recipe}\nfinal_eval: false\nmetric: {{name: val/loss, direction: min}}\n"
                         "seeds: [1]\naxes:\n  model.norm: [layernorm, rmsnorm]\n", encoding="utf-8")
    study_dir, url = tmp_path / "study", pg_url()
    assert main(["ablate", "submit", str(spec_path), "--dir", str(study_dir), "--storage", url, "--nodes", "2",
                 "--workers", "1", "--heartbeat", "2", "--grace", "60", "--poll", "1"]) == 0
    job = f"{job_of(study_dir / 'slurm' / 'jobs.jsonl')}_0"
    logs = study_dir / "slurm" / "submit-001" / "logs"
    assert two_nodes.wait(job, 300, logs) == {job: "COMPLETED"}, read_logs(logs)
    assert two_nodes.nodelist(job) == "node[1-2]"
    log = read_logs(logs)
    assert log.count("Starting with 2 processes") == 2 and log.count("GLOBAL_RANK: 1, MEMBER: 2/2") == 2, log

    spec = load_spec(spec_path)
    h = connect(spec, study_dir, url)
    by_point = trials_by_point(h)
    assert set(by_point) == {p.point_id for p in spec.points()}
    for ts in by_point.values():
        assert [t.state for t in ts] == [TrialState.COMPLETE], "each point ran once"
        t = ts[0]
        assert t.user_attrs["worker"].split(":")[0] == "node1", "the batch step runs on the first node"
        assert t.user_attrs["config"]["trainer"]["num_nodes"] == 2
        assert run_metrics(Path(t.user_attrs["run_dir"]))["train/loss"][-1][0] == 5


@pytest.mark.slow
def test_one_node_trials_spread_over_both_nodes_and_share_postgresql(two_nodes, pg_url, tmp_path, monkeypatch):
    """2 points, an array of 2 one-node workers: one runs on each node (each node has 1 CPU, each worker asks for
    1), both claim points from one PostgreSQL study at once, and every point runs once."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in [str(TESTS), os.environ.get("PYTHONPATH")] if p))
    monkeypatch.setenv("FAKE_TOGETHER", "2")  # each fit waits until both workers are inside one: one point each
    spec_path = write_study(tmp_path, "name: spread\nseeds: [1]\nbudget: {steps: 10}\naxes:\n"
                                      "  model.norm: [layernorm, rmsnorm]\n")
    study_dir, url = tmp_path / "study", pg_url()
    assert main(["ablate", "submit", str(spec_path), "--dir", str(study_dir), "--storage", url, "--workers", "2",
                 "--fit", FAKE, "--heartbeat", "1", "--grace", "30", "--poll", "0.5"]) == 0
    array = job_of(study_dir / "slurm" / "jobs.jsonl")
    logs = study_dir / "slurm" / "submit-001" / "logs"
    assert two_nodes.wait(array, 180, logs) == {f"{array}_0": "COMPLETED", f"{array}_1": "COMPLETED"}, read_logs(logs)
    assert {two_nodes.nodelist(f"{array}_{i}") for i in (0, 1)} == set(NODES)

    spec = load_spec(spec_path)
    h = connect(spec, study_dir, url)
    by_point = trials_by_point(h)
    assert set(by_point) == {p.point_id for p in spec.points()}
    hosts = set()
    for ts in by_point.values():
        assert [t.state for t in ts] == [TrialState.COMPLETE], "each point ran once"
        t = ts[0]
        v = next(p.variant for p in spec.points() if p.point_id == t.user_attrs["point_id"])
        assert t.value == fake_metric(spec.experiment(v.overrides, t.user_attrs["seed"]))
        hosts.add(t.user_attrs["worker"].split(":")[0])
    assert hosts == set(NODES), f"the trials ran on {hosts}"



# ---------------------------------------------------------------------------------------------- a node stops
STALL_FIT = "test_slurm_nodes:stepping_fit"


RELEASE_ENV = "ATTNLAB_TEST_RELEASE"  # a file: stepping_fit waits at its 20th step until it exists (at most 300 s)


def stepping_fit(exp, ckpt_path=None):
    """A fake fit that makes progress only while it runs, as training does: 40 steps of 0.1 s, each appending a line
    (its pid) to <run dir>/progress.log, the stand-in for the metrics and checkpoints a fit writes; then the result
    files of test_ablate_runner's fake fit. A process stopped midway still has its remaining steps to do when it
    is woken. With $ATTNLAB_TEST_RELEASE set, every fit holds at its 20th step until that file exists, so that the
    test, not the machine's load, decides which trial is still running when a node stops."""
    run_dir = exp.run_dir()
    run_dir.mkdir(parents=True, exist_ok=True)
    release = os.environ.get(RELEASE_ENV)
    for step in range(40):
        if step == 20 and release:
            deadline = time.time() + 300
            while not os.path.exists(release) and time.time() < deadline:
                time.sleep(0.1)
        time.sleep(0.1)
        with open(run_dir / "progress.log", "a", encoding="utf-8") as f:
            f.write(f"{os.getpid()}\n")
    return fake_fit(exp, ckpt_path)


def running_on(h, host: str):
    """The RUNNING trial whose worker runs on `host`, or None."""
    return next((t for t in h.study.get_trials(states=(TrialState.RUNNING,))
                 if t.user_attrs["worker"].startswith(f"{host}:")), None)


@pytest.mark.slow
@pytest.mark.parametrize("then", ["woken", "killed"])
def test_a_node_that_stops_answering_has_its_trial_retried_elsewhere_exactly_once(then, two_nodes, pg_url, tmp_path,
                                                                                 monkeypatch):
    """Two workers, one per node, each inside a trial. node1 stops answering: every process in its namespace
    (slurmd, the job's shell, the worker, the trial's srun step) gets SIGSTOP, for longer than the heartbeat's
    grace period. The worker on node2 finishes its point, declares node1's trial lost and runs that point again.
    Then node1 dies (SIGKILL to all of it; its slurmd restarts, as after a reboot) or wakes up (SIGCONT): the woken
    worker finds its trial taken over, kills its step before that writes its result, and records nothing. Either
    way each point has one result, and node1's point exactly two attempts: the lost one and the retry on node2."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in [str(TESTS), os.environ.get("PYTHONPATH")] if p))
    release = tmp_path / "release"  # both first fits hold at step 20 until node1 has been stopped past the grace
    monkeypatch.setenv(RELEASE_ENV, str(release))
    spec_path = write_study(tmp_path, "name: stall\nseeds: [1]\nbudget: {steps: 10}\naxes:\n"
                                      "  model.norm: [layernorm, rmsnorm]\n")
    study_dir, url = tmp_path / "study", pg_url()
    assert main(["ablate", "submit", str(spec_path), "--dir", str(study_dir), "--storage", url, "--workers", "2",
                 "--fit", STALL_FIT, "--heartbeat", "1", "--grace", "3", "--poll", "0.5"]) == 0
    array = job_of(study_dir / "slurm" / "jobs.jsonl")
    logs = study_dir / "slurm" / "submit-001" / "logs"
    spec = load_spec(spec_path)
    h = connect(spec, study_dir, url)
    def holding(host: str) -> bool:  # a trial of host's worker has made its 20 steps and waits for `release`
        t = running_on(h, host)
        progress = Path(t.user_attrs.get("run_dir", "/nonexistent")) / "progress.log" if t else None
        return progress is not None and progress.is_file() and len(progress.read_text().split()) >= 20

    wait_for(lambda: holding("node1") and holding("node2"), 90,
             f"the workers never both held a trial at step 20\n{read_logs(logs)}", two_nodes.dir)
    stalled = running_on(h, "node1")
    # which task runs on node1, asked before it stops: past SlurmdTimeout slurmctld requeues it (no node list)
    on_node1 = f"{array}_0" if two_nodes.nodelist(f"{array}_0") == "node1" else f"{array}_1"
    two_nodes.net.signal("node1", signal.SIGSTOP)
    stopped_at = time.time()
    try:
        time.sleep(3 + 2)  # past the grace (3 s) and a heartbeat: node2's next claim finds node1's trial lost
        release.touch()
        def retried() -> bool:
            return any(t.state == TrialState.COMPLETE and t.user_attrs["worker"].startswith("node2:")
                       for t in trials_by_point(h)[stalled.user_attrs["point_id"]])
        wait_for(retried, 100, f"node2 never ran node1's point again\n{read_logs(logs)}", two_nodes.dir)
    finally:
        two_nodes.net.signal("node1", signal.SIGKILL if then == "killed" else signal.SIGCONT)
        stopped_s = time.time() - stopped_at
    if then == "killed":
        two_nodes.start_slurmd("node1")  # the node comes back, as after a reboot
        two_nodes.run("scancel", on_node1)
    states = two_nodes.wait(array, 120, logs, done=("COMPLETED", "FAILED", "CANCELLED", "NODE_FAIL"))
    log = read_logs(logs)
    assert states[on_node1] == ("CANCELLED" if then == "killed" else "COMPLETED"), (states, log)
    if then == "woken":
        assert f"trial (id {stalled._trial_id}) was declared lost by another worker, which runs it again" in log, log

    by_point = trials_by_point(connect(spec, study_dir, url))
    assert set(by_point) == {p.point_id for p in spec.points()}
    for pid, ts in by_point.items():
        assert [t.state for t in ts].count(TrialState.COMPLETE) == 1, f"{pid}: one result"
    lost, retry = sorted(by_point[stalled.user_attrs["point_id"]], key=lambda t: t.number)
    assert lost.number == stalled.number and lost.state == TrialState.FAIL and "lost_at" in lost.user_attrs
    assert "metric" not in lost.user_attrs and "final" not in lost.user_attrs, "the stalled worker recorded nothing"
    assert retry.state == TrialState.COMPLETE and retry.user_attrs["worker"].startswith("node2:")
    assert retry.user_attrs["attempt"] == 2
    ends = [c for c in read_calls(study_dir)[1] if c["hash"] == retry.user_attrs["config_hash"]]
    assert len(ends) == 1, f"one fit of that point wrote its result: {ends}"
    progress = (Path(retry.user_attrs["run_dir"]) / "progress.log").read_text().split()
    assert progress.count(str(ends[0]["pid"])) == 40, "the retry ran all its steps"
    stale = [p for p in progress if p != str(ends[0]["pid"])]
    assert 0 < len(stale) < 40, "the stalled fit made some progress, and never finished"
    print(f"\n[figures] node1 {then} after {stopped_s:.0f} s stopped (grace 3 s): 2 nodes, 2 workers, 2 points, "
          f"{sum(len(ts) for ts in by_point.values())} trials, node1's point retried on node2 once, duplicates 0, "
          f"the stalled fit made {len(stale)} of 40 steps and wrote no result")
