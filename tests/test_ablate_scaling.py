"""Scaling curves (attnlab.analysis.scaling, scaling_stats, scaling_report): the fit against known laws, the seed
draws, the learning rate re-picked inside every draw, and `attnlab ablate scaling` over a study with a scale:
ladder and an lr: search (with lr.extend_edges), trained by a stand-in whose validation loss follows a known law in
the compute the accounting gives it. The coverage of every printed interval is tested in
tests/test_ablate_scaling_coverage.py."""

from __future__ import annotations

import csv
import hashlib
import json
import math
import re

import numpy as np
import pytest

from attnlab.ablate.budget import step_cost
from attnlab.ablate.runner import run_study, trial_experiment
from attnlab.ablate.spec import load_spec
from attnlab.ablate.study import connect
from attnlab.analysis.scaling import (
    HOFFMANN_A,
    HOFFMANN_ALPHA,
    HOFFMANN_E,
    Layout,
    crossings,
    curve_params,
    fit_many,
    hoffmann_starts,
    interval,
    seed_draws,
)
from attnlab.analysis.scaling_report import collect, size_transfer
from attnlab.analysis.scaling_stats import EMode, ScalingData, ScalingStudy, analyse
from attnlab.cli import main
from attnlab.config import ConfigError
from test_ablate_runner import FAST, TINY_LM, fake_fit, write_study

C = np.geomspace(1e11, 3e12, 5)  # (5,) training FLOPs of a 5-size ladder
E, A, ALPHA = 2.0, 3.0 * 1e11 ** 0.27, 0.27  # L(1e11) = 5


def law(c, e=E, a=A, alpha=ALPHA):
    return e + a * np.power(c, -alpha)


def fit(c, loss, lay=None):
    """One curve's (a, alpha, e) from points (c, loss), the a at the median log C."""
    logc = np.log(c)
    scale = float(np.median(logc))
    lay = lay or Layout(np.zeros(len(c), int), np.zeros(1, int))
    p = fit_many(logc - scale, np.log(loss), np.ones(len(c)), lay, hoffmann_starts(scale, lay.n_curves, lay.n_groups))
    return curve_params(p, lay) if lay.n_curves > 1 else curve_params(p, lay)[0], scale


def test_noise_free_points_give_the_exact_parameters_from_hoffmanns_grid():
    assert hoffmann_starts(0.0).shape == (150, 3)  # 5 alphas x 5 log Es x 6 log As, Hoffmann et al. 2022 D.2
    assert (HOFFMANN_ALPHA, HOFFMANN_E, HOFFMANN_A) == ((0, .5, 1, 1.5, 2), (-1, -.5, 0, .5, 1), (0, 5, 10, 15, 20, 25))
    p, scale = fit(C, law(C))
    assert (math.exp(p[2]), p[1], math.exp(p[0] + p[1] * scale)) == pytest.approx((E, ALPHA, A), rel=1e-6)
    # E shared by two curves: one e, two (a, alpha)
    c2, loss2 = np.concatenate([C, C]), np.concatenate([law(C), law(C, a=2 * A, alpha=0.35)])
    lay = Layout(np.repeat([0, 1], 5), np.zeros(2, int))
    p, scale = fit(c2, loss2, lay)
    assert np.exp(p[:, 2]) == pytest.approx([E, E], rel=1e-6) and p[:, 1] == pytest.approx([ALPHA, 0.35], rel=1e-6)


def test_the_fit_is_least_squares_on_log_loss_not_an_l1_fit():
    """Issue 44: Huber's delta of 1e-3 on residuals of 1-10% made the fit an L1 fit, which passes through some points
    and ignores the others: moving the middle size's loss up 10% left the fit unchanged. Least squares moves the
    fitted loss there by its share of the points."""
    loss = law(C) * np.exp(np.array([0.01, -0.01, 0.0, 0.01, -0.01]))
    moved = loss.copy()
    moved[2] *= 1.1
    (p, scale), (q, _) = fit(C, loss), fit(C, moved)
    at = lambda par: math.exp(par[2]) + math.exp(par[0] - par[1] * (math.log(C[2]) - scale))  # noqa: E731
    assert at(q) / at(p) - 1 > 0.02


