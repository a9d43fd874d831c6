"""Which step checkpoints a run's final model averages (`decode.average_at`): the last `decode.average_last`, or as
many ending at the validation with the lowest loss.

Vaswani et al. 2017 average the last 5 checkpoints of a run that is still improving. A short run on a small
corpus is past its best by its end: the 5-minute base model on the gettext pairs (bench/RESULTS.md, 2026-11-26)
had its lowest validation loss at step 2,999 of 7,574 while its training NLL fell to 0.14 nats. With
`average_at: best`, each validation whose `val/loss` is the lowest so far hard-links the step checkpoints of that
moment (the last `average_last` of them, the one just written at the validation's step included) into
`checkpoints/best/`, with `best.json` naming the loss and step; rotation (`trainer.keep_checkpoints`) then
deletes only the other names of those files. The window ends at the newest checkpoint at or before the
validation: put validations on checkpoint steps (`trainer.val_every` a multiple of `trainer.ckpt_every`) for it
to end at the best step itself.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback

from .checkpoint_io import after_writes
from .checkpoints import last_checkpoints
from .files import copy_atomic, write_text_atomic

log = logging.getLogger("attnlab")
BEST_DIR = "best"


class BestWindow(Callback):
    """At each validation with the lowest `monitor` so far, the last `n` step checkpoints of `ckpt_dir` are linked
    into `ckpt_dir/best/` (replacing the window there before). Rank 0 does the file work; the lowest value
    travels in the callback's checkpointed state, so a resumed run compares against it."""

    def __init__(self, ckpt_dir: str | Path, n: int, monitor: str = "val/loss") -> None:
        self.ckpt_dir, self.n, self.monitor = Path(ckpt_dir), n, monitor
        self.best, self.best_step = math.inf, -1

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or self.monitor not in trainer.callback_metrics:
            return
        value = float(trainer.callback_metrics[self.monitor])
        if not math.isfinite(value) or value >= self.best:
            return
        self.best, self.best_step = value, trainer.global_step
        if trainer.is_global_zero and self.ckpt_dir.is_dir():  # once the step's checkpoint is written
            record = {self.monitor: value, "step": trainer.global_step}
            after_writes(trainer, lambda: link_window(self.ckpt_dir, self.n, record))

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "best_step": self.best_step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.best, self.best_step = state_dict.get("best", math.inf), state_dict.get("best_step", -1)


def link_window(ckpt_dir: Path, n: int, record: dict[str, Any]) -> list[Path]:
    """The last n step checkpoints of ckpt_dir as the files of ckpt_dir/best/ (hard links: no copy, and rotation
    cannot delete them; a copy where the file system has no links), and best.json naming them with `record`."""
    window = last_checkpoints(ckpt_dir, n) if any(ckpt_dir.glob("*.ckpt")) else []
    window = [p for p in window if p.name != "last.ckpt"]
    best = ckpt_dir / BEST_DIR
    best.mkdir(exist_ok=True)
    for old in best.glob("*.ckpt"):
        if old.name not in {p.name for p in window}:
            old.unlink()
    for p in window:
        dst = best / p.name
        if dst.exists() and os.path.samefile(p, dst):
            continue
        dst.unlink(missing_ok=True)
        try:
            os.link(p, dst)
        except OSError:  # no hard links here (some network file systems)
            copy_atomic(p, dst, f"checkpoint {p.name}")
    write_text_atomic(best / "best.json", json.dumps({**record, "checkpoints": [p.name for p in window]}, indent=2))
    return [best / p.name for p in window]


def checkpoints_to_average(run_dir: str | Path, n: int, average_at: str = "last") -> tuple[list[Path], str, str]:
    """(the checkpoints a run's final model averages, "best" or "last", a phrase saying which): the last n, or with
    average_at="best" the window BestWindow kept at the lowest validation loss. A run with no such window (it
    never validated, or it trained with average_at: last) averages its last n, with a warning."""
    ckpt_dir = Path(run_dir) / "checkpoints"
    if average_at == "best":
        best = ckpt_dir / BEST_DIR
        info = best / "best.json"
        if info.is_file():
            record = json.loads(info.read_text(encoding="utf-8"))
            paths = [best / name for name in record["checkpoints"] if (best / name).is_file()]
            if paths:
                what = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                 for k, v in record.items() if k != "checkpoints")
                paths = paths[-n:]
                return paths, "best", f"the {len(paths)} checkpoints up to the lowest validation loss ({what})"
        log.warning("%s: decode.average_at=best, but the run kept no window at a validation (%s is missing): "
                    "averaging its last %d checkpoints", run_dir, info, n)
    paths = last_checkpoints(ckpt_dir, n)
    return paths, "last", f"the last {len(paths)} checkpoints"
