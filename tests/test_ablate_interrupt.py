"""`ablate run` stopped by SIGINT or SIGTERM, for real: with one worker (in the `ablate run` process, a real fit) and
with worker processes (the signal to the parent is passed on to them). The trials are recorded as interrupted,
which is no failed attempt, the process exits 130 / 143, and the next run resumes them from their checkpoints
(with `retries: 0`, where a trial counted as failed would never run again).
"""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from optuna.trial import TrialState

from attnlab.ablate.runner import Options, _create_running, claim_next, run_study, trial_experiment
from attnlab.ablate.spec import load_spec
from attnlab.ablate.study import connect, format_status, point_states, prepare_study
from attnlab.checkpoints import checkpoint_step, latest_checkpoint
from attnlab.cli import main
from attnlab.leftovers import owner, owner_alive
from test_ablate_runner import FAKE, FAST, GRID_4x2, fake_fit, read_calls, write_lm_recipe, write_study

TESTS = Path(__file__).resolve().parent


def alive(pid: int) -> bool:
    return bool(owner_alive(f"{owner().rpartition(':')[0]}:{pid}"))


# The last-resort deadline of every wait here: each wait ends as soon as its event happens, or at once when `ablate
# run` exits first. A fixed 120 s ran out on a loaded machine (two workers starting Python, torch and optuna beside
# other tests) where the same wait takes 35 s alone; only a hang should reach this.
HANG_S = 600


def wait_until(check, proc: subprocess.Popen, what: str, timeout_s: float = HANG_S) -> None:
    deadline = time.time() + timeout_s
    while not check():
        assert proc.poll() is None, f"`ablate run` ended (exit {proc.returncode}) before {what}"
        assert time.time() < deadline, f"no {what} within {timeout_s:.0f} s"
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_ablate_run_with_one_worker_stopped_mid_fit_records_the_trial_interrupted_and_resumes_it(tmp_path, monkeypatch,
                                                                                                 sig):
    """`ablate run --workers 1` runs a real fit in its own process. Lightning turns Ctrl-C into exit(1) and train.fit
    a SIGTERM into exit(143) after its checkpoint: neither may leave the trial RUNNING (the next run would count it as
    a lost, failed attempt and, with retries: 0, never resume it)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    steps = 150
    recipe = write_lm_recipe(tmp_path, max_steps=steps, ckpt_every=10, log_every=1)
    spec_path = tmp_path / "stopped.yaml"
    spec_path.write_text(f"base: {recipe}\nmetric: {{name: val/loss, direction: min}}\nseeds: [1]\nretries: 0\n"
                         "variants:\n  - {name: base}\n", encoding="utf-8")
    spec = load_spec(spec_path)
    study_dir = tmp_path / "study"
    run_dir = trial_experiment(spec, study_dir, {}, 1).run_dir()
    metrics = run_dir / "logs" / "metrics.csv"

    def past_step_20() -> bool:
        rows = list(csv.DictReader(open(metrics, encoding="utf-8"))) if metrics.is_file() else []
        return any(r.get("train/loss") and int(r["step"]) >= 20 for r in rows)

    common = ["--dir", str(study_dir), "--heartbeat", "1", "--grace", "600", "--poll", "0.2"]
    run = subprocess.Popen([sys.executable, "-m", "attnlab", "ablate", "run", str(spec_path), "--workers", "1",
                            *common])
    try:
        wait_until(past_step_20, run, "step 20 of the fit")
        run.send_signal(sig)
        assert run.wait(timeout=60) == 128 + sig, "the conventional status: 130 for SIGINT, 143 for SIGTERM"
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()

    h = connect(spec, study_dir)
    (stopped,) = h.study.get_trials()
    assert stopped.state == TrialState.FAIL and stopped.user_attrs["status"] == "interrupted"
    assert stopped.user_attrs["reason"] == f"interrupted ({sig.name})"
    (state,) = point_states(h, grace_s=600).values()
    assert state.status == "pending" and state.attempts == 0, "an interruption is no failed attempt"
    assert "failed" not in format_status(h, 600)
    newest = latest_checkpoint(run_dir)  # saved on the signal
    assert newest is not None and 20 <= checkpoint_step(newest) < steps

    opts = Options(heartbeat_s=1, grace_s=600, poll_s=0.2)  # the next run: the real fit, in this process
    assert run_study(spec, study_dir, workers=1, opts=opts) == {"done": 1}
    (_, done) = sorted(connect(spec, study_dir).study.get_trials(), key=lambda t: t.number)
    assert done.state == TrialState.COMPLETE and done.user_attrs["resumed"] is True
    assert Path(done.user_attrs["resumed_from"]) == newest, "resumed from the newest checkpoint"


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_ablate_run_is_passed_on_to_its_workers_which_record_their_trials_interrupted(tmp_path,
                                                                                                 monkeypatch, sig):
    """`ablate run --workers 2`, both workers inside a fit, gets SIGTERM (or SIGINT) alone, as from `kill`: it passes
    it on to its workers (they used to carry on orphaned), which record their trials as interrupted and exit; it
    waits for them and exits 143 (130). The next run resumes both trials (retries: 0)."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("FAKE_TOGETHER", "2")  # each fit waits for the other worker's to start,
    monkeypatch.setenv("FAKE_SLEEP", "300")  # then trains for 5 minutes: the signal comes inside both fits
    spec = load_spec(write_study(tmp_path, "retries: 0\n" + GRID_4x2.replace("[1, 2]", "[1]")))
    study_dir = tmp_path / "study"
    common = ["--dir", str(study_dir), "--fit", FAKE, "--heartbeat", "1", "--grace", "600", "--poll", "0.2"]
    run = subprocess.Popen([sys.executable, "-m", "attnlab", "ablate", "run", str(spec.path), "--workers", "2",
                            *common])
    pids: set[int] = set()
    try:
        wait_until(lambda: len({c["pid"] for c in read_calls(study_dir)[0]}) == 2, run, "fit in both workers")
        pids = {c["pid"] for c in read_calls(study_dir)[0]}
        run.send_signal(sig)  # to the parent alone
        assert run.wait(timeout=60) == 128 + sig, "the parent waits for its workers and exits 128 + the signal"
        assert not [pid for pid in pids if alive(pid)], "a worker carries on"
    finally:
        for pid in pids:  # before the fix: orphaned workers, still inside their 5-minute fits
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        if run.poll() is None:
            run.kill()
            run.wait()

    h = connect(spec, study_dir)
    stopped = h.study.get_trials()
    assert len(stopped) == 2
    for t in stopped:
        assert t.state == TrialState.FAIL and t.user_attrs["status"] == "interrupted", t.user_attrs
        assert t.user_attrs["reason"] == f"interrupted ({sig.name})"
    assert all(s.attempts == 0 for s in point_states(h, grace_s=600).values())

    monkeypatch.setenv("FAKE_SLEEP", "0")
    monkeypatch.delenv("FAKE_TOGETHER")
    assert run_study(spec, study_dir, opts=FAST, fit=fake_fit) == {"done": 4}
    again = [t for t in connect(spec, study_dir).study.get_trials() if t.number >= 2]
    resumed = {t.user_attrs["point_id"] for t in again if t.user_attrs["resumed"]}
    assert resumed == {t.user_attrs["point_id"] for t in stopped}, "each interrupted point resumed, once"
    assert all(t.state == TrialState.COMPLETE for t in again) and len(again) == 4


