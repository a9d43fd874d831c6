"""Ablation files: the shipped studies load (without data), and every mistake is an error naming its key,
except an invalid *combination*, which the runner records as an invalid trial."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from attnlab.ablate.spec import load_spec
from attnlab.cli import main
from attnlab.config import ConfigError
from attnlab.lit.optim import lr_factor

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted((ROOT / "ablations").glob("*.yaml"))

# Stand-ins for base recipes that are not in experiments/ yet (the real ones are used when present).
STAND_INS = {
    "wmt14_en_de_base.yaml": "model: {}\ndata: {}\n",
    "demo_en_de.yaml": "base: wmt14_en_de_base.yaml\nmodel: {d_model: 256, n_heads: 4}\n",
    "lm_demo.yaml": "model: {arch: decoder_only, norm_position: pre, d_model: 128, n_heads: 4}\ndata: {}\n",
}

TINY = "name: tiny\nmodel: {d_model: 64, n_heads: 4, n_enc_layers: 1, n_dec_layers: 1}\ndata: {}\n"


def layout(tmp: Path, ablation: Path | None = None, body: str = "") -> Path:
    """tmp/ablations/<file> beside tmp/experiments/ (the real recipes, plus stand-ins for missing ones)."""
    exp = tmp / "experiments"
    if (ROOT / "experiments").is_dir():
        shutil.copytree(ROOT / "experiments", exp, dirs_exist_ok=True)
    exp.mkdir(exist_ok=True)
    for name, text in STAND_INS.items():
        if not (exp / name).exists():
            (exp / name).write_text(text, encoding="utf-8")
    (exp / "tiny.yaml").write_text(TINY, encoding="utf-8")
    (tmp / "ablations").mkdir(exist_ok=True)
    if ablation is not None:
        return Path(shutil.copy(ablation, tmp / "ablations" / ablation.name))
    path = tmp / "ablations" / "x.yaml"
    path.write_text("base: ../experiments/tiny.yaml\nmetric: {name: val/loss, direction: min}\n" + body)
    return path


def spec_of(tmp: Path, body: str):
    return load_spec(layout(tmp, body=body))


# ---------------------------------------------------------------------------------------------- shipped
def test_the_shipped_studies_are_there():
    names = {p.stem for p in SHIPPED}
    assert {"block_variants", "vaswani_table3", "lm_block_variants", "demo_norm_ffn", "mlm_norm_ffn_position"} <= names


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_every_shipped_study_loads_and_every_variant_is_a_valid_config(path, tmp_path):
    spec = load_spec(layout(tmp_path, path))
    variants = spec.variants()
    assert len({p.point_id for p in spec.points()}) == len(variants) * len(spec.seeds)
    for v in variants:
        exp = spec.experiment(v.overrides)  # no combination of a shipped grid is invalid
        for k, x in v.overrides.items():
            section, field = k.split(".")
            assert getattr(getattr(exp, section), field) == x
    assert spec.baseline() in variants


def test_block_variants_and_table3_shapes(tmp_path):
    block = load_spec(layout(tmp_path, ROOT / "ablations" / "block_variants.yaml"))
    assert (len(block.variants()), len(block.points()), block.metric, block.direction) == (
        64, 128, "final/test_bleu", "max")
    assert list(block.axes) == ["model.norm", "model.norm_position", "model.ffn", "model.block", "model.qk_norm"]
    table3 = load_spec(layout(tmp_path, ROOT / "ablations" / "vaswani_table3.yaml"))
    names = [v.name for v in table3.variants()]
    assert names[0] == "base" and table3.baseline().name == "base" and len(names) == 19
    assert sum(n.startswith("(A)") for n in names) == 4 and sum(n.startswith("(C)") for n in names) == 7
    h32 = table3.experiment(next(v for v in table3.variants() if v.name.startswith("(A) h=32")).overrides)
    assert (h32.model.n_heads, h32.model.d_k) == (32, 16)
    rows_b = [table3.experiment(v.overrides).model for v in table3.variants() if v.name.startswith("(B)")]
    assert [(m.n_heads, m.d_k, m.d_v, m.d_model) for m in rows_b] == [(8, 16, 64, 512), (8, 32, 64, 512)]
    # the paper's columns, from the configs and the final evaluation (dev = newstest2013, the valid split)
    assert [c.label for c in table3.columns] == ["N", "d_model", "d_ff", "h", "d_k", "d_v", "P_drop", "ε_ls",
                                                 "train steps", "PPL (dev)", "BLEU (dev)", "params"]
    assert table3.metric == "final/valid_bleu" and table3.experiment({}).decode.average_last == 1
    lm = load_spec(layout(tmp_path, ROOT / "ablations" / "lm_block_variants.yaml"))
    assert len(lm.variants()) == 32 and lm.experiment({}).model.arch == "decoder_only"


# ---------------------------------------------------------------------------------------------- the format
def test_grid_points_seeds_budget_resources_and_overrides(tmp_path):
    spec = spec_of(tmp_path, "seeds: 3\nbudget: {steps: 50, time_min: 2}\nresources: {devices: 1}\n"
                             "overrides: {trainer.val_every: 10, optim.lr: 1e-3}\n"
                             "axes:\n  model.norm: [layernorm, rmsnorm]\n  optim.warmup_steps: [10, 20]\n")
    assert spec.seeds == (1, 2, 3) and len(spec.points()) == 12
    assert [p.seed for p in spec.points()[:4]] == [1, 1, 1, 1], "seed-major order"
    exp = spec.experiment(spec.variants()[3].overrides, seed=2)
    assert (exp.model.norm, exp.optim.warmup_steps, exp.trainer.seed) == ("rmsnorm", 20, 2)
    assert (exp.trainer.max_steps, exp.trainer.max_time_min, exp.trainer.devices) == (50, 2.0, 1)
    assert exp.trainer.val_every == 10 and exp.optim.lr == 1e-3  # YAML's "1e-3" string read as the float
    assert spec.variants()[3].name == "norm=rmsnorm warmup_steps=20"
    again = spec_of(tmp_path, "seeds: 3\nbudget: {steps: 50, time_min: 2}\nresources: {devices: 1}\n"
                              "overrides: {trainer.val_every: 10, optim.lr: 1e-3}\n"
                              "axes:\n  model.norm: [layernorm, rmsnorm]\n  optim.warmup_steps: [10, 20]\n")
    assert [p.point_id for p in again.points()] == [p.point_id for p in spec.points()], "stable point ids"


def test_a_steps_budget_is_also_the_schedules_horizon(tmp_path):
    """lm_demo's cosine decays over optim.max_steps=1000; a 400-step budget must end its trials' schedule at 400,
    not leave them comparing variants with the learning rate still near its peak."""
    layout(tmp_path)
    lm = tmp_path / "ablations" / "lm.yaml"
    lm.write_text("base: ../experiments/lm_demo.yaml\nmetric: {name: val/loss, direction: min}\n"
                  "budget: {steps: 400}\naxes:\n  model.norm: [layernorm, rmsnorm]\n", encoding="utf-8")
    spec = load_spec(lm)
    for v in spec.variants():
        exp = spec.experiment(v.overrides)
        assert (exp.trainer.max_steps, exp.optim.max_steps, exp.optim.schedule) == (400, 400, "cosine")
        assert "max_steps: 400" in exp.to_yaml().split("trainer:")[0]  # the resolved config.yaml shows the horizon
        last = lr_factor(exp.optim, exp.model.d_model)(399)  # the last step's rate: at the cosine's floor
        assert last == pytest.approx(exp.optim.min_lr_ratio, abs=1e-4)
    fixed = lm.with_name("fixed.yaml")  # the file's own horizon wins
    fixed.write_text(lm.read_text() + "overrides: {optim.max_steps: 1000}\n", encoding="utf-8")
    assert load_spec(fixed).experiment({}).optim.max_steps == 1000


def test_trials_of_a_step_budget_validate_and_checkpoint_at_the_recipes_steps(tmp_path):
    """demo_en_de stretches its intervals to 0.5 / 0.1 minutes by the timing of a run's first steps. Trials ending
    at a fixed step must not: each would average the checkpoints of other steps. A time budget keeps them (its
    trials end at no fixed step), and the file's own overrides win."""
    sig = load_spec(layout(tmp_path, ROOT / "ablations" / "demo_significance.yaml"))
    assert sig.base.name == "demo_en_de.yaml"
    exp = sig.experiment({})
    assert (exp.trainer.val_every_min, exp.trainer.ckpt_every_min) == (0, 0)
    assert (exp.trainer.val_every, exp.trainer.ckpt_every, exp.trainer.max_steps) == (300, 50, 600)
    text = sig.path.read_text(encoding="utf-8")
    timed = sig.path.with_name("timed.yaml")
    timed.write_text(text.replace("budget: {steps: 600}", "budget: {time_min: 3}")
                     .replace("overrides:\n", "overrides:\n  optim.max_steps: 600\n"), encoding="utf-8")
    exp = load_spec(timed).experiment({})
    assert (exp.trainer.val_every_min, exp.trainer.ckpt_every_min) == (0.5, 0.1)
    own = sig.path.with_name("own.yaml")
    own.write_text(text.replace("overrides:\n", "overrides:\n  trainer.ckpt_every_min: 0.2\n"), encoding="utf-8")
    assert load_spec(own).experiment({}).trainer.ckpt_every_min == 0.2


