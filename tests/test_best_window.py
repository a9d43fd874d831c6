"""decode.average_at: best: the checkpoints a run averages end at its lowest validation loss (best_window.py), kept
through checkpoint rotation; the demo and the ablation's final evaluation average them; `last` is unchanged."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from attnlab.best_window import BestWindow, checkpoints_to_average
from attnlab.cli import main
from attnlab.config import ConfigError, DecodeConfig
from test_train import read_run, write_recipe


def fake_trainer(step: int, loss: float | None) -> SimpleNamespace:
    metrics = {} if loss is None else {"val/loss": torch.tensor(loss)}
    return SimpleNamespace(sanity_checking=False, callback_metrics=metrics, global_step=step, is_global_zero=True)


def save_step(ckpt_dir: Path, step: int, keep: int) -> None:
    """A step checkpoint as ModelCheckpoint writes and rotates them: step=N.ckpt, the oldest beyond `keep` deleted."""
    torch.save({"state_dict": {"w": torch.full((2,), float(step))}}, ckpt_dir / f"step={step}.ckpt")
    steps = sorted(int(p.stem.split("=")[1]) for p in ckpt_dir.glob("step=*.ckpt"))
    for old in steps[:-keep]:
        (ckpt_dir / f"step={old}.ckpt").unlink()


def test_the_window_at_the_lowest_loss_outlives_rotation_and_a_resume(tmp_path):
    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()
    cb = BestWindow(ckpts, n=3)
    losses = {4: 3.0, 8: 2.0, 12: 2.5, 16: math.nan, 20: 2.0}  # lowest at 8; a tie later is not lower
    for step in range(2, 21, 2):
        save_step(ckpts, step, keep=3)
        if step in losses:
            cb.on_validation_end(fake_trainer(step, losses[step]), None)
    save_step(ckpts, 22, keep=3)
    cb.on_validation_end(fake_trainer(22, None), None)  # a validation that logged no loss changes nothing
    paths, at, which = checkpoints_to_average(tmp_path, 3, "best")
    assert [p.name for p in paths] == ["step=4.ckpt", "step=6.ckpt", "step=8.ckpt"] and at == "best"
    assert not (ckpts / "step=8.ckpt").exists()  # rotated out of checkpoints/, kept in checkpoints/best/
    assert [torch.load(p)["state_dict"]["w"][0].item() for p in paths] == [4.0, 6.0, 8.0]
    assert "val/loss 2" in which and "step 8" in which
    assert json.loads((ckpts / "best" / "best.json").read_text())["step"] == 8
    # the lowest value travels in the checkpointed state: a resumed run does not replace the window with a worse one
    resumed = BestWindow(ckpts, n=3)
    resumed.load_state_dict(cb.state_dict())
    save_step(ckpts, 24, keep=3)
    resumed.on_validation_end(fake_trainer(24, 2.2), None)
    assert [p.name for p in checkpoints_to_average(tmp_path, 3, "best")[0]] == [p.name for p in paths]
    resumed.on_validation_end(fake_trainer(24, 1.5), None)  # a new lowest: the window moves, the old files go
    assert [p.name for p in checkpoints_to_average(tmp_path, 2, "best")[0]] == ["step=22.ckpt", "step=24.ckpt"]
    assert sorted(p.name for p in (ckpts / "best").glob("*.ckpt")) == ["step=20.ckpt", "step=22.ckpt", "step=24.ckpt"]
    # last: the newest step checkpoints, as before
    assert [p.name for p in checkpoints_to_average(tmp_path, 2, "last")[0]] == ["step=22.ckpt", "step=24.ckpt"]


def test_without_a_window_best_falls_back_to_the_last_with_a_warning(tmp_path, caplog):
    (tmp_path / "checkpoints").mkdir()
    for step in (2, 4):
        save_step(tmp_path / "checkpoints", step, keep=5)
    paths, at, which = checkpoints_to_average(tmp_path, 5, "best")
    assert at == "last" and [p.name for p in paths] == ["step=2.ckpt", "step=4.ckpt"]
    assert which == "the last 2 checkpoints"
    assert "decode.average_at=best" in caplog.text and "best.json is missing" in caplog.text
    with pytest.raises(ConfigError, match="decode.average_at='lowest'"):
        DecodeConfig(average_at="lowest")


def test_demo_averages_the_checkpoints_at_the_lowest_validation_loss(tmp_path, capsys):
    """A real fit (a constant learning rate high enough that the validation loss does not fall every time) with
    validations on checkpoint steps and rotation keeping fewer files than the run writes: best.json names the
    step of the lowest val/loss in the run's metrics, and the demo averages the checkpoints up to it."""
    recipe = write_recipe(tmp_path, optim={"lr": 0.3, "schedule": "constant", "warmup_steps": 0},
                          trainer={"max_steps": 16, "val_every": 2, "ckpt_every": 2, "keep_checkpoints": 2},
                          decode={"average_last": 2, "average_at": "best", "val_sentences": 4, "max_len_b": 4})
    assert main(["demo", "-c", str(recipe), "--trainer.run_name", "best"]) == 0
    run_dir = tmp_path / "runs" / "best"
    val = {step: v[-1] for step, v in read_run(run_dir)["val/loss"].items()}
    lowest = min(val, key=val.get)
    record = json.loads((run_dir / "checkpoints" / "best" / "best.json").read_text())
    assert record["step"] == lowest + 1  # metrics count steps from 0, checkpoints from 1
    assert lowest < max(val), sorted(val.items())  # the lr makes the loss turn up: the window is not the last one
    assert record["checkpoints"] == [f"step={lowest - 1}.ckpt", f"step={lowest + 1}.ckpt"]
    assert not (run_dir / "checkpoints" / record["checkpoints"][-1]).exists()  # rotated out, kept in best/
    result = json.loads((run_dir / "demo_results.json").read_text(encoding="utf-8"))
    assert [Path(p).name for p in result["checkpoints_averaged"]] == record["checkpoints"]
    assert "up to the lowest validation loss" in result["checkpoints_averaged_which"]
    a, b, avg = (torch.load(p, weights_only=True)["state_dict"] for p in
                 (*result["checkpoints_averaged"], run_dir / "checkpoints" / "averaged_best2.ckpt"))
    name = "model.decoder.layers.0.ffn.fc1.weight"
    assert torch.allclose(avg[name], (a[name] + b[name]) / 2) and not torch.equal(avg[name], b[name])
