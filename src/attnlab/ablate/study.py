"""An ablation study in its optuna storage: where it is kept, how it is opened, and the state of every point.

Each grid point is a (variant, seed) with a stable `point_id`; a search's points are made by its trials. A
trial's state and user attrs (status, heartbeat, worker) say where its point stands: done, invalid, running,
stale (a worker stopped stamping its heartbeat), failed (more failed attempts than `retries`) or pending.
runner.py claims and runs points; attnlab.analysis turns the finished ones into tables and plots, reading
each trial's value of a metric with `trial_value` (a final score, or the last value of a logged curve).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import time
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
import sqlalchemy
from optuna.storages import BaseStorage, JournalStorage, RDBStorage
from optuna.trial import FrozenTrial, TrialState

from ..config import ConfigError, load_yaml
from ..leftovers import owner, owner_alive, stamped
from . import faults
from .edges import lr_extensions, scaling_metric
from .journal import WholeJournalFile
from .seeds import adopt
from .spec import AblationSpec, Point, load_spec

log = logging.getLogger("attnlab.ablate")

DONE, INVALID, RUNNING, STALE, FAILED, PENDING = "done", "invalid", "running", "stale", "failed", "pending"


@dataclass
class StudyHandle:
    spec: AblationSpec
    dir: Path
    url: str
    storage: BaseStorage
    study: optuna.Study
    study_id: int


@dataclass
class PointState:
    point_id: str
    variant: str
    seed: int
    status: str
    trials: list[FrozenTrial] = field(default_factory=list)
    attempts: int = 0  # failed attempts that count against `retries` (error, lost)

    @property
    def result(self) -> FrozenTrial | None:
        return next((t for t in self.trials if t.state == TrialState.COMPLETE), None)

    @property
    def reason(self) -> str:
        """Why the point's latest attempt ended without a result: its recorded reason or error; a trial failed as lost
        before the reason was recorded (or lost before it could record one) says whose worker was lost."""
        for t in reversed(self.trials):
            text = t.user_attrs.get("reason") or t.user_attrs.get("error")
            if text:
                return str(text)
            status = str(t.user_attrs.get("status", "lost")) if t.state == TrialState.FAIL else ""
            if status == "lost":
                return f"lost: its worker {t.user_attrs.get('worker', '(unknown)')} stopped before recording the trial"
            if status == "interrupted":
                return "interrupted"
        return ""


# ---------------------------------------------------------------------------------------------- storage
def default_study_dir(spec: AblationSpec) -> Path:
    """<base trainer.runs_dir>/ablations/<name>, e.g. runs/ablations/block_variants."""
    return Path(spec.experiment({}).trainer.runs_dir) / "ablations" / spec.name


def storage_url(study_dir: Path, storage: str | None = None) -> str:
    """The storage of a study: `storage` when given (an optuna storage URL, or a journal file path), else the one
    its study directory records (study.yaml), else a journal file in the study directory. One default for
    `ablate run` and `ablate submit`: a journal file works on one machine and on a shared file system alike."""
    recorded = study_dir / "study.yaml"
    if storage is None and recorded.is_file():
        return recorded_storage(study_dir, str(load_yaml(recorded)["storage"]))
    if storage is None:
        storage = str(study_dir / "journal.log")
    if "://" not in storage:  # a journal file: absolute, so the study directory's record holds anywhere
        return str(Path(storage.removeprefix("journal:")).resolve())
    return storage


def recorded_storage(study_dir: Path, storage: str) -> str:
    """The storage study.yaml records: a URL, or a journal file, relative to the study directory when it lies in it
    (so the folder moved as a whole keeps it). A record of an absolute journal path that is gone, from before
    records were relative, finds the journal of that name in the study directory: the folder was moved."""
    if "://" in storage:
        return storage
    path = Path(storage.removeprefix("journal:"))
    if not path.is_absolute():
        return str((study_dir / path).resolve())
    here = study_dir / path.name
    if not path.exists() and here.is_file():
        log.warning("%s records the journal %s, which is gone; using %s (the study folder was moved)",
                    study_dir / "study.yaml", path, here)
        return str(here.resolve())
    return str(path.resolve())


class OwnedLock:
    """A lock file created with O_EXCL (safe on NFS) that names its holder (`leftovers.owner`). A waiter breaks
    it at once when the holder is a process of this host that is gone (SIGKILLed while holding it), and after
    `grace_s` without change otherwise (a holder on a node that died). Unlike optuna's JournalFileOpenLock, a
    waiter interrupted while waiting (SIGTERM, Ctrl-C) never removes the lock another process holds. It has
    the two methods JournalFileBackend calls on a lock: acquire and release."""

    def __init__(self, path: str | Path, grace_s: float = 30.0) -> None:
        self.path, self.grace_s = Path(path), grace_s

    def acquire(self) -> bool:
        delay, seen, since = 0.001, None, time.monotonic()
        while True:
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                try:
                    holder, mtime = self.path.read_text(), self.path.stat().st_mtime_ns
                except OSError:
                    continue  # released meanwhile
                if (holder, mtime) != seen:
                    seen, since = (holder, mtime), time.monotonic()
                gone = holder and owner_alive(holder) is False  # empty: written in a moment
                if gone or time.monotonic() - since > self.grace_s:
                    self._break(holder, "its holder is gone" if gone else f"held for over {self.grace_s:.0f} s")
                    delay = 0.001
                    continue
                time.sleep(delay)
                delay = min(2 * delay, 0.05)
                continue
            try:
                os.write(fd, owner().encode())
            except BaseException:  # interrupted before it says whose it is: not left behind unnamed
                os.close(fd)
                os.unlink(self.path)
                raise
            os.close(fd)
            return True

    def _break(self, holder: str, why: str) -> None:
        """Move the lock aside and delete it, unless it changed hands since it was judged (then put it back)."""
        aside = self.path.with_name(f"{self.path.name}.{uuid.uuid4().hex}.broken")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        if aside.read_text() != holder:  # another waiter broke it first and a live process took it since
            with contextlib.suppress(FileExistsError):
                os.link(aside, self.path)
        else:
            log.warning("lock %s broken: %s (%s)", self.path, why, holder)
        aside.unlink()

    def release(self) -> None:
        try:
            if self.path.read_text() != owner():  # broken while held (frozen past grace_s): not ours to remove
                log.warning("lock %s was taken over while this process held it", self.path)
                return
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def open_storage(url: str) -> BaseStorage:
    if "://" not in url:  # a journal file (shared file systems: one appended log, an O_EXCL lock file; journal.py)
        path = Path(url).resolve()
        path.parent.mkdir(parents=True, exist_ok=True)
        return JournalStorage(WholeJournalFile(str(path), lock_obj=OwnedLock(f"{path}.lock")))
    try:
        if url.startswith("sqlite"):  # concurrent writers wait for SQLite's lock instead of failing at 5 s
            storage = RDBStorage(url, engine_kwargs={"connect_args": {"timeout": 120}})
        else:
            driver_url = url
            if url.startswith("postgresql://") and importlib.util.find_spec("psycopg"):
                driver_url = "postgresql+psycopg://" + url.removeprefix("postgresql://")  # the `postgres` extra's
            storage = RDBStorage(driver_url)
    except (ImportError, sqlalchemy.exc.SQLAlchemyError, ValueError) as e:
        raise ConfigError(storage_error(url, e)) from None
    if (faults.planned() or ("",))[0] == "db_commit":  # the kill-storm tests: die with a transaction open
        sqlalchemy.event.listen(storage.engine, "commit", lambda conn: faults.reached("db_commit"))
    return storage


def storage_error(url: str, e: BaseException) -> str:
    """One line for a storage that cannot be opened: the URL (without its password), why, and what to do."""
    try:
        shown = sqlalchemy.engine.make_url(url).render_as_string(hide_password=True)
    except Exception:
        shown = url
    cause = getattr(e, "orig", None) or e  # the driver's own error under SQLAlchemy's
    why = " ".join(str(cause).split()) or type(cause).__name__
    if isinstance(e, ImportError):
        inner = e.__cause__ if isinstance(e.__cause__, ImportError) else e  # optuna's wraps the driver's
        return (f"storage {shown}: its database driver is not installed ({inner}); install it (PostgreSQL: pip "
                "install 'attnlab[postgres]'; MySQL: pip install mysqlclient), or give --storage a journal file "
                "path or an sqlite:/// URL")
    if url.startswith("sqlite"):
        database = sqlalchemy.engine.make_url(url).database or ""
        where = Path(database).resolve()
        hint = "" if Path(database).is_absolute() else \
            f" (three slashes: a path relative to {Path.cwd()}; an absolute path takes four: sqlite:////{database})"
        return f"storage {shown}: cannot open the SQLite file {where}{hint}: {why}"
    return (f"storage {shown}: cannot connect ({why[:300]}); check that the database server runs and the URL's host, "
            "port, user and database, or give --storage another storage")


def storage_file(url: str) -> Path | None:
    """The local file a storage keeps its studies in (a journal file, an SQLite database), which opening the
    storage creates when it is missing; None for a server's storage (PostgreSQL, MySQL) or an in-memory one."""
    if "://" not in url:
        return Path(url).resolve()
    if url.startswith("sqlite"):
        database = sqlalchemy.engine.make_url(url).database
        if database and database != ":memory:" and not database.startswith("file:"):
            return Path(database).resolve()
    return None


