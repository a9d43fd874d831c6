"""Validation and checkpoint intervals that suit the device: steps, stretched to a minimum wall time.

A recipe sized for a CPU validates every 500 steps and checkpoints every 100; on a GPU a hundred times faster
that is a validation every few seconds and a checkpoint every second. With trainer.val_every_min /
ckpt_every_min, `StretchIntervals` times the first steps of a fit and stretches each interval to the smallest
multiple of its step count that lasts at least that many minutes; where the steps are slow enough already
(the CPU the recipe was sized for) nothing changes. Rank 0's timing is broadcast, so every rank stretches alike
(one collective, once per fit), and the stretched intervals are kept in the checkpoint: a resumed run keeps them.
"""

from __future__ import annotations

import logging
import math
from time import perf_counter
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

log = logging.getLogger("attnlab")


def stretched(every: int, minutes: float, step_s: float, last: int = -1, divide: bool = True) -> int:
    """The smallest multiple of `every` steps lasting at least `minutes` at `step_s` seconds a step, but no more
    than the last multiple of `every` within `last` (trainer.max_steps; <= 0: none): stretched past it, a run of a
    fixed step budget would never validate at all. With `divide` (a run that ends at `last`, not at a time limit),
    where `every` divides `last` the multiple also divides it, so the run still validates (and checkpoints) at its
    last step."""
    if minutes <= 0 or step_s <= 0:
        return every
    n = max(1, math.ceil(minutes * 60 / (step_s * every)))
    if last < every:
        return every * n
    m = last // every
    if divide and last % every == 0:  # the smallest multiple from n on that divides the budget (m itself at the most)
        return every * next((k for k in range(min(n, m), m + 1) if m % k == 0), m)
    return every * min(n, m)


class StretchIntervals(Callback):
    """Stretch trainer.val_every / ckpt_every to last at least val_min / ckpt_min minutes, from the mean time of
    `timed` optimizer steps after `skip` warm-up steps (compiling, first batches)."""

    def __init__(self, ckpt: ModelCheckpoint, val_every: int, ckpt_every: int, val_min: float, ckpt_min: float,
                 steps: dict[str, int] | None = None, skip: int = 5, timed: int = 20, divide: bool = True) -> None:
        self.ckpt = ckpt  # the run's step checkpoints, whose interval this stretches
        self.val_every, self.ckpt_every, self.val_min, self.ckpt_min = val_every, ckpt_every, val_min, ckpt_min
        self.skip, self.timed = skip, timed
        self.divide = divide  # the run ends at trainer.max_steps (no time limit): intervals that divide it
        # the stretched intervals, once known; a resume passes the checkpoint's (`saved_steps`) to the constructor, so
        # the ModelCheckpoint is built with its stretched interval, which is part of the key its state is saved under
        self.steps: dict[str, int] | None = steps
        self._start: tuple[int, float | None] | None = None  # (first timed step, its time)

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = state.get("steps")

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.steps is not None:  # resumed: the intervals the run had
            self._apply(trainer)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.steps is not None:
            return
        step = trainer.global_step
        if self._start is None:
            self._start = (step + self.skip, None)
        first, t0 = self._start
        if step == first:
            self._start = (first, perf_counter())
        elif step == first + self.timed and t0 is not None:
            step_s = trainer.strategy.broadcast((perf_counter() - t0) / self.timed, src=0)
            last = trainer.max_steps
            self.steps = {"val": stretched(self.val_every, self.val_min, step_s, last, self.divide),
                          "ckpt": stretched(self.ckpt_every, self.ckpt_min, step_s, last, self.divide)}
            if self.steps != {"val": self.val_every, "ckpt": self.ckpt_every}:
                log.info("%.3f s a step: validating every %d steps and checkpointing every %d (trainer.val_every_min "
                         "%g, ckpt_every_min %g)", step_s, self.steps["val"], self.steps["ckpt"], self.val_min,
                         self.ckpt_min)
            self._apply(trainer)

    def _apply(self, trainer: L.Trainer) -> None:
        batches = self.steps["val"] * trainer.accumulate_grad_batches  # Lightning counts validation in batches
        trainer.val_check_interval = trainer.val_check_batch = batches
        self.ckpt._every_n_train_steps = self.steps["ckpt"]


def saved_steps(checkpoint: dict[str, Any]) -> dict[str, int] | None:
    """The stretched intervals a checkpoint's run had (None: not stretched, or not yet)."""
    return ((checkpoint.get("callbacks") or {}).get(StretchIntervals.__name__) or {}).get("steps")
