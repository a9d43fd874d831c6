"""`fit(..., ckpt_path="last")` (`attnlab fit --ckpt-path last`) with a damaged last.ckpt: the run resumes from its
newest checkpoint that loads, saying which file it skipped; an explicit path to a damaged file stays an error."""

from __future__ import annotations

import logging

import pytest

from attnlab.checkpoints import load_checkpoint
from attnlab.experiment import load_experiment
from attnlab.train import fit
from test_train import read_metrics, write_recipe


def cut(path) -> None:
    """What a crash mid-write by a tool that does not write atomically leaves: the first half of the file."""
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def test_resume_last_skips_a_damaged_last_ckpt_for_the_newest_step_checkpoint(tmp_path, caplog):
    # run_name: the run directory stays the same when max_steps changes
    recipe = write_recipe(tmp_path, trainer={"max_steps": 8, "ckpt_every": 4, "run_name": "damaged"})
    run_dir = fit(load_experiment(recipe))
    ckpts = run_dir / "checkpoints"
    last, step8 = ckpts / "last.ckpt", ckpts / "step=8.ckpt"
    assert load_checkpoint(step8)["global_step"] == 8
    cut(last)

    longer = load_experiment(recipe, {"trainer.max_steps": 12})
    with caplog.at_level(logging.WARNING, logger="attnlab"):
        assert fit(longer, ckpt_path="last") == run_dir
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and str(last) in r.getMessage()]
    assert len(warned) == 1 and str(step8) in warned[0], [r.getMessage() for r in caplog.records]
    losses = read_metrics(run_dir / "logs" / "metrics.csv")["train/loss"]
    assert sorted(losses) == [8, 9, 10, 11], "the resumed attempt continues from step=8.ckpt"
    assert load_checkpoint(last)["global_step"] == 12

    cut(last)  # a path given explicitly is resumed as given: damaged, it is an error naming it
    with pytest.raises(ValueError, match="not a readable checkpoint") as e:
        fit(load_experiment(recipe, {"trainer.max_steps": 16}), ckpt_path=str(last))
    assert str(last) in str(e.value)

    for path in ckpts.glob("*.ckpt"):  # none loads: an error naming the folder
        cut(path)
    with pytest.raises(ValueError, match="no checkpoint in .* loads") as e:
        fit(load_experiment(recipe, {"trainer.max_steps": 16}), ckpt_path="last")
    assert str(ckpts) in str(e.value) and "last.ckpt" in str(e.value)


def test_resume_last_of_a_hash_named_run_with_more_steps_says_how_to_continue_it(tmp_path):
    """A run named <recipe>-<config hash>: trainer.max_steps is in the hash, so `--trainer.max_steps 8 --ckpt-path
    last` looks in another directory. The error names the run that has checkpoints and the option that continues
    it; with that option, it does."""
    recipe = write_recipe(tmp_path, trainer={"max_steps": 4, "ckpt_every": 4, "run_name": ""})
    run_dir = fit(load_experiment(recipe))
    assert run_dir.name.startswith("tiny-")
    longer = load_experiment(recipe, {"trainer.max_steps": 8})
    with pytest.raises(FileNotFoundError) as e:
        fit(longer, ckpt_path="last")
    assert f"runs of tiny with checkpoints: {run_dir.name}" in str(e.value)
    assert f"add --trainer.run_name {run_dir.name}" in str(e.value)
    assert fit(load_experiment(recipe, {"trainer.max_steps": 8, "trainer.run_name": run_dir.name}),
               ckpt_path="last") == run_dir
    assert load_checkpoint(run_dir / "checkpoints" / "last.ckpt")["global_step"] == 8
