"""The ablation runner's mechanics with a fake, instant `fit`: exactly-once points with several workers, invalid
combinations, retries, resume, tables and plots from stored trials; and a worker killed mid-trial of a real fit.

`fake_fit` has train.fit's signature and writes what a real run writes (metrics.csv, config.yaml, a
last.ckpt); worker processes import it as test_ablate_runner:fake_fit (this folder is on their PYTHONPATH).
`fake_evaluate` has final.evaluate_run's signature and writes hypothesis files with a known quality.
"""

from __future__ import annotations

import csv
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from optuna.trial import TrialState

from attnlab.ablate.devices import default_workers, gpu_slices
from attnlab.ablate.final import write_lines
from attnlab.ablate.runner import (
    Options,
    _create_running,
    claim_next,
    run_study,
    trial_experiment,
    worker_command,
)
from attnlab.ablate.spec import load_spec
from attnlab.ablate.study import OwnedLock, connect, format_status, point_states, prepare_study
from attnlab.analysis.figures import plot
from attnlab.analysis.report import write_table
from attnlab.checkpoints import checkpoint_step
from attnlab.cli import main
from attnlab.config import ConfigError
from attnlab.evaluate import score
from attnlab.leftovers import owner
from attnlab.rundir import keep_metrics, mark_fit_done, run_metrics
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
    # seed noise of each variant's own (+c on seed 1, -c on seed 2, 0 after: the means over seeds 1 and 2, or 1 to
    # 3, stay exact), beside the 0.01 per seed every variant shares: the pooled model has a variance to test with
    own = 0.002 * (1 + (m.ffn == "swiglu") + 2 * (m.norm == "rmsnorm") + 4 * bool(m.qk_norm) + 3 * (m.ffn == "gelu"))
    return round(additive + interaction + 0.01 * exp.trainer.seed + own * {1: 1, 2: -1}.get(exp.trainer.seed, 0), 6)


