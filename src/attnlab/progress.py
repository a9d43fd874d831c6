"""Training progress that suits where it goes: tqdm's bar on a terminal, plain lines in a log file.

`make demo > log 2>&1`, a SLURM job's output file or an ablation worker's log get one line every
`trainer.log_every` optimizer steps and one after each validation, never carriage-return updates:

    [demo_en_de-1a2b3c4d5e] step 500/100000 | loss 4.213 | lr 7.2e-04 | 9,870 tokens/s | ETA 0:05:01
    [demo_en_de-1a2b3c4d5e] step 500 validation | val/loss 3.902 | val/ppl 49.5 | val/bleu 12.41 | val/chrf 38.2
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta
from typing import Any, TextIO

from lightning.pytorch.callbacks import Callback, Timer, TQDMProgressBar
from lightning.pytorch.callbacks.progress.progress_bar import ProgressBar


def progress_callback(every: int, name: str, stream: TextIO | None = None) -> Callback:
    """tqdm's bar when `stream` (default stderr) is a terminal, else `LineProgress`."""
    stream = stream or sys.stderr
    if stream.isatty():
        return LossBar(refresh_rate=max(1, every // 5))
    return LineProgress(every, name, stream)


class LossBar(TQDMProgressBar):
    """tqdm's bar, showing the training loss, read when the bar refreshes (every `refresh_rate` steps) rather than
    converted by Lightning after every step as a prog_bar metric would be."""

    def get_metrics(self, trainer, pl_module) -> dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)
        loss = trainer.callback_metrics.get("train/loss")
        if loss is not None and trainer.training:
            items["loss"] = f"{float(loss):.4g}"
        return items


class LineProgress(ProgressBar):
    """One plain line every `every` optimizer steps (step, loss, learning rate, tokens/s of all ranks since the
    last line, validation time left out, ETA) and one per validation (its metrics), from global rank 0."""

    def __init__(self, every: int, name: str = "", stream: TextIO | None = None) -> None:
        super().__init__()
        self.every, self.prefix, self.stream = every, f"[{name}] " if name else "", stream
        self._enabled = True
        self._start: tuple[float, int] | None = None  # (time, global step) when this fit started training
        self._last_step = -1
        self._mark: tuple[float, int] | None = None  # (time, tokens trained) at the last line
        self._val_time = 0.0  # seconds of validation since the last line (not training time)
        self._val_start: float | None = None

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    def _print(self, text: str) -> None:
        if self._enabled and self.trainer.is_global_zero:
            print(self.prefix + text, file=self.stream or sys.stderr, flush=True)

    def on_train_start(self, trainer, pl_module) -> None:
        self._start = (time.perf_counter(), trainer.global_step)

    def eta(self, trainer) -> timedelta | None:
        """Steps left at the mean step time since the start; sooner when the time budget (max_time) ends first."""
        if self._start is None:
            return None
        t0, step0 = self._start
        done, elapsed = trainer.global_step - step0, time.perf_counter() - t0
        left = elapsed / done * max(trainer.max_steps - trainer.global_step, 0) if done > 0 else None
        timer = next((c for c in trainer.callbacks if isinstance(c, Timer)), None)
        budget = timer.time_remaining("train") if timer is not None else None
        if budget is not None:
            left = budget if left is None else min(left, budget)
        return None if left is None else timedelta(seconds=round(left))

    def on_train_batch_end(self, trainer, pl_module, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if step == self._last_step or step % self.every:  # nothing is read on the other steps: no host sync
            return
        self._last_step = step
        m = trainer.callback_metrics
        parts = [f"step {step}/{trainer.max_steps}"]
        if "train/loss" in m:
            parts.append(f"loss {float(m['train/loss']):.4g}")
        if "train/lr" in m:
            parts.append(f"lr {float(m['train/lr']):.2e}")
        now, tokens = time.perf_counter(), int(getattr(pl_module, "_tokens", 0))  # all ranks' tokens so far
        if self._mark is not None and now - self._mark[0] - self._val_time > 0:
            rate = (tokens - self._mark[1]) / (now - self._mark[0] - self._val_time)
            parts.append(f"{rate:,.0f} tokens/s")
        self._mark, self._val_time = (now, tokens), 0.0
        eta = self.eta(trainer)
        parts.append(f"ETA {eta}" if eta is not None else "ETA unknown")
        self._print(" | ".join(parts))

    def on_train_batch_start(self, trainer, pl_module, batch: Any, batch_idx: int) -> None:
        if self._mark is None:  # the first line's rate counts from the first step of this fit
            self._mark = (time.perf_counter(), int(getattr(pl_module, "_tokens", 0)))

    def on_validation_start(self, trainer, pl_module) -> None:
        self._val_start = time.perf_counter()

    def on_validation_end(self, trainer, pl_module) -> None:
        if self._val_start is not None:
            self._val_time += time.perf_counter() - self._val_start
            self._val_start = None
        if trainer.sanity_checking or trainer.state.fn != "fit":  # validate/test print their own results
            return
        shown = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
        self._print(" | ".join([f"step {trainer.global_step} validation",
                                *(f"{k} {v:.4g}" for k, v in sorted(shown.items()))]))