def test_the_bootstrap_draws_every_multiset_of_the_seeds_with_its_probability():
    counts, prob, exact = seed_draws(2, 200, 0)
    assert exact and counts.tolist() == [[2, 0], [1, 1], [0, 2]] and prob == pytest.approx([0.25, 0.5, 0.25])
    counts, prob, exact = seed_draws(3, 200, 0)
    assert len(prob) == 10 and prob.sum() == pytest.approx(1) and (counts.sum(1) == 3).all()
    x = np.array([1.0, 1.3, 0.8])  # a mean over the draws: its interval is the t interval of the mean
    low, high = interval(x.mean(), counts @ x / 3, prob, 3, exact)
    half = 4.302652729911275 * x.std(ddof=1) / math.sqrt(3)  # t(0.975, 2)
    assert (low, high) == pytest.approx((x.mean() - half, x.mean() + half))
    assert not seed_draws(7, 50, 0)[2] and seed_draws(7, 50, 0)[0].shape == (50, 7)


def test_each_draw_repicks_the_best_learning_rate():
    """Issue 44: the LR was chosen once, on the losses then fitted, and every resample reused its points. Seed 1
    favours LR 0, seed 2 LR 1: the draw of seed 2 twice takes LR 1's loss."""
    loss = np.full((1, 1, 1, 2, 2), np.nan)
    loss[0, 0, 0] = [[1.0, 1.3], [1.2, 1.15]]  # LR 0: seeds 1, 2; LR 1: seeds 1, 2
    r = analyse(ScalingData(loss, np.array([[1e12]]), np.array([1e-3, 2e-3]), (1e-3, 2e-3)))
    assert r.best_lr[0, 0, 0] == 0 and r.size_loss.est[0, 0, 0] == pytest.approx(1.15)
    assert r.size_loss.draws[0, 0, 0].tolist() == pytest.approx([1.0, 1.15, 1.15])  # seeds {1,1}, {1,2}, {2,2}
    assert r.edge[0, 0, 0]  # the smaller of the two tried


def test_crossings_are_found_at_the_right_compute():
    f = np.array([math.log(3.0) + 0.27 * 0, 0.27, math.log(2.0)])  # at scale 0: L = 2 + 3 C^-0.27 (log C units)
    g = np.array([math.log(3.0), 0.40, math.log(2.3)])
    lc = crossings(f, g, -5.0, 10.0, 0.0)
    assert 2 + 3 * math.exp(-0.27 * lc) == pytest.approx(2.3 + 3 * math.exp(-0.40 * lc), abs=1e-9)
    assert np.isnan(crossings(f, f + [0, 0, 0.1], -5.0, 10.0, 0.0))  # parallel: none


# ---------------------------------------------------------------------------------------------- a real study
SIZES = """\
scale:
  sizes:
    - {name: S, model.d_model: 32, model.n_heads: 2}
    - {name: M, model.d_model: 64, model.n_heads: 2}
    - {name: L, model.d_model: 96, model.n_heads: 2, model.n_dec_layers: 2}
    - {name: XL, model.d_model: 128, model.n_heads: 4, model.n_dec_layers: 2}
  d_ff_ratio: 4
  budget: {tokens_per_param: 2}
lr: {values: [5.0e-4, 1.0e-3, 2.0e-3], extend_edges: true}
seeds: [1, 2]
axes:
  model.ffn: [gelu, swiglu]
"""
BASE = TINY_LM.replace("trainer: {max_steps: 10, val_every: 5}",
                       "trainer: {max_steps: 10, val_every: 5}\noptim: {schedule: cosine, lr: 1.0e-3, warmup_steps: 1}")
BEST_LR = {"gelu": 1.0e-3, "swiglu": 4.0e-3}  # swiglu's lies beyond the grid's top edge: extend_edges adds 4e-3
LAWS = {"gelu": (2.0, 3.0 * 1e12 ** 0.27, 0.27), "swiglu": (2.3, 3.0 * 1e12 ** 0.40, 0.40)}  # cross at 3.5e12


