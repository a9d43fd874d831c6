"""What a reviewer reads: final scores stored with each trial, tables with the file's columns, significance against
the baseline (equal to sacreBLEU's command line on the stored hypotheses), main effects and interactions, transfer
between studies, FLOPs budgets and optuna params. Studies run with test_ablate_runner's fake fit and fake final
evaluation, whose true effects are known: SwiGLU translates much better than ReLU (fake_drop), RMSNorm changes the
loss by a fixed amount, and QK-norm interacts with SwiGLU only (fake_metric)."""

from __future__ import annotations

import csv
import itertools
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import sacrebleu
import torch
import torch.nn.functional as F
from optuna.distributions import CategoricalDistribution
from scipy import stats

from attnlab.ablate.budget import step_cost
from attnlab.ablate.final import evaluate_run, write_lines
from attnlab.ablate.runner import run_study
from attnlab.ablate.spec import load_spec
from attnlab.ablate.study import connect
from attnlab.analysis.figures import plot
from attnlab.analysis.hypotheses import read_lines
from attnlab.analysis.ranks import rank_correlation
from attnlab.analysis.report import write_table
from attnlab.analysis.testset import paired_bootstrap
from attnlab.checkpoints import average_checkpoints
from attnlab.cli import main
from attnlab.config import ModelConfig
from attnlab.evaluate import load_module
from attnlab.experiment import load_experiment
from attnlab.models.accounting import flops_per_token, training_flops
from attnlab.train import fit, prepare
from conftest import make_pairs
from test_ablate_runner import FAKE, FAKE_EVAL, FAST, TINY_LM, fake_evaluate, fake_fit, read_calls, write_study

TINY_MT = """\
name: tiny_mt
model: {{d_model: 32, n_heads: 4, n_enc_layers: 1, n_dec_layers: 1, d_ff: 64, dropout: 0.0, max_seq_len: 128}}
data: {{corpus: {corpus}, data_dir: {cache}, vocab_size: 300, max_len: 64, max_tokens: 512, valid_fraction: 0.1,
       test_fraction: 0.1}}
trainer: {{max_steps: 10, val_every: 5, log_every: 5}}
"""
PROOF = """\
seeds: [1, 2, 3]
metric: {name: final/valid_bleu, direction: max}
axes:
  model.ffn: [relu, swiglu]
columns: [{N: model.n_enc_layers}, {h: model.n_heads}, {d_k: model.d_k}, {P_drop: model.dropout},
          {eps_ls: optim.label_smoothing}, {PPL: final/valid_ppl}, metric, {test BLEU: final/test_bleu}, params,
          flops, steps, tokens]
significance: {resamples: 300, seed: 11}
"""


def tiny_mt(tmp: Path) -> str:
    corpus = tmp / "corpus.tsv"
    corpus.write_text("".join(f"{s}\t{t}\n" for s, t in make_pairs(400)), encoding="utf-8")
    return TINY_MT.format(corpus=corpus, cache=tmp / "cache")


def cli_p_value(tmp: Path, ref: list[str], base: list[str], hyp: list[str], resamples: int, seed: int) -> float:
    """The BLEU p-value of `sacrebleu REF -i BASE HYP --paired-bs` on those segments written to files."""
    for name, lines in (("ref", ref), ("base", base), ("hyp", hyp)):
        write_lines(tmp / name, lines)
    out = subprocess.run([sys.executable, "-m", "sacrebleu", str(tmp / "ref"), "-i", str(tmp / "base"),
                          str(tmp / "hyp"), "--paired-bs", "--paired-bs-n", str(resamples), "-f", "text"],
                         capture_output=True, text=True, check=True, env={**os.environ, "SACREBLEU_SEED": str(seed)})
    return float(re.search(r"\(p = ([0-9.]+)\)", out.stdout).group(1))


@pytest.fixture(scope="module")
def proof(tmp_path_factory):
    """2 variants x 3 seeds, scored by the final valid BLEU, as `attnlab ablate run` records them."""
    tmp = tmp_path_factory.mktemp("proof")
    spec = load_spec(write_study(tmp, PROOF, base=tiny_mt(tmp), final_eval=True))
    assert run_study(spec, tmp / "study", opts=FAST, fit=fake_fit) == {"done": 6}
    return tmp, spec, connect(spec, tmp / "study")