def test_a_time_budget_with_a_decaying_schedule_needs_a_horizon(tmp_path):
    lm = tmp_path / "ablations" / "lm.yaml"
    layout(tmp_path)
    body = "base: ../experiments/lm_demo.yaml\nmetric: {name: val/loss, direction: min}\nbudget: {time_min: 5}\n" \
           "axes:\n  model.norm: [layernorm, rmsnorm]\n"
    lm.write_text(body, encoding="utf-8")
    with pytest.raises(ConfigError, match=r"budget\.time_min=5 with optim\.schedule=cosine.*optim\.max_steps"):
        load_spec(lm)
    lm.write_text(body + "overrides: {optim.max_steps: 2000}\n", encoding="utf-8")
    assert load_spec(lm).experiment({}).optim.max_steps == 2000
    lm.write_text(body + "overrides: {optim.schedule: inverse_sqrt}\n", encoding="utf-8")  # no horizon needed
    assert load_spec(lm).experiment({}).trainer.max_time_min == 5


def test_baseline_is_the_base_recipes_own_values_else_the_first(tmp_path):
    spec = spec_of(tmp_path, "axes:\n  model.norm: [rmsnorm, layernorm]\n  model.ffn: [gelu, relu]\n")
    assert spec.baseline().overrides == {"model.norm": "layernorm", "model.ffn": "relu"}
    spec = spec_of(tmp_path, "axes:\n  model.ffn: [gelu, swiglu]\n")
    assert spec.baseline().overrides == {"model.ffn": "gelu"} and "the first, ffn=gelu" in spec.baseline_reason()
    spec = spec_of(tmp_path, "baseline: ffn=swiglu\naxes:\n  model.ffn: [gelu, swiglu]\n")
    assert spec.baseline().overrides == {"model.ffn": "swiglu"} and spec.baseline_reason() == ""
    with pytest.raises(ConfigError, match=r"baseline: 'ffn=silu' is not a variant; expected one of \['ffn=gelu'"):
        spec_of(tmp_path, "baseline: ffn=silu\naxes:\n  model.ffn: [gelu, swiglu]\n")