def law_fit(exp, ckpt_path=None):
    """fake_fit whose val/loss follows a known law (LAWS) in the trial's compute (the accounting's FLOPs per
    token times the tokens its steps hold), times 1 + 0.03 log2(lr / best)^2 and a seed noise of 1.5% (from the
    trial's config); XL seed 2 of gelu at its best LR fails (a hole)."""
    ffn = exp.model.ffn
    if ffn == "gelu" and exp.model.d_model == 128 and exp.trainer.seed == 2 and exp.optim.lr == BEST_LR[ffn]:
        raise RuntimeError("out of memory (a stand-in for a failed trial)")
    run_dir = fake_fit(exp, ckpt_path)
    cost = step_cost(exp)
    compute = cost.flops_per_token * cost.tokens_per_step * exp.trainer.max_steps
    u = int(hashlib.sha1(f"{ffn} {exp.model.d_model} {exp.optim.lr} {exp.trainer.seed}".encode()).hexdigest(), 16)
    noise = float(np.random.default_rng(u % 2**32).normal(0, 0.015))
    loss = float(law(compute, *LAWS[ffn]) * (1 + 0.03 * math.log2(exp.optim.lr / BEST_LR[ffn]) ** 2) * math.exp(noise))
    rows = list(csv.reader(open(run_dir / "logs" / "metrics.csv", encoding="utf-8")))
    rows[-1][-1] = repr(loss)  # the last val/loss
    rows[-2][4] = repr(cost.tokens_per_step * exp.trainer.max_steps)  # train/tokens
    with open(run_dir / "logs" / "metrics.csv", "w", newline="", encoding="utf-8") as f:
        csv.writer(f).writerows(rows)
    (run_dir / "law.json").write_text(json.dumps({"compute": compute, "loss": loss}))
    return run_dir


def test_a_scale_ladder_and_lr_search_make_the_grid_and_each_size_its_budget(tmp_path):
    spec = load_spec(write_study(tmp_path, SIZES, base=BASE))
    assert spec.lrs == (5e-4, 1e-3, 2e-3) and spec.lr_extend and [v.name for v in spec.sizes] == ["S", "M", "L", "XL"]
    assert len(spec.variants()) == 2 * 4 * 3 and len(spec.points()) == 48
    v = spec.variants()[0]
    assert v.name == "scale=S ffn=gelu lr=0.0005" and v.overrides["model.d_ff"] == 128
    exp = trial_experiment(spec, tmp_path / "s", {**v.overrides}, 1)
    cost = step_cost(exp)
    from attnlab.models.accounting import count_parameters
    params = count_parameters(exp.model.replace(vocab_size=exp.data.vocab_size))["total"]
    assert exp.trainer.max_steps == max(1, math.floor(2 * params * cost.flops_per_token / cost.flops_per_step))
    assert exp.optim.max_steps == exp.trainer.max_steps and exp.trainer.max_time_min == 0
    bad = [("lr: {points: 1, spread: 2}\n", "lr: points must be an int >= 2"),
           ("lr: {points: 3, spread: 2, extend_edges: 1}\n", "lr.extend_edges must be true or false"),
           ("scale: {sizes: [{name: S, model.d_model: 32}], budget: {tokens: 1}}\n", "at least 2 sizes"),
           (SIZES.replace("tokens_per_param: 2", "steps: 2"), "scale.budget: expected one of"),
           (SIZES.replace("model.ffn: [gelu, swiglu]", "model.d_model: [32, 64]"), "are set by scale: or lr:"),
           ("budget: {steps: 5}\n" + SIZES, "remove budget:")]
    for body, message in bad:
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_spec(write_study(tmp_path, body if "axes" in body else body + "axes:\n  model.ffn: [gelu]\n",
                                  base=BASE, name="bad"))