def test_final_scores_are_stored_with_each_trial_and_the_table_shows_p_and_ci(proof, capsys):
    tmp, spec, h = proof
    for t in h.study.get_trials():
        final = t.user_attrs["final"]
        hyps = read_lines(Path(final["eval_dir"]) / "valid.hyp")
        assert t.value == final["valid_bleu"] and len(hyps) == 120  # the trial's value is its final score
        assert Path(t.user_attrs["run_dir"], "eval", "test.ref").is_file()
        # a grid trial's factor values are optuna params with their distribution (optuna-dashboard slices by them)
        assert t.params == {"model.ffn": t.user_attrs["overrides"]["model.ffn"]}
        assert t.distributions == {"model.ffn": CategoricalDistribution(["relu", "swiglu"])}
        assert [s for s, _ in t.user_attrs["curves"]["train/loss"]] == [4, 9]  # every logged step, for the plot
    assert main(["ablate", "table", str(spec.path), "--dir", str(tmp / "study")]) == 0
    out = capsys.readouterr().out
    head = ("| variant | N | h | d_k | P_drop | eps_ls | PPL | final/valid_bleu ↑ | n | Δ vs baseline | p "
            "| 95% CI of Δ | test BLEU | params | FLOPs/token | steps | tokens |")
    assert head in out, out
    rows = {r["variant"]: r for r in csv.DictReader(open(tmp / "study" / "table.csv", encoding="utf-8"))}
    swiglu, relu = rows["ffn=swiglu"], rows["ffn=relu"]
    assert relu["baseline"] == "True" and relu["p_value"] == ""
    p, low, high = float(swiglu["p_adjusted"]), float(swiglu["delta_ci_low"]), float(swiglu["delta_ci_high"])
    assert p < 0.01 and 0 < low < float(swiglu["delta_vs_baseline"]) < high and swiglu["significant"] == "True"
    line = next(x for x in out.splitlines() if x.startswith("| ffn=swiglu |"))
    assert f"| {p:.3g}* (n=3) | [+{low:.2f}, +{high:.2f}] |" in line and "| 1 | 4 | 8 | 0 | 0.1 |" in line
    assert "1 comparison(s) against the baseline" in out and "final/valid_bleu ~ variant + seed" in out
    assert "the test set's sampling" in out and "Minimum detectable Δ at 80% power: ±" in out
    assert line.endswith("| 10 | 10K |")  # steps, tokens trained (fake_fit's last train/tokens)
    assert float(swiglu["FLOPs/token"]) == step_cost(spec.experiment({"model.ffn": "swiglu"})).flops_per_token


def test_per_seed_p_values_are_sacrebleus_command_line_and_the_headline_is_the_paired_model(proof, tmp_path):
    """Each seed's p-value in table.csv is what sacreBLEU's command line prints on the stored files; the headline,
    with the test set held fixed (population: test_set), is scipy's paired t-test on each seed's corpus BLEU (2
    rows: the block model is that test); with the test set a sample its interval is no narrower."""
    _, spec, h = proof
    sample = {r["variant"]: r for r in csv.DictReader(open(write_table(h, tmp_path / "sample")[1][1],
                                                           encoding="utf-8"))}
    h.spec.significance["population"] = "test_set"
    table_csv = write_table(h, tmp_path / "table")[1][1]  # this test's own table: it runs alone too
    rows = {r["variant"]: r for r in csv.DictReader(open(table_csv, encoding="utf-8"))}
    per_seed = dict(x.split(":") for x in rows["ffn=swiglu"]["paired_bootstrap_p_per_seed"].split())
    ci_per_seed = dict(x.split(":") for x in rows["ffn=swiglu"]["paired_bootstrap_ci_per_seed"].split())
    files = {}
    for t in h.study.get_trials():
        eval_dir = Path(t.user_attrs["final"]["eval_dir"])
        files[t.user_attrs["variant"], t.user_attrs["seed"]] = (read_lines(eval_dir / "valid.hyp"),
                                                               read_lines(eval_dir / "valid.ref"))
    for seed in (1, 2, 3):
        (base, ref), (hyp, _) = files["ffn=relu", seed], files["ffn=swiglu", seed]
        assert round(float(per_seed[str(seed)]), 4) == cli_p_value(tmp_path, ref, base, hyp, 300, 11)
        low, high = paired_bootstrap(base, hyp, ref, "bleu", 300, 11)[1:]
        assert ci_per_seed[str(seed)] == f"[{low!r},{high!r}]"
    bleu = {v: [sacrebleu.corpus_bleu(files[v, s][0], [files[v, s][1]]).score for s in (1, 2, 3)]
            for v in ("ffn=relu", "ffn=swiglu")}
    h.spec.significance["population"] = "sample"
    res = stats.ttest_rel(bleu["ffn=swiglu"], bleu["ffn=relu"])
    swiglu = rows["ffn=swiglu"]
    assert float(swiglu["p_adjusted"]) == pytest.approx(res.pvalue, rel=1e-9)
    assert (swiglu["test"], swiglu["population"], sample["ffn=swiglu"]["population"]) == ("pooled", "test_set",
                                                                                        "sample")
    width = {k: float(r["ffn=swiglu"]["delta_ci_high"]) - float(r["ffn=swiglu"]["delta_ci_low"])
             for k, r in (("sample", sample), ("fixed", rows))}
    assert width["sample"] >= width["fixed"]  # the fake translations have no per-sentence strengths: about equal


