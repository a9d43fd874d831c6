"""The `attnlab` command on tiny trained runs: fit with dotted overrides, validate/test, translate (file and stdin,
empty and very long lines), generate (LM), average; bad keys, bad checkpoints and missing tokenizers are exit
status 2 with a message on stderr naming the key or file."""

from __future__ import annotations

import io
import json
import logging
import re
import shutil
import sys
from pathlib import Path

import pytest
import sacrebleu
import torch
import yaml

import attnlab.cli
from attnlab.cli import main
from attnlab.data.tokenizer import Tokenizer
from attnlab.decode import beam_search
from attnlab.evaluate import load_module
from attnlab.experiment import load_experiment
from attnlab.train import prepare
from conftest import make_pairs
from test_train import TINY, read_metrics, write_recipe

LM = {
    "model": {"arch": "decoder_only", "d_model": 32, "n_heads": 2, "n_dec_layers": 1, "d_ff": 64, "norm": "rmsnorm",
              "norm_position": "pre", "position": "rope", "tie_embeddings": "decoder", "dropout": 0.0},
    "data": {"vocab_size": 400, "seq_len": 32, "max_len": 32, "max_tokens": 256, "valid_fraction": 0.05,
             "test_fraction": 0.05},
    "optim": {"lr": 3e-3, "schedule": "constant", "warmup_steps": 0, "label_smoothing": 0.0},
    "trainer": {"max_steps": 4, "val_every": 4, "ckpt_every": 4, "log_every": 1, "progress_bar": False},
}


def one_by_one(ckpt: Path, lines: list[str], beam: int) -> list[str]:
    """Translations computed apart from the command's batching: each line alone through `beam_search` (the
    checkpoint's decoding settings), cut to max_seq_len tokens as translate_lines documents; blank lines give ""."""
    module, tok = load_module(ckpt), Tokenizer.load(ckpt.parent.parent / "tokenizer")
    c, limit = module.decode_cfg, module.model_cfg.max_seq_len
    out = []
    for line in lines:
        ids = tok.encode(line) + [tok.eos_id]
        ids = ids if len(ids) <= limit else ids[: limit - 1] + [tok.eos_id]
        best = beam_search(module.model, torch.tensor([ids]), beam_size=beam, len_penalty=c.len_penalty,
                           penalty=c.penalty, max_len_a=c.max_len_a, max_len_b=c.max_len_b)[0][0][0]
        out.append(tok.decode(best) if line.strip() else "")
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """A translation run trained through `attnlab fit` with dotted overrides, and a small LM run."""
    root = tmp_path_factory.mktemp("cli")
    recipe = write_recipe(root, trainer={"max_steps": 4, "ckpt_every": 2, "val_every": 100})
    assert main(["fit", "-c", str(recipe), "--model.norm", "rmsnorm", "--trainer.max_steps=6",
                 "--trainer.run_name", "mt"]) == 0
    docs = root / "docs.txt"
    docs.write_text("".join(t + "\n\n" for _, t in make_pairs(500)), encoding="utf-8")  # blank-line separated
    lm_raw = {k: dict(v) for k, v in LM.items()}
    lm_raw["data"].update(corpus=str(docs), data_dir=str(root / "data_cache"))
    lm_raw["trainer"].update(runs_dir=str(root / "runs"), run_name="lm")
    lm_recipe = root / "lm.yaml"
    lm_recipe.write_text(yaml.safe_dump({"name": "lm", **lm_raw}), encoding="utf-8")
    assert main(["fit", "-c", str(lm_recipe)]) == 0
    yield {"root": root, "recipe": recipe, "mt": root / "runs" / "mt", "lm": root / "runs" / "lm",
           "lm_recipe": lm_recipe}


