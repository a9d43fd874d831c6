"""Ablation studies on each storage, and under fire: a journal file, SQLite and a real PostgreSQL server with
several workers; a kill storm (workers SIGKILLed at random and replaced) on the journal file and PostgreSQL.

The PostgreSQL server is the suite's session fixture `postgres` (tests/pg_server.py): a fresh cluster made with
`initdb` in a temporary folder, installed when missing and possible, else those tests skip and say why. Each
test gets a database of its own.
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
import uuid
from collections import Counter
from pathlib import Path

import pytest
from optuna.trial import TrialState

from attnlab.ablate.runner import Options, run_study, worker_command
from attnlab.ablate.spec import load_spec
from attnlab.ablate.study import connect, prepare_study
from attnlab.analysis.report import write_table

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


def files_under(root: Path) -> set[Path]:
    return {p for p in root.rglob("*") if p.is_file()}


def test_reading_a_study_never_run_says_so_and_creates_no_storage(tmp_path, monkeypatch, capsys):
    """status, table, plot, effects, scaling and compare only read: on a study never run each is one line and
    exit status 2, and none creates the study directory, its journal file or an SQLite database."""
    from attnlab.cli import main

    monkeypatch.chdir(tmp_path)  # the base recipe's trainer.runs_dir is relative: the default study directory
    spec_path = write_study(tmp_path, GRID_8)
    before = files_under(tmp_path)
    sqlite = f"sqlite:///{tmp_path / 'never.db'}"
    for sub in ("status", "table", "plot", "effects", "scaling"):
        for extra in ([], ["--dir", str(tmp_path / "study")], ["--storage", sqlite]):
            assert main(["ablate", sub, str(spec_path), *extra]) == 2, (sub, extra)
            err = capsys.readouterr().err.strip()
            assert "no study 'study'" in err and "attnlab ablate run" in err and "\n" not in err, (sub, extra, err)
    assert main(["ablate", "compare", str(spec_path), str(spec_path)]) == 2
    assert "no study 'study'" in capsys.readouterr().err
    assert files_under(tmp_path) == before
    assert not (tmp_path / "runs").exists() and not (tmp_path / "study").exists()


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
MIN_KILLS = 3  # outside kills inside fits: the storm goes on past STORM_S until this many have landed


def in_fit(study_dir: Path) -> set[int]:
    """PIDs of the workers inside a (fake) fit now: a start in calls.jsonl without its end."""
    starts, ends = read_calls(study_dir)
    done = {(e["pid"], e["hash"]) for e in ends}
    return {c["pid"] for c in starts if (c["pid"], c["hash"]) not in done}


def storm(spec, study_dir: Path, storage: str, opts: Options, n_workers: int, seconds: float, rng: random.Random,
          moments: list[str]) -> dict:
    """n_workers worker processes under two kinds of kills for `seconds`, each dead worker replaced by a new one:
    - every 1.5-3.5 s, one of those inside a fit, at random, is SIGKILLed from outside (and on after `seconds`
      until MIN_KILLS have landed);
    - the first len(moments) workers die by their own hand (ablate/faults.py) at their first visit of one moment
      each, so that every moment is hit whatever the machine's speed (each worker of the first wave claims a point
      of its own: there are more points than workers); then every other worker started does so at the next of
      `moments` in turn, at its n-th visit there (n at random: 1-2 for the claim and recording moments, up to 15
      for journal and database writes). These are the moments where an outside kill rarely lands: in the claim,
      between the fit's end and COMPLETE, with the journal's or the database's lock held.
    Then the workers finish calmly. Returns what happened; every worker must end with status 0."""
    h = prepare_study(spec, study_dir, storage)
    cmd = worker_command(h.spec.path, h.dir, h.url, opts)
    logs = study_dir / "worker-logs"
    logs.mkdir()
    die_log = study_dir / "deaths.jsonl"
    upto = {"claim": 2, "fit_done": 2, "recording": 2, "journal_write": 15, "db_commit": 15}
    started, kills, planned = 0, 0, 0

    def start(storming: bool) -> subprocess.Popen:
        nonlocal started, planned
        env = {k: v for k, v in os.environ.items() if k != "ATTNLAB_DIE_AT"}
        if planned < len(moments):  # the first wave: each moment at its first visit, hit by construction
            env.update(ATTNLAB_DIE_AT=f"{moments[planned]}:1", ATTNLAB_DIE_LOG=str(die_log))
            planned += 1
        elif storming and started % 2 == 0:  # every other worker: a death planned at a moment of its work
            moment = moments[planned % len(moments)]
            env.update(ATTNLAB_DIE_AT=f"{moment}:{rng.randint(1, upto[moment])}", ATTNLAB_DIE_LOG=str(die_log))
            planned += 1
        started += 1
        return subprocess.Popen(cmd, env=env, stdout=open(logs / f"{started:03d}.log", "w"), stderr=subprocess.STDOUT)

    t0 = time.time()
    procs = [start(True) for _ in range(n_workers)]
    ours: set[int] = set()  # pids this storm killed
    try:
        while not read_calls(study_dir)[0] and time.time() - t0 < 180:
            time.sleep(0.2)  # the outside kills start with the first fit (a worker's imports take seconds)
        storm_start = time.time()
        storm_end = storm_start + seconds
        next_kill = storm_start + rng.uniform(1.5, 3.5)
        while any(p.poll() is None for p in procs):
            assert time.time() - t0 < 600, "the study did not finish in 10 minutes"
            now = time.time()
            for i, p in enumerate(procs):
                if p.poll() == -signal.SIGKILL and p.pid not in ours:  # it died where it planned to: replace it
                    ours.add(p.pid)
                    procs[i] = start(now < storm_end)
            if (storm_end > now or kills < MIN_KILLS) and now >= next_kill:
                next_kill = now + rng.uniform(1.5, 3.5)
                busy = in_fit(study_dir)
                targets = [p for p in procs if p.poll() is None and p.pid in busy]
                if targets:  # none: still starting, a kill now would only cost an import
                    victim = rng.choice(targets)
                    victim.send_signal(signal.SIGKILL)
                    victim.wait()
                    ours.add(victim.pid)
                    kills += 1
                    procs[procs.index(victim)] = start(True)
            time.sleep(0.1)
        codes = [p.wait() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    wall = time.time() - t0
    assert codes == [0] * n_workers, "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(logs.iterdir()))
    deaths = [json.loads(x) for x in die_log.read_text().splitlines()] if die_log.exists() else []
    return {"kills": kills, "deaths": deaths, "wall_s": wall, "storm_s": min(time.time(), storm_end) - storm_start,
            "workers_started": started}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["journal", "postgresql"])
def test_a_kill_storm_loses_and_duplicates_nothing(kind, tmp_path, worker_env, monkeypatch, request, capsys):  # noqa: F811
    """8 workers over 96 points with a fast fake fit, killed from outside inside fits and by their own hand in the
    claim, between the fit's end and COMPLETE, and with the journal's or database's lock held (`storm`), for
    STORM_S seconds: every point ends with exactly one COMPLETE trial and exactly one fit that ran to its end (a
    point whose fit had ended is collected, not fitted again), no claim is a duplicate, no trial is left RUNNING,
    and the table is the calm run's."""
    monkeypatch.setenv("FAKE_SLEEP", str(FIT_S))
    storage = storage_for(kind, tmp_path, request)
    spec = load_spec(write_study(tmp_path, GRID_96))
    assert len(spec.points()) == 96
    opts = Options(fit=FAKE, heartbeat_s=1, grace_s=4, poll_s=0.3)
    study_dir = tmp_path / "storm"
    lock_moment = "journal_write" if kind == "journal" else "db_commit"
    moments = ["claim", "fit_done", lock_moment, "recording"]
    got = storm(spec, study_dir, storage, opts, n_workers=8, seconds=STORM_S, rng=random.Random(18), moments=moments)

    h = connect(spec, study_dir)
    trials = h.study.get_trials(deepcopy=False)
    assert not [t.number for t in trials if t.state == TrialState.RUNNING], "a trial outlived its worker"
    by_point = trials_by_point(h)
    assert set(by_point) == {p.point_id for p in spec.points()}, "a point was never run"
    for ts in by_point.values():
        assert [t.state for t in ts].count(TrialState.COMPLETE) == 1, "lost or counted twice"
    lost = [t for t in trials if t.state == TrialState.FAIL and "lost_at" in t.user_attrs]
    dup = [t for t in trials if t.user_attrs.get("status") == "duplicate"]
    reused = [t for t in trials if t.user_attrs.get("fit_reused")]
    retried = sum(len([t for t in ts if t.user_attrs.get("status") != "duplicate"]) > 1 for ts in by_point.values())
    died = Counter(d["moment"] for d in got["deaths"])
    assert got["kills"] >= MIN_KILLS and len(lost) >= got["kills"] / 2, got  # it happened, and hit running trials
    assert all(died[m] >= 1 for m in moments), died  # every moment was hit
    assert not dup, f"{len(dup)} duplicate claims"
    starts, ends = read_calls(study_dir)
    hashes = {t.user_attrs["config_hash"] for t in trials if t.state == TrialState.COMPLETE}
    assert len(hashes) == 96
    assert Counter(e["hash"] for e in ends) == Counter(hashes), "a point's fit ran to its end twice, or never"
    assert len(reused) >= died["fit_done"], (len(reused), died)  # those deaths left a finished fit behind

    calm_dir = tmp_path / "calm"
    monkeypatch.setenv("FAKE_SLEEP", "0")
    run_study(spec, calm_dir, str(calm_dir / "journal.log"), opts=opts, fit=fake_fit)
    assert table_rows(h, tmp_path / "t1") == table_rows(connect(spec, calm_dir), tmp_path / "t2")

    figures = (f"kill storm on {kind}: {len(spec.points())} points in {got['wall_s']:.0f} s "
               f"({60 * len(spec.points()) / got['wall_s']:.0f} points/minute) by 8 workers with a {FIT_S} s fake fit; "
               f"in {got['storm_s']:.0f} s, {got['kills']} kills inside fits and {sum(died.values())} deaths at "
               f"chosen moments ({', '.join(f'{m} {died[m]}' for m in moments)}); {len(lost)} trials lost with "
               f"their worker and rerun ({retried} points retried, {len(reused)} finished fits collected without "
               f"fitting again), {len(dup)} duplicate claims, {len(starts) - len(ends)} fits cut short, "
               f"{len(ends)} fits ran to their end")
    with capsys.disabled():
        print("\n" + figures)