def test_a_finished_study_is_evaluated_afterwards_without_retraining(tmp_path, capsys):
    base = tiny_mt(tmp_path)
    path = write_study(tmp_path, "seeds: [1, 2]\naxes:\n  model.ffn: [relu, swiglu]\n", base=base)
    spec = load_spec(path)
    assert run_study(spec, tmp_path / "study", opts=FAST, fit=fake_fit) == {"done": 4}
    trained = len(read_calls(tmp_path / "study")[0])
    # the file now asks for the final BLEU: the stored trials have none yet
    path.write_text(path.read_text().replace("final_eval: false", "final_eval: true")
                    .replace("metric: {name: val/loss, direction: min}", "metric: final/valid_bleu"))
    common = [str(path), "--dir", str(tmp_path / "study")]
    assert main(["ablate", "table", *common]) == 0
    assert capsys.readouterr().out.count("done, but without final/valid_bleu") == 4
    assert main(["ablate", "evaluate", *common, "--evaluate", FAKE_EVAL]) == 0
    assert capsys.readouterr().out.count("valid_bleu") == 4
    assert len(read_calls(tmp_path / "study")[0]) == trained, "evaluating trained nothing"
    h = connect(load_spec(path), tmp_path / "study")
    assert main(["ablate", "table", *common]) == 0
    out = capsys.readouterr().out
    for t in h.study.get_trials():
        exp = load_experiment(Path(t.user_attrs["run_dir"]) / "config.yaml")
        assert h.study.user_attrs[f"final:{t.number}"]["valid_bleu"] == fake_evaluate(exp, t.user_attrs["run_dir"])[
            "valid_bleu"]
    assert "| ffn=swiglu |" in out and "final/valid_bleu ↑" in out and "without" not in out
    assert main(["ablate", "evaluate", *common, "--evaluate", FAKE_EVAL]) == 0
    assert capsys.readouterr().out.count("already evaluated") == 4


def test_main_effects_and_the_interaction_equal_the_means_of_table_csv(tmp_path, capsys):
    body = "seeds: [1, 2]\naxes:\n  model.ffn: [relu, swiglu]\n  model.qk_norm: [false, true]\n"  # Holm: default
    spec = load_spec(write_study(tmp_path, body))
    run_study(spec, tmp_path / "study", opts=FAST, fit=fake_fit)
    assert main(["ablate", "table", str(spec.path), "--dir", str(tmp_path / "study")]) == 0
    out = capsys.readouterr().out
    assert "val/loss ~ variant + seed" in out and "* adjusted p < 0.05; 3 comparison(s) against the baseline" in out
    assert "seed-to-seed variation on this test set only (val/loss has no per-sentence scores stored)" in out
    assert "Baseline:" not in out  # relu without qk_norm is the base recipe's own values
    tested = [r for r in csv.DictReader(open(tmp_path / "study" / "table.csv", encoding="utf-8")) if r["p_value"]]
    assert all(float(r["p_adjusted"]) >= float(r["p_value"]) and r["adjust"] == "dunnett" for r in tested)
    assert all((r["significant"] == "True") == (float(r["p_adjusted"]) < 0.05) for r in tested)
    assert main(["ablate", "effects", str(spec.path), "--dir", str(tmp_path / "study"), "--pair", "model.ffn",
                 "model.qk_norm"]) == 0
    out = capsys.readouterr().out
    table = list(csv.DictReader(open(tmp_path / "study" / "table.csv", encoding="utf-8")))
    mean = {r["variant"]: float(r["val/loss mean"]) for r in table}

    def by_hand(*parts: str) -> float:  # the mean of the rows whose name holds every part
        vals = [m for v, m in mean.items() if all(p in v.split() for p in parts)]
        return sum(vals) / len(vals)

    effects = list(csv.DictReader(open(tmp_path / "study" / "effects.csv", encoding="utf-8")))
    main_effects = {(e["factor"], e["level"]): e for e in effects if " x " not in e["factor"]}
    for (factor, level), e in main_effects.items():
        assert float(e["mean"]) == pytest.approx(by_hand(f"{factor.split('.')[1]}={level}"))
        assert float(e["ci_low"]) < float(e["mean"]) < float(e["ci_high"]) and e["n_seeds"] == "2"
    gap = float(main_effects["model.ffn", "swiglu"]["mean"]) - float(main_effects["model.ffn", "relu"]["mean"])
    assert gap == pytest.approx(-0.5 + 0.2 / 2)  # fake_metric's SwiGLU effect, and half its QK-norm interaction
    cells = {e["level"]: float(e["interaction"]) for e in effects if e["factor"] == "model.ffn x model.qk_norm"}
    grand = sum(mean.values()) / len(mean)
    for ffn in ("relu", "swiglu"):
        for qk in ("false", "true"):
            term = (by_hand(f"ffn={ffn}", f"qk_norm={qk}") - by_hand(f"ffn={ffn}") - by_hand(f"qk_norm={qk}") + grand)
            assert cells[f"{ffn} x {qk}"] == pytest.approx(term)
    assert cells["swiglu x true"] == pytest.approx(0.05)  # fake_metric's 0.2 interaction: 0.2 / 4 in each cell
    assert "interaction model.ffn x model.qk_norm" in out and (tmp_path / "study" / "effects.png").stat().st_size > 5000


