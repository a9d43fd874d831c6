"""Preemption inside a SLURM job: which job this is, and a Trainer callback that checkpoints and requeues on USR1.

Lightning's own auto-requeue saves its checkpoint from inside the USR1 handler: on each rank wherever that rank
happens to be (in the middle of a step, on one rank before a gradient all-reduce and on another after it), with
a collective barrier inside a signal handler. `RequeueOnUSR1` only notes the signal; at the next step boundary
the ranks agree (an all-reduce: any rank signalled) and all of them save `hpc_ckpt_N.ckpt` there, one consistent
state; rank 0 requeues the job; then every rank waits, parked at that same place, for the SIGTERM with which
SLURM stops a requeued job, and Lightning stops them all at the end of that step (and saves last.ckpt there). The
requeued job resumes from the newest checkpoint that loads (`checkpoints.latest_checkpoint`).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback

log = logging.getLogger("attnlab.launch")


def job_identity() -> tuple[str, int] | None:
    """(job key, restart count) inside a SLURM job: `<array job>_<task>` for an array task, else the job id."""
    if "SLURM_JOB_ID" not in os.environ:
        return None
    array = os.environ.get("SLURM_ARRAY_JOB_ID")
    key = f"{array}_{os.environ.get('SLURM_ARRAY_TASK_ID', '0')}" if array else os.environ["SLURM_JOB_ID"]
    return key, int(os.environ.get("SLURM_RESTART_COUNT") or 0)


def unused_allocation() -> str | None:
    """Inside a SLURM job's batch script (no srun step: SLURM_STEP_ID unset) whose allocation has more than one
    task, GPU or node: what would go unused, in words (one process trains on one device). None otherwise."""
    env = os.environ
    if "SLURM_JOB_ID" not in env or "SLURM_STEP_ID" in env or "SLURM_STEPID" in env:
        return None
    counts = {"tasks": env.get("SLURM_NTASKS"), "GPUs on this node": env.get("SLURM_GPUS_ON_NODE"),
              "nodes": env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES")}
    many = [f"{v} {what}" for what, v in counts.items() if v and v.isdigit() and int(v) > 1]
    return ", ".join(many) or None


class RequeueOnUSR1(Callback):
    """On USR1 (`--signal=USR1@N` before the time limit, `scancel --signal=USR1`): at the next step boundary every
    rank saves <run dir>/hpc_ckpt_N.ckpt, rank 0 runs `scontrol requeue`, and all wait for SLURM's SIGTERM."""

    def __init__(self, run_dir: Path, wait_s: float = 120.0) -> None:
        self.run_dir, self.wait_s = Path(run_dir), wait_s
        self.signalled = False
        self._previous: Any = None

    def _on_usr1(self, signum: int, frame: Any) -> None:
        self.signalled = True

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGUSR1, self._on_usr1)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGUSR1, self._previous)
            self._previous = None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        # any rank signalled: an all-reduce read back on the host, so only on the steps that log (USR1 comes
        # minutes before the time limit; --signal=USR1@N), not on every step
        if trainer.global_step % trainer.log_every_n_steps:
            return
        if not trainer.strategy.reduce_boolean_decision(self.signalled, all=False):
            return
        self.signalled = False
        n = 1 + max([int(p.stem.rpartition("_")[2]) for p in self.run_dir.glob("hpc_ckpt_*.ckpt")
                     if p.stem.rpartition("_")[2].isdigit()], default=0)
        trainer.save_checkpoint(self.run_dir / f"hpc_ckpt_{n}.ckpt")  # collective: every rank at this step
        me = job_identity()
        if trainer.is_global_zero and me is not None:
            code = subprocess.call(["scontrol", "requeue", me[0]])
            log.warning("USR1 at step %d: saved hpc_ckpt_%d.ckpt; scontrol requeue %s: exit %d", trainer.global_step,
                        n, me[0], code)
        deadline = time.monotonic() + self.wait_s
        while me is not None and not trainer.received_sigterm and time.monotonic() < deadline:
            time.sleep(0.1)  # parked: SLURM's SIGTERM finds every rank here, none inside a collective
        if not trainer.received_sigterm:
            log.warning("no SIGTERM within %.0f s of the requeue: training on", self.wait_s)
        # else Lightning stops every rank at the end of this same step (SIGTERMException) and saves last.ckpt