def quiet_optuna() -> None:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)


def prepare_study(spec: AblationSpec, study_dir: Path | None = None, storage: str | None = None) -> StudyHandle:
    """Create (or open) the study and record the spec in it; call once before starting workers."""
    quiet_optuna()
    study_dir = (study_dir or default_study_dir(spec)).resolve()
    study_dir.mkdir(parents=True, exist_ok=True)
    url = storage_url(study_dir, storage)
    for attempt in range(3):  # two `run`s creating one SQLite schema at once: the loser retries
        try:
            st = open_storage(url)
            study = optuna.create_study(storage=st, study_name=spec.name, load_if_exists=True,
                                        direction="maximize" if spec.direction == "max" else "minimize")
            break
        except Exception:
            if attempt == 2:
                raise
            time.sleep(1.0 + attempt)
    spec = adopt(spec, study.user_attrs.get("rounds"))  # run in rounds before: a file without them runs them too
    if spec.rounds is not None:
        study.set_user_attr("rounds", spec.rounds.to_dict(spec.seeds))
    baseline = spec.baseline()
    study.set_user_attr("spec", spec.to_dict())
    study.set_user_attr("baseline", baseline.key if baseline else None)
    if not spec.is_search:
        study.set_user_attr("variants", [{"key": v.key, "name": v.name} for v in spec.variants()])
    write_record(spec, study_dir, url)
    return StudyHandle(spec, study_dir, url, st, study, st.get_study_id_from_name(spec.name))


