"""A full disk, for real: a small tmpfs the test mounts (as root) as the runs folder, the study's journal folder or
a run's eval folder, filled up mid-way. Every write that does not fit leaves the previous file whole and loadable
and fails with an error naming the folder and the bytes needed; once there is space again the work goes on from
what was saved (`--ckpt-path last`, the next journal append, the next evaluation). Where a tmpfs cannot be
mounted (not root, not Linux) the tests skip and say why.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from attnlab import checkpoint_io, cli
from attnlab.ablate.final import evaluate_run
from attnlab.ablate.spec import load_spec
from attnlab.ablate.study import connect, prepare_study
from attnlab.checkpoints import average_checkpoints, checkpoint_step, loads, read
from attnlab.experiment import load_experiment
from attnlab.files import DiskFull
from attnlab.rundir import run_metrics
from attnlab.train import fit

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))
from test_ablate_runner import GRID_4x2, write_lm_recipe, write_study  # noqa: E402


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


def fill_before_last(monkeypatch, disk: Path, step: int) -> None:
    """The disk fills just before last.ckpt is written at `step` (after step=<step>.ckpt), however it is written."""
    save = checkpoint_io.StepCheckpoint._save_checkpoint

    def filling(self, trainer, filepath: str) -> None:
        if Path(filepath).name == "last.ckpt" and trainer.global_step == step:
            fill(disk, leave=16384)
        save(self, trainer, filepath)

    monkeypatch.setattr(checkpoint_io.StepCheckpoint, "_save_checkpoint", filling)


@pytest.mark.slow
@pytest.mark.parametrize("at", ["step", "last", "step-background"])
def test_a_checkpoint_save_on_a_full_disk_keeps_the_last_one_and_says_what_it_needs(at, small_disk, tmp_path,
                                                                                    monkeypatch):
    """The disk fills before step=20.ckpt (written in the training thread, or in the writer thread: its error is
    raised at the next save or the end of the fit), or between step=20.ckpt and last.ckpt, its copy."""
    monkeypatch.chdir(tmp_path)
    steps = 30
    recipe = write_lm_recipe(tmp_path, max_steps=steps, ckpt_every=10, log_every=1)
    writes = "background" if at.endswith("background") else "foreground"
    exp = load_experiment(recipe, {"trainer.runs_dir": str(small_disk / "runs"), "trainer.run_name": "full",
                                   "trainer.checkpoint_writes": writes})
    ckpts = small_disk / "runs" / "full" / "checkpoints"
    callbacks = [FillAt(small_disk, 15)] if at.startswith("step") else []
    real_save = checkpoint_io.StepCheckpoint._save_checkpoint
    if at == "last":
        fill_before_last(monkeypatch, small_disk, 20)
    with pytest.raises(DiskFull) as e:
        fit(exp, callbacks=callbacks)
    message = str(e.value)
    name = "last.ckpt" if at == "last" else "step=20.ckpt"
    assert f"no space left in {ckpts} to write checkpoint {name}: it needs " in message, message
    needed = int(re.search(r"it needs ([\d,]+) bytes", message).group(1).replace(",", ""))
    last = ckpts / "last.ckpt"
    assert loads(last) and checkpoint_step(last) == 10, "the previous checkpoint is whole"
    assert abs(needed - last.stat().st_size) < 0.01 * needed, (needed, last.stat().st_size)
    assert not [p for p in ckpts.iterdir() if p.name.endswith(".tmp")], "no temporary file left behind"
    if at == "last":  # the step checkpoint was written whole before the disk filled
        assert sorted(p.name for p in ckpts.glob("*.ckpt")) == ["last.ckpt", "step=10.ckpt", "step=20.ckpt"]
        assert loads(ckpts / "step=20.ckpt") and checkpoint_step(ckpts / "step=20.ckpt") == 20
    else:
        assert sorted(p.name for p in ckpts.glob("*.ckpt")) == ["last.ckpt", "step=10.ckpt"]

    monkeypatch.setattr(checkpoint_io.StepCheckpoint, "_save_checkpoint", real_save)
    (small_disk / "filler").unlink()  # space again: the command line resumes from the last good checkpoint
    assert cli.main(["fit", "-c", str(recipe), "--trainer.runs_dir", str(small_disk / "runs"),
                     "--trainer.run_name", "full", "--ckpt-path", "last"]) == 0
    assert checkpoint_step(last) == steps
    ref = fit(load_experiment(recipe, {"trainer.run_name": "reference"}))
    got, want = run_metrics(ckpts.parent), run_metrics(ref)
    logged = [s for s, _ in got["train/loss"]]
    # with last.ckpt the fit died after step=20.ckpt, which it resumes from, and before step 19's row reached
    # metrics.csv (Lightning logs a step's row after on_train_batch_end, where the checkpoint is written): that
    # one row is missing (a gap of any death between a step checkpoint and its row, not of the full disk)
    assert set(range(steps)) - set(logged) <= ({19} if at == "last" else set()) and len(set(logged)) == len(logged)
    assert got["train/loss"] == [(s, v) for s, v in want["train/loss"] if s in logged], \
        "the resumed run trained on as the uninterrupted one"


class FillForRows(Callback):
    """Fills the disk (no page left) a step after step=40.ckpt (Lightning runs checkpoint callbacks last), or at
    the end of the first validation (before its row is written), and keeps metrics.csv as it was then."""

    def __init__(self, disk: Path, at: str) -> None:
        self.disk, self.at, self.saved = disk, at, None

    def fill(self, trainer) -> None:
        if self.saved is None:
            self.saved = (Path(trainer.log_dir) / "metrics.csv").read_bytes()
            fill(self.disk, leave=0)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.at == "row" and trainer.global_step == 41:
            self.fill(trainer)

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        if self.at == "new-column":
            self.fill(trainer)


def disk_full_errors(e: BaseException | None) -> list[str]:
    """The DiskFull messages in an exception and those it was raised from or during."""
    out = []
    while e is not None and len(out) < 10:
        out += [str(e)] if isinstance(e, DiskFull) else []
        e = e.__cause__ or e.__context__
    return out


@pytest.mark.parametrize("at", ["row", "new-column"])
def test_metrics_csv_on_a_full_disk_keeps_its_rows_and_the_resumed_run_logs_them_all(at, small_disk, tmp_path,
                                                                                    monkeypatch):
    """The disk fills after step=40.ckpt: the rows go on filling metrics.csv's last page (a tmpfs counts pages)
    until one does not fit (39 rows of ~115 bytes are more than a page, and the next checkpoint and validation are
    at step 80), its append cut back; or the disk fills at the first validation (step 42), whose val/loss column
    makes the CSV logger rewrite the whole file under a new header."""
    monkeypatch.chdir(tmp_path)
    steps = 80
    recipe = write_lm_recipe(tmp_path, max_steps=steps, ckpt_every=40, val_every=steps if at == "row" else 42,
                             log_every=1)
    overrides = {"trainer.runs_dir": str(small_disk / "runs"), "trainer.run_name": "m", "trainer.loggers": "csv"}
    filler = FillForRows(small_disk, at)
    with pytest.raises(DiskFull) as e:
        fit(load_experiment(recipe, overrides), callbacks=[filler])
    logs = small_disk / "runs" / "m" / "logs"
    errors = disk_full_errors(e.value)
    assert any(m.startswith(f"no space left in {logs} to write metrics.csv: it needs ") for m in errors), errors
    kept = (logs / "metrics.csv").read_bytes()
    if at == "new-column":
        assert kept == filler.saved, "the file as it was before the rewrite"
    else:  # the rows that fit, each whole, and none cut
        assert kept.startswith(filler.saved) and kept.endswith(b"\n") and len(kept) > len(filler.saved)
    assert not [p for p in logs.iterdir() if p.name.endswith(".tmp")], "no temporary file left behind"
    (small_disk / "filler").unlink()
    assert cli.main(["fit", "-c", str(recipe), *(f"--{k}={v}" for k, v in overrides.items()),
                     "--ckpt-path", "last"]) == 0
    ref = fit(load_experiment(recipe, {"trainer.run_name": "reference"}))
    got, want = run_metrics(small_disk / "runs" / "m"), run_metrics(ref)
    assert [s for s, _ in got["train/loss"]] == list(range(steps))
    assert got["train/loss"] == want["train/loss"] and got["val/loss"] == want["val/loss"]


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



def journal_attrs(spec, study_dir: Path) -> list[dict]:
    """Every trial's user attrs, read by a fresh reader of the journal (as another worker reads it)."""
    return [t.user_attrs for t in connect(spec, study_dir).study.get_trials()]


