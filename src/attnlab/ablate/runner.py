"""Run an ablation: one optuna study, local or distributed workers, every point exactly once.

Each grid point is a (variant, seed) with a stable `point_id`. Workers do not let a sampler pick points:
optuna's GridSampler can hand one point to two workers near the end of a grid, starts new trials on a
finished one, and cannot express a `variants:` list. Instead a worker *claims* a point:

1. under a lock file in the study directory (`claim.lock`, created with O_EXCL, safe on NFS, naming its
   holder; a lock left by a killed worker is broken at once when that worker ran on this host, else after
   30 s), it reads the study's trials, fails RUNNING trials whose worker is gone (no heartbeat for the grace
   period, or a worker process of this host that no longer exists), and picks the first point that has no
   COMPLETE trial, no invalid record, no live RUNNING trial, and fewer than 1 + retries failed attempts;
2. it creates a RUNNING trial with user attrs point_id, variant, seed, overrides and a heartbeat;
3. it reads the trials again: if a live trial for the same point has a lower number (a worker that did not
   share the lock), its own trial is recorded as a duplicate and never runs.

So every point has at most one live trial and, once done, exactly one COMPLETE trial: guaranteed for all
workers that share the study directory (local workers, SLURM jobs on a shared file system), and by step 3
alone on storages that order writes (SQLite, a journal file). While a trial runs, a thread stamps its
`heartbeat` user attr every `heartbeat_s`; a worker that dies stops stamping, and after `grace_s` (at once
when it ran on the claiming worker's host) the next claim fails its trial ("lost") and runs the point again,
resuming from the newest checkpoint of its run directory that loads (`checkpoints.latest_checkpoint`) when
the run left one; when that attempt's fit had run to its end (`rundir.fit_done`: its worker died between the
fit and the trial's COMPLETE), the run is collected and evaluated, not fitted again. Heartbeats are kept as user
attrs rather than optuna's RDB heartbeat because optuna's JournalStorage has none, and the SLURM runner uses a
journal file. A worker whose trial was declared lost while it was merely frozen gets UpdateFinishedTrialError
when it reports: its result is discarded.

A trial whose config cannot run is recorded as FAIL with status=invalid and the reason, never retried. A
trial that raises is FAIL with status=error, the error and the traceback tail, and is tried again while
the point has fewer than 1 + retries failed (error or lost) attempts. A trial whose worker is stopped by SIGINT
or SIGTERM (`ablate run`, `ablate worker`, a SLURM job requeued or cancelled) is FAIL with status=interrupted: no
failed attempt, so the next run resumes it from its newest checkpoint.

A finished fit is then evaluated as its recipe defines it (final.py, unless the file says final_eval: false), and
the trial stores what the tables show: the final scores, its curves (every val/ one and train/loss), parameters,
steps, tokens, FLOPs per token, tokens/s and its resolved config. A grid trial carries its factor values as
optuna params with categorical distributions, so optuna-dashboard and optuna.visualization slice by factor.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from optuna.distributions import BaseDistribution
from optuna.exceptions import UpdateFinishedTrialError
from optuna.storages import BaseStorage
from optuna.trial import TrialState

from ..analysis.rounds import points_wanted, round_counts
from ..checkpoints import latest_checkpoint
from ..config import ConfigError
from ..experiment import Experiment
from ..launch.job import (
    DEFAULT_FIT,
    FitFn,
    job_identity,
    kill_steps,
    local_fit,
    resolve_fit,
    stop_signal,
    stop_status,
)
from ..leftovers import owner, owner_alive
from ..rundir import fit_done
from . import faults
from .budget import StepCost, scale_flops, step_cost, warmup_warning, with_flops_budget
from .devices import gpu_slices, trial_devices, visible_devices_label, visible_gpus
from .factors import fmt, short_key
from .final import DEFAULT_EVALUATE
from .params import grid_params, optuna_distributions
from .results import collect
from .spec import AblationSpec
from .study import (
    DONE,
    INVALID,
    PENDING,
    RUNNING,
    STALE,
    OwnedLock,
    PointState,
    StudyHandle,
    extension_points,
    point_states,
    prepare_study,
    status_counts,
    trial_status,
)

log = logging.getLogger("attnlab.ablate")


@dataclass
class Options:
    """How workers behave. Every worker of a study must use the same heartbeat_s and grace_s."""

    fit: str = DEFAULT_FIT  # "module:function" with train.fit's signature; importable by worker processes
    evaluate: str = DEFAULT_EVALUATE  # "module:function" (exp, run_dir) -> final scores (final.evaluate_run)
    heartbeat_s: int = 30
    grace_s: int = 120  # a RUNNING trial with no heartbeat for this long is lost
    poll_s: float = 10.0  # how often an idle worker looks again while other workers' points run
    max_trials: int | None = None  # per worker; None = until nothing is left
    max_round: int | None = None  # a study in rounds: claim no point of a later round (a SLURM array is one round)
    linger: bool = True  # wait while other workers' points run (one may be lost); SLURM workers exit instead


def options_from(args: argparse.Namespace) -> Options:
    """The Options of `ablate run`, `ablate worker` and `ablate submit` from their command-line arguments."""
    return Options(fit=args.fit, evaluate=args.evaluate, heartbeat_s=args.heartbeat, grace_s=args.grace,
                   poll_s=args.poll, max_trials=getattr(args, "max_trials", None),
                   max_round=getattr(args, "max_round", None),
                   linger=not getattr(args, "no_linger", False))


@contextmanager
def claim_lock(study_dir: Path) -> Iterator[None]:
    lock = OwnedLock(study_dir / "claim.lock", grace_s=30)
    lock.acquire()
    try:
        yield
    finally:
        lock.release()


def fail_stale(h: StudyHandle, grace_s: float) -> int:
    """Fail RUNNING trials whose worker died: no heartbeat for grace_s, or a worker process of this host that is
    gone. Returns how many."""
    now, n = time.time(), 0
    for t in h.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if trial_status(t, now, grace_s) == STALE:
            worker, age = t.user_attrs.get("worker"), now - float(t.user_attrs.get("heartbeat", 0))
            why = f"its worker {worker} is gone" if owner_alive(worker) is False else \
                f"its worker {worker} sent no heartbeat for {age:.0f} s"
            try:
                h.storage.set_trial_user_attr(t._trial_id, "lost_at", now)
                h.storage.set_trial_user_attr(t._trial_id, "reason", f"lost: {why}")
                h.storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
                n += 1
                log.warning("trial %d (%s) lost: %s (last heartbeat %.0f s ago)", t.number, t.user_attrs.get("variant"),
                            why, age)
            except UpdateFinishedTrialError:
                pass  # its worker reported after all, or another worker failed it first
    return n


# ---------------------------------------------------------------------------------------------- claims
@dataclass
class Claim:
    trial_id: int
    number: int
    point_id: str
    variant: str
    overrides: dict[str, Any]
    seed: int


def _attrs(point_id: str, variant: str, overrides: dict[str, Any], seed: int, attempt: int) -> dict[str, Any]:
    job = job_identity()  # inside SLURM: which job (array task) and which run of it after requeues
    return {"point_id": point_id, "variant": variant, "overrides": overrides, "seed": seed, "attempt": attempt,
            "worker": owner(), "heartbeat": time.time(), "cuda_visible_devices": visible_devices_label(),
            **({"slurm_job": job[0], "slurm_restart": job[1]} if job else {})}


def fail_requeued(h: StudyHandle) -> None:
    """In a requeued SLURM job: this job's earlier run was killed with its trial RUNNING (usually it records
    the trial as interrupted itself; not after SIGKILL). Release that point now, not after grace_s."""
    job = job_identity()
    for t in h.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)) if job and job[1] else []:
        if t.user_attrs.get("slurm_job") == job[0] and int(t.user_attrs.get("slurm_restart", 0)) < job[1]:
            record_interrupted(h, t._trial_id, "its job was requeued")


def record_interrupted(h: StudyHandle, trial_id: int, reason: str) -> None:
    """A trial stopped from outside (SIGINT, SIGTERM, a SLURM requeue): FAIL with status=interrupted, which is no
    failed attempt (study.point_states), so the point is claimed again and resumed from its newest checkpoint."""
    _finish(h, trial_id, TrialState.FAIL, {"status": "interrupted", "reason": reason})


def _create_running(h: StudyHandle, attrs: dict[str, Any], params: dict[str, Any] | None = None,
                    dists: dict[str, BaseDistribution] | None = None) -> tuple[int, int]:
    template = optuna.trial.create_trial(state=TrialState.RUNNING, params=params or {},
                                         distributions=dists or {}, user_attrs=attrs)
    tid = h.storage.create_new_trial(h.study_id, template_trial=template)
    return tid, h.storage.get_trial(tid).number


def _first_live_claim(h: StudyHandle, point_id: str, number: int, grace_s: float) -> bool:
    """After creating trial `number` for point_id: is it the lowest-numbered live trial of that point?"""
    now = time.time()
    for t in h.study.get_trials(deepcopy=False):
        if t.user_attrs.get("point_id") == point_id and t.number < number:
            if trial_status(t, now, grace_s) in (DONE, INVALID, RUNNING, STALE):
                return False
    return True


def claim_next(h: StudyHandle, grace_s: float, max_round: int | None = None) -> tuple[Claim | None, bool]:
    """Claim the next point to run. Returns (claim or None, whether other workers still run points)."""
    with claim_lock(h.dir):
        fail_requeued(h)
        fail_stale(h, grace_s)
        states = point_states(h, grace_s=grace_s)
        busy = any(s.status in (RUNNING, STALE) for s in states.values())
        wanted = points_wanted(h, states, max_round)  # seeds until decided: the round under way (analysis/rounds.py)
        if h.spec.is_search:
            return _claim_search(h, states, grace_s), busy
        for p in h.spec.points() + extension_points(h, states):  # an lr: edge's extension (edges.py)
            s = states[p.point_id]
            if s.status != PENDING or (wanted is not None and p.point_id not in wanted):
                continue
            attrs = _attrs(p.point_id, p.variant.name, p.variant.overrides, p.seed, s.attempts + 1)
            attrs["variant_key"] = p.variant.key
            try:
                tid, number = _create_running(h, attrs, *grid_params(h.spec, p.variant))
            except ValueError as e:  # an axis whose values changed since earlier trials: optuna refuses new choices
                log.warning("%s: factor values not recorded as optuna params (%s)", p.variant.name, e)
                tid, number = _create_running(h, attrs)
            faults.reached("claim")
            if _first_live_claim(h, p.point_id, number, grace_s):
                return Claim(tid, number, p.point_id, p.variant.name, p.variant.overrides, p.seed), busy
            _finish(h, tid, TrialState.FAIL, {"status": "duplicate"})
            log.warning("point %s was claimed by another worker first; trial %d recorded as duplicate",
                        p.variant.name, number)
        return None, busy


def _claim_search(h: StudyHandle, states: dict[str, PointState], grace_s: float) -> Claim | None:
    """A TPE search: first re-run failed or lost points with their parameters, then ask for new ones."""
    seed = h.spec.seeds[0]
    for s in states.values():
        if s.status == PENDING and s.trials:
            first = s.trials[0]
            attrs = _attrs(s.point_id, s.variant, dict(first.user_attrs["overrides"]), seed, s.attempts + 1)
            tid, number = _create_running(h, attrs, first.params, first.distributions)
            return Claim(tid, number, s.point_id, s.variant, attrs["overrides"], seed)
    if len(states) >= h.spec.n_trials:
        return None
    trial = h.study.ask(optuna_distributions(h.spec))
    keys = list(trial.params)
    variant = " ".join(f"{short_key(k, keys)}={v:.3g}" if isinstance(v, float) else f"{short_key(k, keys)}={fmt(v)}"
                       for k, v in trial.params.items())
    point_id = f"s{trial.number:04d}"
    for k, v in _attrs(point_id, variant, dict(trial.params), seed, 1).items():
        trial.set_user_attr(k, v)
    return Claim(trial._trial_id, trial.number, point_id, variant, dict(trial.params), seed)


# ---------------------------------------------------------------------------------------------- trials
class Heartbeat(threading.Thread):
    """Stamps the trial's `heartbeat` user attr every interval until stopped."""

    def __init__(self, storage: BaseStorage, trial_id: int, interval_s: float) -> None:
        super().__init__(daemon=True, name=f"heartbeat-{trial_id}")
        self.storage, self.trial_id, self.interval_s = storage, trial_id, interval_s
        self.stopped = threading.Event()
        self.lost = False

    def run(self) -> None:
        while not self.stopped.wait(self.interval_s):
            try:
                self.storage.set_trial_user_attr(self.trial_id, "heartbeat", time.time())
            except UpdateFinishedTrialError:
                self.lost = taken_over(self.storage, self.trial_id)
                return
            except Exception as e:  # a busy database: try again at the next beat
                log.warning("heartbeat of trial id %d failed: %s", self.trial_id, e)

    def stop(self) -> None:
        self.stopped.set()