@pytest.mark.slow
@pytest.mark.parametrize("moment", ["claim", "journal_write", "fit_done", "recording"])
def test_a_worker_dead_at_a_chosen_moment_loses_nothing_and_fits_once(moment, tmp_path, worker_env):  # noqa: F811
    """A worker process SIGKILLs itself (ablate/faults.py) at `moment` of its first trial: holding the claim lock
    with its RUNNING trial just created; holding the journal's lock with half a record written; after its fit
    ended; after the result's attrs but before COMPLETE. The next worker breaks the dead one's lock, cuts the
    torn record, fails the trial as lost and runs the point: from a finished fit it collects the run and does not
    fit it again, so the point has one COMPLETE trial and one fit that ran to its end."""
    spec = load_spec(write_study(tmp_path, "seeds: [1]\nretries: 1\naxes:\n  model.ffn: [gelu]\n"))
    study_dir = tmp_path / "study"
    h = prepare_study(spec, study_dir)  # a journal file in the study directory
    opts = Options(fit=FAKE, heartbeat_s=1, grace_s=30, poll_s=0.2)
    deaths = tmp_path / "deaths.jsonl"
    env = {**os.environ, "ATTNLAB_DIE_AT": f"{moment}:1", "ATTNLAB_DIE_LOG": str(deaths)}
    r = subprocess.run(worker_command(h.spec.path, h.dir, h.url, opts), env=env, capture_output=True, text=True,
                       timeout=180)
    assert r.returncode == -signal.SIGKILL, (r.stdout + r.stderr)[-3000:]
    assert json.loads(deaths.read_text())["moment"] == moment
    journal = Path(h.url).read_bytes()
    assert journal.endswith(b"\n") == (moment != "journal_write")  # a torn record left behind
    assert (study_dir / "claim.lock").exists() == (moment == "claim")  # the dead worker's locks
    assert Path(f"{h.url}.lock").exists() == (moment == "journal_write")
    fitted = len(read_calls(study_dir)[1])
    assert fitted == (1 if moment in ("fit_done", "recording") else 0)

    assert run_study(spec, study_dir, opts=opts, fit=fake_fit) == {"done": 1}  # at once: no wait for grace_s
    trials = connect(spec, study_dir).study.get_trials(deepcopy=False)
    done = [t for t in trials if t.state == TrialState.COMPLETE]
    assert len(done) == 1 and done[0].user_attrs["fit_reused"] == (fitted == 1), [t.user_attrs for t in trials]
    assert len(read_calls(study_dir)[1]) == 1, "the point's fit ran to its end twice"
    assert Path(h.url).read_bytes().endswith(b"\n")


