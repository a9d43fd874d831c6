"""Budgets that mean what they say (attnlab.ablate.budget, spec.trial_overrides, report): a steps or FLOPs
budget ends a trial, not the recipe's time limit, and both set the schedule's horizon the same way; a budget that
ends inside the warmup or a schedule that ignores it is warned about when the study starts, naming the fix; a
trial that stopped short of its budget is flagged in the table."""

from __future__ import annotations

import logging

import torch

from attnlab.ablate.budget import budget_warnings
from attnlab.ablate.runner import run_study, trial_experiment
from attnlab.ablate.spec import load_spec
from attnlab.cli import main
from test_ablate_runner import FAST, TINY_LM, fake_fit, write_study
from test_ablate_spec import ROOT

TIMED = TINY_LM.replace("trainer: {max_steps: 10, val_every: 5}",
                        "trainer: {max_steps: 10, val_every: 5, max_time_min: 7}\noptim: {warmup_steps: 4}")
AXES = "axes:\n  model.ffn: [gelu, swiglu]\n"


def test_a_steps_or_flops_budget_clears_the_time_limit_and_sets_the_horizon_alike(tmp_path):
    def trial(body: str, name: str):
        spec = load_spec(write_study(tmp_path, body + AXES, base=TIMED, name=name))
        return trial_experiment(spec, tmp_path / name, {"model.ffn": "gelu"}, 1)

    steps = trial("budget: {steps: 20}\n", "steps")
    flops = trial("budget: {flops: 1.0e12}\n", "flops")
    assert steps.trainer.max_time_min == flops.trainer.max_time_min == 0  # the recipe's 7 minutes cleared
    assert (steps.trainer.max_steps, steps.optim.max_steps) == (20, 20)
    assert flops.optim.max_steps == flops.trainer.max_steps > 1
    pinned = "overrides: {optim.max_steps: 500}\n"  # the file's own horizon wins, for either budget
    assert trial("budget: {steps: 20}\n" + pinned, "steps_pinned").optim.max_steps == 500
    assert trial("budget: {flops: 1.0e12}\n" + pinned, "flops_pinned").optim.max_steps == 500
    timed = trial("budget: {time_min: 3}\n" + pinned, "timed")
    assert timed.trainer.max_time_min == 3


def test_a_budget_inside_the_warmup_or_a_schedule_without_horizon_is_warned_about_at_the_start(tmp_path, caplog):
    noam = load_spec(write_study(tmp_path, "budget: {steps: 3}\n" + AXES, base=TIMED, name="noam"))
    warnings = budget_warnings(noam)
    assert len(warnings) == 2, warnings  # one each, not one per variant
    assert "budget.steps=3 ends inside the warmup (optim.warmup_steps=4)" in warnings[0]
    assert "Fix: set optim.warmup_steps under overrides:" in warnings[0]
    assert "optim.schedule=noam ignores the budget's horizon" in warnings[1]
    assert "Fix: overrides: {optim.schedule: cosine}" in warnings[1]
    fixed = "overrides: {optim.schedule: cosine, optim.lr: 1.0e-3, optim.warmup_steps: 1}\n"
    assert budget_warnings(load_spec(write_study(tmp_path, "budget: {steps: 3}\n" + fixed + AXES, base=TIMED,
                                                 name="fixed"))) == []
    one = "budget: {steps: 3}\noverrides: {optim.schedule: cosine, optim.lr: 1.0e-3}\n" \
          "variants:\n  - {name: long, optim.warmup_steps: 1}\n  - {name: short, optim.warmup_steps: 8}\n"
    assert budget_warnings(load_spec(write_study(tmp_path, one, base=TIMED, name="one")))[0].endswith(
        "(variants: short)")
    assert budget_warnings(load_spec(write_study(tmp_path, AXES, base=TIMED, name="none"))) == []  # no budget
    caplog.set_level(logging.WARNING, logger="attnlab")
    assert main(["ablate", "run", str(noam.path), "--dir", str(tmp_path / "run"), "--fit",
                 "test_ablate_runner:fake_fit", "--heartbeat", "1", "--grace", "2", "--poll", "0.2"]) == 0
    logged = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings[0] in logged and warnings[1] in logged
    flops = load_spec(write_study(tmp_path, "budget: {flops: 1.0e3}\n" + fixed + AXES, base=TIMED, name="tiny"))
    caplog.clear()
    trial_experiment(flops, tmp_path / "tiny", {"model.ffn": "gelu"}, 1)  # 1 step: inside even 1 warmup step
    assert any("budget.flops=1000, i.e. trainer.max_steps=1 ends inside the warmup" in r.getMessage()
               for r in caplog.records)


def short_fit(exp, ckpt_path=None):
    """fake_fit whose seed-2 trials stop 4 steps short of their budget (a time limit or a crash would)."""
    run_dir = fake_fit(exp, ckpt_path)
    if exp.trainer.seed == 2:
        torch.save({"global_step": exp.trainer.max_steps - 4}, run_dir / "checkpoints" / "last.ckpt")
    return run_dir


def test_a_trial_that_stopped_short_of_its_budget_is_flagged_in_the_table(tmp_path, capsys):
    spec = load_spec(write_study(tmp_path, "seeds: [1, 2]\nbudget: {steps: 10}\n" + AXES, name="short"))
    assert run_study(spec, tmp_path / "study", opts=FAST, fit=short_fit) == {"done": 4}
    assert main(["ablate", "table", str(spec.path), "--dir", str(tmp_path / "study")]) == 0
    out = capsys.readouterr().out
    assert "| ffn=gelu † |" in out and "| ffn=swiglu † |" in out
    assert "- ffn=gelu (seed 2) stopped at step 6 of 10: short of its budget (†)" in out
    assert "(seed 1)" not in out


def test_the_shipped_studies_start_without_a_budget_warning():
    for path in sorted((ROOT / "ablations").glob("*.yaml")):
        assert budget_warnings(load_spec(path)) == [], path.name
