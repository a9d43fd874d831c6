"""The ablation runner's mechanics with a fake, instant `fit`: exactly-once points with several workers,
a worker killed mid-trial, invalid combinations, retries, resume, tables and plots from stored trials.

`fake_fit` has train.fit's signature and writes what a real run writes (metrics.csv, config.yaml, a
last.ckpt); worker processes import it as test_ablate_runner:fake_fit (this folder is on their PYTHONPATH).
`fake_evaluate` has final.evaluate_run's signature and writes hypothesis files with a known quality.
"""

from __future__ import annotations

import csv
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from optuna.trial import TrialState

from attnlab.ablate.figures import plot
from attnlab.ablate.final import write_lines
from attnlab.ablate.report import write_table
from attnlab.ablate.runner import Options, run_study, worker_command
from attnlab.ablate.spec import load_spec
from attnlab.ablate.study import connect, format_status, point_states, prepare_study
from attnlab.cli import main
from attnlab.evaluate import score
from attnlab.rundir import keep_metrics, run_metrics
from conftest import make_pairs

TESTS = Path(__file__).resolve().parent
FAKE = "test_ablate_runner:fake_fit"

TINY_LM = """\
name: tiny_lm
model: {arch: decoder_only, vocab_size: 64, d_model: 32, n_heads: 2, n_dec_layers: 1, d_ff: 64,
        max_seq_len: 32, dropout: 0.0, norm_position: pre}
data: {}
trainer: {max_steps: 10, val_every: 5}
"""


# ---------------------------------------------------------------------------------------------- fake fit
def fake_metric(exp) -> float:
    m = exp.model
    interaction = 0.2 * (m.qk_norm and m.ffn == "swiglu")  # QK-norm changes nothing with ReLU, costs SwiGLU 0.2
    additive = 3.0 - 0.25 * (m.norm == "rmsnorm") - 0.5 * (m.ffn == "swiglu")
    return round(additive + interaction + 0.01 * exp.trainer.seed, 6)