def declared_lost(storage: BaseStorage, trial_id: int) -> bool:
    """Whether another worker declared this trial lost (`fail_stale`: no heartbeat for the grace period, as when
    this worker's node stopped answering) and so runs its point again."""
    return "lost_at" in storage.get_trial(trial_id).user_attrs


def taken_over(storage: BaseStorage, trial_id: int) -> bool:
    """After a heartbeat found its trial finished: whether it was declared lost rather than finished by this
    worker. Then its trial steps are killed at once (launch.job.kill_steps), so the stalled run writes no more
    checkpoints or metrics into the run directory its retry now uses; `run_claim` records nothing of it."""
    if not declared_lost(storage, trial_id):
        return False
    n = kill_steps()
    log.warning("trial (id %d) was declared lost by another worker, which runs it again; %s, and its result is "
                "discarded", trial_id, f"killed its {n} step(s)" if n else "it runs in this process")
    return True


def _finish(h: StudyHandle, trial_id: int, state: TrialState, attrs: dict[str, Any],
            value: float | None = None) -> bool:
    """Record attrs, then the final state. False when another worker already finished (failed) the trial."""
    try:
        for k, v in attrs.items():
            h.storage.set_trial_user_attr(trial_id, k, v)
        if state == TrialState.COMPLETE:
            faults.reached("recording")
        h.storage.set_trial_state_values(trial_id, state, [value] if value is not None else None)
        return True
    except UpdateFinishedTrialError:
        log.warning("trial id %d was already finished (declared lost?); this result is discarded", trial_id)
        return False