def test_ablate_scaling_on_a_run_study_extends_the_lr_edge_reports_the_hole_and_the_held_out_check(tmp_path,
                                                                                                   capsys):
    """4 sizes x 3 LRs x 2 seeds x 2 variants, swiglu's best LR beyond the grid (extend_edges runs 4e-3 at every
    size, 8 more trials), one trial failing: the printed figures are analyse's on the collected losses, the truth
    lies inside the intervals, every swiglu figure carries (edge), and the crossing is found. The same study read
    with 3 sizes gives the per-size comparison and withholds the fit."""
    spec = load_spec(write_study(tmp_path, SIZES, base=BASE))
    counts = run_study(spec, tmp_path / "study", opts=FAST, fit=law_fit)
    assert counts == {"done": 55, "failed": 1}  # 48 grid points + 8 at swiglu's extension, one failed
    assert main(["ablate", "scaling", str(spec.path), "--dir", str(tmp_path / "study")]) == 0
    out = capsys.readouterr().out
    assert "holes (1), fitted without: scale=XL ffn=gelu lr=0.001 (seed 2): failed" in out
    assert "every one of the 3 multisets of the 2 seeds, the best LR re-picked in each" in out
    st = collect(connect(spec, tmp_path / "study"))
    assert st.data.lrs.tolist() == [5e-4, 1e-3, 2e-3, 4e-3] and st.variants == ["ffn=gelu", "ffn=swiglu"]
    assert np.isnan(st.data.loss[0, 0, :, 3]).all() and np.isfinite(st.data.loss[0, 1, :, 3]).all()  # 4e-3
    r = analyse(st.data, seed=spec.significance["seed"])
    rows = list(csv.DictReader(open(tmp_path / "study" / "scaling.csv", encoding="utf-8")))
    get = {(x["kind"], x["variant"], x["size"], x["quantity"]): x for x in rows}
    for v, name in enumerate(st.variants):
        e, a, alpha = LAWS[name.split("=")[1]]
        for q, est, truth in (("alpha", r.alpha, alpha), ("E", r.e, e)):
            row = get[("fit", name, "", q)]
            assert float(row["estimate"]) == pytest.approx(float(est.est[0, v]), rel=1e-5)
            assert float(row["low"]) == pytest.approx(float(est.lo[0, v]), rel=1e-5)
            assert float(row["estimate"]) == pytest.approx(truth, rel=0.25), (name, q, row)  # coverage: see
            # tests/test_ablate_scaling_coverage.py
    swiglu = [x for x in rows if x["variant"] == "ffn=swiglu" and x["kind"] == "size" and x["quantity"] == "loss"]
    assert [x["flags"] for x in swiglu] == ["edge;extended"] * 4 and all("lr=0.004" in x["note"] for x in swiglu)
    assert get[("fit", "ffn=swiglu", "", "alpha")]["flags"] == "edge"  # every figure of its fit carries it
    assert get[("fit", "ffn=gelu", "", "E")]["flags"] == ""
    assert "at LR 0.004 (edge, extended)" in out and "(extended): lr.extend_edges added one LR" in out
    held = get[("heldout", "ffn=gelu", "XL", "error %")]
    assert held["flags"] == "passed" and float(held["low"]) < 0 < float(held["high"])
    assert "| ffn=gelu |" in out and "passed: its interval holds 0" in out
    cross = next(x for x in rows if x["kind"] == "crossing")
    assert float(cross["estimate"]) == pytest.approx(10 ** 12.54, rel=0.5)
    assert float(cross["estimate"]) == pytest.approx(10 ** float(r.cross.est[0, 0]), rel=1e-5)
    assert cross["flags"] == "edge" and cross["note"].startswith("share=1.000; cross at C = ")  # swiglu's edge
    assert (tmp_path / "study" / "scaling.png").stat().st_size > 10_000
    # the same study read with its 3 smaller sizes: the per-size comparison, no fit, no crossing
    three = write_study(tmp_path, SIZES.replace("    - {name: XL, model.d_model: 128, model.n_heads: 4, "
                                                "model.n_dec_layers: 2}\n", ""), base=BASE)
    assert main(["ablate", "scaling", str(three), "--dir", str(tmp_path / "study"), "--out", str(tmp_path / "3")]) == 0
    out = capsys.readouterr().out
    assert "ffn=gelu: no fit: 3 size(s) with a result: a fit needs >= 4" in out
    assert "no crossing given" in out and "Fit L = E" not in out
    assert re.search(r"\| L \| [0-9K/]+ \| [0-9.]+ \[[0-9.]+, [0-9.]+\] at LR 0.001 \| ", out), out
    assert main(["ablate", "compare", str(spec.path), "--dirs", str(tmp_path / "study")]) == 0
    assert "2 variant(s) at both: too few for a rank correlation" in capsys.readouterr().out
    # a seed with no finished trial (seed 3, never run) is neither drawn nor counted in n (it narrowed the intervals)
    three_seeds = load_spec(write_study(tmp_path, SIZES.replace("seeds: [1, 2]", "seeds: [1, 2, 3]"), base=BASE))
    assert collect(connect(three_seeds, tmp_path / "study")).seeds == [1, 2]


