"""End to end with the real `attnlab.train.fit` and the real final evaluation: the shipped demo study, shrunk to
2 variants x 1 seed of a tiny model trained for a few steps on the demo corpus; then its table and plots from the
stored trials."""

from __future__ import annotations

import csv
import dataclasses
import math
import shutil
from pathlib import Path

import pytest
from optuna.trial import TrialState

from attnlab.ablate.runner import Options, run_study
from attnlab.ablate.spec import load_spec
from attnlab.ablate.study import connect
from attnlab.analysis.columns import Column
from attnlab.analysis.figures import plot
from attnlab.analysis.hypotheses import read_lines
from attnlab.analysis.report import write_table
from attnlab.evaluate import score
from attnlab.experiment import load_experiment
from attnlab.rundir import run_metrics
from attnlab.train import prepare

ROOT = Path(__file__).resolve().parents[1]
TINY = {
    "model.d_model": 32, "model.n_heads": 2, "model.n_enc_layers": 1, "model.n_dec_layers": 1, "model.d_ff": 64,
    "model.dropout": 0.0, "optim.schedule": "constant", "optim.lr": 1e-3, "optim.warmup_steps": 0,
    "trainer.val_every": 2, "trainer.ckpt_every": 2, "trainer.limit_val_batches": 1, "trainer.log_every": 1,
    "decode.val_sentences": 4, "decode.average_last": 2, "decode.beam": 2, "decode.max_len_a": 0.0,
    "decode.max_len_b": 3,  # at most 3 tokens: the whole splits are decoded, quickly
}


@pytest.mark.slow
def test_real_fit_two_point_grid(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # tokenizer caches and anything else relative land here
    (tmp_path / "ablations").mkdir()
    shutil.copytree(ROOT / "experiments", tmp_path / "experiments")
    spec = load_spec(shutil.copy(ROOT / "ablations" / "demo_norm_ffn.yaml", tmp_path / "ablations"))
    spec = dataclasses.replace(spec, axes={"model.norm": ["layernorm", "rmsnorm"]}, seeds=(1,), budget_steps=4,
                               overrides={**spec.overrides, **TINY}, metric="final/valid_bleu",
                               columns=(Column("", "metric"), Column("PPL", "final/valid_ppl"),
                                        Column("steps", "steps"), Column("tokens", "tokens")))
    study_dir = tmp_path / "study"
    assert run_study(spec, study_dir, opts=Options(heartbeat_s=5, grace_s=60, poll_s=1)) == {"done": 2}

    h = connect(spec, study_dir)
    trials = h.study.get_trials()
    assert len(trials) == 2 and all(t.state == TrialState.COMPLETE for t in trials)
    srcs = None
    for t in trials:
        run_dir = Path(t.user_attrs["run_dir"])
        assert (run_dir / "checkpoints" / "last.ckpt").exists() and (run_dir / "logs" / "metrics.csv").exists()
        assert run_dir.parent == study_dir.resolve() / "runs"
        assert t.user_attrs["n_params"] > 0 and t.user_attrs["tokens_per_s"] > 0 and t.user_attrs["wall_s"] > 0
        logged = run_metrics(run_dir)["val/bleu"]  # what the run itself logged at each validation
        stored = t.user_attrs["curves"]["val/bleu"]  # what the study keeps for its plots
        # Lightning's CSV steps count from 0: the validations after optimizer steps 2 and 4 are logged at 1 and 3
        assert [s for s, _ in stored] == [s for s, _ in logged] == [1, 3]
        assert [v for _, v in stored] == pytest.approx([v for _, v in logged])
        assert t.user_attrs["steps"] == 4 and t.user_attrs["tokens"] > 0
        # the final evaluation: the last 2 checkpoints averaged, the whole valid and test splits decoded
        final = t.user_attrs["final"]
        assert [Path(p).name for p in final["checkpoints"]] == ["step=2.ckpt", "step=4.ckpt"]
        assert (run_dir / "checkpoints" / "averaged_last2.ckpt").is_file()
        if srcs is None:
            dm, _ = prepare(load_experiment(run_dir / "config.yaml"))
            srcs = {split: dm.split_texts(split)[0] for split in ("valid", "test")}
        for split in ("valid", "test"):
            hyps, refs = read_lines(run_dir / "eval" / f"{split}.hyp"), read_lines(run_dir / "eval" / f"{split}.ref")
            assert len(hyps) == len(refs) == len(srcs[split]) > 100  # every segment, one a line
            scored = score(hyps, refs)  # the stored scores are those of the files
            assert (final[f"{split}_bleu"], final[f"{split}_chrf"]) == (scored["bleu"], scored["chrf"])
            assert final[f"{split}_ppl"] == pytest.approx(math.exp(final[f"{split}_loss"]), rel=1e-5)
        assert t.value == final["valid_bleu"]
    md, paths = write_table(h)
    rows = list(csv.DictReader(open(paths[1], encoding="utf-8")))
    assert {r["variant"] for r in rows} == {"norm=layernorm", "norm=rmsnorm"}
    stored = {t.user_attrs["variant"]: t.value for t in trials}
    assert all(float(r["final/valid_bleu mean"]) == pytest.approx(stored[r["variant"]]) for r in rows)
    rms = next(r for r in rows if r["variant"] == "norm=rmsnorm")
    # one seed: sacreBLEU's paired bootstrap of that seed, conditional on it, and the rows flagged
    assert (rms["test"], rms["population"]) == ("paired bootstrap", "seed 1") and "| PPL | steps | tokens |" in md
    assert "| 1 ‡ |" in md and "paired bootstrap of seed 1 alone" in md and "conditional on that seed" in md
    assert all(p.stat().st_size > 0 for p in plot(h))

    # a second run of the finished study trains nothing
    assert run_study(spec, study_dir, opts=Options(heartbeat_s=5, grace_s=60, poll_s=1)) == {"done": 2}
    assert len(connect(spec, study_dir).study.get_trials()) == 2
