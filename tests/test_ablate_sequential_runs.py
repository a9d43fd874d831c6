"""Seeds until decided, run: a study in rounds (`seeds: {min, max}`, `ablate run --until-decided`) trains only the
seeds its rounds ask for, with one worker and with packed worker processes killed at the moments a trial or a round
could be lost or counted twice; its table, `status` and decisions are the rounds that attnlab.analysis.sequential
replays from the stored scores (for BLEU: from the stored hypotheses, rescored by sacreBLEU on resampled
sentences, as the simulations of test_ablate_sequential.py do); and SLURM runs a round as an array whose chained
job submits the next. Fits and evaluations are the stand-ins of test_ablate_runner.py, scored from known values.
"""

from __future__ import annotations

import csv
import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from optuna.trial import TrialState

from attnlab.ablate.final import write_lines
from attnlab.ablate.runner import Options, run_study
from attnlab.ablate.spec import load_spec
from attnlab.ablate.study import connect
from attnlab.analysis import sequential, testset
from attnlab.analysis.report import write_table
from attnlab.analysis.rounds import replayed
from attnlab.cli import main
from attnlab.evaluate import score
from test_ablate_runner import REFS, fake_fit, read_calls, worker_env, write_study  # noqa: F401 (a fixture)
from test_slurm import slurm_cluster  # noqa: F401 (the single-node cluster fixture)

FIT = "test_ablate_sequential_runs:round_fit"
EVAL = "test_ablate_sequential_runs:round_evaluate"
OPTS = Options(fit=FIT, evaluate=EVAL, heartbeat_s=1, grace_s=2, poll_s=0.2)
LOSS = {64: 3.0, 96: 2.55, 128: 3.0, 160: 3.25}  # the true val/loss of each d_ff (64: the baseline's)
ROUNDS = """\
seeds: {min: 2, max: 5}
budget: {steps: 10}
significance: {equivalence: 0.3}
axes:
  model.d_ff: [64, 96, 128, 160]
"""


def loss(d_ff: int, seed: int) -> float:
    return round(LOSS[d_ff] + random.Random(f"c{d_ff}/{seed}").gauss(0.0, 0.15), 6)


