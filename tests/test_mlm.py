"""Masked language modelling with the encoder-only model: BERT's masking, the loss on the masked positions only,
seeded validation, the <mask> token (and the tokenizers without it unchanged), experiments/mlm_demo.yaml learning on
the gettext German text, and a recipe whose arch has no training task refused before any data is prepared."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from scipy import stats

from attnlab.cli import main
from attnlab.config import CHOICES, ConfigError, ModelConfig
from attnlab.data import DataConfig, LMDataModule, MLMDataModule, Tokenizer
from attnlab.data.tokenizer import MASK, SPECIALS
from attnlab.experiment import Experiment, load_experiment
from attnlab.lit.mlm import MLMModule, mask_tokens
from attnlab.rundir import run_metrics
from attnlab.train import fit, make_module, make_trainer, prepare
from conftest import jitter

ROOT = Path(__file__).resolve().parents[1]
V, FIRST = 300, 5  # ids 0-4: PAD, BOS, EOS, UNK, <mask>


def test_masking_is_berts_15_percent_with_80_10_10():
    """BERT's split, each share within 3 binomial standard deviations of its value (about 0.2 points here, not a
    fixed ±1), and the random replacements uniform over the ordinary tokens: every one drawn, and Pearson's
    chi-square against equal counts not rejected (p > 0.001, seeded)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (400, 2000), generator=g)  # some specials among them
    inputs, target = mask_tokens(ids, 4, FIRST, V, pad_id=0, generator=torch.Generator().manual_seed(1))
    chosen = target.ne(0)
    ordinary = ids.ge(FIRST)
    assert not (chosen & ~ordinary).any() and torch.equal(target[chosen], ids[chosen])  # specials never chosen

    def within_3_sigma(count: torch.Tensor, total: torch.Tensor, p: float) -> bool:
        n = int(total)
        return abs(int(count) / n - p) < 3 * math.sqrt(p * (1 - p) / n)

    assert within_3_sigma(chosen.sum(), ordinary.sum(), 0.15)
    masked, kept = inputs.eq(4) & chosen, inputs.eq(ids) & chosen
    replaced = chosen & ~masked & ~kept
    n = chosen.sum()
    # a random replacement may draw the token itself (1 in V - 5): it then counts as kept
    assert within_3_sigma(masked.sum(), n, 0.8)
    assert within_3_sigma(replaced.sum(), n, 0.1 * (1 - 1 / (V - FIRST)))
    assert within_3_sigma(kept.sum(), n, 0.1 + 0.1 / (V - FIRST))
    counts = torch.bincount(inputs[replaced], minlength=V)[FIRST:].double()  # (V - FIRST,)
    assert torch.bincount(inputs[replaced], minlength=V)[:FIRST].sum() == 0 and counts.min() > 0  # every one drawn
    chi2 = float(((counts - counts.mean()) ** 2 / counts.mean()).sum())
    assert stats.chi2.sf(chi2, len(counts) - 1) > 1e-3, chi2
    assert torch.equal(inputs[~chosen], ids[~chosen])  # nothing else changes
    again = mask_tokens(ids, 4, FIRST, V, generator=torch.Generator().manual_seed(1))
    other = mask_tokens(ids, 4, FIRST, V, generator=torch.Generator().manual_seed(2))
    assert torch.equal(again[0], inputs) and torch.equal(again[1], target) and not torch.equal(other[1], target)


def tiny_module(**kw) -> MLMModule:
    torch.manual_seed(0)
    model = dict(arch="encoder_only", vocab_size=V, d_model=32, n_heads=4, n_enc_layers=2, dropout=0.0,
                 position="learned", max_seq_len=64, embed_norm=True, tie_embeddings="decoder")
    module = MLMModule(model=model, optim={"label_smoothing": 0.0}, **kw)
    jitter(module.model)
    return module.eval()