def test_fit_overrides_reach_the_run_and_validate_test_report_scores(runs, capsys):
    mt = runs["mt"]
    cfg = yaml.safe_load((mt / "config.yaml").read_text(encoding="utf-8"))
    assert cfg["model"]["norm"] == "rmsnorm" and cfg["trainer"]["max_steps"] == 6
    assert cfg["model"]["d_model"] == TINY["model"]["d_model"]  # the rest from the recipe
    names = {p.name for p in (mt / "checkpoints").iterdir()}
    assert {"step=2.ckpt", "step=4.ckpt", "step=6.ckpt", "last.ckpt"} <= names
    last = str(mt / "checkpoints" / "last.ckpt")
    capsys.readouterr()
    for command, split in (("validate", "valid"), ("test", "test")):
        assert main([command, "-c", str(runs["recipe"]), "--model.norm", "rmsnorm", "--ckpt", last]) == 0
        printed = json.loads(capsys.readouterr().out)
        saved = json.loads((mt / f"{split}_results.json").read_text(encoding="utf-8"))
        stage = "val" if split == "valid" else "test"
        assert printed[f"{stage}/loss"] == saved[f"{stage}/loss"] > 0
        assert saved[f"{stage}/ppl"] == pytest.approx(2.718281828 ** saved[f"{stage}/loss"], rel=1e-4)
        # sacreBLEU of the split's own text, translated here one sentence at a time (decode.beam 2 of TINY)
        srcs, refs = prepare(load_experiment(runs["recipe"], {"model.norm": "rmsnorm"}))[0].split_texts(split)
        hyps = one_by_one(mt / "checkpoints" / "last.ckpt", srcs, beam=2)
        assert saved["sentences"] == len(srcs) > 10
        assert saved["bleu"] == round(sacrebleu.corpus_bleu(hyps, [refs]).score, 2)
        assert saved["chrf"] == round(sacrebleu.corpus_chrf(hyps, [refs]).score, 2) > 0
        assert saved["bleu_signature"].startswith("nrefs:1|") and len(saved["examples"]) == 5
    # the recipe without the override describes another model than the checkpoint's
    assert main(["validate", "-c", str(runs["recipe"]), "--ckpt", last]) == 2
    err = capsys.readouterr().err
    assert "model.norm: checkpoint 'rmsnorm' vs config 'layernorm'" in err and last in err


@pytest.mark.parametrize("argv, needle", [
    (["--model.nrom", "rmsnorm"], "model.nrom (did you mean model.norm?)"),
    (["--model.d_model", "abc"], "model.d_model='abc' has type str, expected int"),
    (["--trainer.max_steps", "1.5"], "trainer.max_steps=1.5"),
    (["--modle.norm", "rmsnorm"], "--modle.norm"),
    (["--model.norm", "batchnorm"], "batchnorm"),
    (["--model.norm"], "--model.norm needs a value"),
    (["--model.norm", "--trainer.max_steps", "3"], "--model.norm needs a value"),
    (["stray"], "unexpected argument 'stray'"),
    (["--decode.beem=4"], "decode.beem"),
])
def test_unknown_or_mistyped_override_is_exit_2_naming_the_key(runs, capsys, argv, needle):
    for command in (["fit", "-c", str(runs["recipe"])],
                    ["validate", "-c", str(runs["recipe"]), "--ckpt", str(runs["mt"] / "checkpoints" / "last.ckpt")]):
        assert main(command + argv) == 2
        out = capsys.readouterr()
        assert needle in out.err and out.out == "", (command, out.err)