def test_e_shared_or_given_by_a_prior_labels_every_figure_that_depends_on_it(tmp_path, capsys):
    loss = np.stack([law(C), law(C, e=2.0, a=2 * A, alpha=0.32)])[None, :, :, None, None] * np.exp(
        np.array([0.01, -0.01])[None, None, None, None, :])  # (1, 2 variants, 5 sizes, 1 LR, 2 seeds)
    st = ScalingStudy("s", "val/loss", ["a", "b"], list("12345"), [1, 2],
                      ScalingData(loss, np.stack([C, C]), np.array([1e-3]), (1e-3,)), np.full((2, 5), 1e5))
    from attnlab.analysis.scaling_report import fit_rows
    for mode, label in ((EMode("shared"), "E shared"), (EMode("prior", 2.0, 0.1), "E prior 2 ± 0.1"),
                        (EMode("prior", 2.0), "E fixed at 2")):
        r = analyse(st.data, mode)
        if mode.kind == "shared":
            assert r.e.est[0, 0] == r.e.est[0, 1] == pytest.approx(2.0, rel=0.05)
        head, rows = fit_rows(st, r)
        for row in rows:  # alpha, E, L at 10x, L at 100x and the held-out prediction
            assert all(row[i].endswith(f"{label})") for i in (1, 3, 4, 5)), row
    with pytest.raises(SystemExit):
        main(["ablate", "scaling", "x.yaml", "--e", "fitted"])
    capsys.readouterr()


def off_law_study():
    """Variant a's largest size 8% above the law its smaller sizes follow, b on its law; 5 sizes, 2 seeds: the
    study and its analysis."""
    loss = np.stack([law(C), law(C, a=1.1 * A)])
    loss[0, -1] *= 1.08
    loss = loss[None, :, :, None, None] * np.exp(np.array([0.005, -0.005]))
    st = ScalingStudy("s", "val/loss", ["a", "b"], list("12345"), [1, 2],
                      ScalingData(loss, np.stack([C, C]), np.array([1e-3]), (1e-3,)), np.full((2, 5), 1e5))
    return st, analyse(st.data)


def test_a_held_out_size_off_the_law_flags_the_extrapolation_unreliable(tmp_path):
    """The largest size 8% above the law the smaller ones follow: the held-out check fails and alpha, L at kx and
    the plot's legend say so."""
    st, r = off_law_study()
    assert r.failed[0].tolist() == [True, False]
    from attnlab.analysis.scaling_plot import plot_scaling
    from attnlab.analysis.scaling_report import fit_rows
    _, rows = fit_rows(st, r)
    assert rows[0][1].endswith("(unreliable)") and rows[0][-1].startswith("FAILED") and "unreliable" not in rows[1][1]
    fig = plot_scaling(tmp_path / "p.png", st, r)
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == ["a (held-out check failed: unreliable)",
                                                                            "b"]