def trial_setup(spec: AblationSpec, study_dir: Path, overrides: dict[str, Any],
                seed: int) -> tuple[Experiment, StepCost | None]:
    """The experiment a point runs: its own run directory <study>/runs/<name>-<config hash>, named up front
    so a rerun of the point finds the checkpoint of an earlier, interrupted attempt. With `budget: {flops: X}`
    its steps are the ones that spend X (budget.py; a translation trial's data is prepared to measure them), and
    the StepCost measured for them is returned with it (None without a FLOPs budget)."""
    exp = spec.experiment(overrides, seed)
    exp = exp.replace(trainer=exp.trainer.replace(runs_dir=str(study_dir / "runs")))
    cost = None
    horizon = "optim.max_steps" not in {**spec.overrides, **overrides}
    if spec.budget_flops:
        exp, cost = with_flops_budget(exp, spec.budget_flops, horizon)
        what = f"budget.flops={spec.budget_flops:g}, i.e. trainer.max_steps"
    elif spec.scale_budget:
        cost = step_cost(exp)
        exp, cost = with_flops_budget(exp, scale_flops(exp, spec.scale_budget, cost), horizon, cost)
        what = f"scale.budget {spec.scale_budget}, i.e. trainer.max_steps"
    if cost is not None and exp.trainer.max_steps <= exp.optim.warmup_steps:
        log.warning(warmup_warning(f"{spec.path} ({exp.name})", exp.trainer.max_steps, exp.optim.warmup_steps, what))
    return exp.replace(trainer=exp.trainer.replace(run_name=f"{exp.name}-{exp.config_hash()}")), cost