def test_an_unknown_key_in_the_recipe_file_names_the_file_and_key(runs, tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    raw = yaml.safe_load(runs["recipe"].read_text(encoding="utf-8"))
    raw["optim"]["warmup"] = 10
    bad.write_text(yaml.safe_dump(raw), encoding="utf-8")
    assert main(["fit", "-c", str(bad)]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "optim.warmup (did you mean optim.warmup_steps?)" in err
    assert main(["translate", "--ckpt", "x.ckpt", "--model.norm", "rmsnorm"]) == 2
    assert "takes no --section.key overrides" in capsys.readouterr().err


def test_translate_file_and_stdin_keep_one_line_per_input_with_empty_and_very_long_lines(runs, capsys, caplog,
                                                                                          monkeypatch):
    last = runs["mt"] / "checkpoints" / "last.ckpt"
    long_line = " ".join(["the big red house cannot find the old network file"] * 300)  # ~3000 words
    lines = ["the red house 5.", "", "   ", long_line, "open the window 7."]
    src = runs["root"] / "input.txt"
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    capsys.readouterr()
    with caplog.at_level(logging.WARNING, logger="attnlab"):
        assert main(["translate", "--ckpt", str(last), "--input", str(src), "--beam", "2"]) == 0
    out = capsys.readouterr().out.split("\n")
    assert out[-1] == "" and len(out) - 1 == len(lines)
    assert out[1] == "" and out[2] == ""  # empty and blank lines give empty translations
    assert any("line 4 has" in r.getMessage() and "cut to" in r.getMessage() for r in caplog.records)
    assert out[:-1] == [h.replace("\n", " ") for h in one_by_one(last, lines, beam=2)]

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(src.read_bytes()), encoding="utf-8"))
    assert main(["translate", "--ckpt", str(last), "--beam", "2"]) == 0
    assert capsys.readouterr().out.split("\n") == out

    latin1 = runs["root"] / "latin1.txt"
    latin1.write_bytes("ok\nGr\xfc\xdfe\n".encode("latin-1"))
    assert main(["translate", "--ckpt", str(last), "--input", str(latin1)]) == 2
    assert f"{latin1}: line 2 is not UTF-8" in capsys.readouterr().err
    assert main(["translate", "--ckpt", str(last), "--input", str(runs["root"] / "nope.txt")]) == 2
    assert "nope.txt" in capsys.readouterr().err


def test_generate_samples_from_an_lm_checkpoint_conditioned_on_the_document_separator(runs, capsys, monkeypatch):
    logged = read_metrics(runs["lm"] / "logs" / "metrics.csv")
    assert sorted(logged["train/loss"]) == [0, 1, 2, 3] and sorted(logged["train/grad_norm"]) == [0, 1, 2, 3]
    assert logged["val/ppl"][3][0] == pytest.approx(2.718281828 ** logged["val/loss"][3][0], rel=1e-4)
    last = str(runs["lm"] / "checkpoints" / "last.ckpt")
    tok = Tokenizer.load(runs["lm"] / "tokenizer")
    argv = ["generate", "--ckpt", last, "--prompt", "der Hund", "--max_new_tokens", "12", "--seed", "3"]
    capsys.readouterr()
    assert main(argv) == 0
    first = capsys.readouterr().out
    assert first.startswith("der Hund") and len(first) > len("der Hund\n")
    assert main(argv) == 0 and capsys.readouterr().out == first  # seeded: reproducible

    seen = {}
    real = attnlab.cli.generate

    def spy(model, prompt, **kw):
        seen["prompt"], seen["eos_id"] = prompt.tolist(), kw["eos_id"]
        return real(model, prompt, **kw)

    monkeypatch.setattr(attnlab.cli, "generate", spy)
    assert main(argv) == 0
    # LM training data is documents each followed by EOS (never BOS): a prompt starts after an EOS
    assert seen["prompt"] == [[tok.eos_id] + tok.encode("der Hund", side="tgt")] and seen["eos_id"] == tok.eos_id
    capsys.readouterr()
    assert main(["test", "-c", str(runs["lm_recipe"]), "--ckpt", last]) == 0
    scores = json.loads(capsys.readouterr().out)
    assert scores["test/ppl"] == pytest.approx(2.718281828 ** scores["test/loss"], rel=1e-4) and "bleu" not in scores
    assert main(["generate", "--ckpt", str(runs["mt"] / "checkpoints" / "last.ckpt")]) == 2
    assert "is not a language model (model.arch=encoder_decoder)" in capsys.readouterr().err
    assert main(["translate", "--ckpt", last]) == 2
    assert "is not a translation model (model.arch=decoder_only)" in capsys.readouterr().err