def test_compare_joins_shared_variants_and_gives_their_rank_correlation(tmp_path, capsys):
    a = write_study(tmp_path, "name: a\naxes:\n  model.ffn: [gelu, relu, swiglu]\n", name="a")
    b = write_study(tmp_path, "name: b\nmetric: {name: val/loss, direction: max}\naxes:\n  model.norm: [layernorm, "
                    "rmsnorm]\n  model.ffn: [gelu, relu, swiglu]\n",
                    base=TINY_LM.replace("d_model: 32", "d_model: 64"), name="b")
    for path in (a, b):
        run_study(load_spec(path), tmp_path / path.stem, opts=FAST, fit=fake_fit)
        assert main(["ablate", "table", str(path), "--dir", str(tmp_path / path.stem)]) == 0
    capsys.readouterr()
    assert main(["ablate", "compare", str(a), "--dirs", str(tmp_path / "a")]) == 2  # one study: needs a ladder
    assert "needs a scale: ladder (a has none); give a second study to compare it with" in capsys.readouterr().err
    assert main(["ablate", "compare", str(a), str(b), "--dirs", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "3 variant(s) in both, joined on the fields both vary (model.ffn; other factors averaged over)" in out
    means = {}
    for name in ("a", "b"):  # by hand from table.csv: b averaged over its norms
        groups: dict[str, list[float]] = {}
        for r in csv.DictReader(open(tmp_path / name / "table.csv", encoding="utf-8")):
            key = " ".join(x for x in r["variant"].split() if x.startswith("ffn="))
            groups.setdefault(key, []).append(float(r["val/loss mean"]))
        means[name] = {k: sum(v) / len(v) for k, v in groups.items()}
    keys = sorted(means["a"])
    x = [-means["a"][k] for k in keys]  # a: lower loss is better; b says higher is: oriented, they disagree
    y = [means["b"][k] for k in keys]
    tau, rho = stats.kendalltau(x, y), stats.spearmanr(x, y)
    # 3 variants: the statistics, and no p-value (scipy's t-approximation would say p = 0 at rho = -1; exact: 1/3)
    printed = re.search(r"Kendall's tau = (\S+), Spearman's rho = (\S+), n = 3: no p-value with 3 shared", out).groups()
    assert [float(x) for x in printed] == pytest.approx((tau.statistic, rho.statistic), abs=1e-3)
    assert printed[0] == "-1.000"
    # one seed each: no seed variance, no Δ test (the table says the same)
    assert f"| ffn=swiglu | {means['a']['ffn=swiglu']:.3f} |  | 1 | {means['b']['ffn=swiglu']:.3f} |  | 3 |" in out


def test_a_flops_budget_gives_each_variant_the_steps_that_spend_it(tmp_path, capsys):
    body = "budget: {flops: 2.0e13}\naxes:\n  model.ffn: [gelu, swiglu]\ncolumns: [metric, params, flops, steps]\n"
    spec = load_spec(write_study(tmp_path, body))
    assert run_study(spec, tmp_path / "study", opts=FAST, fit=fake_fit) == {"done": 2}
    steps = {}
    for t in connect(spec, tmp_path / "study").study.get_trials():
        m = t.user_attrs["config"]["model"]
        # the LM's steps by hand: 4096 // 256 = 16 windows of 256 tokens; the tokenizer's 8,000-token vocabulary
        cfg = ModelConfig.from_dict({**m, "vocab_size": 8000})
        want = math.floor(2.0e13 / (flops_per_token(cfg, 256) * 16 * 256))
        assert t.user_attrs["config"]["trainer"]["max_steps"] == t.user_attrs["steps"] == want
        assert t.user_attrs["config"]["optim"]["max_steps"] == want  # the schedule's horizon too
        steps[m["ffn"]] = want
    assert steps["swiglu"] < steps["gelu"]  # its gated FFN costs more per token: fewer steps for the same FLOPs
    assert main(["ablate", "table", str(spec.path), "--dir", str(tmp_path / "study")]) == 0
    assert f"| {steps['swiglu']:,} |" in capsys.readouterr().out


def test_a_translation_step_cost_is_measured_on_the_training_split(tmp_path):
    (tmp_path / "mt.yaml").write_text(tiny_mt(tmp_path), encoding="utf-8")
    exp = load_experiment(tmp_path / "mt.yaml")
    cost = step_cost(exp)
    dm, resolved = prepare(exp)
    flops = tokens = batches = 0
    for batch in dm.train_dataloader():  # every pair of the split, from the batches themselves
        for s, t in zip(batch["src"].ne(0).sum(1).tolist(), batch["tgt_out"].ne(0).sum(1).tolist(), strict=True):
            flops += training_flops(resolved.model, t, s)["total"]
            tokens += t
        batches += 1
    assert cost.flops_per_token == pytest.approx(flops / tokens) and cost.tokens_per_step == pytest.approx(
        tokens / batches)


def test_the_study_cli_passes_the_evaluator_to_its_workers(tmp_path, capsys):
    path = write_study(tmp_path, "metric: final/valid_bleu\naxes:\n  model.ffn: [relu, swiglu]\n",
                       base=tiny_mt(tmp_path), final_eval=True)
    common = ["--dir", str(tmp_path / "study"), "--fit", FAKE, "--evaluate", FAKE_EVAL, "--poll", "0.2"]
    assert main(["ablate", "run", str(path), *common]) == 0
    assert main(["ablate", "table", str(path), "--dir", str(tmp_path / "study")]) == 0
    assert "| ffn=swiglu |" in capsys.readouterr().out


def test_a_language_models_final_evaluation_is_its_loss_over_the_whole_splits(tmp_path):
    """A real tiny LM fit, evaluate_run, and the same numbers by hand: the last 2 checkpoints averaged, the
    token-weighted cross-entropy over every window of the valid and test splits."""
    words = "the a small big red green house cat dog tree river city open close file save print".split()
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(5 + i % 11)) + f" {i}.\n\n"
                              for i in range(600)), encoding="utf-8")
    recipe = tmp_path / "lm.yaml"
    recipe.write_text(f"""\
name: lm
model: {{arch: decoder_only, d_model: 32, n_heads: 2, n_dec_layers: 1, d_ff: 64, max_seq_len: 64, dropout: 0.0,
        norm_position: pre, position: rope}}
data: {{corpus: {corpus}, vocab_size: 300, seq_len: 32, max_tokens: 256, valid_fraction: 0.1, test_fraction: 0.1,
       data_dir: {tmp_path / 'cache'}}}
optim: {{schedule: constant, lr: 1.0e-3, warmup_steps: 0}}
trainer: {{max_steps: 4, val_every: 4, ckpt_every: 2, limit_val_batches: 1, log_every: 2, progress_bar: false,
          runs_dir: {tmp_path / 'runs'}}}
decode: {{average_last: 2}}
""", encoding="utf-8")
    exp = load_experiment(recipe)
    run_dir = fit(exp)
    final = evaluate_run(exp, run_dir)
    assert [Path(p).name for p in final["checkpoints"]] == ["step=2.ckpt", "step=4.ckpt"] and "valid_bleu" not in final
    averaged = average_checkpoints([run_dir / "checkpoints" / f"step={s}.ckpt" for s in (2, 4)])
    model = load_module(run_dir / "checkpoints" / "averaged_last2.ckpt").model
    assert all(torch.equal(v, averaged["state_dict"][f"model.{k}"]) for k, v in model.state_dict().items())
    dm, _ = prepare(exp)
    for split, loader in (("valid", dm.val_dataloader()), ("test", dm.test_dataloader())):
        nll = tokens = 0.0
        with torch.no_grad():
            for batch in loader:
                logits = model(batch["input"])  # (B, T, V)
                nll += float(F.cross_entropy(logits.flatten(0, 1), batch["target"].flatten(), reduction="sum",
                                             ignore_index=0))
                tokens += int(batch["target"].ne(0).sum())
        assert final[f"{split}_loss"] == pytest.approx(nll / tokens, rel=1e-5), split
        assert final[f"{split}_ppl"] == pytest.approx(math.exp(nll / tokens), rel=1e-5)