def test_variants_list_combines_with_axes(tmp_path):
    spec = spec_of(tmp_path, "variants:\n  - {name: a}\n  - {name: b, model.n_heads: 2}\n"
                             "axes:\n  model.qk_norm: [false, true]\n")
    assert [v.name for v in spec.variants()] == ["a qk_norm=false", "a qk_norm=true", "b qk_norm=false",
                                                 "b qk_norm=true"]
    assert spec.variants()[3].overrides == {"model.n_heads": 2, "model.qk_norm": True}


@pytest.mark.parametrize("body, needles", [
    ("axes:\n  model.norm: [layernorm, bogus]\n", ["axes.model.norm", "'bogus'", "not one of"]),
    ("axes:\n  model.nrom: [layernorm]\n", ["model.nrom", "did you mean model.norm"]),
    ("axes:\n  norm: [layernorm]\n", ["'norm'", "names no config field"]),
    ("axes:\n  model.d_model: [64, abc]\n", ["axes.model.d_model", "'abc'"]),
    ("axes:\n  model.attn_softcap: [0.0, 30.0]\n", ["axes.model.attn_softcap", "'30'", "attention_backend"]),
    ("axes:\n  trainer.seed: [1, 2]\n", ["trainer.seed", "seeds:"]),
    ("axes:\n  model.norm: []\n", ["axes.model.norm", "non-empty"]),
    ("axis:\n  model.norm: [rmsnorm]\n", ["unknown key(s) ['axis']"]),
    ("metric: {name: val/loss, mode: min}\naxes: {model.norm: [rmsnorm]}\n", ["metric:"]),
    ("budget: {epochs: 3}\naxes: {model.norm: [rmsnorm]}\n", ["budget:"]),
    ("resources: {gpus: 1}\naxes: {model.norm: [rmsnorm]}\n", ["resources key(s) ['gpus']"]),
    ("seeds: [1, 1]\naxes: {model.norm: [rmsnorm]}\n", ["seeds"]),
    ("overrides: {model.colour: red}\naxes: {model.norm: [rmsnorm]}\n", ["overrides", "model.colour"]),
    ("variants:\n  - {name: a, model.n_heads: 5}\n", ["variants: 'a'", "model.n_heads=5"]),
    ("overrides: {model.d_model: 63}\naxes: {model.norm: [rmsnorm]}\n",  # was reported against the base recipe
     ["x.yaml: overrides.model.d_model: model.d_model=63", "not divisible", "(on the base recipe "]),
    ("variants:\n  - {name: a}\n  - {name: a, model.qk_norm: true}\n", ["two variants are named 'a'"]),
    ("", ["nothing varies"]),
    ("search: optuna\nn_trials: 4\ndistributions:\n  optim.lr: {type: float, low: 1.0, high: 0.1}\n",
     ["distributions.optim.lr", "low=1.0 must be < high=0.1"]),
    ("search: optuna\nn_trials: 4\ndistributions:\n  model.ffn: {type: categorical, choices: [relu, nope]}\n",
     ["distributions.model.ffn", "'nope'"]),
    ("search: grid\n", ["search='grid'"]),
    ("metric: final/valid_blue\naxes: {model.norm: [rmsnorm]}\n", ["final/valid_blue", "final/<valid|test>_"]),
    ("metric: final/test_bleu\nfinal_eval: false\naxes: {model.norm: [rmsnorm]}\n", ["needs the final evaluation"]),
    ("columns: [params, model.colour]\naxes: {model.norm: [rmsnorm]}\n", ["columns[1] (model.colour)", "model.d_k"]),
    ("columns: [{PPL: final/dev_ppl}]\naxes: {model.norm: [rmsnorm]}\n", ["columns[0] (final/dev_ppl)"]),
    ("columns: [metric, metric]\naxes: {model.norm: [rmsnorm]}\n", ["metric appears twice"]),
    ("significance: {level: 2}\naxes: {model.norm: [rmsnorm]}\n", ["significance.level=2"]),
    ("significance: {seed: 0}\naxes: {model.norm: [rmsnorm]}\n", ["significance.seed=0"]),
    ("significance: {alpha: 0.1}\naxes: {model.norm: [rmsnorm]}\n", ["significance: unknown key(s) ['alpha']"]),
    ("budget: {steps: 10, flops: 1e12}\naxes: {model.norm: [rmsnorm]}\n", ["steps: or flops:, not both"]),
    ("budget: {flops: -1}\naxes: {model.norm: [rmsnorm]}\n", ["budget.flops=-1"]),
    ("budget: {flops: 1e12}\naxes: {trainer.max_steps: [5, 6]}\n", ["trainer.max_steps is set by budget.flops"]),
])
def test_mistakes_are_load_errors_naming_the_key(tmp_path, body, needles):
    with pytest.raises(ConfigError) as e:
        spec_of(tmp_path, body)
    for needle in needles:
        assert needle in str(e.value), str(e.value)