def test_average_the_last_checkpoints_of_a_run(runs, capsys):
    ckpts = runs["mt"] / "checkpoints"
    capsys.readouterr()
    assert main(["average", "--run_dir", str(runs["mt"]), "--last", "2"]) == 0
    out = ckpts / "averaged_last2.ckpt"
    assert str(out) in capsys.readouterr().out
    a, b = (torch.load(ckpts / f"step={s}.ckpt", weights_only=True)["state_dict"] for s in (4, 6))
    avg = torch.load(out, weights_only=True)["state_dict"]
    for k, v in avg.items():
        if v.is_floating_point():
            assert torch.allclose(v, (a[k] + b[k]) / 2, atol=1e-7), k
    assert any(not torch.equal(v, b[k]) for k, v in avg.items() if v.is_floating_point())  # not just a copy
    src = runs["root"] / "one.txt"
    src.write_text("the red house 5.\n", encoding="utf-8")
    assert main(["translate", "--ckpt", str(out), "--input", str(src)]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 1
    assert main(["average"]) == 2
    assert "--run_dir" in capsys.readouterr().err


def test_missing_tokenizer_and_unreadable_or_foreign_checkpoints_are_exit_2(runs, tmp_path, capsys):
    last = runs["mt"] / "checkpoints" / "last.ckpt"
    alone = tmp_path / "elsewhere" / "model.ckpt"
    alone.parent.mkdir()
    shutil.copy(last, alone)
    assert main(["translate", "--ckpt", str(alone)]) == 2
    err = capsys.readouterr().err
    assert "no tokenizer beside the checkpoint" in err and str(alone.parent / "tokenizer") in err
    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(last.read_bytes()[:1000])
    foreign = tmp_path / "foreign.ckpt"
    torch.save({"state_dict": {}, "hyper_parameters": {"lr": 0.1}}, foreign)
    for path, needle in ((truncated, "not a readable checkpoint"), (foreign, "not an attnlab checkpoint"),
                         (tmp_path / "absent.ckpt", "checkpoint not found")):
        for argv in (["translate", "--ckpt", str(path)], ["generate", "--ckpt", str(path)],
                     ["validate", "-c", str(runs["recipe"]), "--ckpt", str(path)]):
            assert main(argv) == 2, argv
            err = capsys.readouterr().err
            assert needle in err and str(path) in err, (argv, err)


def test_info_sizes_a_recipe(runs, capsys):
    assert main(["info", str(runs["recipe"])]) == 0
    out = capsys.readouterr().out
    assert "d_model=32" in out and "total" in out
    # the embedding norm of the MLM recipe: its own line, 2 x 128 LayerNorm parameters, and in the header
    assert main(["info", str(Path(__file__).parents[1] / "experiments" / "mlm_demo.yaml")]) == 0
    out = capsys.readouterr().out
    assert "norm=layernorm/post+embed_norm" in out and re.search(r"encoder\.embed_norm +256 ", out)


def test_demo_trains_averages_decodes_and_scores_end_to_end(runs, capsys):
    """`attnlab demo` at a tiny size: fit, average the last decode.average_last step checkpoints, beam-decode the test
    split with the averaged weights, score. The scores are sacreBLEU of the averaged model's translations made here
    one sentence at a time; the averaged weights are the mean of the checkpoints it names."""
    capsys.readouterr()
    argv = ["demo", "-c", str(runs["recipe"]), "--trainer.run_name", "demo", "--trainer.max_steps", "6",
            "--trainer.ckpt_every", "2", "--decode.average_last", "2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    run_dir = runs["root"] / "runs" / "demo"
    result = json.loads((run_dir / "demo_results.json").read_text(encoding="utf-8"))
    assert [Path(p).name for p in result["checkpoints_averaged"]] == ["step=4.ckpt", "step=6.ckpt"]
    averaged = run_dir / "checkpoints" / "averaged_last2.ckpt"
    a, b, avg = (torch.load(p, weights_only=True)["state_dict"] for p in (*result["checkpoints_averaged"], averaged))
    name = "model.decoder.layers.0.ffn.fc1.weight"
    assert torch.allclose(avg[name], (a[name] + b[name]) / 2) and not torch.equal(avg[name], b[name])
    srcs, refs = prepare(load_experiment(runs["recipe"]))[0].split_texts("test")
    hyps = one_by_one(averaged, srcs, beam=2)  # decode.beam of the recipe
    assert result["sentences"] == len(srcs)
    assert result["bleu"] == round(sacrebleu.corpus_bleu(hyps, [refs]).score, 2)
    assert result["chrf"] == round(sacrebleu.corpus_chrf(hyps, [refs]).score, 2) > 0
    assert result["bleu_detail"] in out and f"chrF2 = {result['chrf']:.2f}" in out and str(run_dir) in out
