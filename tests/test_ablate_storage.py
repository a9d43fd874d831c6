"""Ablation studies on each storage, and under fire: a journal file, SQLite and a real PostgreSQL server with
several workers; a kill storm (workers SIGKILLed at random and replaced) on the journal file and PostgreSQL.

The PostgreSQL server is the suite's session fixture `postgres` (tests/pg_server.py): a fresh cluster made with
`initdb` in a temporary folder, installed when missing and possible, else those tests skip and say why. Each
test gets a database of its own.
"""

from __future__ import annotations

import csv
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from optuna.trial import TrialState

from attnlab.ablate.report import write_table
from attnlab.ablate.runner import Options, run_study, worker_command
from attnlab.ablate.spec import load_spec
from attnlab.ablate.study import connect, prepare_study

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))
from test_ablate_runner import FAKE, fake_fit, fake_metric, read_calls, worker_env, write_study  # noqa: E402, F401, F811


def storage_for(kind: str, tmp_path: Path, request) -> str:
    if kind == "postgresql":
        server = request.getfixturevalue("postgres")
        return server.new_database(f"study_{uuid.uuid4().hex[:12]}")
    return str(tmp_path / "journal.log") if kind == "journal" else f"sqlite:///{tmp_path / 'study.db'}"


def trials_by_point(h) -> dict[str, list]:
    out: dict[str, list] = {}
    for t in h.study.get_trials(deepcopy=False):
        out.setdefault(t.user_attrs["point_id"], []).append(t)
    return out


def table_rows(h, out: Path) -> list[dict]:
    """The study's table as CSV rows, without what is a timing (wall time)."""
    _, paths = write_table(h, out)
    rows = list(csv.DictReader(open(paths[1], encoding="utf-8")))
    return [{k: v for k, v in r.items() if "wall" not in k} for r in rows]


# ---------------------------------------------------------------------------------------------- storages
GRID_8 = """\
seeds: [1, 2]
retries: 0
axes:
  model.norm: [layernorm, rmsnorm]
  model.ffn: [gelu, swiglu]
"""


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["journal", "sqlite", "postgresql"])
def test_four_workers_run_every_point_exactly_once_on_each_storage(kind, tmp_path, worker_env, monkeypatch,  # noqa: F811
                                                                   request):
    monkeypatch.setenv("FAKE_SLEEP", "0.3")
    monkeypatch.setenv("FAKE_TOGETHER", "4")  # the first fits wait until all four workers run one at once
    storage = storage_for(kind, tmp_path, request)
    spec = load_spec(write_study(tmp_path, GRID_8))
    study_dir = tmp_path / "study"
    opts = Options(fit=FAKE, heartbeat_s=1, grace_s=5, poll_s=0.2)
    assert run_study(spec, study_dir, storage, workers=4, opts=opts) == {"done": 8}

    h = connect(spec, study_dir)  # the storage recorded in the study directory
    assert h.url == (storage if "://" in storage else str(Path(storage).resolve()))
    starts, ends = read_calls(study_dir)
    assert len(starts) == len(ends) == 8 and len({c["hash"] for c in starts}) == 8, "a point ran twice"
    assert len({c["pid"] for c in starts}) == 4, "four workers ran points at once"
    by_point = trials_by_point(h)
    assert set(by_point) == {p.point_id for p in spec.points()}
    for ts in by_point.values():
        assert [t.state for t in ts].count(TrialState.COMPLETE) == 1
        assert all(t.user_attrs.get("status") == "duplicate" for t in ts if t.state != TrialState.COMPLETE)
        done = next(t for t in ts if t.state == TrialState.COMPLETE)
        p = next(p for p in spec.points() if p.point_id == done.user_attrs["point_id"])
        assert done.value == fake_metric(spec.experiment(p.variant.overrides, p.seed))
    rows = table_rows(h, tmp_path / "table")
    assert [r["n"] for r in rows] == ["2"] * 4


# ---------------------------------------------------------------------------------------------- kill storm
GRID_96 = """\
seeds: [1, 2, 3, 4, 5, 6, 7, 8]
retries: 100
axes:
  model.norm: [layernorm, rmsnorm]
  model.ffn: [gelu, swiglu]
  model.norm_position: [pre, post, sandwich]
"""
STORM_S = float(os.environ.get("ATTNLAB_STORM_S", "20"))  # how long the killer kills, per storage
FIT_S = 1.5  # how long one fake fit takes


def in_fit(study_dir: Path) -> set[int]:
    """PIDs of the workers inside a (fake) fit now: a start in calls.jsonl without its end."""
    starts, ends = read_calls(study_dir)
    done = {(e["pid"], e["hash"]) for e in ends}
    return {c["pid"] for c in starts if (c["pid"], c["hash"]) not in done}