def round_fit(exp, ckpt_path=None):
    """fake_fit, its val/loss the known value of this d_ff and seed."""
    run_dir = fake_fit(exp, ckpt_path)
    value = loss(exp.model.d_ff, exp.trainer.seed)
    with open(run_dir / "logs" / "metrics.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["epoch", "step", "train/loss", "train/tokens_per_s", "train/tokens", "val/loss"])
        w.writerow([0, 9, value + 1.0, 1200.0, 10000, ""])
        w.writerow([0, 9, "", "", "", value])
    return run_dir


DROP = {"0": 0.35, "1": 0.27, "2": 0.2, "3": 0.35, "4": 0.45}  # variant 0 is the baseline, 3 like it, 4 worse


def drop(variant: str, seed: int) -> float:
    """A translation's word-drop rate: its variant's, and a seed part of its own."""
    return DROP[variant] + random.Random(f"{variant}/{seed}").gauss(0.0, 0.01)


def translate(variant: str, seed: int) -> list[str]:
    rng = random.Random(f"text {variant}/{seed}")
    strength = random.Random(f"strength {variant}")  # per-sentence strengths that repeat on every seed
    return [" ".join(w for w in r.split() if rng.random() >= min(max(drop(variant, seed) + strength.gauss(0, 0.05),
                                                                      0.0), 0.95)) for r in REFS]


def round_evaluate(exp, run_dir):
    """Test hypotheses of the drop rate of variant str(model.n_heads - 1), scored by sacreBLEU (final.py's fields)."""
    eval_dir = Path(run_dir) / "eval"
    eval_dir.mkdir(parents=True, exist_ok=True)
    hyps = translate(str(exp.model.n_heads // 2 - 1), exp.trainer.seed)
    write_lines(eval_dir / "test.hyp", hyps)
    write_lines(eval_dir / "test.ref", REFS)
    s = score(hyps, REFS, exp.data.tgt_lang)
    return {"eval_dir": str(eval_dir), "bleu_signature": s["bleu_signature"], "chrf_signature": s["chrf_signature"],
            "test_bleu": s["bleu"], "test_chrf": s["chrf"]}


def sequential_p(r) -> bool:
    """Whether each comparison's p is its repeated p-value, above the fixed-sample p of the round it stopped at (a
    sequential boundary asks for less than the level at every round), unless both are 1."""
    rep = r.replay
    return bool(((rep.p_repeated[0] > rep.p_raw[0]) | (rep.p_raw[0] >= 0.999)).all())


def trained(study_dir: Path) -> list[tuple[str, int]]:
    """(config hash, seed) of every fit that ran to its end."""
    starts, ends = read_calls(study_dir)
    seed_of = {c["hash"]: c["seed"] for c in starts}
    return sorted((c["hash"], seed_of[c["hash"]]) for c in ends)


def test_a_study_in_rounds_trains_only_its_rounds_and_its_table_and_status_are_theirs(tmp_path, capsys):
    """4 rows, seeds 2 to 5, equivalence within ±0.3, seed noise of SD 0.15 (val/loss: lower is better): d_ff 96 is
    0.45 better and is decided at round 2 (3 seeds); 128 and 160 (true differences 0 and +0.25) are decided
    equivalent at round 3 (4 seeds), the baseline keeping up: 15 of the 20 trainings. (Stopping at the first
    fixed-sample star or 90% interval decides all three at round 1.) Only those seeds are trained; the table's Δ, p
    and interval are the replay of the stored values at the round each row stopped at, and `status` says what each
    comparison is."""
    spec = load_spec(write_study(tmp_path, ROUNDS))
    study_dir = tmp_path / "study"
    counts = run_study(spec, study_dir, opts=OPTS, fit=round_fit)
    h = connect(spec, study_dir)
    r = replayed(h)
    assert [r.state(i) for i in range(3)] == ["better", "equivalent", "equivalent"]
    assert r.replay.stopped[0].tolist() == [2, 3, 3] and r.replay.seeds[-1][0].tolist() == [4, 3, 4, 4]
    assert counts == {"done": 15, "not needed": 5}
    assert len(trained(study_dir)) == 15 and len(set(trained(study_dir))) == 15, "a seed trained twice"

    y = np.array([[[loss(d, s) for s in spec.seeds] for d in (64, 96, 128, 160)]])
    want = sequential.replay(y, None, sequential.Design(2, 5, equivalence=0.3), sign=-1.0)
    assert want.state[0].tolist() == [sequential.BETTER, sequential.EQUIVALENT, sequential.EQUIVALENT]
    md, paths = write_table(h)
    rows = {row["variant"]: row for row in csv.DictReader(open(paths[1], encoding="utf-8"))}
    for i, d in enumerate((96, 128, 160)):
        row = rows[f"d_ff={d}"]
        assert float(row["p_adjusted"]) == pytest.approx(want.p_adjusted[0, i], rel=1e-9)
        assert (float(row["delta_ci_low"]), float(row["delta_ci_high"])) == pytest.approx(
            (want.low[0, i], want.high[0, i]), rel=1e-9)
        assert int(row["n"]) == want.seeds[-1][0, i + 1] and row["test"] == "sequential"
    assert re.search(r"\| d_ff=96 \| 2\.\d+ ± 0\.\d+ \| 3 \| -0\.\d+ \| [0-9.e-]+\* \(n=3\) \| \[-0\.\d+, -0\.\d+\] \| "
                     r"better, round 2 \(3 seeds\) \|", md), md
    assert "| equivalent, round 3 (4 seeds) |" in md and "O'Brien-Fleming-type alpha spending" in md
    assert "Stopped: d_ff=96: better, round 2 (3 seeds)" in md and "3 round(s), 15 trainings (20 for 5 seeds" in md
    assert ": pending" not in md and "Not in the table" not in md

    assert main(["ablate", "status", str(spec.path), "--dir", str(study_dir)]) == 0
    out = capsys.readouterr().out
    assert "20 points: 15 done, 5 not needed" in out and "    5  " not in out  # no unneeded point listed
    assert "round 2: 3 seeds; 4 trainings (d_ff=64, d_ff=96, d_ff=128, d_ff=160)" in out
    assert "round 3: 4 seeds; 3 trainings (d_ff=64, d_ff=128, d_ff=160)" in out
    assert re.search(r"d_ff=96: better \(stopped at round 2, 3 seeds; Δ -0\.\d+, p [0-9.e-]+, CI", out), out
    assert "decided after 3 round(s): 15 trainings, 75% of the 20" in out
    assert run_study(spec, study_dir, opts=OPTS, fit=round_fit) == counts  # decided: nothing more runs
    assert len(trained(study_dir)) == 15


def test_until_decided_on_a_bleu_study_is_the_replay_of_its_texts(tmp_path, capsys):
    """`ablate run --until-decided` on a file that lists 2 seeds: rounds from 2 to 4 seeds over 4 variants and the
    baseline, each trial's test BLEU (sacreBLEU, with per-sentence strengths of each variant that repeat on its
    seeds), the test set a sample. The table (read from the file alone: the study records its rounds) gives the p,
    the interval and the decision that sequential.replay computes from the hypothesis files: the corpus scores and
    the scores of resampled sentences (testset.py), what the simulations push through."""
    from test_ablate_report import tiny_mt

    (tmp_path / "experiments").mkdir()
    (tmp_path / "experiments" / "mt.yaml").write_text(tiny_mt(tmp_path), encoding="utf-8")
    (tmp_path / "ablations").mkdir()
    path = tmp_path / "ablations" / "mt.yaml"
    path.write_text("base: ../experiments/mt.yaml\nseeds: [1, 2]\nsignificance: {resamples: 100}\n"
                    "axes:\n  model.n_heads: [2, 4, 6, 8, 10]\nbaseline: n_heads=2\noverrides: {model.d_model: 120}\n",
                    encoding="utf-8")
    study_dir = tmp_path / "study"
    common = ["--dir", str(study_dir), "--fit", "test_ablate_runner:fake_fit", "--evaluate", EVAL, "--poll", "0.2"]
    assert main(["ablate", "run", str(path), "--until-decided", "--max-seeds", "4", *common]) == 0
    assert main(["ablate", "table", str(path), "--dir", str(study_dir)]) == 0
    out = capsys.readouterr().out
    h = connect(load_spec(path), study_dir)
    assert h.spec.seeds == (1, 2, 3, 4) and h.spec.rounds.max == 4
    counts = testset.resample_counts(len(REFS), 100, h.spec.significance["seed"])
    cells = [[testset.sentence_stats(translate(str(v), s), REFS, "bleu") for s in (1, 2, 3, 4)] for v in range(5)]
    y = np.array([[[testset.corpus(c, "bleu") for c in row] for row in cells]])
    ystar = np.array([[[testset.resampled(c, counts, "bleu") for c in row] for row in cells]])  # (1, 5, 4, B)
    want = sequential.replay(y, np.moveaxis(ystar, -1, 1), sequential.Design(2, 4))
    r = replayed(h)
    assert r.population == "sample" and r.replay.rounds == want.rounds
    assert r.replay.p_adjusted[0] == pytest.approx(want.p_adjusted[0], rel=1e-9)
    assert r.replay.low[0] == pytest.approx(want.low[0], rel=1e-9) and (r.replay.state == want.state).all()
    assert sequential_p(r), "the table's p is the fixed-sample p of the round, not its repeated p-value"
    for i in range(4):
        d = {1: "better", 2: "worse"}.get(int(want.state[0, i]), "")
        assert re.search(rf"\| n_heads={2 * i + 4} \|.* \| {want.p_adjusted[0, i]:.3g}\*? \(n=\d\) \|.*\| {d}", out)
    assert "resamples of its sentences" in out and f"{want.rounds} round(s)" in out


@pytest.mark.slow
def test_packed_workers_killed_at_any_moment_resume_the_rounds_and_train_no_seed_twice(tmp_path, worker_env,  # noqa: F811
                                                                                      monkeypatch):
    """Two `ablate worker` processes on one study in rounds, packed on this machine, each SIGKILLed by its own hand
    (ablate/faults.py) at its 2nd result: the fit has run to its end, its trial is not yet COMPLETE, so the round it
    belongs to cannot be looked at. The next run resumes: it collects those two fits without training them again,
    looks at the rounds and runs them to the end. Every point the rounds need has exactly one result, no fit ran to
    its end twice, no seed beyond the rounds was trained, and the decisions are those of an uninterrupted run."""
    monkeypatch.setenv("FAKE_SLEEP", "0.1")
    spec = load_spec(write_study(tmp_path, ROUNDS))
    study_dir = tmp_path / "study"
    deaths = tmp_path / "deaths.jsonl"
    worker = [sys.executable, "-m", "attnlab", "ablate", "worker", str(spec.path), "--dir", str(study_dir), "--fit",
              FIT, "--heartbeat", "1", "--grace", "5", "--poll", "0.2"]
    env = {**os.environ, "ATTNLAB_DIE_AT": "recording:2", "ATTNLAB_DIE_LOG": str(deaths)}
    logs = [open(tmp_path / f"worker{i}.log", "w") for i in range(2)]
    workers = [subprocess.Popen(worker, env=env, stdout=log, stderr=subprocess.STDOUT) for log in logs]
    assert [p.wait(timeout=120) for p in workers] == [-9, -9], [(tmp_path / f"worker{i}.log").read_text()[-2000:]
                                                                for i in range(2)]
    for log in logs:
        log.close()
    assert [json.loads(line)["moment"] for line in deaths.read_text().splitlines()] == ["recording"] * 2
    assert run_study(spec, study_dir, opts=OPTS, fit=round_fit) == {"done": 15, "not needed": 5}
    run_study(spec, tmp_path / "reference", opts=OPTS, fit=round_fit)
    h, ref = connect(spec, study_dir), connect(spec, tmp_path / "reference")
    r, want = replayed(h), replayed(ref)
    assert (r.replay.state == want.replay.state).all() and (r.replay.seeds[-1] == want.replay.seeds[-1]).all()
    assert r.replay.stopped[0].tolist() == [2, 3, 3] and sequential_p(r)  # test A's rounds
    complete: dict[str, int] = {}
    for t in h.study.get_trials(states=(TrialState.COMPLETE,)):
        complete[t.user_attrs["point_id"]] = complete.get(t.user_attrs["point_id"], 0) + 1
    assert set(complete.values()) == {1} and len(complete) == int(want.replay.seeds[-1].sum()) == 15
    assert sum(t.user_attrs.get("fit_reused", False) for t in h.study.get_trials()) == 2
    ends = trained(study_dir)
    assert len(ends) == len(set(ends)) == 15, "a fit ran to its end twice"


@pytest.mark.slow
def test_rounds_run_as_chained_slurm_arrays(slurm_cluster, tmp_path, monkeypatch, capsys):  # noqa: F811
    """`ablate submit` of a study in rounds: round 1 is an array job, and a job that depends on it (afterany) submits
    round 2 when it ends, and so on until every comparison is decided; `status` shows each comparison's state."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parent))
    spec = load_spec(write_study(tmp_path, ROUNDS.replace("max: 5", "max: 3").replace("[64, 96, 128, 160]",
                                                                                       "[64, 96]")))
    study_dir = tmp_path / "study"
    assert main(["ablate", "submit", str(spec.path), "--dir", str(study_dir), "--workers", "2", "--fit", FIT,
                 "--heartbeat", "1", "--grace", "30", "--poll", "0.5"]) == 0
    jobs = study_dir / "slurm" / "jobs.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline:
        r = replayed(connect(spec, study_dir))
        if r is not None and r.done and not slurm_cluster.run("squeue", "-h", check=False).stdout.strip():
            break
        time.sleep(2)
    logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted(study_dir.rglob("*.log")))
    assert r.done, logs
    submitted = [json.loads(line)["script"] for line in jobs.read_text().splitlines()]
    workers = [s for s in submitted if s.endswith("worker.sbatch")]
    assert len(workers) == r.replay.rounds >= 2 and len(submitted) == 2 * r.replay.rounds, submitted
    h = connect(spec, study_dir)
    assert {t.user_attrs["slurm_job"].partition("_")[0] for t in h.study.get_trials()} == {
        json.loads(line)["job"] for line in jobs.read_text().splitlines()
        if json.loads(line)["script"].endswith("worker.sbatch")}
    assert len(h.study.get_trials(states=(TrialState.COMPLETE,))) == r.trainings() and sequential_p(r)
    capsys.readouterr()
    assert main(["ablate", "status", str(study_dir)]) == 0
    out = capsys.readouterr().out
    assert f"decided after {r.replay.rounds} round(s)" in out and f"d_ff=96: {r.state(0)}" in out
    assert main(["ablate", "submit", str(spec.path), "--dir", str(study_dir), "--fit", FIT]) == 0
    assert "every comparison is decided" in capsys.readouterr().out


def test_submit_wait_submits_each_round_when_its_array_ends(tmp_path, monkeypatch, capsys):
    """`ablate submit --wait` on a study in rounds, against a stand-in for sbatch and squeue: it submits round 1 as an
    array whose workers claim no later round (--max-round 1), waits for it to leave the queue (here: the array's
    workers run in this process while it waits), submits round 2, and so on until every comparison is decided;
    an array that ends without starting a trial is not submitted again."""
    from attnlab.ablate import submit
    from attnlab.ablate.runner import work

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text('#!/bin/bash\nn=$(( $(cat "$0.n" 2>/dev/null || echo 100) + 1 ))\necho $n > '
                                    '"$0.n"\necho "$@" >> "$0.log"\necho $n\n')
    (bin_dir / "squeue").write_text("#!/bin/bash\nexit 0\n")  # every job has left the queue
    for f in ("sbatch", "squeue"):
        (bin_dir / f).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    spec = load_spec(write_study(tmp_path, ROUNDS))
    study_dir = tmp_path / "study"
    rounds: list[int] = []

    def array_runs(job: str, poll_s: float = 10.0) -> None:  # the array's one worker, as SLURM would run it
        script = sorted((study_dir / "slurm").glob("submit-*/worker.sbatch"))[-1].read_text()
        rounds.append(int(re.search(r"--max-round (\d+)", script).group(1)))
        monkeypatch.setenv("SLURM_JOB_ID", job)
        monkeypatch.setenv("SLURM_ARRAY_JOB_ID", job)
        monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "0")
        opts = Options(fit=FIT, heartbeat_s=1, grace_s=2, poll_s=0.2, linger=False, max_round=rounds[-1])
        work(connect(spec, study_dir), opts, round_fit)
        for name in ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID"):
            monkeypatch.delenv(name)

    monkeypatch.setattr(submit, "wait_job", array_runs)
    assert main(["ablate", "submit", str(spec.path), "--dir", str(study_dir), "--fit", FIT, "--wait"]) == 0
    r = replayed(connect(spec, study_dir))
    assert r.done and rounds == [1, 2, 3] and r.replay.stopped[0].tolist() == [2, 3, 3] and sequential_p(r)
    assert "every comparison is decided" in capsys.readouterr().out
    assert len((bin_dir / "sbatch.log").read_text().splitlines()) == 3  # one array a round, no chained job
    monkeypatch.setattr(submit, "wait_job", lambda job, poll_s=10.0: None)  # an array whose workers never start
    spec = load_spec(write_study(tmp_path, ROUNDS, name="other"))
    assert main(["ablate", "submit", str(spec.path), "--dir", str(tmp_path / "other"), "--fit", FIT, "--wait"]) == 1
    assert "ended without starting a trial; not submitting again" in capsys.readouterr().out