# ---------------------------------------------------------------------------------------------- user errors
GRID_2x2 = """\
seeds: [1]
axes:
  model.norm: [layernorm, rmsnorm]
  model.ffn: [gelu, swiglu]
"""


def test_a_storage_or_pair_that_cannot_work_is_one_line_naming_it(tmp_path, monkeypatch, capsys, worker_env):  # noqa: F811
    """A relative SQLite path, a server that refuses, a driver not installed, --pair A A: one line each, naming the
    URL or argument and what to do (they were tracebacks), and the study is as it was."""
    from attnlab.cli import main

    monkeypatch.chdir(tmp_path)
    spec_path = write_study(tmp_path, GRID_2x2)
    study_dir = tmp_path / "study"
    common = ["--fit", FAKE, "--heartbeat", "1", "--grace", "2", "--poll", "0.2"]
    assert main(["ablate", "run", str(spec_path), "--dir", str(study_dir), *common]) == 0
    journal = (study_dir / "journal.log").read_bytes()
    capsys.readouterr()
    cases = [
        (["move", str(study_dir), "--to", "sqlite:///nowhere/toy.db"], ["sqlite:///nowhere/toy.db", "sqlite:////"]),
        (["run", str(spec_path), "--dir", str(study_dir), "--storage", "postgresql://u:secret@127.0.0.1:1/db", *common],
         ["postgresql://u:***@127.0.0.1:1/db", "cannot connect", "--storage"]),
        (["status", str(spec_path), "--dir", str(study_dir), "--storage", "mysql://u@127.0.0.1:1/db"],
         ["mysql://u@127.0.0.1:1/db", "--storage"]),
        (["effects", str(spec_path), "--dir", str(study_dir), "--pair", "model.ffn", "model.ffn"],
         ["--pair model.ffn model.ffn", "two different factors"]),
    ]
    for argv, needles in cases:
        assert main(["ablate", *argv]) == 2, argv
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and "Traceback" not in err and "secret" not in err, err
        for needle in needles:
            assert needle in err, (needle, err)
    assert (study_dir / "journal.log").read_bytes() == journal and not (tmp_path / "nowhere").exists()
    assert connect(load_spec(spec_path), study_dir).url == str(study_dir / "journal.log")


