"""A fit or a trial run as a process of its own: one srun task inside a SLURM job, or a local subprocess; the
data built once before it; a worker's signals; and which SLURM job (and which restart of it) this is.

    python -m attnlab.launch.job prepare CONFIG                      # tokenizer + token caches, once, before srun
    srun ... python -m attnlab.launch.job task CONFIG [--fit module:function] [--ckpt_path none|last|PATH]

Under srun, `train.make_trainer` takes devices and num_nodes from SLURM in each task, so Lightning runs DDP
across the step's tasks. Locally, Lightning's DDP launcher starts the other ranks by running the same `task`
command again. A requeued job (SLURM_RESTART_COUNT > 0) resumes from the run directory's newest checkpoint.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import logging
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attnlab

from ..checkpoints import checkpoint_step, latest_checkpoint
from ..config import ConfigError, load_yaml
from ..experiment import Experiment, from_raw
from ..train import make_datamodule
from .requeue import job_identity

log = logging.getLogger("attnlab.launch")

DEFAULT_FIT = "attnlab.train:fit"  # what a trial or a SLURM task trains with, as module:function
FitFn = Callable[..., Any]  # fit(exp, ckpt_path=None) -> run directory
_RUNNING: list[subprocess.Popen] = []  # the srun step of the trial this worker runs now (for USR1)


def resolve_fit(fit: str | FitFn) -> FitFn:
    """A fit function from "module:function" (tests and custom training loops name their own)."""
    if callable(fit):
        return fit
    module, _, name = fit.partition(":")
    if not name:
        raise ConfigError(f"--fit {fit!r}: expected module:function, e.g. {DEFAULT_FIT}")
    return getattr(importlib.import_module(module), name)


def check_code() -> Path:
    """Where `attnlab` was imported from; with ATTNLAB_CODE set (by the scripts), it must be that snapshot."""
    here = Path(attnlab.__file__).resolve().parent
    want = os.environ.get("ATTNLAB_CODE")
    if want and Path(want).resolve() not in here.parents:
        raise RuntimeError(f"attnlab was imported from {here}, not from the submission's copy {want}; "
                           "is PYTHONPATH overridden?")
    return here


def srun_prefix(gpus: bool | None = None) -> list[str]:
    """srun for one step over the whole allocation. With GPUs every task sees all of its node's GPUs
    (Lightning picks cuda:<local rank>), rather than only its own as cuda:0."""
    gpus = bool(os.environ.get("SLURM_GPUS_PER_TASK")) if gpus is None else gpus
    return ["srun", "--kill-on-bad-exit=1", *(["--gpu-bind=none"] if gpus else [])]


def task_command(config: Path, fit: str = DEFAULT_FIT, ckpt_path: str | None = None, srun: bool = True,
                 gpus: bool | None = None) -> list[str]:
    """The command that runs a resolved experiment file with `fit`: an srun step (one task per device) or, with
    srun=False, one local process."""
    return [*(srun_prefix(gpus) if srun else []), sys.executable, "-m", "attnlab.launch.job", "task", str(config),
            "--fit", fit, "--ckpt_path", ckpt_path or "none"]


def prepare_command(config: Path) -> list[str]:
    return [sys.executable, "-m", "attnlab.launch.job", "prepare", str(config)]


def prepare_data(exp: Experiment) -> None:
    """Tokenizer and token caches built (or found) by this one process before the step starts: otherwise every
    task of the step builds the same caches at once. Keep data.data_dir on the shared file system."""
    t0 = time.perf_counter()
    make_datamodule(exp).prepare_data()
    log.info("data ready in %.1f s", time.perf_counter() - t0)


class StepFit:
    """A fit(exp, ckpt_path) that runs the trial as a process of its own, `task_command` on the trial's resolved
    config: with `srun`, an srun step of the SLURM job's allocation (one task per device); without, a local
    subprocess (a trial on several devices: Lightning's DDP launcher then starts the other ranks from that
    command, not from the worker's). Each runs `inner` (module:function, train.fit by default)."""

    def __init__(self, inner: str, srun: bool = True) -> None:
        self.inner, self.srun = inner, srun
        check_code()

    def __call__(self, exp: Experiment, ckpt_path: str | None = None) -> Path:
        run_dir = exp.run_dir()
        run_dir.mkdir(parents=True, exist_ok=True)
        config = run_dir / "trial.yaml"
        tmp = config.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(exp.to_yaml(), encoding="utf-8")
        tmp.replace(config)
        if self.inner == DEFAULT_FIT:  # a custom fit prepares its own data
            prepare_data(exp)
        cmd = task_command(config, self.inner, ckpt_path, srun=self.srun)
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
        _RUNNING.append(proc)
        try:
            code = proc.wait()
        except BaseException:  # SIGTERM (requeue, cancel, time limit): stop the step, let the runner record it
            proc.terminate()
            try:
                proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                pass
            raise
        finally:
            _RUNNING.remove(proc)
        if code != 0:
            where = "srun step" if self.srun else f"process ({shlex.join(cmd)})"
            raise RuntimeError(f"the trial's {where} exited with {code}; see this worker's log")
        return run_dir


def kill_steps() -> int:
    """Stop the trial steps this worker runs, at once and saving nothing: their trial was declared lost while this
    worker was stalled (its node stopped answering), and another worker runs it again in the same run directory.
    An srun step is killed by SLURM on every node it runs on (`scancel --signal=KILL <job>.<step>`); a local one by
    SIGKILL. Returns how many steps there were."""
    procs = list(_RUNNING)
    job = os.environ.get("SLURM_JOB_ID")
    if job and any(p.args and p.args[0] == "srun" for p in procs):
        r = subprocess.run(["squeue", "-h", "-s", "-j", job, "-o", "%i"], capture_output=True, text=True, timeout=60)
        steps = [s for s in r.stdout.split() if s.rpartition(".")[2].isdigit()]  # not <job>.batch / .extern
        if steps:
            subprocess.call(["scancel", "--signal=KILL", *steps])
    for proc in procs:
        proc.kill()
    return len(procs)


def local_fit(inner: str) -> FitFn:
    """What a local worker trains a trial with: `inner` in this process when the trial uses one device, a
    StepFit subprocess when it uses several (see StepFit)."""
    direct, step = resolve_fit(inner), StepFit(inner, srun=False)

    def run(exp: Experiment, ckpt_path: str | None = None) -> Any:
        several = exp.trainer.devices != 1 or exp.trainer.num_nodes != 1
        return (step if several else direct)(exp, ckpt_path=ckpt_path)

    return run


_STOP: list[int] = []  # the SIGINT or SIGTERM that asked this process to stop (install_worker_signals)


def stop_signal() -> int | None:
    """The signal (SIGINT, SIGTERM) that asked this worker to stop, once one came (install_worker_signals)."""
    return _STOP[0] if _STOP else None


def stop_status(e: BaseException) -> int | None:
    """The exit status (128 + the signal: 130, 143) when `e` is this process being stopped by SIGINT or SIGTERM, else
    None. That is a KeyboardInterrupt, or the SystemExit into which a fit turns one: Lightning ends Ctrl-C with
    exit(1), and train.fit ends a SIGTERM, its state saved, with exit(143)."""
    sig = stop_signal()
    if isinstance(e, KeyboardInterrupt):
        return 128 + (sig or signal.SIGINT)
    if isinstance(e, SystemExit):
        if sig is not None:
            return 128 + sig
        if isinstance(e.code, int) and e.code in (128 + signal.SIGINT, 128 + signal.SIGTERM):
            return e.code  # train.fit's SIGTERM without install_worker_signals (run_study called as a library)
    return None


def install_worker_signals() -> None:
    """SIGTERM and SIGINT stop a worker (and `ablate run`) the same way: its trial is recorded as interrupted,
    which is no failed attempt, so the next run resumes it from its checkpoint, and the process exits 128 + the
    signal (`stop_status`). The first raises KeyboardInterrupt at once, except a SIGTERM during a Lightning fit of
    this process: Lightning's handler, which calls this one, stops the fit at the end of its step and saves it
    there (train.fit then raises SystemExit(143)). Another one while stopping is ignored, so that recording the
    trial is not cut short. USR1 (sent to the batch shell and passed on by it) goes to the running trial's srun
    step, whose tasks checkpoint and requeue; between trials the worker requeues its job itself."""

    def on_stop(signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if _STOP:
            log.warning("%s: already stopping (%s)", name, signal.Signals(_STOP[0]).name)
            return
        _STOP.append(signum)
        if signum == signal.SIGTERM and signal.getsignal(signal.SIGTERM) is not on_stop:
            log.warning("SIGTERM: the fit stops and saves at the end of this step")  # Lightning's handler called us
            return
        raise KeyboardInterrupt(name)

    def on_usr1(signum: int, frame: Any) -> None:
        if _RUNNING:
            log.warning("USR1: passing it on to the trial's srun step (checkpoint and requeue)")
            for proc in list(_RUNNING):
                proc.send_signal(signal.SIGUSR1)
            return
        me = job_identity()
        if me is not None:
            log.warning("USR1 between trials: requeueing job %s", me[0])
            subprocess.call(["scontrol", "requeue", me[0]])

    signal.signal(signal.SIGTERM, on_stop)
    signal.signal(signal.SIGINT, on_stop)
    signal.signal(signal.SIGUSR1, on_usr1)


@contextmanager
def worker_signals() -> Iterator[None]:
    """`install_worker_signals` for the block (`ablate run`, which may run inside another program: a test), then
    the handlers from before it, and no stop pending."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield
        return
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    install_worker_signals()
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
        _STOP.clear()


def task_main(argv: list[str]) -> int:
    """One srun task of a trial or a fit: load the resolved config, resume when there is a checkpoint, fit."""
    p = argparse.ArgumentParser(prog="python -m attnlab.launch.job task")
    p.add_argument("config", help="a resolved experiment (trial.yaml / config.yaml)")
    p.add_argument("--fit", default=DEFAULT_FIT, help="module:function with train.fit's signature")
    p.add_argument("--ckpt_path", default="none",
                   help="none | last | PATH; in a requeued job (SLURM_RESTART_COUNT > 0) the newest checkpoint")
    args = p.parse_args(argv)
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logging.getLogger("attnlab").addHandler(handler)  # Lightning prints its own messages once, with its handler
    logging.getLogger("attnlab").setLevel(logging.INFO)
    logging.getLogger("attnlab").propagate = False
    code = check_code()
    exp = from_raw(load_yaml(Path(args.config)), args.config)
    run_dir = exp.run_dir()
    ckpt: str | None = None if args.ckpt_path == "none" else args.ckpt_path
    me = job_identity()
    latest = latest_checkpoint(run_dir) if me is not None and me[1] > 0 else None
    if latest is not None:
        ckpt = str(latest)  # a requeued fit continues where its checkpoint left it
    rank, world = os.environ.get("SLURM_PROCID", "0"), os.environ.get("SLURM_NTASKS", "1")
    path = run_dir / "checkpoints" / "last.ckpt" if ckpt == "last" else Path(ckpt) if ckpt else None
    what = f"resuming from {path} (global step {checkpoint_step(path)})" if path else "from step 0"
    print(f"[attnlab task {rank}/{world}] {datetime.datetime.now():%F %T} code {code}; run {run_dir}; {what}",
          flush=True)  # every rank says where it starts: a resume must start all of them from one checkpoint
    resolve_fit(args.fit)(exp, ckpt_path=ckpt)
    return 0


def prepare_main(argv: list[str]) -> int:
    """`prepare CONFIG`: the data of a resolved experiment, built once in the batch step before srun."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    logging.getLogger("attnlab").setLevel(logging.INFO)
    check_code()
    if len(argv) != 1:
        raise SystemExit("usage: python -m attnlab.launch.job prepare CONFIG")
    prepare_data(from_raw(load_yaml(Path(argv[0])), argv[0]))
    return 0


if __name__ == "__main__":
    commands = {"task": task_main, "prepare": prepare_main}
    if sys.argv[1:2] == [] or sys.argv[1] not in commands:
        sys.exit("usage: python -m attnlab.launch.job task CONFIG [--fit module:function] [--ckpt_path P]\n"
                 "       python -m attnlab.launch.job prepare CONFIG")
    sys.exit(commands[sys.argv[1]](sys.argv[2:]))