def test_an_invalid_combination_is_not_a_load_error(tmp_path):
    spec = spec_of(tmp_path, "axes:\n  model.attn_softcap: [0.0, 30.0]\n  model.attention_backend: [sdpa, eager]\n"
                             "  model.d_model: [64, 96]\n  model.n_heads: [4, 64]\n")
    bad = []
    for v in spec.variants():
        try:
            spec.experiment(v.overrides)
        except ConfigError as e:
            bad.append(str(e))
    assert len(spec.variants()) == 16 and len(bad) == 4 + 4 - 1  # softcap+sdpa, 96 with 64 heads, both
    assert any("attn_softcap" in b for b in bad) and any("not divisible by model.n_heads" in b for b in bad)


def test_final_metrics_columns_and_significance(tmp_path):
    spec = spec_of(tmp_path, "metric: final/test_chrf\ncolumns: [params, {PPL: final/test_ppl}, metric, model.d_k]\n"
                             "significance: {level: 0.01, population: test_set}\nbudget: {flops: 1e15}\n"
                             "axes: {model.norm: [rmsnorm]}\n")
    assert (spec.metric, spec.direction, spec.final_eval, spec.budget_flops) == ("final/test_chrf", "max", True, 1e15)
    assert [(c.label, c.source, c.kind) for c in spec.columns] == [
        ("params", "params", "built_in"), ("PPL", "final/test_ppl", "metric"), ("", "metric", "built_in"),
        ("model.d_k", "model.d_k", "config")]
    assert spec.significance == {"level": 0.01, "resamples": 1000, "seed": 12345, "correction": "dunnett",
                                 "population": "test_set", "equivalence": None, "spending": "obrien_fleming"}
    plain = spec_of(tmp_path, "axes: {model.norm: [rmsnorm]}\n")  # the metric's block comes first by default
    assert plain.significance["correction"] == "dunnett"  # Dunnett's adjustment unless the file turns it off
    assert plain.significance["population"] == "sample"  # the test set is a sample of sentences by default
    for body, needle in (("{holm: false}", "significance.holm is now significance.correction"),
                         ("{correction: holm}", "significance.correction='holm': expected one of dunnett, none"),
                         ("{population: seeds}", "significance.population='seeds': expected one of sample, test_set")):
        with pytest.raises(ConfigError, match=re.escape(needle)):
            spec_of(tmp_path, f"significance: {body}\naxes: {{model.norm: [rmsnorm]}}\n")
    assert [c.source for c in plain.columns] == ["metric", "params", "tokens_per_s", "wall"] and plain.final_eval