def test_rank_correlation_p_values_are_permutation_ones_and_absent_under_5_variants_or_all_tied():
    """Against independent computations: 6 variants with a tie and a non-monotone order, each p-value equal to the
    share of the 720 orders of y whose |scipy statistic| reaches the observed one, and tau's equal to scipy's own
    exact p where there is no tie; 9 variants: exact too (scipy's asymptotic Spearman p rejects 5.9% at 0.05
    there); 12: Monte Carlo, within its error of the exact p; 4: none, saying why; one side all tied: tau and rho
    undefined and no p-value (the exact count gave p = 0 there)."""
    x, y = [3.1, 2.0, 5.5, 5.5, 1.0, 4.2], [2.0, 3.0, 4.4, 6.1, 0.5, 3.9]
    r = rank_correlation(x, y)
    tau, rho = stats.kendalltau(x, y).statistic, stats.spearmanr(x, y).statistic
    assert (r["tau"], r["rho"]) == pytest.approx((tau, rho))
    orders = list(itertools.permutations(y))
    assert r["tau_p"] == pytest.approx(sum(abs(stats.kendalltau(x, o).statistic) >= abs(tau) - 1e-12
                                           for o in orders) / len(orders))
    assert r["rho_p"] == pytest.approx(sum(abs(stats.spearmanr(x, o).statistic) >= abs(rho) - 1e-12
                                           for o in orders) / len(orders))
    assert 0 < r["tau_p"] < 0.05 and "exact permutation" in r["p_method"]
    untied = [2, 1, 4, 3, 6, 5]
    assert rank_correlation(range(6), untied)["tau_p"] == pytest.approx(
        stats.kendalltau(range(6), untied, method="exact").pvalue)
    x9, y9 = [5, 1, 4, 2, 8, 3, 9, 7, 6], [4, 2, 5, 1, 9, 3, 7, 8, 6]
    r9 = rank_correlation(x9, y9)
    perms = np.array(list(itertools.permutations(y9)))  # (9!, 9): rho = 1 - 6 sum d^2 / (n (n^2 - 1)) untied
    rhos = 1 - 6 * ((perms - np.array(x9)) ** 2).sum(1) / (9 * 80)
    assert r9["rho_p"] == pytest.approx(np.mean(np.abs(rhos) >= abs(r9["rho"]) - 1e-12))
    assert r9["tau_p"] == pytest.approx(stats.kendalltau(x9, y9, method="exact").pvalue)
    assert "exact permutation" in r9["p_method"] and r9["rho_p"] != pytest.approx(stats.spearmanr(x9, y9).pvalue)
    x12, y12 = list(range(12)), [1, 0, 3, 2, 5, 4, 11, 6, 8, 7, 10, 9]
    r12 = rank_correlation(x12, y12)
    exact = stats.kendalltau(x12, y12, method="exact").pvalue  # 0.00097; Monte Carlo SE about 0.0002
    assert r12["tau_p"] == pytest.approx(exact, abs=0.0007) and "Monte Carlo" in r12["p_method"]
    assert rank_correlation(x12, y12) == r12  # a fixed seed
    r4 = rank_correlation([1, 2, 3, 4], [1, 2, 3, 4])
    assert r4["tau_p"] is None and r4["rho_p"] is None and "fewer than 5" in r4["why"]
    for a, b in (([0.0] * 6, [20.1, 21.3, 19.8, 22.0, 20.5, 21.0]), ([1, 2, 3, 4, 5, 6], [7.0] * 6)):
        tied = rank_correlation(a, b)
        assert tied["tau_p"] is None and tied["rho_p"] is None and "all scores tied" in tied["why"]
        assert math.isnan(tied["tau"]) and math.isnan(tied["rho"])