def trial_experiment(spec: AblationSpec, study_dir: Path, overrides: dict[str, Any], seed: int) -> Experiment:
    """The experiment a point runs (trial_setup, without its step cost)."""
    return trial_setup(spec, study_dir, overrides, seed)[0]


def _error(h: StudyHandle, claim: Claim, e: Exception) -> str:
    tb = traceback.format_exc()
    _finish(h, claim.trial_id, TrialState.FAIL, {"status": "error", "error": f"{type(e).__name__}: {e}"[:2000],
                                                 "traceback": tb[-4000:]})
    log.warning("trial %d %s seed %d failed: %s: %s", claim.number, claim.variant, claim.seed, type(e).__name__, e)
    return "error"


def run_claim(h: StudyHandle, claim: Claim, fit: FitFn, heartbeat_s: float, evaluate: FitFn) -> str:
    """Run one claimed point to its recorded end: fit, collect, the final evaluation (`evaluate`, e.g.
    final.evaluate_run) unless the file says final_eval: false. Returns the status recorded. Stopped by SIGINT or
    SIGTERM (`launch.job.stop_status`: also the SystemExit a fit turns them into), the trial is recorded as
    interrupted, which is no failed attempt: the next run resumes the point from its newest checkpoint."""
    beat = Heartbeat(h.storage, claim.trial_id, heartbeat_s)
    beat.start()
    try:
        return _run_claim(h, claim, fit, beat, evaluate)
    except BaseException as e:
        code = stop_status(e)
        if code is None:
            raise
        how = signal.Signals(code - 128).name
        record_interrupted(h, claim.trial_id, f"interrupted ({how})")
        log.warning("trial %d %s seed %d interrupted (%s): the next run resumes it from its checkpoint",
                    claim.number, claim.variant, claim.seed, how)
        raise
    finally:
        beat.stop()