def test_metric_must_be_logged_by_the_task(tmp_path):
    layout(tmp_path)
    path = tmp_path / "ablations" / "lm.yaml"
    path.write_text("base: ../experiments/lm_demo.yaml\nmetric: {name: val/bleu, direction: max}\n"
                    "axes: {model.norm: [rmsnorm]}\n")
    with pytest.raises(ConfigError, match="val/bleu is scored for translation experiments only"):
        load_spec(path)


@pytest.mark.parametrize("base, body, needles", [
    ("tiny.yaml", "metric: val/lsos\n", ["x.yaml: metric: val/lsos is never logged by a translation trial",
                                          "val/loss", "val/bleu", "train/loss"]),
    ("tiny.yaml", "metric: test/loss\n", ["metric: test/loss is never logged", "final/test_loss"]),
    ("tiny.yaml", "columns: [metric, {acc: val/mlm_acc}]\n", ["columns[1] (val/mlm_acc)", "never logged"]),
    ("tiny.yaml", "columns: [metric, train/lr]\n", ["columns[1] (train/lr)", "never logged"]),  # not kept
    ("mlm_demo.yaml", "metric: val/bleu\n", ["val/bleu is scored for translation experiments only"]),
])
def test_a_curve_no_trial_logs_is_a_load_error(tmp_path, base, body, needles):
    """A typo in a curve's name failed every trial after it trained to the end ("val/lsos was never logged")."""
    path = layout(tmp_path, body="")
    path.write_text(f"base: ../experiments/{base}\n{body}axes: {{model.norm: [rmsnorm]}}\n")
    with pytest.raises(ConfigError) as e:
        load_spec(path)
    for needle in needles:
        assert needle in str(e.value), str(e.value)


