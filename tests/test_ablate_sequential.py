"""Seeds until decided (attnlab.analysis.sequential): the group-sequential boundaries against published values and a
simulation of their own, then simulated studies run in rounds (attnlab.analysis.seeds_power: the rounds the table
replays, inference.against_baseline and testset.test_set_cov at every round) for the issue's three targets: size
under optional stopping, equivalence declared wrongly, and the seeds spent against a fixed 10-seed design.

The simulations use 100 test sentences of SD 5.77 (the 0.58 points of sentence noise in a corpus score that 300
sentences of SD 10 give) and 100 resamples, a few hundred studies a setting; `attnlab ablate seeds-power` runs 2,000
at 300 sentences and 200 resamples (docs/results/seeds_power.md). Stopping at the first round whose fixed-sample
test stars a comparison (spending `none`) fails the first three tests here: docs/seeds.md gives its rates."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from scipy import stats

from attnlab.ablate.seeds import parse_seeds
from attnlab.analysis import seeds_power as sp
from attnlab.analysis import sequential as sq
from attnlab.config import ConfigError

SMALL = {"sentences": 100, "sentence_sd": 10 * math.sqrt(100 / 300), "resamples": 100}


def test_boundaries_are_lan_demets_and_spend_what_they_say():
    """Lan-DeMets boundaries of 5 equally spaced looks, two-sided level 0.05 (alpha / 2 a side), as gsDesign's
    sfLDOF / sfLDPocock and Jennison & Turnbull 2000 (table 7.6) give them; the level each look spends, checked by
    simulating the standardised statistics of 200,000 studies; repeated p-values that invert the boundaries."""
    five = (0.2, 0.4, 0.6, 0.8, 1.0)
    assert sq.boundaries(five, 0.05, "obrien_fleming") == pytest.approx([4.8769, 3.3569, 2.6803, 2.2898, 2.0310],
                                                                         abs=2e-4)
    assert sq.boundaries(five, 0.05, "pocock") == pytest.approx([2.4380, 2.4268, 2.4101, 2.3966, 2.3859], abs=2e-4)
    assert sq.boundaries(five, 0.025, "obrien_fleming", sides=1) == pytest.approx(
        sq.boundaries(five, 0.05, "obrien_fleming"), abs=1e-6)
    d = sq.Design(2, 10)
    fractions = np.array(d.fractions)
    rng = np.random.default_rng(0)
    steps = np.diff(np.r_[0.0, fractions])
    z = np.cumsum(rng.normal(size=(200_000, len(steps))) * np.sqrt(steps), -1) / np.sqrt(fractions)
    for alpha in (0.05, 0.0125):
        c = sq.boundaries(d.fractions, alpha, "obrien_fleming")
        crossed = np.maximum.accumulate(np.abs(z) >= c, -1).mean(0)  # (looks,) by each look
        assert crossed == pytest.approx(sq.spent(fractions, alpha, "obrien_fleming"), abs=4 * math.sqrt(alpha / 2e5))
        for look in (2, 5, 9):
            assert d.repeated_p(np.array([d.nominal(look, alpha)]), look)[0] == pytest.approx(alpha, rel=0.01)
    assert d.nominal(1, 0.05) < 1e-5 and d.nominal(9, 0.05) < 0.05  # little spent early; the last look under 0.05
    naive = sq.Design(2, 10, spending="none")  # the fixed-sample test after every round
    assert naive.nominal(3, 0.05) == pytest.approx(0.05) and naive.repeated_p(np.array([0.03]), 3)[0] == 0.03


def test_size_under_optional_stopping_per_comparison_and_family_wise(tmp_path, monkeypatch, capsys):
    """No variant better: looking after every round from 2 to 10 seeds and stopping at a star, at most 7% of null
    comparisons and 7% of studies get one (4 variants at seed SD 0, 1.3 and 3, 600 studies each, through the command
    docs/seeds.md names, which writes the table and its raw numbers; 8 variants at 1.3). The fixed-sample test after
    every round stars one in 10-17% of studies (docs/results/seeds_power.md)."""
    from attnlab.cli import main

    simulate = sp.simulate
    monkeypatch.setattr(sp, "simulate", lambda rng, case, studies, **_: simulate(rng, case, studies, **SMALL))
    monkeypatch.setattr(sp, "size_cases", lambda: [sp.Case(4, sd, (0.0,) * 4) for sd in (0.0, 1.3, 3.0)])
    monkeypatch.setattr(sp, "equivalence_cases", list)
    monkeypatch.setattr(sp, "cost_cases", list)
    out = tmp_path / "power.md"
    assert main(["ablate", "seeds-power", "--studies", "600", "--out", str(out)]) == 0
    assert out.read_text().startswith("`attnlab ablate seeds-power --studies 600`: 600 simulated studies per row")
    assert "| 4 | 1.3 | O'Brien-Fleming |" in out.read_text() and "written:" in capsys.readouterr().out
    rows = [(r["case"]["variants"], r["case"]["seed_sd"], r["rounds"]) for r in
            json.loads(out.with_suffix(".json").read_text())["size"]]
    r = sp.run_case(sp.Case(8, 1.3, (0.0,) * 8), 200, seed=1, **SMALL)
    for variants, sd, x in rows + [(8, 1.3, r["rounds"])]:
        assert x["size"] <= 0.07 and x["familywise"] <= 0.07, (variants, sd, x)


def test_equivalence_is_declared_wrongly_at_most_5_percent_when_the_difference_is_eps():
    """Every variant differs by exactly +-eps: declared equivalent (within +-eps) in at most 5% of comparisons, at
    seed SD 0 (eps 1), 1.3 and 3 (eps 2). A fixed 90% interval after every round declares it in 10% (SD 0)."""
    for sd, eps in ((0.0, 1.0), (1.3, 2.0), (3.0, 2.0)):
        r = sp.run_case(sp.Case(4, sd, (eps, -eps, eps, -eps), eps=eps), 250, seed=2, **SMALL)
        assert r["rounds"]["equivalent_wrongly"] <= 0.05, (sd, eps, r["rounds"])


def test_seeds_spent_against_a_fixed_10_seed_design_of_the_same_power():
    """Half the variants better by 3, half not at all. With sentence noise alone (seed SD 0) and equivalence within
    +-2, the rounds take at most half the fixed design's 50 trainings, find the +3 variants as often as it does,
    star no more nulls than 7% of studies and decide the nulls as equivalent. With independent seed noise of SD 1.3
    (equivalence within +-2) they save a fifth of the trainings at the fixed design's power, not half
    (docs/results/seeds_power.md: the target is met only where the noise is small against eps)."""
    r = sp.run_case(sp.Case(4, 0.0, (3.0, 3.0, 0.0, 0.0), eps=2.0), 200, seed=3, fixed_too=True, **SMALL)
    x, f = r["rounds"], r["fixed"]
    assert r["trainings"] <= 0.5 * r["fixed_trainings"], r
    assert x["power"] >= f["power"] - 0.02 and x["familywise"] <= 0.07 and x["null_equivalent"] >= 0.8, r
    r = sp.run_case(sp.Case(4, 1.3, (3.0, 3.0, 0.0, 0.0), eps=2.0), 200, seed=4, fixed_too=True, **SMALL)
    assert r["trainings"] < 0.9 * r["fixed_trainings"] and r["rounds"]["power"] >= r["fixed"]["power"] - 0.03, r
    assert r["rounds"]["familywise"] <= 0.07


def test_rounds_plan_the_baseline_keeps_up_and_decided_rows_keep_their_look():
    """A batch of 2 studies, the baseline first: a row whose comparison is decided gets no more seeds and keeps the
    estimate of the round it stopped at; the baseline has as many seeds as the undecided rows; a round whose
    trials have not all ended is not looked at, and replay.waiting names them."""
    rng = np.random.default_rng(5)
    y = rng.normal(0.0, 0.3, (2, 4, 6)) + np.array([0.0, 5.0, 0.0, 0.0])[None, :, None]  # row 1 far better
    d = sq.Design(2, 6, equivalence=None)
    r = sq.replay(y, None, d)
    assert r.state[:, 0].tolist() == [sq.BETTER] * 2 and r.stopped[:, 0].tolist() == [2, 2]
    assert (r.seeds[-1][:, 1] == 3).all() and (r.seeds[-1][:, 0] == r.seeds[-1][:, 2:].max(-1)).all()
    assert (r.state[:, 1:] == sq.AT_MAX).all() and (r.seeds[-1][:, 0] == 6).all()
    held = sq.replay(y[:1], None, d)
    assert held.estimate[0, 0] == pytest.approx(r.estimate[0, 0], rel=1e-12)  # round 2's, not a later round's
    settled = np.zeros(y[:1].shape, bool)
    settled[..., :3] = True
    settled[0, 2, 2] = False  # round 2 waits for the trial of row 2, seed 3
    part = sq.replay(y[:1], None, d, settled)
    assert part.rounds == 1 and part.waiting[0].sum() == 1 and part.waiting[0, 2, 2]


def test_seeds_in_a_file_make_rounds_whose_first_round_spends_little():
    """seeds: {min, max} in a file: the seeds 1..max in rounds min, min + 1, ..., max; at the first of 3 rounds the
    O'Brien-Fleming boundary of a 2-comparison family (0.025 each) asks for p below 0.001."""
    assert parse_seeds([3, 1], "f") == ((3, 1), None)
    seeds, rounds = parse_seeds({"min": 2, "max": 4}, "f")
    assert seeds == (1, 2, 3, 4) and (rounds.min, rounds.max, rounds.step) == (2, 4, 1)
    d = sq.Design(rounds.min, rounds.max, rounds.step)
    assert d.schedule == (2, 3, 4) and d.nominal(1, 0.025) < 1e-3
    assert parse_seeds({"min": 2, "max": 5, "step": 2, "list": [9, 8, 7, 6, 5, 4]}, "f")[0] == (9, 8, 7, 6, 5)
    assert sq.Design(2, 5, 2).schedule == (2, 4, 5)
    for bad in ({"min": 1, "max": 4}, {"max": 4, "every": 2}, {"min": 3, "max": 2}, {"max": 3, "list": [1, 2]}):
        with pytest.raises(ConfigError, match="seeds"):
            parse_seeds(bad, "f")
    assert stats.norm.isf(0.025) == pytest.approx(sq.Design(2, 4, spending="none").critical(1, 0.05))