@pytest.mark.parametrize("leave", [4096, 0], ids=["room-for-the-lock", "none"])
def test_a_journal_append_on_a_full_disk_is_cut_back_and_the_study_reads_whole(leave, small_disk, tmp_path):
    """With a page left, the lock file fits and the append is cut short by the disk (what optuna's own append
    leaves torn, so that the next append corrupts the study); with none, taking the lock fails."""
    spec = load_spec(write_study(tmp_path, GRID_4x2))
    study_dir = small_disk / "study"
    h = prepare_study(spec, study_dir)  # its journal: study_dir/journal.log
    tid = h.storage.create_new_trial(h.study_id)
    h.storage.set_trial_user_attr(tid, "before", 1)
    journal = study_dir / "journal.log"
    saved = journal.read_bytes()
    fill(small_disk, leave=leave)
    with pytest.raises(OSError) as e:  # a trial's curves: more than the page the journal's end has room in
        h.storage.set_trial_user_attr(tid, "curves", "x" * 100_000)
    assert journal.read_bytes() == saved, "the records before the failed append are whole, and nothing follows"
    assert journal_attrs(spec, study_dir) == [{"before": 1}]
    (small_disk / "filler").unlink()
    h.storage.set_trial_user_attr(tid, "after", 2)  # space again: the next append lands on a line of its own
    assert journal_attrs(spec, study_dir) == [{"before": 1, "after": 2}]
    assert isinstance(e.value, DiskFull), repr(e.value)
    message = str(e.value)
    assert f"no space left in {study_dir} to write 1 record(s) to the study journal journal.log: it needs " in message
    assert int(re.search(r"it needs ([\d,]+) bytes", message).group(1).replace(",", "")) > 100_000


