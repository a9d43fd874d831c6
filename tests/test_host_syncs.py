"""Device-to-host syncs of the training loop, counted on a CPU with DispatchCount over real Lightning steps.

A sync stalls a GPU's queue: the host waits for every kernel before it to finish. The steady steps of a fit
(no logging, no validation, no checkpoint) must make none, for the encoder-decoder and for the language model;
the steps that log read their metrics back, which is allowed. The corpora are big enough that no epoch starts
within the counted steps (a new epoch's shuffle is host-side work on host tensors, counted here all the same)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import yaml
from lightning.pytorch.callbacks import Callback

from attnlab.experiment import load_experiment
from attnlab.train import fit
from conftest import make_pairs
from dispatch_count import DispatchCount
from test_cli import LM
from test_train import write_recipe

LOG_EVERY = 5


class StepSyncs(Callback):
    """Counts the syncs of each training step, from its on_train_batch_start to the next one's (the step, its
    hooks, the logging connector and the fetch of the next batch)."""

    def __init__(self, count: DispatchCount) -> None:
        self.count, self.per_step, self._at = count, {}, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._close(trainer.global_step - 1)
        self._at = Counter(self.count.sync_ops)

    def on_train_end(self, trainer, pl_module) -> None:
        self._close(trainer.global_step - 1)

    def _close(self, step: int) -> None:
        if self._at is not None:
            self.per_step[step + 1] = Counter(self.count.sync_ops) - self._at  # the step that ended at step + 1


def recipe_for(task: str, root: Path) -> Path:
    trainer = {"max_steps": 16, "val_every": 1000, "ckpt_every": 1000, "log_every": LOG_EVERY, "progress_bar": True,
               "runs_dir": str(root / "runs")}
    if task == "translation":
        return write_recipe(root, name="mt", n_pairs=2000, model={"dropout": 0.0}, trainer=trainer)
    docs = root / "docs.txt"
    docs.write_text("".join(t + "\n\n" for _, t in make_pairs(2000)), encoding="utf-8")  # blank-line separated
    raw = {k: dict(v) for k, v in LM.items()}
    raw["data"].update(corpus=str(docs), data_dir=str(root / "data_cache"))
    raw["trainer"].update(trainer)
    path = root / "lm.yaml"
    path.write_text(yaml.safe_dump({"name": "lm", **raw}), encoding="utf-8")
    return path


@pytest.mark.parametrize("task", ["translation", "lm"])
def test_steady_training_steps_make_no_host_sync(tmp_path, task):
    exp = load_experiment(recipe_for(task, tmp_path))
    with DispatchCount() as count:
        steps = StepSyncs(count)
        fit(exp, callbacks=[steps])
    steady = {s: dict(c) for s, c in steps.per_step.items() if s > 2 and s % LOG_EVERY and s < 16}
    assert len(steady) >= 10
    assert not {s: c for s, c in steady.items() if c}, steady


def test_only_the_steps_that_log_call_lightnings_log(tmp_path, monkeypatch):
    """LightningModule.log costs ~1 ms of host time a call (it moves its whole record through apply_to_collection):
    the training steps call it only when their values reach the loggers (every trainer.log_every steps), and
    those steps still log loss, nll, lr, tokens, tokens/s, the wall clock and the gradient norm."""
    import lightning.pytorch as pl

    calls: dict[int, set[str]] = {}
    real = pl.LightningModule.log

    def spy(self, name, *args, **kwargs):
        if self.trainer.training:
            calls.setdefault(self.trainer.global_step + 1, set()).add(name)  # the step being taken
        return real(self, name, *args, **kwargs)

    monkeypatch.setattr(pl.LightningModule, "log", spy)
    fit(load_experiment(recipe_for("translation", tmp_path)))
    assert sorted(calls) == list(range(LOG_EVERY, 17, LOG_EVERY)), sorted(calls)
    assert all(names == {"train/loss", "train/nll", "train/lr", "train/tokens", "train/tokens_per_s",
                         "train/time", "train/grad_norm"} for names in calls.values()), calls