def test_a_failed_point_says_why_a_lost_worker_included(tmp_path):
    """`ablate status` never shows a failed point with an empty reason: a trial failed as lost names its worker
    and why (gone, or no heartbeat), and one failed as lost before reasons were recorded still says it was lost."""
    spec = load_spec(write_study(tmp_path, "retries: 0\n" + GRID_4x2.replace("[1, 2]", "[1]")))
    h = prepare_study(spec, tmp_path / "study")
    p0, p1, p2 = spec.points()[:3]
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    gone = f"{owner().rpartition(':')[0]}:{dead.pid}"
    for p, worker, age in ((p0, gone, 0), (p1, "node-18:4242", 100), (p2, "node-19:4242", 0)):
        _create_running(h, {"point_id": p.point_id, "variant": p.variant.name, "seed": p.seed, "worker": worker,
                            "heartbeat": time.time() - age})
    old = h.study.get_trials()[2]  # lost as recorded before: FAIL, no status, no reason
    h.storage.set_trial_state_values(old._trial_id, TrialState.FAIL)
    claim_next(h, grace_s=30)
    states = point_states(h, grace_s=30)
    assert [states[p.point_id].status for p in (p0, p1, p2)] == ["failed"] * 3
    assert states[p0.point_id].reason == f"lost: its worker {gone} is gone"
    assert states[p1.point_id].reason == "lost: its worker node-18:4242 sent no heartbeat for 100 s"
    assert states[p2.point_id].reason == "lost: its worker node-19:4242 stopped before recording the trial"
    for line in format_status(h, grace_s=30).splitlines():
        if line.startswith("failed"):
            assert "lost: its worker" in line, line


def test_ablate_run_in_a_program_leaves_its_signal_handlers_as_they_were(tmp_path):
    """`ablate run` called in-process (a test, a notebook) sets its SIGINT/SIGTERM handlers only while it runs."""
    spec_path = write_study(tmp_path, GRID_4x2.replace("[1, 2]", "[1]"))
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    common = ["--dir", str(tmp_path / "study"), "--fit", FAKE, "--heartbeat", "1", "--grace", "2", "--poll", "0.2"]
    assert main(["ablate", "run", str(spec_path), "--workers", "1", *common]) == 0
    assert {s: signal.getsignal(s) for s in before} == before