def fake_fit(exp, ckpt_path=None):
    """A stand-in for attnlab.train.fit. FAKE_SLEEP seconds of 'training'; dropout 0.3 always raises;
    dropout 0.2 raises on its first attempt only."""
    run_dir = exp.run_dir()
    (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
    calls = Path(exp.trainer.runs_dir).parent / "calls.jsonl"
    start = time.time()
    with open(calls, "a", encoding="utf-8") as f:
        f.write(json.dumps({"hash": exp.config_hash(), "seed": exp.trainer.seed, "pid": os.getpid(),
                            "ckpt_path": ckpt_path, "start": start}) + "\n")
    torch.save({"global_step": exp.trainer.max_steps}, run_dir / "checkpoints" / "last.ckpt")
    if exp.model.dropout == 0.3:
        raise RuntimeError("boom: dropout 0.3 always fails")
    if exp.model.dropout == 0.2 and not (run_dir / "flaked").exists():
        (run_dir / "flaked").touch()
        raise RuntimeError("flaky: fails once")
    time.sleep(float(os.environ.get("FAKE_SLEEP", "0")))
    value = fake_metric(exp)
    (run_dir / "logs").mkdir(exist_ok=True)
    with open(run_dir / "logs" / "metrics.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["epoch", "step", "train/loss", "train/tokens_per_s", "train/tokens", "val/loss"])
        w.writerow([0, 4, value + 1.5, 1000.0, 5000, ""])
        w.writerow([0, 4, "", "", "", value + 0.5])
        w.writerow([0, 9, value + 1.0, 1200.0, 10000, ""])
        w.writerow([0, 9, "", "", "", value])
    (run_dir / "config.yaml").write_text(exp.to_yaml(), encoding="utf-8")
    with open(calls, "a", encoding="utf-8") as f:
        f.write(json.dumps({"hash": exp.config_hash(), "pid": os.getpid(), "end": time.time()}) + "\n")
    return run_dir


REFS = [de for _, de in make_pairs(120, seed=7)]


def fake_hypotheses(refs: list[str], drop: float, rng: random.Random) -> list[str]:
    """References with each word dropped with probability `drop`: a system whose quality `drop` sets."""
    return [" ".join(w for w in r.split() if rng.random() >= drop) for r in refs]


def fake_drop(exp) -> float:
    """The word-drop rate of a fake system: SwiGLU translates better (a large, known effect); the norm does not
    matter (no effect)."""
    return 0.35 - 0.2 * (exp.model.ffn == "swiglu")


def fake_evaluate(exp, run_dir):
    """A stand-in for final.evaluate_run: eval/{valid,test}.{hyp,ref} whose quality fake_drop sets (each seed its
    own draw), and the scores sacreBLEU gives those files."""
    eval_dir = Path(run_dir) / "eval"
    eval_dir.mkdir(parents=True, exist_ok=True)
    out = {"eval_dir": str(eval_dir)}
    for split in ("valid", "test"):
        rng = random.Random(f"{exp.model.norm} {exp.model.ffn} {exp.trainer.seed} {split}")
        refs = REFS if split == "valid" else REFS[::-1]
        hyps = fake_hypotheses(refs, fake_drop(exp), rng)
        write_lines(eval_dir / f"{split}.hyp", hyps)
        write_lines(eval_dir / f"{split}.ref", refs)
        scores = score(hyps, refs)
        out.update({f"{split}_bleu": scores["bleu"], f"{split}_chrf": scores["chrf"],
                    f"{split}_loss": fake_metric(exp) + (split == "test"), f"{split}_ppl": 2.0 ** fake_metric(exp)})
    return out


def read_calls(study_dir: Path) -> tuple[list[dict], list[dict]]:
    path = study_dir / "calls.jsonl"
    lines = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    return [x for x in lines if "start" in x], [x for x in lines if "end" in x]


# ---------------------------------------------------------------------------------------------- fixtures
def write_study(tmp: Path, body: str, base: str = TINY_LM, final_eval: bool = False, name: str = "study") -> Path:
    """tmp/ablations/<name>.yaml over tmp/experiments/tiny_lm.yaml (`base`), metric val/loss unless `body` says."""
    (tmp / "experiments").mkdir(exist_ok=True)
    (tmp / "ablations").mkdir(exist_ok=True)
    (tmp / "experiments" / f"{name}_base.yaml").write_text(base, encoding="utf-8")
    path = tmp / "ablations" / f"{name}.yaml"
    head = f"base: ../experiments/{name}_base.yaml\nfinal_eval: {str(final_eval).lower()}\n"
    if "metric:" not in body:
        head += "metric: {name: val/loss, direction: min}\n"
    path.write_text(head + body)
    return path


GRID_4x2 = """\
seeds: [1, 2]
budget: {steps: 10}
axes:
  model.norm: [layernorm, rmsnorm]
  model.ffn: [gelu, swiglu]
"""

FAKE_EVAL = "test_ablate_runner:fake_evaluate"
FAST = Options(fit=FAKE, evaluate=FAKE_EVAL, heartbeat_s=1, grace_s=2, poll_s=0.2)


@pytest.fixture
def worker_env(monkeypatch):
    """Worker processes import this module; keep their CPU threads small."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("FAKE_SLEEP", "0")


def trials_by_point(study_dir: Path, spec) -> dict[str, list]:
    h = connect(spec, study_dir)
    out: dict[str, list] = {}
    for t in h.study.get_trials(deepcopy=False):
        out.setdefault(t.user_attrs["point_id"], []).append(t)
    return out


# ---------------------------------------------------------------------------------------------- tests
def test_two_local_workers_run_every_point_exactly_once_and_the_table_matches(tmp_path, worker_env, monkeypatch):
    monkeypatch.setenv("FAKE_SLEEP", "0.4")  # long enough that the two workers overlap
    spec = load_spec(write_study(tmp_path, GRID_4x2))
    study_dir = tmp_path / "study"
    counts = run_study(spec, study_dir, workers=2, opts=FAST)
    assert counts == {"done": 8}

    starts, ends = read_calls(study_dir)
    hashes = [c["hash"] for c in starts]
    assert len(hashes) == 8 and len(set(hashes)) == 8, "a point ran twice"
    assert len({c["pid"] for c in starts}) == 2, "both workers should have run points"
    by_point = trials_by_point(study_dir, spec)
    assert set(by_point) == {p.point_id for p in spec.points()}
    assert all(len(ts) == 1 and ts[0].state == TrialState.COMPLETE for ts in by_point.values())

    # the table's numbers are the stored trial metrics: mean/std over the two seeds of each variant
    h = connect(spec, study_dir)
    md, paths = write_table(h)
    assert [p.name for p in paths] == ["table.md", "table.csv", "table.tex"] and all(p.exists() for p in paths)
    stored: dict[str, list[float]] = {}
    for t in h.study.get_trials(states=(TrialState.COMPLETE,)):
        stored.setdefault(t.user_attrs["variant"], []).append(t.value)
        assert t.user_attrs["n_params"] > 0 and t.user_attrs["tokens_per_s"] == 1200.0
        assert t.user_attrs["curve"]["step"] == [4, 9] and Path(t.user_attrs["run_dir"]).is_dir()
    rows = list(csv.DictReader(open(paths[1], encoding="utf-8")))
    assert len(rows) == 4
    for r in rows:
        vals = sorted(stored[r["variant"]])
        assert sorted(float(v) for v in r["values"].split()) == vals
        assert float(r["val/loss mean"]) == pytest.approx(sum(vals) / 2)
        assert float(r["val/loss std"]) == pytest.approx(abs(vals[0] - vals[1]) / 2 ** 0.5)
    means = [float(r["val/loss mean"]) for r in rows]
    assert means == sorted(means), "sorted best first (min)"
    assert rows[0]["variant"] == "norm=rmsnorm ffn=swiglu"
    base = next(r for r in rows if r["baseline"] == "True")
    assert base["variant"] == "norm=layernorm ffn=gelu"  # the base recipe's own values
    for r in rows:
        assert float(r["delta_vs_baseline"]) == pytest.approx(float(r["val/loss mean"]) - float(base["val/loss mean"]))
    assert "| norm=rmsnorm ffn=swiglu | 2.265 ± 0.007 | 2 | -0.750 |" in md
    assert "baseline" in md and r"\toprule" in paths[2].read_text()

    # running the finished study again runs nothing
    n_trials = len(h.study.get_trials())
    assert run_study(spec, study_dir, workers=2, opts=FAST) == {"done": 8}
    assert len(connect(spec, study_dir).study.get_trials()) == n_trials
    assert len(read_calls(study_dir)[0]) == 8


def test_two_workers_started_at_once_never_run_the_same_point(tmp_path, worker_env, monkeypatch):
    """Two independent `ablate worker` processes on a fresh study, started together (no parent preparing it)."""
    monkeypatch.setenv("FAKE_SLEEP", "0.2")
    spec = load_spec(write_study(tmp_path, GRID_4x2))
    study_dir = tmp_path / "study"
    study_dir.mkdir()
    cmd = [sys.executable, "-m", "attnlab", "ablate", "worker", str(spec.path), "--dir", str(study_dir), "--fit", FAKE,
           "--heartbeat", "1", "--grace", "5", "--poll", "0.2"]
    procs = [subprocess.Popen(cmd) for _ in range(2)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    starts, _ = read_calls(study_dir)
    assert len(starts) == 8 and len({c["hash"] for c in starts}) == 8
    by_point = trials_by_point(study_dir, spec)
    for ts in by_point.values():
        real = [t for t in ts if t.user_attrs.get("status") != "duplicate"]
        assert len(real) == 1 and real[0].state == TrialState.COMPLETE


def test_a_worker_killed_mid_trial_is_detected_and_its_point_resumed(tmp_path, worker_env, monkeypatch):
    spec = load_spec(write_study(tmp_path, GRID_4x2))
    study_dir = tmp_path / "study"
    h = prepare_study(spec, study_dir)
    env = {**os.environ, "FAKE_SLEEP": "120"}  # this worker hangs in its first trial
    victim = subprocess.Popen(worker_command(h.spec.path, h.dir, h.url, FAST), env=env)
    try:
        deadline = time.time() + 60
        while time.time() < deadline and not read_calls(study_dir)[0]:
            time.sleep(0.1)
        assert read_calls(study_dir)[0], "the worker never started a trial"
        running = h.study.get_trials(states=(TrialState.RUNNING,))
        assert len(running) == 1
        killed_point = running[0].user_attrs["point_id"]
    finally:
        victim.send_signal(signal.SIGKILL)
        victim.wait()
    assert "running" in format_status(connect(spec, study_dir), grace_s=2)

    t0 = time.time()
    counts = run_study(spec, study_dir, workers=1, opts=FAST, fit=fake_fit)  # the same study, run again
    assert counts == {"done": 8}
    assert time.time() - t0 < 30
    by_point = trials_by_point(study_dir, spec)
    for pid, ts in by_point.items():
        assert [t.state for t in ts].count(TrialState.COMPLETE) == 1, "exactly one result per point"
        if pid != killed_point:
            assert len(ts) == 1
    lost, done = by_point[killed_point]
    assert lost.state == TrialState.FAIL and "lost_at" in lost.user_attrs and "status" not in lost.user_attrs
    assert done.user_attrs["resumed"] is True and done.user_attrs["attempt"] == 2
    starts, ends = read_calls(study_dir)
    assert len(starts) == 9 and len(ends) == 8
    assert [c["ckpt_path"] for c in starts].count("last") == 1


def test_invalid_combination_is_recorded_with_its_reason_not_a_crash(tmp_path):
    body = "axes:\n  model.attn_softcap: [0.0, 30.0]\n  model.attention_backend: [sdpa, eager]\n"
    spec = load_spec(write_study(tmp_path, body))  # not a load error: the value is valid with eager
    study_dir = tmp_path / "study"
    assert run_study(spec, study_dir, opts=FAST, fit=fake_fit) == {"done": 3, "invalid": 1}
    h = connect(spec, study_dir)
    (bad,) = [s for s in point_states(h).values() if s.status == "invalid"]
    assert bad.variant == "attn_softcap=30 attention_backend=sdpa"
    assert "model.attn_softcap" in bad.reason and "attention_backend" in bad.reason
    assert bad.trials[0].state == TrialState.FAIL and bad.trials[0].user_attrs["status"] == "invalid"
    assert "attn_softcap=30 attention_backend=sdpa (seed 1): invalid" in write_table(h)[0]
    assert run_study(spec, study_dir, opts=FAST, fit=fake_fit) == {"done": 3, "invalid": 1}
    assert len(h.study.get_trials()) == 4, "an invalid point is recorded once, never retried"


def test_a_failing_trial_is_retried_up_to_the_limit_then_recorded_failed(tmp_path):
    body = "retries: 2\naxes:\n  model.dropout: [0.0, 0.2, 0.3]\n"
    spec = load_spec(write_study(tmp_path, body))
    study_dir = tmp_path / "study"
    assert run_study(spec, study_dir, opts=FAST, fit=fake_fit) == {"done": 2, "failed": 1}
    states = {s.variant: s for s in point_states(connect(spec, study_dir)).values()}
    always = states["dropout=0.3"]
    assert [t.user_attrs["status"] for t in always.trials] == ["error"] * 3
    last = always.trials[-1].user_attrs
    assert "boom" in last["error"] and "RuntimeError" in last["traceback"]
    flaky = states["dropout=0.2"]
    assert [t.state for t in flaky.trials] == [TrialState.FAIL, TrialState.COMPLETE]
    assert flaky.trials[1].user_attrs["resumed"] is True  # the failed attempt left a checkpoint
    # a failed point stays failed on a rerun: the limit is in the file (raise retries: to try again)
    assert run_study(spec, study_dir, opts=FAST, fit=fake_fit) == {"done": 2, "failed": 1}
    assert len(always.trials) == 3 and len(connect(spec, study_dir).study.get_trials()) == 1 + 2 + 3


def test_variants_list_search_and_journal_storage(tmp_path):
    body = """\
variants:
  - {name: base}
  - {name: rms, model.norm: rmsnorm}
  - {name: swiglu, model.ffn: swiglu}
"""
    spec = load_spec(write_study(tmp_path, body))
    journal = tmp_path / "shared" / "journal.log"
    assert run_study(spec, tmp_path / "study", storage=str(journal), opts=FAST, fit=fake_fit) == {"done": 3}
    assert journal.exists()
    md, _ = write_table(connect(spec, tmp_path / "study", str(journal)))
    assert md.index("| swiglu |") < md.index("| rms |") < md.index("| base |")

    search = """\
search: optuna
n_trials: 5
search_seed: 3
distributions:
  optim.lr: {type: float, low: 1e-4, high: 1e-2, log: true}
  model.ffn: {type: categorical, choices: [gelu, swiglu]}
"""
    spec = load_spec(write_study(tmp_path, search))
    counts = run_study(spec, tmp_path / "search", opts=FAST, fit=fake_fit)
    assert counts == {"done": 5}
    h = connect(spec, tmp_path / "search")
    trials = h.study.get_trials()
    assert len(trials) == 5 and all(1e-4 <= t.params["optim.lr"] <= 1e-2 for t in trials)
    assert h.study.best_value == min(t.value for t in trials)
    assert len(write_table(h)[0].splitlines()) == 4 + 5  # title, blank, header, rule, one row per trial


def test_cli_run_status_table_plot(tmp_path, capsys):
    spec_path = write_study(tmp_path, GRID_4x2.replace("[1, 2]", "[1]"))
    study_dir = tmp_path / "study"
    common = ["--dir", str(study_dir), "--fit", FAKE, "--heartbeat", "1", "--grace", "2", "--poll", "0.2"]
    assert main(["ablate", "run", str(spec_path), *common]) == 0
    assert main(["ablate", "status", str(study_dir)]) == 0
    out = capsys.readouterr().out
    assert "4 points: 4 done" in out and "norm=rmsnorm ffn=swiglu" in out
    assert main(["ablate", "table", str(spec_path), "--dir", str(study_dir)]) == 0
    assert "| norm=rmsnorm ffn=swiglu | 2.260 | 1 | -0.750 |" in capsys.readouterr().out
    assert main(["ablate", "plot", str(study_dir), "--out", str(tmp_path / "fig")]) == 0
    for name in ("curves.png", "metric.png"):
        png = tmp_path / "fig" / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    assert main(["ablate", "status", str(tmp_path / "nowhere")]) == 2
    assert "not found" in capsys.readouterr().err


def test_plot_from_stored_trials(tmp_path):
    spec = load_spec(write_study(tmp_path, GRID_4x2))
    run_study(spec, tmp_path / "study", opts=FAST, fit=fake_fit)
    paths = plot(connect(spec, tmp_path / "study"))
    assert [p.name for p in paths] == ["curves.png", "metric.png"] and all(p.stat().st_size > 5000 for p in paths)


def test_a_resumed_runs_curve_joins_the_metrics_of_its_attempts(tmp_path):
    """Lightning's CSVLogger starts metrics.csv afresh on resume; fit keeps the earlier part, run_metrics joins them."""
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "metrics.csv").write_text("epoch,step,val/loss\n0,99,3.0\n0,199,2.5\n0,299,2.4\n")
    keep_metrics(tmp_path)
    (logs / "metrics.csv").write_text("epoch,step,val/loss,train/loss\n0,199,2.6,\n0,299,2.2,\n0,300,,1.9\n")
    curves = run_metrics(tmp_path)
    assert curves["val/loss"] == [(99, 3.0), (199, 2.6), (299, 2.2)] and curves["train/loss"] == [(300, 1.9)]
    assert (logs / "metrics.part0.csv").exists()