def test_the_loss_and_accuracy_are_over_the_masked_positions_only():
    """validation_step's sums against cross-entropy computed here at the chosen positions of the same masks."""
    module = tiny_module(seed=3)
    ids = torch.randint(FIRST, V, (4, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        module.validation_step({"input": ids}, 7)
        inputs, target = mask_tokens(ids, 4, FIRST, V, generator=torch.Generator().manual_seed(3 * 1_000_003 + 7))
        logits = module.model(inputs)  # (B, T, V)
    chosen = target.ne(0)
    nll = F.cross_entropy(logits[chosen], target[chosen], reduction="sum")
    assert float(module.eval_tokens.compute()) == chosen.sum() > 10
    assert float(module.eval_nll.compute()) == pytest.approx(float(nll), rel=1e-5)
    correct = logits.argmax(-1)[chosen].eq(target[chosen]).sum()
    assert float(module.eval_correct.compute()) == correct and float(module.eval_masked.compute()) == chosen.sum()
    with torch.no_grad():  # the unchosen positions' predictions count for nothing
        full = F.cross_entropy(logits.flatten(0, 1), ids.flatten(), reduction="sum")
    assert abs(float(full) - float(nll)) > 1.0
    with pytest.raises(ValueError, match="MLMModule needs model.arch=encoder_only"):
        MLMModule(model={"arch": "decoder_only", "vocab_size": V}, optim={})


def test_the_mask_token_keeps_the_other_special_ids_and_leaves_other_tokenizers_alone(tmp_path):
    docs = tmp_path / "docs.txt"
    docs.write_text("".join(f"die Datei {i} wurde nicht gespeichert <mask>\n\n" for i in range(400)), encoding="utf-8")
    cfg = DataConfig(corpus=str(docs), data_dir=str(tmp_path / "cache"), vocab_size=300, seq_len=16,
                     max_tokens=64, max_len=16, valid_fraction=0.1, test_fraction=0.1)
    dirs = {}
    for cls in (LMDataModule, MLMDataModule):
        dm = cls(cfg)
        dm.prepare_data()
        dm.setup()
        tok = dm.tokenizer
        assert [tok.src.token_to_id(s) for s in SPECIALS] == [0, 1, 2, 3]
        dirs[cls] = dm.cache_dir
        assert Tokenizer.load(tok.save(tmp_path / cls.__name__)).mask_id == tok.mask_id  # saved and loaded
        if cls is MLMDataModule:
            assert tok.mask_id == dm.mask_id == 4 and tok.src.id_to_token(4) == MASK
            assert 4 not in tok.encode("x <mask> y")  # text spelling it is text, never the special id
        else:  # the LM's tokenizer has no <mask>: id 4 is an ordinary token, as before <mask> existed
            assert tok.mask_id is None and tok.src.id_to_token(4) != MASK
        assert tok.decode(tok.encode("x <mask> y")) == "x <mask> y"
    assert dirs[LMDataModule] != dirs[MLMDataModule]  # their own tokenizers and caches


def test_a_recipe_whose_arch_has_no_training_task_fails_before_any_data_is_prepared(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(CHOICES, "arch", (*CHOICES["arch"], "prefix_lm"))  # a new arch, with no task yet
    data = DataConfig(corpus=str(tmp_path / "absent.txt"), data_dir=str(tmp_path / "cache"))
    exp = Experiment(name="x", model=ModelConfig(arch="prefix_lm", n_dec_layers=1), data=data)
    trains = r"encoder_decoder \(translation\), decoder_only \(lm\), encoder_only \(mlm\)"
    with pytest.raises(ConfigError, match=rf"model.arch=prefix_lm has no training task; attnlab fit trains {trains}"):
        fit(exp)
    recipe = tmp_path / "x.yaml"
    recipe.write_text(f"model: {{arch: prefix_lm}}\ndata: {{corpus: {tmp_path / 'absent.txt'}, data_dir: "
                      f"{tmp_path / 'cache'}}}\n", encoding="utf-8")
    assert main(["fit", "-c", str(recipe)]) == 2
    assert "model.arch=prefix_lm has no training task" in capsys.readouterr().err
    assert not (tmp_path / "cache").exists()  # no tokenizer, no cache: it failed first


TINY_DEMO = {"model.d_model": 64, "model.max_seq_len": 64, "model.dropout": 0.0, "data.vocab_size": 1000,
             "data.seq_len": 64, "data.max_tokens": 1024, "optim.lr": 6e-3, "optim.warmup_steps": 30,
             "optim.max_steps": 300, "trainer.max_steps": 300, "trainer.val_every": 150, "trainer.ckpt_every": 300,
             "trainer.log_every": 10, "trainer.progress_bar": False}


def unigram_baseline(dm, module) -> float:
    """Accuracy of always answering the most frequent token, on the masked positions validation scores (its seeded
    masks over the same batches)."""
    counts: Counter = Counter()
    for i, batch in enumerate(dm.val_dataloader()):
        _, target = module.masked(batch["input"], torch.Generator().manual_seed(module.seed * 1_000_003 + i))
        counts.update(target[target.ne(0)].tolist())
    return counts.most_common(1)[0][1] / sum(counts.values())


@pytest.mark.slow
def test_mlm_demo_learns_on_the_gettext_text(data_locale_de, tmp_path, capsys):
    """experiments/mlm_demo.yaml shrunk (d 64, 300 steps of 1,024 tokens) on the gettext German text: the loss
    falls, and the masked-token accuracy ends far above the unigram baseline. `attnlab validate` on the checkpoint,
    in another Trainer, reproduces the last validation's numbers exactly (the masks are seeded)."""
    overrides = {**TINY_DEMO, "data.locale_dir": str(data_locale_de), "data.data_dir": str(tmp_path / "cache"),
                 "trainer.runs_dir": str(tmp_path / "runs"), "trainer.run_name": "mlm"}
    exp = load_experiment(ROOT / "experiments" / "mlm_demo.yaml", overrides)
    run_dir = fit(exp)
    m = run_metrics(run_dir)
    train, val, acc = ([v for _, v in m[k]] for k in ("train/loss", "val/loss", "val/mlm_acc"))
    assert [s for s, _ in m["val/loss"]] == [149, 299]
    assert sum(train[-5:]) / 5 < sum(train[:5]) / 5 - 0.3 and val[-1] < val[0] < math.log(1000)
    assert m["val/ppl"][-1][1] == pytest.approx(math.exp(val[-1]), rel=1e-5)
    dm, resolved = prepare(exp)
    baseline = unigram_baseline(dm, make_module(resolved, dm))
    assert acc[-1] > 2 * baseline and acc[-1] > acc[0], (acc, baseline)
    capsys.readouterr()
    argv = ["validate", "-c", str(ROOT / "experiments" / "mlm_demo.yaml"), "--ckpt",
            str(run_dir / "checkpoints" / "last.ckpt")] + [f"--{k}={v}" for k, v in overrides.items()]
    assert main(argv) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["val/loss"] == pytest.approx(val[-1], rel=1e-6) and again["val/mlm_acc"] == pytest.approx(acc[-1])
    # the commands it does not fit say what it is and what does fit it
    last = str(run_dir / "checkpoints" / "last.ckpt")
    assert main(["generate", "--ckpt", last]) == 2
    assert "not a language model (model.arch=encoder_only); a masked language model is scored by attnlab " \
           "validate / test" in capsys.readouterr().err
    assert main(["export", "--ckpt", last, "--out", str(tmp_path / "hf")]) == 2
    assert "decoder_only -> Llama, Qwen3 or GPT-2, encoder_decoder -> Marian" in capsys.readouterr().err
    assert main([*argv, "--beam", "4"]) == 2
    assert "--beam and --engine choose how translations are decoded; this recipe trains mlm" in \
           capsys.readouterr().err
    trainer = make_trainer(resolved, tmp_path / "other", logger=False, enable_progress_bar=False)
    module = make_module(resolved, dm)
    first = trainer.validate(module, datamodule=dm, verbose=False)[0]
    assert trainer.validate(module, datamodule=dm, verbose=False)[0] == first  # the same numbers every pass