def zero_fit(exp, ckpt_path=None):
    """fake_fit whose every trial scores 0 (what a too-short translation study gives: BLEU 0 everywhere)."""
    run_dir = fake_fit(exp, ckpt_path)
    path = run_dir / "logs" / "metrics.csv"
    rows = list(csv.reader(open(path, encoding="utf-8")))
    for row in rows[1:]:
        row[5] = "0.0" if row[5] else row[5]
    with open(path, "w", newline="", encoding="utf-8") as f:
        csv.writer(f).writerows(rows)
    return run_dir


def test_a_study_where_every_row_scores_0_is_called_degenerate_and_gets_no_stars(tmp_path, capsys):
    path = write_study(tmp_path, "seeds: [1, 2, 3]\naxes:\n  model.ffn: [relu, swiglu, gelu]\n")
    spec = load_spec(path)
    assert run_study(spec, tmp_path / "study", opts=FAST, fit=zero_fit) == {"done": 9}
    assert main(["ablate", "table", str(path), "--dir", str(tmp_path / "study")]) == 0
    out = capsys.readouterr().out
    assert "degenerate study: every trial scored 0 on val/loss" in out and "*" not in out.replace("**", "")
    assert all(r["significant"] in ("", "False") for r in csv.DictReader(open(tmp_path / "study" / "table.csv",
                                                                                encoding="utf-8")))