def storm(spec, study_dir: Path, storage: str, opts: Options, n_workers: int, seconds: float, rng: random.Random
          ) -> dict:
    """n_workers worker processes; every 1.5-3.5 s one of those inside a trial, at random, is SIGKILLed and a new
    one started in its place, for `seconds`; then the workers finish calmly. Returns what happened."""
    h = prepare_study(spec, study_dir, storage)
    cmd = worker_command(h.spec.path, h.dir, h.url, opts)
    logs = study_dir / "worker-logs"
    logs.mkdir()

    def start(i: int) -> subprocess.Popen:
        return subprocess.Popen(cmd, stdout=open(logs / f"{i:03d}.log", "w"), stderr=subprocess.STDOUT)

    t0 = time.time()
    procs = [start(i) for i in range(n_workers)]
    started, kills = n_workers, 0
    try:
        while not read_calls(study_dir)[0] and time.time() - t0 < 180:
            time.sleep(0.2)  # the storm starts with the first fit (a worker's imports take seconds)
        storm_start = time.time()
        while time.time() - storm_start < seconds:
            time.sleep(rng.uniform(1.5, 3.5))
            if all(p.poll() is not None for p in procs):
                break  # the study finished inside the storm
            busy = in_fit(study_dir)
            targets = [p for p in procs if p.poll() is None and p.pid in busy]
            if not targets:
                continue  # still starting: a kill now would only cost an import
            victim = rng.choice(targets)
            victim.send_signal(signal.SIGKILL)
            victim.wait()
            kills += 1
            procs[procs.index(victim)] = start(started)
            started += 1
        storm_end = time.time()
        codes = [p.wait(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    wall = time.time() - t0
    assert codes == [0] * n_workers, "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(logs.iterdir()))
    return {"kills": kills, "wall_s": wall, "storm_s": storm_end - storm_start, "workers_started": started}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["journal", "postgresql"])
def test_a_kill_storm_loses_and_duplicates_nothing(kind, tmp_path, worker_env, monkeypatch, request, capsys):  # noqa: F811
    """8 workers over 96 points with a fast fake fit, a random worker SIGKILLed every 1-3 s and replaced for
    STORM_S seconds: every point ends with exactly one COMPLETE trial, no trial is left RUNNING, and the table is
    the calm run's."""
    monkeypatch.setenv("FAKE_SLEEP", str(FIT_S))
    storage = storage_for(kind, tmp_path, request)
    spec = load_spec(write_study(tmp_path, GRID_96))
    assert len(spec.points()) == 96
    opts = Options(fit=FAKE, heartbeat_s=1, grace_s=4, poll_s=0.3)
    study_dir = tmp_path / "storm"
    got = storm(spec, study_dir, storage, opts, n_workers=8, seconds=STORM_S, rng=random.Random(18))

    h = connect(spec, study_dir)
    trials = h.study.get_trials(deepcopy=False)
    assert not [t.number for t in trials if t.state == TrialState.RUNNING], "a trial outlived its worker"
    by_point = trials_by_point(h)
    assert set(by_point) == {p.point_id for p in spec.points()}, "a point was never run"
    for ts in by_point.values():
        assert [t.state for t in ts].count(TrialState.COMPLETE) == 1, "lost or counted twice"
    lost = [t for t in trials if t.state == TrialState.FAIL and "lost_at" in t.user_attrs]
    dup = [t for t in trials if t.user_attrs.get("status") == "duplicate"]
    retried = sum(len([t for t in ts if t.user_attrs.get("status") != "duplicate"]) > 1 for ts in by_point.values())
    assert got["kills"] >= STORM_S / 5 and len(lost) >= got["kills"] / 2, got  # it happened, and hit running trials
    starts, ends = read_calls(study_dir)
    assert len({e["hash"] for e in ends}) == 96

    calm_dir = tmp_path / "calm"
    monkeypatch.setenv("FAKE_SLEEP", "0")
    run_study(spec, calm_dir, str(calm_dir / "journal.log"), opts=opts, fit=fake_fit)
    assert table_rows(h, tmp_path / "t1") == table_rows(connect(spec, calm_dir), tmp_path / "t2")

    figures = (f"kill storm on {kind}: {len(spec.points())} points in {got['wall_s']:.0f} s "
               f"({60 * len(spec.points()) / got['wall_s']:.0f} points/minute) by 8 workers with a {FIT_S} s fake fit; "
               f"{got['kills']} kills survived in {got['storm_s']:.0f} s, {len(lost)} trials lost with their worker "
               f"and rerun ({retried} points retried), {len(dup)} duplicate claims refused, "
               f"{len(starts) - len(ends)} fits cut short")
    with capsys.disabled():
        print("\n" + figures)