def connect(spec: AblationSpec, study_dir: Path, storage: str | None = None) -> StudyHandle:
    """Open an existing study (workers, status, reports). A study never run is a ConfigError, and leaves no file
    behind: its journal file or SQLite database is not created (nor the study directory)."""
    quiet_optuna()
    study_dir = study_dir.resolve()
    url = storage_url(study_dir, storage)
    never_run = f"no study {spec.name!r} in {url}; run `attnlab ablate run {spec.path}` first"
    kept = storage_file(url)
    if kept is not None and not kept.is_file():  # opening it would create it (and its folder): a query leaves none
        raise ConfigError(never_run)
    st = open_storage(url)
    try:
        study = optuna.load_study(study_name=spec.name, storage=st)
    except KeyError:
        raise ConfigError(never_run) from None
    spec = adopt(spec, study.user_attrs.get("rounds"))  # the rounds it was run with (seeds.py)
    return StudyHandle(spec, study_dir, url, st, study, st.get_study_id_from_name(spec.name))


def open_study(ref: str | Path, storage: str | None = None, study_dir: str | Path | None = None) -> StudyHandle:
    """A study from an ablation file or a study directory (which holds study.yaml, written by `run`)."""
    ref = Path(ref)
    if ref.is_dir():
        info_path = ref / "study.yaml"
        if not info_path.exists():
            raise ConfigError(f"{ref} is not a study directory (no study.yaml); give the ablation file instead")
        info = load_yaml(info_path)
        if not Path(str(info["spec"])).is_file():
            raise ConfigError(f"{info_path}: spec: the ablation file {info['spec']} is not there (moved?); give the "
                              f"ablation file instead, with --dir {ref}")
        return connect(load_spec(info["spec"]), ref, storage)  # storage None: the one study.yaml records
    spec = load_spec(ref)
    return connect(spec, Path(study_dir) if study_dir else default_study_dir(spec), storage)