def test_the_footnote_says_which_row_became_the_baseline_and_why(tmp_path, capsys):
    """No variant has the base recipe's ffn (relu): the first is the baseline and the footnote says so; a
    `baseline:` key picks another row and the footnote is silent; `correction: none` turns the adjustment off."""
    for body, baseline, note in (
            ("axes:\n  model.ffn: [gelu, swiglu]\n", "ffn=gelu", "Baseline: no variant has the base recipe's own "
             "values of model.ffn, so the first, ffn=gelu, is the baseline"),
            ("baseline: ffn=swiglu\nsignificance: {correction: none}\naxes:\n  model.ffn: [gelu, swiglu]\n",
             "ffn=swiglu", "")):
        spec = load_spec(write_study(tmp_path, "seeds: [1, 2]\n" + body))
        run_study(spec, tmp_path / baseline, opts=FAST, fit=fake_fit)
        assert main(["ablate", "table", str(spec.path), "--dir", str(tmp_path / baseline)]) == 0
        out = capsys.readouterr().out
        line = next(x for x in out.splitlines() if x.startswith(f"| {baseline} |"))
        assert "| baseline |" in line and (note in out if note else "Baseline:" not in out), out
        assert ("Dunnett's many-to-one" if note else "p (not corrected for multiple comparisons)") in out


def test_a_translation_study_is_scored_by_final_test_bleu_and_rows_scored_another_way_are_refused(tmp_path, capsys):
    """No metric: key: a translation study's metric is the final test BLEU with chrF beside it (a language
    model's stays val/loss). A row whose trials' sacreBLEU signature differs from the baseline's (another
    tokenizer) gets no test, and the table says why."""
    (tmp_path / "experiments").mkdir()
    (tmp_path / "experiments" / "mt.yaml").write_text(tiny_mt(tmp_path), encoding="utf-8")
    (tmp_path / "experiments" / "lm.yaml").write_text(TINY_LM, encoding="utf-8")
    (tmp_path / "ablations").mkdir()
    path = tmp_path / "ablations" / "mt.yaml"
    path.write_text("base: ../experiments/mt.yaml\nseeds: [1, 2]\nsignificance: {resamples: 100}\n"
                    "axes:\n  model.ffn: [relu, swiglu]\n", encoding="utf-8")
    spec = load_spec(path)
    assert (spec.metric, spec.direction) == ("final/test_bleu", "max")
    assert [(c.label, c.source) for c in spec.columns][:2] == [("", "metric"), ("chrF", "final/test_chrf")]
    (tmp_path / "ablations" / "lm.yaml").write_text("base: ../experiments/lm.yaml\naxes:\n  model.ffn: [relu, gelu]\n",
                                                    encoding="utf-8")
    assert load_spec(tmp_path / "ablations" / "lm.yaml").metric == "val/loss"
    assert run_study(spec, tmp_path / "study", opts=FAST, fit=fake_fit) == {"done": 4}
    h = connect(spec, tmp_path / "study")
    assert main(["ablate", "table", str(path), "--dir", str(tmp_path / "study")]) == 0
    out = capsys.readouterr().out
    assert "| final/test_bleu ↑ | n | Δ vs baseline | p | 95% CI of Δ | chrF |" in out
    assert re.search(r"\| ffn=swiglu \| [0-9.]+ ± [0-9.]+ \| 2 ‡ \| \+[0-9.]+ \| [0-9.e-]+\*? \(n=2\) \|", out), out
    swiglu = next(t for t in h.study.get_trials() if t.user_attrs["variant"] == "ffn=swiglu")
    other = {**swiglu.user_attrs["final"]}
    other["bleu_signature"] = other["bleu_signature"].replace("tok:13a", "tok:intl")
    h.study.set_user_attr(f"final:{swiglu.number}", other)
    assert main(["ablate", "table", str(path), "--dir", str(tmp_path / "study")]) == 0
    out = capsys.readouterr().out
    assert "| none: sacreBLEU signatures differ |" in out
    assert re.search(r"ffn=swiglu: not compared with the baseline: its sacreBLEU signature\(s\) .*tok:13a.* ; "
                     r".*tok:intl.* differ from the baseline's .*tok:13a", out), out