def test_a_study_folder_moved_as_a_whole_keeps_working(tmp_path, capsys, worker_env):  # noqa: F811
    """study.yaml recorded its journal by an absolute path: after `mv` of the folder, `table` said "no study" at
    the old place, and following its hint started the study again there. A journal in the folder is recorded
    relative to it; an old record's absolute journal that is gone is looked for in the folder."""
    from attnlab.cli import main

    spec_path = write_study(tmp_path, GRID_2x2)
    old = tmp_path / "runs" / "ablations" / "part2"
    common = ["--fit", FAKE, "--heartbeat", "1", "--grace", "2", "--poll", "0.2"]
    assert main(["ablate", "run", str(spec_path), "--dir", str(old), *common]) == 0
    assert "storage: journal.log\n" in (old / "study.yaml").read_text()
    for record in ("journal.log", str(old / "journal.log")):  # as recorded now, and by the former absolute path
        moved = tmp_path / f"moved_{len(record)}"
        text = (old / "study.yaml").read_text().replace("storage: journal.log", f"storage: {record}")
        (old / "study.yaml").write_text(text)
        old.rename(moved)
        capsys.readouterr()
        for sub in ("status", "table"):
            assert main(["ablate", sub, str(moved)]) == 0, (record, sub, capsys.readouterr().err)
        assert "4 points: 4 done" in capsys.readouterr().out
        assert connect(load_spec(spec_path), moved).url == str(moved / "journal.log")
        assert not old.exists()  # nothing made at the old place
        moved.rename(old)
    spec_path.rename(tmp_path / "elsewhere.yaml")
    assert main(["ablate", "status", str(old)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and str(spec_path) in err and "give the ablation file" in err, err


def test_the_move_submit_suggests_after_a_move_to_sqlite_works(tmp_path, capsys, worker_env):  # noqa: F811
    """run (journal) -> move to SQLite -> submit refused, suggesting `move ... --to <study>/journal.log`, which then
    failed: the first move left that journal, holding the study, in place. The suggested command now works."""
    import re

    from attnlab.cli import main

    spec_path = write_study(tmp_path, GRID_2x2)
    study_dir = tmp_path / "study"
    common = ["--fit", FAKE, "--heartbeat", "1", "--grace", "2", "--poll", "0.2"]
    assert main(["ablate", "run", str(spec_path), "--dir", str(study_dir), *common]) == 0
    assert main(["ablate", "move", str(study_dir), "--to", f"sqlite:///{tmp_path / 'toy.db'}"]) == 0
    capsys.readouterr()
    assert main(["ablate", "submit", str(spec_path), "--dir", str(study_dir), "--fit", FAKE]) == 2
    suggested = re.search(r"attnlab ablate move (\S+) --to (\S+)", capsys.readouterr().err)
    assert suggested is not None and suggested[2] != str(study_dir / "journal.log")
    assert main(["ablate", "move", suggested[1], "--to", suggested[2]]) == 0, capsys.readouterr().err
    assert connect(load_spec(spec_path), study_dir).url == suggested[2]
    assert main(["ablate", "submit", str(spec_path), "--dir", str(study_dir), "--fit", FAKE]) == 0
    assert "nothing to run" in capsys.readouterr().out
    assert main(["ablate", "move", str(study_dir), "--to", str(study_dir / "journal.log")]) == 2
    assert f"--to {study_dir / 'journal-3.log'}" in capsys.readouterr().err