def move_study(h: StudyHandle, to: str) -> StudyHandle:
    """Copy a study, every trial with its attributes, into another storage (`to`: a URL or a journal file) and
    record that storage in the study directory; the old one is left as it was. Refused while a trial runs."""
    url = storage_url(h.dir, to)
    if url == h.url:
        raise ConfigError(f"{h.spec.name} is already in {url}")
    running = [t.number for t in h.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
               if trial_status(t, time.time(), 120.0) == RUNNING]
    if running:
        raise ConfigError(f"{h.spec.name}: trial(s) {running} are running in {h.url}; move the study once its "
                          "workers have stopped")
    try:
        optuna.copy_study(from_study_name=h.spec.name, from_storage=h.storage, to_storage=open_storage(url))
    except optuna.exceptions.DuplicatedStudyError:
        raise ConfigError(f"{url} already holds a study named {h.spec.name!r} (a copy an earlier move left behind?); "
                          f"move it to a new file instead, e.g. --to {free_journal(h.dir)}") from None
    moved = connect(h.spec, h.dir, url)
    if len(moved.study.get_trials(deepcopy=False)) != len(h.study.get_trials(deepcopy=False)):
        raise RuntimeError(f"copying {h.spec.name} from {h.url} to {url} lost trials")
    write_record(h.spec, h.dir, url)
    return moved


def free_journal(study_dir: Path) -> Path:
    """A journal file in the study directory that does not exist yet (journal.log, else journal-2.log, ...): where a
    study can be moved back to, since a move leaves the storage it left as it was."""
    n, path = 1, study_dir / "journal.log"
    while path.exists():
        n += 1
        path = study_dir / f"journal-{n}.log"
    return path


def write_record(spec: AblationSpec, study_dir: Path, url: str) -> None:
    """study.yaml: the study's name, storage and ablation file, read by `status`, `table`, `submit` and workers; a
    journal file in the study directory is recorded relative to it."""
    if "://" not in url and Path(url).resolve().is_relative_to(study_dir.resolve()):
        url = str(Path(url).resolve().relative_to(study_dir.resolve()))  # moves with the folder (recorded_storage)
    info = {"name": spec.name, "storage": url, "spec": str(spec.path)}
    tmp = study_dir / stamped(".study.yaml", ".tmp")  # replaced in one rename: a killed worker leaves no half file
    tmp.write_text("".join(f"{k}: {v}\n" for k, v in info.items()), encoding="utf-8")
    os.replace(tmp, study_dir / "study.yaml")


# ---------------------------------------------------------------------------------------------- results
def final_scores(t: FrozenTrial, study_attrs: dict[str, Any]) -> dict[str, Any]:
    """A trial's final evaluation: the one `ablate evaluate` stored in the study for it, else its own (final.py)."""
    return study_attrs.get(f"final:{t.number}") or t.user_attrs.get("final") or {}


def trial_value(t: FrozenTrial, metric: str, study_attrs: dict[str, Any]) -> float | None:
    """The trial's value of `metric`: final/<name> from its final evaluation, else the last value of that logged
    curve (val/bleu, val/loss, train/loss). None when the trial has none."""
    if metric.startswith("final/"):
        value = final_scores(t, study_attrs).get(metric.removeprefix("final/"))
        return None if value is None else float(value)
    curve = (t.user_attrs.get("curves") or {}).get(metric)
    if curve:
        return float(curve[-1][1])
    return float(t.value) if t.user_attrs.get("metric_name") == metric and t.value is not None else None


# ---------------------------------------------------------------------------------------------- state
def trial_status(t: FrozenTrial, now: float, grace_s: float) -> str:
    if t.state == TrialState.COMPLETE:
        return DONE
    if t.state == TrialState.RUNNING:  # stale: no heartbeat for grace_s, or its worker (on this host) is gone
        late = now - float(t.user_attrs.get("heartbeat", 0)) > grace_s
        return STALE if late or owner_alive(t.user_attrs.get("worker")) is False else RUNNING
    if t.state == TrialState.FAIL:
        return str(t.user_attrs.get("status", "lost"))  # error | invalid | duplicate | interrupted | lost
    return t.state.name.lower()


def point_states(h: StudyHandle, trials: list[FrozenTrial] | None = None, grace_s: float = 120.0
                 ) -> dict[str, PointState]:
    """The state of every point: grid points of the spec (in order), or a search's points as trials made them."""
    trials = h.study.get_trials(deepcopy=False) if trials is None else trials
    now = time.time()
    states: dict[str, PointState] = {}
    if not h.spec.is_search:
        for p in h.spec.points():
            states[p.point_id] = PointState(p.point_id, p.variant.name, p.seed, PENDING)
    others: dict[str, list[FrozenTrial]] = {}
    for t in sorted(trials, key=lambda t: t.number):
        pid = t.user_attrs.get("point_id")
        if pid is None or (pid not in states and not h.spec.is_search):
            others.setdefault(pid, []).append(t)  # an lr: extension's point, or not a point of this file any more
            continue
        if pid not in states:
            states[pid] = PointState(pid, str(t.user_attrs.get("variant")), int(t.user_attrs.get("seed", 0)), PENDING)
        states[pid].trials.append(t)
    _set_status(h, states.values(), now, grace_s)
    for p in extension_points(h, states):  # due once their cell's grid points have finished (edges.py)
        states[p.point_id] = PointState(p.point_id, p.variant.name, p.seed, PENDING, others.get(p.point_id, []))
        _set_status(h, [states[p.point_id]], now, grace_s)
    return states