def test_size_transfer_with_every_variant_tied_at_one_size_gives_no_p_value():
    """5 variants all at the same loss at the smallest size: tau and rho undefined, the reason printed (not p = 0)."""
    loss = np.zeros((1, 5, 2, 1, 2))
    loss[0, :, 0] = 3.0
    loss[0, :, 1, 0] = np.array([[2.0 + 0.1 * i, 2.05 + 0.1 * i] for i in range(5)])
    st = ScalingStudy("s", "val/loss", [f"v{i}" for i in range(5)], ["S", "L"], [1, 2],
                      ScalingData(loss, np.array([[1e12, 1e14]] * 5), np.array([1e-3])), np.full((5, 2), 1e5))
    h = type("H", (), {"spec": type("S", (), {"significance": {"seed": 0}})})()
    text = size_transfer(h, st)
    assert "Kendall's tau = undefined, Spearman's rho = undefined, n = 5: no p-value: all scores tied" in text
    assert "p = " not in text


def test_the_csv_flags_a_failed_check_and_a_crossing_below_80_percent_of_draws_is_no_reliable_crossing(tmp_path):
    """The held-out case above: the CSV's fit, held-out and crossing rows carry the failed check; then the crossing
    cell with a crossing in the full data at 79% and at 80% of the draws (RELIABLE_SHARE)."""
    from attnlab.analysis.scaling_report import crossing_lines, write_csv
    st, r = off_law_study()
    r.cross.est[0, 0], r.cross.lo[0, 0], r.cross.hi[0, 0] = 12.0, 11.5, 12.5
    write_csv(tmp_path / "s.csv", st, r, crossing_lines(st, r))
    rows = list(csv.DictReader((tmp_path / "s.csv").read_text(encoding="utf-8").splitlines()))
    fit_a = [x for x in rows if x["kind"] == "fit" and x["variant"] == "a"]
    assert {x["quantity"] for x in fit_a} >= {"alpha", "E", "L at 100x"}
    assert all(x["flags"] == "unreliable" for x in fit_a)
    assert all("unreliable" not in x["flags"] for x in rows if x["kind"] == "fit" and x["variant"] == "b")
    assert [x["flags"] for x in rows if x["kind"] == "heldout" and x["variant"] == "a"] == ["failed"] * 3
    for share, reliable in ((0.79, False), (0.80, True)):
        r.cross_share[0, 0] = share
        (_, text, at, fields), = crossing_lines(st, r)
        assert fields["flags"] == "unreliable" and fields["share"] == share
        if reliable:
            assert text.startswith("cross at C = 1e+12 [3.16e+11, 3.16e+12] (80% of draws cross") and at == 1e12
            assert text.endswith("(unreliable)")
        else:
            assert text.startswith("no reliable crossing (the full data cross at 1e+12; 79% of draws cross")
            assert math.isnan(at)


def test_the_demo_study_and_docs_state_the_parameter_range_count_parameters_gives(tmp_path):
    """ablations/scaling_demo.yaml's sizes through count_parameters (the tied 1,000-token embedding included): the
    range its header and docs/scaling.md state, and each size's params cell of the docs' table (issue 44, point 7)."""
    from pathlib import Path

    from attnlab.models.accounting import count_parameters
    root = Path(__file__).resolve().parents[1]
    spec = load_spec(root / "ablations" / "scaling_demo.yaml")
    params: dict[str, set[int]] = {}
    for v in spec.variants():
        exp = trial_experiment(spec, tmp_path / "s", {**v.overrides}, 1)
        size = re.search(r"scale=(\S+)", v.name).group(1)
        n = count_parameters(exp.model.replace(vocab_size=exp.data.vocab_size))["total"]
        params.setdefault(size, set()).add(n)
    low, high = min(min(x) for x in params.values()), max(max(x) for x in params.values())
    doc = (root / "docs" / "scaling.md").read_text(encoding="utf-8")
    assert f"from {low:,} to {high:,} parameters" in doc
    assert f"({low // 1000}K to {high // 1000}K parameters by count_parameters" in (
        root / "ablations" / "scaling_demo.yaml").read_text(encoding="utf-8")
    for size, ns in params.items():
        cell = "/".join(f"{round(n / 1000)}K" for n in sorted(ns))
        assert f"| {size} | {cell} |" in doc, (size, cell)