def test_a_record_torn_by_a_killed_writer_is_cut_before_the_next_append(tmp_path):
    spec = load_spec(write_study(tmp_path, GRID_4x2))
    h = prepare_study(spec, tmp_path / "study")
    tid = h.storage.create_new_trial(h.study_id)
    with open(tmp_path / "study" / "journal.log", "ab") as f:
        f.write(b'{"op_code":8,"worker_id":"x","trial_id":0,"user_attr":{"ha')  # a write killed midway
    h.storage.set_trial_user_attr(tid, "after", 2)
    assert journal_attrs(spec, tmp_path / "study") == [{"after": 2}]


def test_a_final_evaluation_on_a_full_disk_keeps_the_previous_files(small_disk, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    recipe = write_lm_recipe(tmp_path, max_steps=4, ckpt_every=4, log_every=1)
    exp = load_experiment(recipe, {"trainer.runs_dir": str(small_disk / "runs"), "trainer.run_name": "ev",
                                   "decode.average_last": 1})
    run_dir = fit(exp)
    evaluate_run(exp, run_dir)
    eval_dir = run_dir / "eval"
    saved = (eval_dir / "final.json").read_text()
    fill(small_disk, leave=0)
    with pytest.raises(DiskFull, match=re.escape(f"no space left in {eval_dir} to write final.json: it needs ")):
        evaluate_run(exp, run_dir)
    assert (eval_dir / "final.json").read_text() == saved
    assert [p.name for p in eval_dir.iterdir()] == ["final.json"], "no temporary file left behind"
    (small_disk / "filler").unlink()  # space again: the evaluation runs and writes its files
    evaluate_run(exp, run_dir)
    again, before = json.loads((eval_dir / "final.json").read_text()), json.loads(saved)
    assert {k: v for k, v in again.items() if k != "seconds"} == {k: v for k, v in before.items() if k != "seconds"}


def test_an_averaged_checkpoint_on_a_full_disk_keeps_the_previous_one(small_disk, tmp_path):
    """What `attnlab demo` and `attnlab average` write: the average of step checkpoints (plain state dicts, off the
    small disk) into checkpoints/averaged_last2.ckpt on it; the second average (2 MiB) is larger than the first
    (1 MiB), so a write in place would not fit either, once the old file is truncated."""
    inputs = []
    for k, cols in enumerate([512, 512, 1024, 1024]):
        inputs.append(tmp_path / f"step={k}.ckpt")
        torch.save({"w": torch.full((512, cols), float(k))}, inputs[-1])
    out = small_disk / "checkpoints" / "averaged_last2.ckpt"
    out.parent.mkdir()
    average_checkpoints(inputs[:2], out)
    fill(small_disk, leave=0)
    with pytest.raises(DiskFull, match=re.escape(f"no space left in {out.parent} to write checkpoint {out.name}: "
                                                 "it needs 2,0")):
        average_checkpoints(inputs[2:], out)
    assert float(read(out)["w"].mean()) == 0.5, "the previous average, whole"
    assert [p.name for p in out.parent.iterdir()] == [out.name], "no temporary file left behind"
    (small_disk / "filler").unlink()
    average_checkpoints(inputs[2:], out)
    assert float(read(out)["w"].mean()) == 2.5