def fake_fit(exp, ckpt_path=None):
    """A stand-in for attnlab.train.fit. FAKE_SLEEP seconds of 'training' (after waiting, with FAKE_TOGETHER=n,
    until n worker processes have started a fit); dropout 0.3 always raises; dropout 0.2 raises on its first
    attempt only."""
    run_dir = exp.run_dir()
    (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
    calls = Path(exp.trainer.runs_dir).parent / "calls.jsonl"
    start = time.time()
    with open(calls, "a", encoding="utf-8") as f:
        f.write(json.dumps({"hash": exp.config_hash(), "seed": exp.trainer.seed, "pid": os.getpid(),
                            "ckpt_path": ckpt_path, "start": start,
                            "cuda": os.environ.get("CUDA_VISIBLE_DEVICES")}) + "\n")
    torch.save({"global_step": exp.trainer.max_steps}, run_dir / "checkpoints" / "last.ckpt")  # one that loads
    together = int(os.environ.get("FAKE_TOGETHER", "0"))  # wait until this many workers are inside a fit
    while len({c["pid"] for c in read_calls(calls.parent)[0]}) < together and time.time() - start < 120:
        time.sleep(0.05)
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
    mark_fit_done(run_dir, exp.trainer.max_steps)  # what train.fit does last
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
        scores = score(hyps, refs, exp.data.tgt_lang)
        out.update({"bleu_signature": scores["bleu_signature"], "chrf_signature": scores["chrf_signature"]})
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
@pytest.mark.slow
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
    assert "| norm=rmsnorm ffn=swiglu | 2.265 ± 0.004 | 2 ‡ | -0.750 |" in md
    assert "baseline" in md and r"\toprule" in paths[2].read_text()

    # running the finished study again runs nothing
    n_trials = len(h.study.get_trials())
    assert run_study(spec, study_dir, workers=2, opts=FAST) == {"done": 8}
    assert len(connect(spec, study_dir).study.get_trials()) == n_trials
    assert len(read_calls(study_dir)[0]) == 8


@pytest.mark.slow
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


def write_lm_recipe(tmp: Path, max_steps: int, ckpt_every: int = 10, val_every: int = 0, log_every: int = 5,
                    dropout: float = 0.0) -> Path:
    """A tiny decoder-only LM on a synthetic text file: a real fit that trains in seconds on a CPU."""
    words = "the a small big red green house cat dog tree river city open close file save print".split()
    corpus = tmp / "corpus.txt"
    corpus.write_text("".join(" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(5 + i % 11))
                              + f" {i}.\n\n" for i in range(2000)), encoding="utf-8")
    recipe = tmp / "tiny_lm.yaml"
    recipe.write_text(f"""\
name: tiny_lm
model: {{arch: decoder_only, d_model: 32, n_heads: 2, n_dec_layers: 1, d_ff: 64, max_seq_len: 64, dropout: {dropout},
        norm_position: pre, position: rope}}
data: {{corpus: {corpus}, vocab_size: 300, seq_len: 32, max_tokens: 256, valid_fraction: 0.05,
       test_fraction: 0.05, data_dir: {tmp / 'data_cache'}}}
optim: {{schedule: constant, lr: 1.0e-3, warmup_steps: 0}}
trainer: {{accelerator: cpu, max_steps: {max_steps}, val_every: {val_every or max_steps}, ckpt_every: {ckpt_every},
          limit_val_batches: 2, log_every: {log_every}, progress_bar: false, runs_dir: {tmp / 'runs'}}}
""", encoding="utf-8")
    return recipe


@pytest.mark.slow
def test_a_worker_killed_mid_fit_is_released_and_resumed_to_the_uninterrupted_losses(tmp_path, monkeypatch):
    """A worker running a real fit is SIGKILLed mid-trial; a crash also left its newest checkpoint cut short. The
    next worker releases the point at once (its worker was a process of this host that is gone, long before the
    grace period), resumes it from the newest checkpoint that loads, and the trial's per-step losses (dropout
    on, so the RNG state and the data position matter) equal an uninterrupted run's.

    Every fit compared runs in a worker process of its own, as `ablate run` starts them: the pytest process is no
    reference for bit-equal losses, since what ran in it before (other test files, in an order pytest-xdist
    chooses) can change the last bits of its kernels' results (under xdist an in-process reference was 2 ulps
    off the killed worker's loss at step 11, 5.593203 against 5.593204). About 30 s alone: three real fits of
    150 steps, one SIGKILLed."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    steps = 150
    recipe = write_lm_recipe(tmp_path, max_steps=steps, ckpt_every=10, log_every=1, dropout=0.1)
    spec_path = tmp_path / "killed.yaml"
    spec_path.write_text(f"base: {recipe}\nmetric: {{name: val/loss, direction: min}}\nseeds: [1]\n"
                         "variants:\n  - {name: base}\n", encoding="utf-8")
    spec = load_spec(spec_path)
    study_dir = tmp_path / "study"
    opts = Options(heartbeat_s=1, grace_s=600, poll_s=0.2)  # the real fit (attnlab.train:fit)
    h = prepare_study(spec, study_dir)
    run_dir = trial_experiment(spec, study_dir, {}, 1).run_dir()
    victim = subprocess.Popen(worker_command(h.spec.path, h.dir, h.url, opts))
    metrics = run_dir / "logs" / "metrics.csv"

    def run_worker(study) -> None:  # a worker to the end of the study; the deadline a last resort under load
        r = subprocess.run(worker_command(study.spec.path, study.dir, study.url, opts), capture_output=True,
                           text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]

    def logged() -> int:  # the last step with a train/loss row written (Lightning logs a step after its checkpoint)
        rows = list(csv.DictReader(open(metrics, encoding="utf-8"))) if metrics.is_file() else []
        return max([int(r["step"]) for r in rows if r.get("train/loss") and (r.get("step") or "").isdigit()],
                   default=-1)

    try:
        deadline = time.time() + 240
        while time.time() < deadline and victim.poll() is None and logged() < 30:
            time.sleep(0.02)
    finally:
        victim.send_signal(signal.SIGKILL)
        victim.wait()
    assert victim.returncode == -signal.SIGKILL, "the worker ended before it could be killed"
    last = run_dir / "checkpoints" / "last.ckpt"
    killed_at = torch.load(last, weights_only=True)["global_step"]
    assert 20 <= killed_at < steps
    last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])  # what a crash of the machine may leave
    newest = max((run_dir / "checkpoints").glob("step=*.ckpt"), key=checkpoint_step)
    assert checkpoint_step(newest) >= killed_at
    assert "stale" in format_status(connect(spec, study_dir))

    t0 = time.time()
    run_worker(h)  # the next worker, the real fit
    (lost, done) = trials_by_point(study_dir, spec)[spec.points()[0].point_id]
    assert lost.state == TrialState.FAIL and "lost_at" in lost.user_attrs
    assert done.state == TrialState.COMPLETE and done.user_attrs["resumed"] is True
    # released at once, not after the grace period: before the next worker's own trial began (fail_stale runs
    # before its claim; 1 ms for the microseconds optuna's datetime keeps), and well within grace_s (a fixed 30 s
    # measured the next worker's start-up instead, 52 s on a loaded machine)
    assert t0 < lost.user_attrs["lost_at"] <= done.datetime_start.timestamp() + 1e-3, (t0, lost.user_attrs, done)
    assert lost.user_attrs["lost_at"] - t0 < opts.grace_s / 2, "released at once, not after the grace period"
    resumed_from = Path(done.user_attrs["resumed_from"])
    assert resumed_from == newest, "the newest checkpoint that loads (last.ckpt does not)"

    run_worker(prepare_study(spec, tmp_path / "reference"))  # the same trial, uninterrupted, by a worker of its own
    full = run_metrics(trial_experiment(spec, tmp_path / "reference", {}, 1).run_dir())
    resumed = run_metrics(run_dir)
    assert [s for s, _ in resumed["train/loss"]] == list(range(steps))
    for col in ("train/loss", "train/grad_norm", "val/loss"):
        assert resumed[col] == full[col], col
    assert done.value == full["val/loss"][-1][1]


def test_a_trial_of_another_hosts_worker_is_released_only_after_the_grace_period(tmp_path):
    """Whether a worker on another host lives cannot be seen from here: its trial is lost once its heartbeat is
    older than grace_s, and not before (a trial of this host's dead process is released at once)."""
    spec = load_spec(write_study(tmp_path, GRID_4x2.replace("[1, 2]", "[1]")))
    h = prepare_study(spec, tmp_path / "study")
    p0, p1, p2 = spec.points()[:3]
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    for p, worker, age in ((p0, "node-17:4242", 100), (p1, "node-18:4242", 0), (p2, owner().split(":")[0] +
                                                                              f":{dead.pid}", 0)):
        _create_running(h, {"point_id": p.point_id, "variant": p.variant.name, "seed": p.seed, "worker": worker,
                            "heartbeat": time.time() - age})
    claim, busy = claim_next(h, grace_s=30)
    states = point_states(h, grace_s=30)
    assert [t.user_attrs.get("lost_at") is not None for t in h.study.get_trials() if t.number < 3] == \
           [True, False, True], "stale heartbeat: lost; fresh one of another host: running; this host's dead: lost"
    assert states[p1.point_id].status == "running" and busy
    assert claim is not None and claim.point_id == p0.point_id  # the first pending point again


def test_a_lock_left_by_a_killed_process_is_broken_at_once_a_live_ones_only_after_its_grace(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        lock = OwnedLock(tmp_path / "claim.lock", grace_s=1.5)
        (tmp_path / "claim.lock").write_text(f"{socket.gethostname()}:{holder.pid}")  # held by a live process
        t0 = time.monotonic()
        lock.acquire()
        assert time.monotonic() - t0 >= 1.5, "a live holder's lock is waited for, up to the grace period"
        assert (tmp_path / "claim.lock").read_text() == owner()
        lock.release()
        assert not (tmp_path / "claim.lock").exists()
        (tmp_path / "claim.lock").write_text(f"{socket.gethostname()}:{holder.pid}")
    finally:
        holder.kill()
        holder.wait()
    t0 = time.monotonic()
    lock.acquire()  # its holder is gone: broken at once
    assert time.monotonic() - t0 < 1.0 and (tmp_path / "claim.lock").read_text() == owner()
    lock.release()
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc to tell a zombie")
def test_a_lock_left_by_a_process_dead_but_not_yet_reaped_is_broken_at_once(tmp_path):
    """A zombie (a worker that died and whose parent has not waited for it yet, as the kill storm's first wave
    left them) holds nothing: its lock is broken at once, not after the grace period, during which every worker
    waiting on the journal's lock misses its heartbeats and has its live trial declared lost."""
    dead = subprocess.Popen([sys.executable, "-c", "import os; os._exit(0)"])
    try:
        stat = Path(f"/proc/{dead.pid}/stat")
        deadline = time.monotonic() + 30
        while stat.read_bytes().rpartition(b")")[2].split()[0] != b"Z":
            assert time.monotonic() < deadline, "the child never exited"
            time.sleep(0.01)
        (tmp_path / "claim.lock").write_text(f"{socket.gethostname()}:{dead.pid}")
        t0 = time.monotonic()
        OwnedLock(tmp_path / "claim.lock", grace_s=30).acquire()
        assert time.monotonic() - t0 < 1.0, "a zombie's lock waited for"
        assert (tmp_path / "claim.lock").read_text() == owner()
    finally:
        dead.wait()


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
    assert "| norm=rmsnorm ffn=swiglu | 2.268 | 1 ‡ | -0.750 |" in capsys.readouterr().out  # fake_metric, seed 1
    assert main(["ablate", "plot", str(study_dir), "--out", str(tmp_path / "fig")]) == 0
    for name in ("curves.png", "metric.png"):
        png = tmp_path / "fig" / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    assert main(["ablate", "status", str(tmp_path / "nowhere")]) == 2
    assert "not found" in capsys.readouterr().err


def test_one_default_storage_and_submit_refuses_sqlite_saying_how_to_move_it(tmp_path, capsys):
    """`run` and `submit` default to a journal file in the study directory; a study started on SQLite keeps it
    (recorded in study.yaml), `submit` refuses it with the command that moves it, and `move` copies every trial."""
    spec_path = write_study(tmp_path, GRID_4x2.replace("[1, 2]", "[1]"))
    common = ["--fit", FAKE, "--heartbeat", "1", "--grace", "2", "--poll", "0.2"]
    assert main(["ablate", "run", str(spec_path), "--dir", str(tmp_path / "default"), *common]) == 0
    assert connect(load_spec(spec_path), tmp_path / "default").url == str(tmp_path / "default" / "journal.log")

    study_dir = tmp_path / "study"
    sqlite = f"sqlite:///{tmp_path / 'old.db'}"
    assert main(["ablate", "run", str(spec_path), "--dir", str(study_dir), "--storage", sqlite, *common]) == 0
    before = {t.user_attrs["point_id"]: t for t in connect(load_spec(spec_path), study_dir).study.get_trials()}
    capsys.readouterr()
    assert main(["ablate", "submit", str(spec_path), "--dir", str(study_dir), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert f"kept in SQLite ({sqlite})" in err and f"ablate move {study_dir} --to {study_dir / 'journal.log'}" in err
    assert main(["ablate", "move", str(study_dir), "--to", str(study_dir / "journal.log")]) == 0
    h = connect(load_spec(spec_path), study_dir)
    assert h.url == str(study_dir / "journal.log")
    after = {t.user_attrs["point_id"]: t for t in h.study.get_trials()}
    assert {k: (t.state, t.value, t.user_attrs) for k, t in after.items()} == \
           {k: (t.state, t.value, t.user_attrs) for k, t in before.items()}
    assert main(["ablate", "move", str(study_dir), "--to", str(study_dir / "journal.log")]) == 2  # already there
    assert main(["ablate", "submit", str(spec_path), "--dir", str(study_dir), "--fit", FAKE]) == 0
    assert "nothing to run" in capsys.readouterr().out


def test_plot_from_stored_trials(tmp_path, monkeypatch):
    """What the figures draw: each variant's mean training-loss and validation curves over its 2 seeds (steps 4
    and 9 of fake_fit's metrics), its final metric with the seeds' std as error bar, the baseline's line dashed."""
    from matplotlib.figure import Figure

    spec = load_spec(write_study(tmp_path, GRID_4x2))
    run_study(spec, tmp_path / "study", opts=FAST, fit=fake_fit)
    figures = []
    savefig = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: figures.append(fig) or savefig(fig, *a, **k))
    paths = plot(connect(spec, tmp_path / "study"))
    assert [p.name for p in paths] == ["curves.png", "metric.png"] and all(p.stat().st_size > 5000 for p in paths)
    (loss, curves), (metric,) = figures[0].axes, figures[1].axes

    def final(label: str) -> float:  # fake_metric's value of a variant, mean over seeds 1 and 2
        axes = dict(kv.split("=") for kv in label.split(" (")[0].split())
        return 3.0 - 0.25 * (axes["norm"] == "rmsnorm") - 0.5 * (axes["ffn"] == "swiglu") + 0.015

    for line in loss.get_lines():  # fake_fit's training loss: its final value + 1.5 at step 4, + 1.0 at step 9
        assert list(line.get_xdata()) == [4, 9]
        assert list(line.get_ydata()) == pytest.approx([final(line.get_label()) + 1.5, final(line.get_label()) + 1])
    lines = {line.get_label(): line for line in curves.get_lines()}
    assert len(lines) == 4 and all("(n=2)" in label for label in lines)
    for label, line in lines.items():
        assert list(line.get_xdata()) == [4, 9]
        assert list(line.get_ydata()) == pytest.approx([final(label) + 0.5, final(label)])
        assert (line.get_linestyle() == "--") == label.endswith("[baseline]") == ("norm=layernorm ffn=gelu" in label)
    labels = [t.get_text() for t in metric.get_yticklabels()]
    ys = list(metric.get_yticks())
    xs = {y: x for x, y in metric.lines[0].get_xydata()}
    assert sorted(labels, key=final) == labels  # best (lowest val/loss) first, at the top
    for label, y in zip(labels, ys, strict=True):
        assert xs[y] == pytest.approx(final(label))
    def std(label: str) -> float:  # over seeds 1 and 2: 0.01 a seed shared, +-own of the variant (fake_metric)
        axes = dict(kv.split("=") for kv in label.split(" (")[0].split())
        own = 0.002 * (1 + (axes["ffn"] == "swiglu") + 2 * (axes["norm"] == "rmsnorm") + 3 * (axes["ffn"] == "gelu"))
        return abs(0.01 - 2 * own) / math.sqrt(2)

    bars = {y: abs(seg[1][0] - seg[0][0]) for c in metric.collections for seg in c.get_segments()
            for y in [seg[0][1]]}
    assert [bars[y] for y in ys] == pytest.approx([2 * std(label) for label in labels])  # 2 std each
    baseline = [line for line in metric.lines if line.get_linestyle() == "--"]
    assert len(baseline) == 1 and baseline[0].get_xdata()[0] == pytest.approx(3.015)


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


# ---------------------------------------------------------------------------------------------- GPUs
def test_gpu_slices_give_each_worker_its_own_gpus():
    four = ["0", "1", "2", "3"]
    assert gpu_slices([], 4, 1) is None  # no GPU: CPU trials, nothing to share out
    assert gpu_slices(four, 4, 1) == ["0", "1", "2", "3"]
    assert gpu_slices(four, 2, 2) == ["0,1", "2,3"]
    assert gpu_slices(["4", "6"], 4, 1, workers_per_gpu=2) == ["4", "4", "6", "6"]  # asked to share
    assert gpu_slices(four, 3, 1) == ["0", "1", "2"]  # fewer workers than GPUs: the first ones
    with pytest.raises(ConfigError, match=r"--workers 3 with 2 GPU\(s\) per trial .* need 6 GPUs; 4 are given"):
        gpu_slices(four, 3, 2)
    with pytest.raises(ConfigError, match="not -1"):
        gpu_slices(four, 2, -1)
    with pytest.raises(ConfigError, match="listed twice"):
        gpu_slices(["0", "0"], 1, 1)


def test_default_workers_pack_every_gpu():
    assert default_workers([], 1, 8) == 1  # CPU trials: one worker, in this process
    assert default_workers(["0"], 1, 8) == 8
    assert default_workers([str(i) for i in range(8)], 2, 3) == 12  # 4 slices of 2 GPUs, 3 workers on each
    assert default_workers(["0", "1"], 4, 2) == 2  # trials wider than the GPUs: gpu_slices says why it fails
    assert default_workers(["0", "1"], -1, 2) == 1


@pytest.mark.slow
def test_cli_workers_per_gpu_alone_packs_the_gpus(tmp_path, worker_env, monkeypatch, capsys):
    """`ablate run --workers-per-gpu 2` on 2 GPUs starts 4 workers (it used to start one, so trials ran one at a
    time on the first GPU): both GPUs see trials, and two trials share a GPU at once."""
    monkeypatch.setenv("FAKE_SLEEP", "0.5")
    spec_path = write_study(tmp_path, GRID_4x2)
    study_dir = tmp_path / "study"
    common = ["--dir", str(study_dir), "--fit", FAKE, "--heartbeat", "1", "--grace", "2", "--poll", "0.2"]
    assert main(["ablate", "run", str(spec_path), *common, "--gpus", "0,1", "--workers-per-gpu", "2"]) == 0
    starts, ends = read_calls(study_dir)
    assert len(starts) == 8 and {c["cuda"] for c in starts} == {"0", "1"}
    end_of = {c["hash"]: c["end"] for c in ends}
    spans = sorted((c["start"], end_of[c["hash"]]) for c in starts if c["cuda"] == "0")
    assert any(b[0] < a[1] for a, b in zip(spans, spans[1:], strict=False)), spans  # two at once on GPU 0


@pytest.mark.slow
def test_workers_on_given_gpus_each_see_only_their_slice(tmp_path, worker_env, monkeypatch):
    """4 GPUs named (none is touched: the fake fit records CUDA_VISIBLE_DEVICES), 2 workers, 2 devices a trial:
    the workers see 0,1 and 2,3, never at once on one slice; each trial records its slice; status shows it.
    Asking for more GPUs than given fails before anything starts."""
    monkeypatch.setenv("FAKE_SLEEP", "0.3")
    body = "seeds: [1, 2]\nbudget: {steps: 10}\nresources: {devices: 2}\naxes:\n  model.norm: [layernorm, rmsnorm]\n"
    spec = load_spec(write_study(tmp_path, body))
    with pytest.raises(ConfigError, match="need 6 GPUs; 4 are given"):
        run_study(spec, tmp_path / "never", workers=3, opts=FAST, gpus=["0", "1", "2", "3"])
    assert not (tmp_path / "never").exists()
    study_dir = tmp_path / "study"
    counts = run_study(spec, study_dir, workers=2, opts=FAST, gpus=["0", "1", "2", "3"])
    assert counts == {"done": 4}
    starts, ends = read_calls(study_dir)
    assert {c["cuda"] for c in starts} <= {"0,1", "2,3"} and len(starts) == 4
    end_of = {c["hash"]: c["end"] for c in ends}
    for slice_ in ("0,1", "2,3"):  # one trial at a time on each slice
        spans = sorted((c["start"], end_of[c["hash"]]) for c in starts if c["cuda"] == slice_)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False)), spans
    h = connect(spec, study_dir)
    by_hash = {c["hash"]: c["cuda"] for c in starts}
    for t in h.study.get_trials(states=(TrialState.COMPLETE,)):
        assert t.user_attrs["cuda_visible_devices"] == by_hash[t.user_attrs["config_hash"]]
    assert "GPUs 0,1" in format_status(h) or "GPUs 2,3" in format_status(h)
