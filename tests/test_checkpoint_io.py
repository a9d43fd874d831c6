"""trainer.checkpoint_writes: background (checkpoint_io.py): a fit's checkpoint files written by a thread from a
point-in-time copy of the state are the files the foreground writes; rotation and the copies that read a file
wait for its write; an error in the thread is raised at the next save and at the end of fit."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

import attnlab.checkpoint_io as cio
from attnlab.checkpoint_io import AtomicCheckpointIO
from attnlab.cli import main
from attnlab.config import ConfigError
from attnlab.experiment import load_experiment
from test_train import write_recipe


def files(run_dir: Path) -> dict[str, dict]:
    ckpts = run_dir / "checkpoints"
    return {p.relative_to(ckpts).as_posix(): torch.load(p, weights_only=False, map_location="cpu")
            for p in sorted(ckpts.rglob("*.ckpt"))}


def test_background_writes_give_the_files_of_foreground_writes(tmp_path):
    """Two fits of one recipe, one writing in the foreground, one in the background: the same checkpoint files
    (step ones rotated to the same two, last.ckpt, the best window's links) with the same weights, optimizer state
    and loop state; and the background run's config says how it wrote."""
    recipe = write_recipe(tmp_path, trainer={"max_steps": 10, "val_every": 2, "ckpt_every": 2, "keep_checkpoints": 2},
                          decode={"average_last": 2, "average_at": "best", "val_sentences": 0})
    runs = {}
    for how in ("foreground", "background"):
        assert main(["fit", "-c", str(recipe), "--trainer.run_name", how, "--trainer.checkpoint_writes", how]) == 0
        runs[how] = files(tmp_path / "runs" / how)
    fg, bg = runs["foreground"], runs["background"]
    assert sorted(fg) == sorted(bg) and "last.ckpt" in fg and any(k.startswith("best/") for k in fg), sorted(fg)
    assert sorted(k for k in fg if not k.startswith("best/")) == ["last.ckpt", "step=10.ckpt", "step=8.ckpt"]
    for name in fg:
        a, b = fg[name], bg[name]
        assert a["global_step"] == b["global_step"], name
        for key, t in a["state_dict"].items():
            assert torch.equal(t, b["state_dict"][key]), (name, key)
        ma = [s["exp_avg"] for s in a["optimizer_states"][0]["state"].values()]
        mb = [s["exp_avg"] for s in b["optimizer_states"][0]["state"].values()]
        assert all(torch.equal(x, y) for x, y in zip(ma, mb, strict=True)), name
    exp = load_experiment(tmp_path / "runs" / "background" / "config.yaml")
    assert exp.trainer.checkpoint_writes == "background"
    assert exp.config_hash() == load_experiment(tmp_path / "runs" / "foreground" / "config.yaml").config_hash()
    with pytest.raises(ConfigError, match="trainer.checkpoint_writes='sometimes'"):
        load_experiment(recipe, {"trainer.checkpoint_writes": "sometimes"})


def test_a_background_save_is_a_snapshot_and_what_follows_waits_for_it(tmp_path, monkeypatch):
    """The tensors saved are those of the moment of the save, whatever the caller does to them after; a removal
    and an after() queued behind a write run once it is on disk; save_checkpoint returns before the write ends."""
    gate, started = threading.Event(), threading.Event()
    real = cio.save_atomic

    def slow(obj, path):
        started.set()
        gate.wait(10)
        real(obj, path)

    monkeypatch.setattr(cio, "save_atomic", slow)
    io = AtomicCheckpointIO(background=True)
    old = tmp_path / "old.ckpt"
    torch.save({"x": 0}, old)
    w = torch.arange(4.0)
    io.save_checkpoint({"state_dict": {"w": w}, "step": [1]}, tmp_path / "new.ckpt")
    assert started.wait(10) and not (tmp_path / "new.ckpt").exists()  # returned while the thread writes
    w.add_(100)  # the optimizer steps on
    io.remove_checkpoint(old)
    seen = []
    io.after(lambda: seen.append((tmp_path / "new.ckpt").exists()))
    assert old.exists() and seen == []  # nothing removed or read before the write it follows
    gate.set()
    io.teardown()
    saved = torch.load(tmp_path / "new.ckpt", weights_only=False)
    assert torch.equal(saved["state_dict"]["w"], torch.arange(4.0)) and saved["attnlab_format"] == cio.FORMAT
    assert not old.exists() and seen == [True]


def test_an_error_in_the_writer_is_raised_at_the_next_save_and_at_the_end(tmp_path, monkeypatch):
    def full(obj, path):
        raise OSError(28, f"No space left on device: {path}")

    monkeypatch.setattr(cio, "save_atomic", full)
    io = AtomicCheckpointIO(background=True)
    io.save_checkpoint({"w": torch.ones(2)}, tmp_path / "a.ckpt")  # queued: no error yet
    with pytest.raises(OSError, match="a.ckpt"):  # raised instead of writing b.ckpt
        io.save_checkpoint({"w": torch.ones(2)}, tmp_path / "b.ckpt")
    with pytest.raises(OSError, match="a.ckpt"):  # the exception checkpoint that follows: the first error again,
        io.save_checkpoint({"w": torch.ones(2)}, tmp_path / "c.ckpt")  # not c.ckpt's, which would replace it
    io.teardown()  # once raised, the end of fit does not raise it again
    assert not (tmp_path / "c.ckpt").exists()
    io = AtomicCheckpointIO(background=True)
    io.save_checkpoint({"w": torch.ones(2)}, tmp_path / "e.ckpt")
    with pytest.raises(OSError, match="e.ckpt"):  # the end of fit
        io.teardown()
    monkeypatch.setattr(cio, "save_atomic", lambda obj, path: torch.save(obj, path))
    AtomicCheckpointIO(background=False).save_checkpoint({"w": torch.ones(2)}, tmp_path / "d.ckpt")
    assert (tmp_path / "d.ckpt").is_file()  # the foreground writes at once