def _run_claim(h: StudyHandle, claim: Claim, fit: FitFn, beat: Heartbeat, evaluate: FitFn) -> str:
    try:
        exp, cost = trial_setup(h.spec, h.dir, claim.overrides, claim.seed)
    except ConfigError as e:
        _finish(h, claim.trial_id, TrialState.FAIL, {"status": INVALID, "reason": str(e)})
        log.info("trial %d %s seed %d: invalid: %s", claim.number, claim.variant, claim.seed, e)
        return INVALID
    except Exception as e:  # the data a FLOPs budget is measured on
        return _error(h, claim, e)
    run_dir = exp.run_dir()
    done = fit_done(run_dir)  # an earlier attempt's fit ran to its end; its worker died before recording it
    ckpt = latest_checkpoint(run_dir)  # the newest of last, hpc_ckpt_N, step=N that loads
    resume = ckpt is not None
    for k, v in {"run_dir": str(run_dir), "config_hash": exp.config_hash(), "resumed": resume,
                 "resumed_from": str(ckpt) if ckpt else None, "fit_reused": done is not None}.items():
        h.storage.set_trial_user_attr(claim.trial_id, k, v)
    log.info("trial %d: %s seed %d%s -> %s", claim.number, claim.variant, claim.seed,
             " (its fit finished in an earlier attempt: collected, not fitted again)" if done
             else " (resuming)" if resume else "", run_dir)
    t0 = time.perf_counter()
    try:
        if done:
            out = run_dir
        else:
            out = fit(exp, ckpt_path=None if ckpt is None else "last" if ckpt.name == "last.ckpt" else str(ckpt))
            faults.reached("fit_done")
        if beat.lost or declared_lost(h.storage, claim.trial_id):  # taken over while this worker was
            return "lost"  # stalled: no result and no final evaluation (its files are the retry's)
        run_dir = Path(out) if out else run_dir
        result = collect(run_dir, exp, h.spec.metric, cost)
        result["wall_s"] = time.perf_counter() - t0  # training; the final evaluation's time is its own
        if h.spec.final_eval:
            result["final"] = evaluate(exp, run_dir)
    except Exception as e:
        return "lost" if beat.lost else _error(h, claim, e)  # a step killed because its trial was taken over
    metric = h.spec.metric
    value = result["final"].get(metric.removeprefix("final/")) if metric.startswith("final/") else result["metric"]
    if value is None or not math.isfinite(value):
        _finish(h, claim.trial_id, TrialState.FAIL, {"status": "error", "error": f"{h.spec.metric} = {value}"})
        return "error"
    ok = _finish(h, claim.trial_id, TrialState.COMPLETE, result, value)
    return DONE if ok else "lost"