@pytest.mark.parametrize("base, metric, columns", [
    ("tiny.yaml", "val/bleu", "[metric, val/chrf, val/ppl, train/loss]"),
    ("tiny.yaml", "train/lr", "[metric]"),  # logged, and kept as the metric
    ("mlm_demo.yaml", "val/mlm_acc", "[metric, val/loss]"),
    ("lm_demo.yaml", "train/loss", "[metric, val/ppl, final/test_ppl]"),
])
def test_every_logged_curve_is_a_valid_metric(tmp_path, base, metric, columns):
    path = layout(tmp_path, body="")
    path.write_text(f"base: ../experiments/{base}\nmetric: {metric}\ncolumns: {columns}\n"
                    "axes: {model.norm: [rmsnorm]}\n")
    assert load_spec(path).metric == metric


def test_the_declared_curves_are_the_logged_ones():
    """The names the ablation files are checked against are those the LightningModules log (self.log calls)."""
    import re

    from attnlab.lit import TASK_MODULES
    from attnlab.lit.base import BaseModule

    lit = ROOT / "src" / "attnlab" / "lit"
    for path, cls in (("base.py", BaseModule), ("seq2seq.py", TASK_MODULES["translation"]),
                      ("lm.py", TASK_MODULES["lm"]), ("mlm.py", TASK_MODULES["mlm"])):
        text = (lit / path).read_text()
        for stage, name in re.findall(r'self\.log\(f?"(train|\{stage\})/(\w+)"', text):
            assert name in (cls.TRAIN_CURVES if stage == "train" else cls.EVAL_CURVES), (path, stage, name)
        for stage in re.findall(r'log_eval_loss\("(\w+)"\)', text):
            assert stage in ("val", "test"), (path, stage)
    assert "val/loss" in TASK_MODULES["lm"].curves() and "val/mlm_acc" in TASK_MODULES["mlm"].curves()


def test_search_spec(tmp_path):
    spec = spec_of(tmp_path, "search: optuna\nn_trials: 6\ndistributions:\n"
                             "  optim.lr: {type: log, low: 1e-4, high: 1e-2}\n"
                             "  model.n_dec_layers: {type: int, low: 1, high: 3}\n"
                             "  model.ffn: {type: categorical, choices: [gelu, swiglu]}\n")
    assert spec.is_search and spec.n_trials == 6 and spec.baseline() is None
    lr, layers, ffn = spec.distributions
    assert (lr.type, lr.log, lr.low, lr.high) == ("float", True, 1e-4, 1e-2)
    assert (layers.type, layers.low, layers.high) == ("int", 1, 3) and ffn.choices == ("gelu", "swiglu")


@pytest.mark.parametrize("body", [
    "axes: {trainer.devices: [1, 2]}\n",
    "axes: {model.norm: [layernorm]}\nvariants: [{name: two, trainer.num_nodes: 2}]\n",
])
def test_an_axis_over_the_job_shape_is_refused_by_submit(tmp_path, capsys, body):
    """One SLURM array has one job shape: `ablate submit` refuses a study whose trials differ in trainer.devices
    or trainer.num_nodes, naming the key, before it writes anything; the same study without that axis renders."""
    path = layout(tmp_path, body=body)
    study = tmp_path / "study"
    assert main(["ablate", "submit", str(path), "--dir", str(study), "--dry-run"]) == 2
    key = "trainer.devices" if "devices" in body else "trainer.num_nodes"
    assert f"{key} varies across trials; one SLURM array has one job shape" in capsys.readouterr().err
    assert not study.exists()
    path.write_text(path.read_text().replace(body, "axes: {model.norm: [layernorm, rmsnorm]}\n"))
    assert main(["ablate", "submit", str(path), "--dir", str(study), "--dry-run"]) == 0
    assert "#SBATCH" in capsys.readouterr().out
