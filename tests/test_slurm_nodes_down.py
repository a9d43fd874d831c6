"""The two-node SLURM cluster of test_slurm_nodes.py (a cluster of its own, started for this module), for what
needs a node to die or a rank on each node: a node that goes DOWN mid-study, and the DDP step's oracle
(test_ddp_oracle.py) with its two ranks on two nodes.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
from optuna.trial import TrialState

from attnlab.ablate.runner import trial_experiment
from attnlab.ablate.spec import load_spec
from attnlab.ablate.study import connect
from attnlab.cli import main
from attnlab.experiment import load_experiment
from attnlab.rundir import run_metrics
from attnlab.train import fit, prepare

TESTS = Path(__file__).resolve().parent
SLURMD_TIMEOUT = 30  # slurmctld marks the dead node1 DOWN and requeues its task within a minute (netns_cluster.CONF)
sys.path.insert(0, str(TESTS))
import test_slurm_nodes  # noqa: E402
from netns_cluster import IFNAME  # noqa: E402
from test_ablate_runner import write_lm_recipe  # noqa: E402
from test_ddp_oracle import DRIVER, check_against_the_oracle, oracle_recipe  # noqa: E402
from test_slurm import job_of, read_logs, wait_for  # noqa: E402
from test_slurm_nodes import running_on, trials_by_point  # noqa: E402

two_nodes, pg_url = test_slurm_nodes.two_nodes, test_slurm_nodes.pg_url  # module fixtures: a cluster for this module

DOWN_STEPS = 150  # the fit on node1 dies past step 10 (a checkpoint every 5 steps), some seconds from its end


@pytest.mark.slow
def test_a_node_that_goes_down_mid_study_requeues_its_worker_which_resumes_the_fit_elsewhere(two_nodes, pg_url,
                                                                                          tmp_path, monkeypatch):
    """2 points of real fits, an array of 2 one-node workers on PostgreSQL, one per node. Past step 10 of the fit
    on node1, node1 dies: SIGKILL to its slurmd and every process in its namespace (the job's shell, the worker,
    the fit's srun step). After SlurmdTimeout (30 s) slurmctld marks node1 DOWN and requeues the array task that
    ran there (`#SBATCH --requeue`). Its second run, on node2 (node1 is still down), releases the trial its first
    run left RUNNING (no grace period: the job's own), claims the point again and resumes the fit from its newest
    checkpoint: the trial's per-step losses equal an uninterrupted fit's, each point has one COMPLETE trial, no
    claim is a duplicate and none was declared lost. node1's slurmd is then restarted and the node returns."""
    monkeypatch.chdir(tmp_path)
    # one intra-op thread in the jobs (sbatch passes the environment on) and in the reference fit below: the same
    # sums at every step (with 2 threads on a loaded machine the losses differed in the 7th digit at step 8)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    recipe = write_lm_recipe(tmp_path, max_steps=DOWN_STEPS, ckpt_every=5, log_every=1)
    spec_path = tmp_path / "down.yaml"
    spec_path.write_text(f"base: {recipe}\nfinal_eval: false\nmetric: {{name: val/loss, direction: min}}\n"
                         "seeds: [1]\naxes:\n  model.norm: [layernorm, rmsnorm]\n", encoding="utf-8")
    study_dir, url = tmp_path / "study", pg_url()
    # --grace 600: node2's worker never declares node1's trial lost; the requeued task takes it back itself
    assert main(["ablate", "submit", str(spec_path), "--dir", str(study_dir), "--storage", url, "--workers", "2",
                 "--heartbeat", "1", "--grace", "600", "--poll", "0.5"]) == 0
    array = job_of(study_dir / "slurm" / "jobs.jsonl")
    logs = study_dir / "slurm" / "submit-001" / "logs"
    spec = load_spec(spec_path)
    h = connect(spec, study_dir, url)

    def run_dir_on(host: str) -> Path | None:  # the run directory of the trial host's worker runs, once it has one
        t = running_on(h, host)
        return Path(t.user_attrs["run_dir"]) if t and "run_dir" in t.user_attrs else None

    def saved(run_dir: Path) -> int:  # its newest step checkpoint (files only: this polls every 20 ms)
        return max((int(p.stem.removeprefix("step=")) for p in (run_dir / "checkpoints").glob("step=*.ckpt")),
                   default=-1)

    wait_for(lambda: run_dir_on("node1"), 120, f"node1's worker never ran a trial\n{read_logs(logs)}", two_nodes.dir)
    victim, run_dir = running_on(h, "node1"), run_dir_on("node1")
    deadline = time.time() + 120
    while saved(run_dir) < 10 and time.time() < deadline:
        time.sleep(0.02)
    on_node1 = next(f"{array}_{i}" for i in (0, 1) if two_nodes.nodelist(f"{array}_{i}") == "node1")
    killed = two_nodes.net.signal("node1", signal.SIGKILL)
    killed_at = time.time()
    try:
        assert killed, "node1's namespace had no process"
        saved_at = saved(run_dir)
        assert 10 <= saved_at and not (run_dir / "fit_done.json").exists(), f"node1 died mid-fit ({saved_at})"

        # while slurmctld waits out SlurmdTimeout: the same point's fit, uninterrupted, in this process
        v = next(p for p in spec.points() if p.point_id == victim.user_attrs["point_id"])
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            reference = run_metrics(fit(trial_experiment(spec, tmp_path / "reference", v.variant.overrides, v.seed)))
        finally:
            torch.set_num_threads(threads)

        wait_for(lambda: two_nodes.states(on_node1).get(on_node1) == "PENDING", 120,
                 f"{on_node1} was not requeued after node1 died\n{read_logs(logs)}", two_nodes.dir)
        down_s = time.time() - killed_at
        assert two_nodes.node_states()["node1"].startswith("down"), two_nodes.node_states()
        ctld = (two_nodes.dir / "log" / "slurmctld.log").read_text(errors="replace")
        assert "due to failure of node node1" in ctld and "Nodes node1 not responding, setting DOWN" in ctld, ctld
        two_nodes.run("scontrol", "update", f"JobId={on_node1}", "StartTime=now")  # the requeue hold is 2 minutes
        states = two_nodes.wait(array, 240, logs, done=("COMPLETED", "FAILED", "CANCELLED", "NODE_FAIL"))
        assert states == {f"{array}_0": "COMPLETED", f"{array}_1": "COMPLETED"}, (states, read_logs(logs))
        record = next(r for r in two_nodes.records(array) if f"{r['ArrayJobId']}_{r['ArrayTaskId']}" == on_node1)
        assert record["Restarts"] == "1" and record["NodeList"] == "node2", record
    finally:  # node1 comes back (ReturnToService=2 takes a DOWN node that registers again), for whatever follows
        two_nodes.start_slurmd("node1")
        wait_for(lambda: two_nodes.node_states().get("node1") == "idle", 90, "node1 never came back", two_nodes.dir)

    by_point = trials_by_point(connect(spec, study_dir, url))
    assert set(by_point) == {p.point_id for p in spec.points()}
    for pid, ts in by_point.items():
        assert [t.state for t in ts].count(TrialState.COMPLETE) == 1, f"{pid}: one result"
        assert all("lost_at" not in t.user_attrs and t.user_attrs.get("status") != "duplicate" for t in ts), pid
    first, retry = sorted(by_point[v.point_id], key=lambda t: t.number)
    assert first.number == victim.number and first.state == TrialState.FAIL
    assert first.user_attrs["status"] == "interrupted" and first.user_attrs["reason"] == "its job was requeued"
    assert retry.state == TrialState.COMPLETE and retry.user_attrs["worker"].startswith("node2:")
    assert retry.user_attrs["slurm_job"] == on_node1 and retry.user_attrs["slurm_restart"] == 1
    resumed = [int(n) for n in re.findall(r"resuming from \S+ \(global step (\d+)\)", read_logs(logs))]
    assert retry.user_attrs["resumed"] and len(resumed) == 1 and saved_at <= resumed[0] < DOWN_STEPS, resumed
    other = [ts for pid, ts in by_point.items() if pid != v.point_id]
    assert [[t.state for t in ts] for ts in other] == [[TrialState.COMPLETE]], "node2's own point ran once"

    got = run_metrics(run_dir)
    assert [s for s, _ in got["train/loss"]] == list(range(DOWN_STEPS))
    for col in ("train/loss", "train/grad_norm", "val/loss"):
        assert got[col] == reference[col], col
    print(f"\n[figures] node1 killed at step {saved_at}+ of {DOWN_STEPS}: DOWN and its array task requeued "
          f"{down_s:.0f} s later (SlurmdTimeout 30 s), resumed on node2 from step "
          f"{resumed[0]}; 2 points, "
          f"{sum(len(ts) for ts in by_point.values())} trials, duplicates 0, lost 0; losses equal the "
          "uninterrupted fit's")


# ---------------------------------------------------------------------------------------------- DDP oracle
ORACLE_JOB = """#!/bin/bash
#SBATCH --job-name=oracle
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --output={d}/oracle.log
set -e
cd {d}
# first with a communication hook that all-reduces nothing (the oracle must tell it apart), then as attnlab runs
ATTNLAB_ORACLE_NOOP_HOOK=1 srun --kill-on-bad-exit=1 {py} driver.py {d}/noop/tiny.yaml {d}/noop {tests}
srun --kill-on-bad-exit=1 {py} driver.py {d}/ddp/tiny.yaml {d}/ddp {tests}
"""


@pytest.mark.slow
def test_a_ddp_step_with_a_rank_on_each_node_equals_one_process_on_both_batches(two_nodes, tmp_path, monkeypatch):
    """test_ddp_oracle's check with each rank in its own srun task on its own node, gloo over the nodes' network
    (GLOO_SOCKET_IFNAME=fabric0): the gradients of both ranks equal a single process's on both ranks' batches
    joined (torch's cross-entropy, normalised over every target token of the step), and so do the weights after
    one AdamW step. The same job first runs the step with a no-op communication hook on the DDP module (each rank
    keeps its own gradient), which the check must reject."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", IFNAME)
    monkeypatch.setenv("MASTER_PORT", str(21000 + os.getpid() % 10000))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    made = {}
    for name in ("noop", "ddp"):
        (tmp_path / name).mkdir()
        recipe = oracle_recipe(tmp_path / name, devices=1, num_nodes=2, strategy="ddp", run_name=name)
        made[name] = prepare(load_experiment(recipe))  # (datamodule, experiment): caches built before the job
    (tmp_path / "driver.py").write_text(DRIVER, encoding="utf-8")
    script = tmp_path / "oracle.sbatch"
    script.write_text(ORACLE_JOB.format(d=tmp_path, py=sys.executable, tests=TESTS), encoding="utf-8")
    job = two_nodes.run("sbatch", "--parsable", str(script)).stdout.strip().split(";")[0]
    log = tmp_path / "oracle.log"
    states = two_nodes.wait(job, 240, tmp_path)
    text = log.read_text(errors="replace") if log.exists() else ""
    assert states == {job: "COMPLETED"}, text[-6000:]
    assert two_nodes.nodelist(job) == "node[1-2]"
    assert text.count("distributed_backend=gloo") == 2 and text.count("GLOBAL_RANK: 1, MEMBER: 2/2") == 2, text[-6000:]

    for name, (dm, exp) in made.items():
        ranks = [torch.load(tmp_path / name / f"rank{k}.pt", weights_only=False) for k in (0, 1)]
        assert [s["world"] for s in ranks] == [2, 2] and [s["host"] for s in ranks] == ["node1", "node2"]
        batches = [s["batches"][0] for s in ranks]
        if name == "noop":
            with pytest.raises(AssertionError, match="not close"):
                check_against_the_oracle(exp, dm, batches, ranks)
        else:
            check_against_the_oracle(exp, dm, batches, ranks)