# ---------------------------------------------------------------------------------------------- workers
def work(h: StudyHandle, opts: Options, fit: FitFn | None = None) -> int:
    """A worker: claim, run, repeat; wait while other workers' points may still come back; return trials run."""
    fit_fn = fit or local_fit(opts.fit)
    evaluate = resolve_fit(opts.evaluate)
    n = 0
    while opts.max_trials is None or n < opts.max_trials:
        if stop_signal() is not None:  # a SIGTERM that came as a fit ended, too late to stop it: no next trial
            raise KeyboardInterrupt(signal.Signals(stop_signal()).name)
        claim, busy = claim_next(h, opts.grace_s, opts.max_round)
        if claim is None:
            if not busy or not opts.linger:
                break
            time.sleep(opts.poll_s)  # a running point may still be lost and need running again
            continue
        run_claim(h, claim, fit_fn, opts.heartbeat_s, evaluate)
        n += 1
    return n


def worker_command(spec_path: Path, study_dir: Path, storage: str, opts: Options, srun: bool = False) -> list[str]:
    """The command line of one worker process: what `ablate run --workers N` starts N times, and what each
    task of an `ablate submit` array job runs (`srun`: trials as srun steps; exit when nothing is pending)."""
    cmd = [sys.executable, "-m", "attnlab", "ablate", "worker", str(spec_path), "--dir", str(study_dir),
           "--storage", storage, "--fit", opts.fit, "--evaluate", opts.evaluate, "--heartbeat", str(opts.heartbeat_s),
           "--grace", str(opts.grace_s), "--poll", str(opts.poll_s)]
    if opts.max_trials is not None:
        cmd += ["--max-trials", str(opts.max_trials)]
    if opts.max_round is not None:
        cmd += ["--max-round", str(opts.max_round)]
    return cmd + (["--srun", "--no-linger"] if srun else [])


def run_study(spec: AblationSpec, study_dir: Path | None = None, storage: str | None = None, workers: int = 1,
              opts: Options | None = None, fit: FitFn | None = None, gpus: list[str] | None = None,
              workers_per_gpu: int = 1) -> dict[str, int]:
    """Run what is missing of a study with `workers` local workers; returns the count of points by status.

    Each worker gets its own slice of the GPUs (`gpus`, default every visible one; see `gpu_slices`) through
    CUDA_VISIBLE_DEVICES, and an equal share of the CPU threads. A single worker with the default GPUs runs
    in this process (with `fit` when given, a callable for tests); otherwise workers are processes of
    `worker_command`."""
    opts = opts or Options()
    if workers < 1:
        raise ConfigError(f"--workers {workers} must be >= 1")
    slices = gpu_slices(visible_gpus() if gpus is None else gpus, workers, trial_devices(spec), workers_per_gpu)
    h = prepare_study(spec, study_dir, storage)
    if workers == 1 and gpus is None:
        work(h, opts, fit)
        return round_counts(h, opts.grace_s) or status_counts(h, opts.grace_s)
    if fit is not None:
        raise ValueError("run_study with worker processes: give the fit as opts.fit='module:function'")
    procs: list[subprocess.Popen] = []
    try:
        for i in range(workers):
            env = dict(os.environ)
            env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // workers)))
            if slices is not None:
                env["CUDA_VISIBLE_DEVICES"] = slices[i]
                log.info("worker %d: CUDA_VISIBLE_DEVICES=%s", i, slices[i])
            procs.append(subprocess.Popen(worker_command(h.spec.path, h.dir, h.url, opts), env=env))
        codes = [p.wait() for p in procs]
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (`install_worker_signals`): passed on to every worker, whose
        sig = stop_signal() or signal.SIGINT  # trials are recorded as interrupted, and waited for
        log.warning("%s: passing it on to the %d worker(s) and waiting for them", signal.Signals(sig).name, len(procs))
        for p in procs:
            if p.poll() is None:
                p.send_signal(sig)
        for p in procs:
            p.wait()
        raise
    if any(codes):
        log.warning("worker exit codes: %s", codes)
    return round_counts(h, opts.grace_s) or status_counts(h, opts.grace_s)