def test_plot_of_a_study_without_the_metrics_curve_says_so_and_does_not_warn(tmp_path):
    """A study whose metric (final/test_bleu) has no curve logged during training (fake_fit logs no val/bleu):
    the metric's panel says "no curve logged", the loss curves' legend goes right of both panels, and matplotlib has
    nothing to warn about."""
    import warnings

    from matplotlib.figure import Figure

    body = "seeds: [1]\nmetric: final/test_bleu\naxes:\n  model.ffn: [gelu, swiglu]\n"
    spec = load_spec(write_study(tmp_path, body, base=tiny_mt(tmp_path), final_eval=True))
    run_study(spec, tmp_path / "study", opts=FAST, fit=fake_fit)
    drawn = []
    savefig = Figure.savefig
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.MonkeyPatch.context() as m:
            m.setattr(Figure, "savefig", lambda fig, *a, **k: drawn.append(fig) or savefig(fig, *a, **k))
            plot(connect(spec, tmp_path / "study"))
    loss, curves = drawn[0].axes
    assert not curves.get_lines() and [t.get_text() for t in curves.texts] == ["no curve logged"]
    assert len(loss.get_lines()) == 2 and loss.get_legend() is None
    # the legend of the loss curves stands right of both panels (beside the loss panel it lay under the other)
    legend = curves.get_legend()
    assert [t.get_text() for t in legend.get_texts()] == [line.get_label() for line in loss.get_lines()]
    assert legend.get_bbox_to_anchor().x0 > curves.transAxes.transform((1, 0))[0]  # anchored right of it


def test_table_effects_and_compare_print_the_same_difference_interval_and_p(tmp_path, capsys):
    """One study of 3 FFNs x 3 seeds scored by the final valid BLEU (hypotheses stored: the test set a sample):
    for each variant against the baseline (ReLU), `ablate table` (table.csv), `ablate effects` (effects.csv, the
    factor's values) and `ablate compare` (the study beside itself) give the same Δ, 95% interval and adjusted p,
    from the one model of the study."""
    body = ("seeds: [1, 2, 3]\nmetric: {name: final/valid_bleu, direction: max}\n"
            "axes:\n  model.ffn: [relu, swiglu, gelu]\n")
    spec = load_spec(write_study(tmp_path, body, base=tiny_mt(tmp_path), final_eval=True))
    assert run_study(spec, tmp_path / "study", opts=FAST, fit=fake_fit) == {"done": 9}
    common = ["--dir", str(tmp_path / "study")]
    assert main(["ablate", "table", str(spec.path), *common]) == 0
    assert main(["ablate", "effects", str(spec.path), *common]) == 0
    assert main(["ablate", "compare", str(spec.path), str(spec.path), "--dirs", *common[1:] * 2]) == 0
    out = capsys.readouterr().out
    table = {r["variant"]: r for r in csv.DictReader(open(tmp_path / "study" / "table.csv", encoding="utf-8"))}
    effects = {r["level"]: r for r in csv.DictReader(open(tmp_path / "study" / "effects.csv", encoding="utf-8"))
               if r["factor"] == "model.ffn"}
    tested = [v for v in ("swiglu", "gelu") if table[f"ffn={v}"]["p_adjusted"]]
    assert tested == ["swiglu", "gelu"] and table["ffn=relu"]["baseline"] == "True"
    for v in tested:
        t, e = table[f"ffn={v}"], effects[v]
        got = [float(e[k]) for k in ("delta_vs_baseline", "delta_ci_low", "delta_ci_high", "p_adjusted")]
        assert got == pytest.approx([float(t[k]) for k in ("delta_vs_baseline", "delta_ci_low", "delta_ci_high",
                                                           "p_adjusted")], rel=1e-12)
        d = 2  # BLEU: 2 decimals
        printed = (f"{float(t['delta_vs_baseline']):+.{d}f} [{float(t['delta_ci_low']):+.{d}f}, "
                   f"{float(t['delta_ci_high']):+.{d}f}] p {float(t['p_adjusted']):.3g}")
        star = "*" if t["significant"] == "True" else ""
        lines = out.splitlines()
        table_line = next(x for x in lines if x.startswith(f"| ffn={v} |") and "(n=3)" in x)
        delta, rest = printed.split(" [")
        ci, p = rest.split("] p ")
        assert f"| {delta} | {p}{star} (n=3) | [{ci}] |" in table_line
        effects_line = next(x for x in lines if x.strip().startswith(f"{v} ") and "Δ" in x)
        assert f"Δ {printed}{star}" in effects_line
        compare_line = next(x for x in lines if x.startswith(f"| ffn={v} |") and " p " in x)
        assert compare_line.count(printed + star) == 2, (printed, compare_line)  # both sides of the comparison
    assert float(table["ffn=swiglu"]["p_adjusted"]) >= float(table["ffn=swiglu"]["p_value"])
