"""A full disk, for real: a small tmpfs the test mounts (as root) as the runs folder, the study's journal folder or
a run's eval folder, filled up mid-way. Every write that does not fit leaves the previous file whole and loadable
and fails with an error naming the folder and the bytes needed; once there is space again the work goes on from
what was saved (`--ckpt-path last`, the next journal append, the next evaluation). Where a tmpfs cannot be
mounted (not root, not Linux) the tests skip and say why.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from lightning.pytorch.callbacks import Callback

from attnlab import cli
from attnlab.checkpoints import checkpoint_step, loads
from attnlab.experiment import load_experiment
from attnlab.files import DiskFull
from attnlab.rundir import run_metrics
from attnlab.train import fit

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))
from test_ablate_runner import write_lm_recipe  # noqa: E402


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs mounted at tmp_path/disk (unmounted afterwards)."""
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        pytest.skip("a full disk needs a tmpfs of its own, which only root can mount (on Linux)")
    disk = tmp_path / "disk"
    disk.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"mounting a tmpfs failed: {r.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def fill(disk: Path, leave: int) -> Path:
    """A file that takes all of the disk's free space but `leave` bytes."""
    filler = disk / "filler"
    free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
    with open(filler, "ab") as f:
        f.write(b"\0" * max(0, free - leave))
    return filler


class FillAt(Callback):
    """Fills the disk at one step, between two checkpoints."""

    def __init__(self, disk: Path, step: int) -> None:
        self.disk, self.step = disk, step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            fill(self.disk, leave=16384)


@pytest.mark.slow
def test_a_checkpoint_save_on_a_full_disk_keeps_the_last_one_and_says_what_it_needs(small_disk, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    steps = 30
    recipe = write_lm_recipe(tmp_path, max_steps=steps, ckpt_every=10, log_every=1)
    exp = load_experiment(recipe, {"trainer.runs_dir": str(small_disk / "runs"), "trainer.run_name": "full"})
    ckpts = small_disk / "runs" / "full" / "checkpoints"
    with pytest.raises(DiskFull) as e:
        fit(exp, callbacks=[FillAt(small_disk, 15)])
    message = str(e.value)
    assert f"no space left in {ckpts} to write checkpoint step=20.ckpt: it needs " in message, message
    needed = int(re.search(r"it needs ([\d,]+) bytes", message).group(1).replace(",", ""))
    last = ckpts / "last.ckpt"
    assert loads(last) and checkpoint_step(last) == 10, "the previous checkpoint is whole"
    assert abs(needed - last.stat().st_size) < 0.01 * needed, (needed, last.stat().st_size)
    assert not [p for p in ckpts.iterdir() if p.name.endswith(".tmp")], "no temporary file left behind"
    assert sorted(p.name for p in ckpts.glob("*.ckpt")) == ["last.ckpt", "step=10.ckpt"]

    (small_disk / "filler").unlink()  # space again: the command line resumes from the last good checkpoint
    assert cli.main(["fit", "-c", str(recipe), "--trainer.runs_dir", str(small_disk / "runs"),
                     "--trainer.run_name", "full", "--ckpt-path", "last"]) == 0
    assert checkpoint_step(last) == steps
    ref = fit(load_experiment(recipe, {"trainer.run_name": "reference"}))
    got, want = run_metrics(ckpts.parent), run_metrics(ref)
    assert [s for s, _ in got["train/loss"]] == list(range(steps))
    assert got["train/loss"] == want["train/loss"], "the resumed run trained on as the uninterrupted one"


def test_the_command_line_reports_a_full_disk_as_an_error_naming_the_folder(small_disk, tmp_path, monkeypatch,
                                                                           capsys):
    monkeypatch.chdir(tmp_path)
    recipe = write_lm_recipe(tmp_path, max_steps=5, ckpt_every=5, log_every=1)
    fill(small_disk, leave=200_000)  # room for the run's small files, not for a checkpoint
    code = cli.main(["fit", "-c", str(recipe), "--trainer.runs_dir", str(small_disk / "runs"),
                     "--trainer.run_name", "full"])
    err = capsys.readouterr().err
    assert code == 1 and f"attnlab fit: error: no space left in {small_disk / 'runs' / 'full'}" in err, err
    assert "--ckpt-path last" in err