def extension_points(h: StudyHandle, states: dict[str, PointState]) -> list[Point]:
    """The points `lr: {extend_edges: true}` adds, given the grid's point states (edges.lr_extensions)."""
    if not h.spec.lr_extend:
        return []
    metric, attrs = scaling_metric(h.spec), h.study.user_attrs

    def finished(p: Point) -> tuple[bool, float | None]:
        s = states[p.point_id]
        return s.status in (DONE, INVALID, FAILED), trial_value(s.result, metric, attrs) if s.result else None

    return lr_extensions(h.spec, finished)


def _set_status(h: StudyHandle, states: Any, now: float, grace_s: float) -> None:
    for s in states:
        kinds = [trial_status(t, now, grace_s) for t in s.trials]
        s.attempts = sum(k in ("error", "lost") for k in kinds)
        for status in (DONE, INVALID, RUNNING, STALE):
            if status in kinds:
                s.status = status
                break
        else:
            s.status = FAILED if s.attempts > h.spec.retries else PENDING


def status_counts(h: StudyHandle, grace_s: float = 120.0) -> dict[str, int]:
    counts: dict[str, int] = {}
    for s in point_states(h, grace_s=grace_s).values():
        counts[s.status] = counts.get(s.status, 0) + 1
    return counts


def devices_note(t: FrozenTrial) -> str:
    """', GPUs 0,1' (or ', CPU' / ', all GPUs') from a trial's cuda_visible_devices user attr; '' when unrecorded."""
    devices = t.user_attrs.get("cuda_visible_devices")
    if devices is None:
        return ""
    return {"cpu": ", CPU", "all": ", all GPUs", "": ", no GPU"}.get(devices, f", GPUs {devices}")


def format_status(h: StudyHandle, grace_s: float = 120.0, unneeded: set[str] = frozenset()) -> str:
    """Which points are done, running, failed, invalid, pending; one line each. `unneeded`: the pending points no round
    of a study in rounds needs (analysis/rounds.py), counted as such and not listed."""
    states = [s for s in point_states(h, grace_s=grace_s).values() if s.point_id not in unneeded]
    counts = {k: sum(s.status == k for s in states) for k in (DONE, RUNNING, STALE, FAILED, INVALID, PENDING)}
    counts["not needed"] = len(unneeded)
    total = h.spec.n_trials if h.spec.is_search else len(states) + len(unneeded)
    if h.spec.is_search:
        counts[PENDING] += max(0, h.spec.n_trials - len(states))
    lines = [f"study {h.spec.name}  ({h.url})  metric {h.spec.metric} ({h.spec.direction})",
             f"{total} points: " + ", ".join(f"{v} {k}" for k, v in counts.items() if v) + "\n"]
    width = max([len(s.variant) for s in states] + [7])
    lines.append(f"{'status':<8}  {'variant':<{width}}  seed  tries  result")
    for s in states:
        r = s.result
        if r is not None:
            detail = f"{h.spec.metric}={r.value:.4g}  (trial {r.number}, {r.user_attrs.get('wall_s', 0):.0f} s" \
                     f"{devices_note(r)})"
        elif s.status in (RUNNING, STALE):
            t = s.trials[-1]
            detail = f"trial {t.number} on {t.user_attrs.get('worker')}{devices_note(t)}"
            detail += f" (SLURM job {t.user_attrs['slurm_job']})" if "slurm_job" in t.user_attrs else ""
            detail += f", last heartbeat {time.time() - float(t.user_attrs.get('heartbeat', 0)):.0f} s ago"
        else:
            detail = s.reason.splitlines()[0][:100] if s.reason else ""
        tries = len([t for t in s.trials if t.user_attrs.get("status") != "duplicate"])
        lines.append(f"{s.status:<8}  {s.variant:<{width}}  {s.seed:>4}  {tries:>5}  {detail}")
    return "\n".join(lines)
