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
import attnlab.evaluate
from attnlab.ablate import final
from attnlab.cli import main
from attnlab.config import ConfigError
from attnlab.data.tokenizer import Tokenizer
from attnlab.decode import beam_search
from attnlab.evaluate import load_module, translate_lines
from attnlab.experiment import load_experiment
from attnlab.train import prepare
from conftest import make_pairs
from test_train import TINY, read_metrics, write_recipe

LM = {
    "model": {"arch": "decoder_only", "d_model": 32, "n_heads": 2, "n_dec_layers": 1, "d_ff": 64, "norm": "rmsnorm",
              "norm_position": "pre", "position": "rope", "tie_embeddings": "decoder", "dropout": 0.0,
              "ffn": "swiglu", "attn_bias": False, "ffn_bias": False, "scale_embeddings": False},  # Llama's layout
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
    return make_runs(tmp_path_factory.mktemp("cli"))


def make_runs(root: Path) -> dict[str, Path]:
    """A translation run trained through `attnlab fit` with dotted overrides, and a small LM run."""
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
    return {"root": root, "recipe": recipe, "mt": root / "runs" / "mt", "lm": root / "runs" / "lm",
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
    (["--optim.lr", "1e400"], "optim.lr=inf must be a finite number"),
    (["--model.dropout", ".nan"], "model.dropout=nan must be a finite number"),
])
def test_unknown_or_mistyped_override_is_exit_2_naming_the_key(runs, capsys, argv, needle):
    for command in (["fit", "-c", str(runs["recipe"])],
                    ["validate", "-c", str(runs["recipe"]), "--ckpt", str(runs["mt"] / "checkpoints" / "last.ckpt")]):
        assert main(command + argv) == 2
        out = capsys.readouterr()
        assert needle in out.err and out.out == "", (command, out.err)
        if "has type" in needle or "did you mean" in needle:  # the command line's key or value, not the file's
            assert out.err.startswith(f"attnlab {command[0]}: error: override --")
            assert str(runs["recipe"]) not in out.err
        if needle == "batchnorm":  # a value out of range: the file, with the override that set it
            assert f"{runs['recipe']} with --model.norm batchnorm: " in out.err


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
    real = attnlab.evaluate.generate

    def spy(model, prompt, **kw):
        seen["prompt"], seen["eos_id"] = prompt.tolist(), kw["eos_id"]
        return real(model, prompt, **kw)

    monkeypatch.setattr(attnlab.evaluate, "generate", spy)
    assert main(argv) == 0
    # LM training data is documents each followed by EOS (never BOS): a prompt starts after an EOS
    assert seen["prompt"] == [[tok.eos_id] + tok.encode("der Hund", side="tgt")] and seen["eos_id"] == tok.eos_id
    capsys.readouterr()
    assert main(["test", "-c", str(runs["lm_recipe"]), "--ckpt", last]) == 0
    scores = json.loads(capsys.readouterr().out)
    assert scores["test/ppl"] == pytest.approx(2.718281828 ** scores["test/loss"], rel=1e-4) and "bleu" not in scores
    for extra in (["--beam", "4"], ["--engine", "ctranslate2"]):  # decoding options: refused, not ignored
        assert main(["test", "-c", str(runs["lm_recipe"]), "--ckpt", last, *extra]) == 2
        assert "this recipe trains lm, which test scores by loss and perplexity alone" in capsys.readouterr().err
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


def test_a_checkpoint_alone_translates_and_an_old_one_needs_its_tokenizer_folder(runs, tmp_path, capsys):
    last = runs["mt"] / "checkpoints" / "last.ckpt"
    src = runs["root"] / "two.txt"
    src.write_text("the red house 5.\nopen the window 7.\n", encoding="utf-8")
    assert main(["translate", "--ckpt", str(last), "--input", str(src)]) == 0
    expected = capsys.readouterr().out
    alone = tmp_path / "elsewhere" / "model.ckpt"  # copied off the cluster: no run directory beside it
    alone.parent.mkdir()
    shutil.copy(last, alone)
    assert main(["translate", "--ckpt", str(alone), "--input", str(src)]) == 0
    assert capsys.readouterr().out == expected and expected.count("\n") == 2
    old = torch.load(alone, weights_only=True)
    assert old["tokenizer"] == Tokenizer.load(runs["mt"] / "tokenizer").to_files()  # plain strings
    del old["tokenizer"]  # as checkpoints written before they carried it
    torch.save(old, alone)
    assert main(["translate", "--ckpt", str(alone)]) == 2
    err = capsys.readouterr().err
    assert "carries no tokenizer" in err and str(alone.parent / "tokenizer") in err


def test_average_into_a_folder_is_refused_before_reading(runs, tmp_path, capsys):
    ckpt = str(runs["mt"] / "checkpoints" / "last.ckpt")
    assert main(["average", "--ckpts", ckpt, ckpt, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"--out {tmp_path} is a folder: give the file to write ({tmp_path / 'averaged.ckpt'})" in err
    assert list(tmp_path.iterdir()) == []  # no temporary file left behind either


def test_unreadable_or_foreign_checkpoints_are_exit_2(runs, tmp_path, capsys):
    last = runs["mt"] / "checkpoints" / "last.ckpt"
    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(last.read_bytes()[:1000])
    foreign = tmp_path / "foreign.ckpt"
    torch.save({"state_dict": {}, "hyper_parameters": {"lr": 0.1}}, foreign)
    for path, needle in ((truncated, "not a readable checkpoint"), (foreign, "not an attnlab checkpoint"),
                         (tmp_path / "absent.ckpt", "checkpoint not found"),
                         (runs["mt"], "is a folder; a checkpoint is a file")):
        for argv in (["translate", "--ckpt", str(path)], ["generate", "--ckpt", str(path)],
                     ["validate", "-c", str(runs["recipe"]), "--ckpt", str(path)]):
            assert main(argv) == 2, argv
            err = capsys.readouterr().err
            assert needle in err and str(path) in err, (argv, err)


def test_info_sizes_a_recipe(runs, capsys):
    assert main(["info", str(runs["recipe"])]) == 0
    out = capsys.readouterr().out
    assert "d_model=32" in out and "total" in out
    assert main(["info", "-c", str(runs["recipe"])]) == 0  # as every other command takes its recipe
    assert capsys.readouterr().out == out
    for argv in (["info"], ["info", str(runs["recipe"]), "-c", str(runs["recipe"])]):
        assert main(argv) == 2, argv
        assert "give one config" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- devices
def test_decoding_picks_cuda_when_there_is_one_and_device_chooses(monkeypatch):
    from attnlab.evaluate import decode_dtype, pick_device

    assert pick_device() == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert pick_device() == torch.device("cuda") and pick_device("cuda:1") == torch.device("cuda:1")
    assert pick_device("cpu") == torch.device("cpu")
    with pytest.raises(ConfigError, match="--device cuda:2: this machine has 2 CUDA device"):
        pick_device("cuda:2")
    with pytest.raises(ConfigError, match="--device 'tpu'"):
        pick_device("tpu")
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert decode_dtype(cuda, "auto") == decode_dtype(cuda, "bf16-mixed") == torch.bfloat16
    assert decode_dtype(cuda, "16-mixed") == torch.float16 and decode_dtype(cuda, "32-true") is None
    assert decode_dtype(cpu, "auto") is None and decode_dtype(cpu, "bf16-mixed") is None  # fp32 on a CPU


def test_translate_and_generate_decode_on_cuda_when_faked_and_on_the_device_given(runs, capsys, monkeypatch):
    """With CUDA (faked: the decoding itself is stubbed), translate and generate get cuda and bf16 (the recipe
    trains with precision auto, which is bf16-mixed on a GPU); --device cpu gives the CPU and fp32."""
    seen: list[tuple] = []
    monkeypatch.setattr(attnlab.cli, "translate_lines",
                        lambda module, tok, lines, beam=None, device=None, dtype=None, engine=None, ckpt_path=None:
                        seen.append((device, dtype)) or ["x"] * len(lines))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    src = runs["root"] / "one.txt"
    src.write_text("the red house 5.\n", encoding="utf-8")
    last = str(runs["mt"] / "checkpoints" / "last.ckpt")
    assert main(["translate", "--ckpt", last, "--input", str(src)]) == 0
    assert main(["translate", "--ckpt", last, "--input", str(src), "--device", "cpu"]) == 0
    assert seen == [(torch.device("cuda"), torch.bfloat16), (torch.device("cpu"), None)]
    lm = str(runs["lm"] / "checkpoints" / "last.ckpt")
    real = attnlab.cli.generate_text
    generated: list[tuple] = []
    monkeypatch.setattr(attnlab.cli, "generate_text", lambda module, tok, prompt, n, seed, device=None, dtype=None,
                        **kw: generated.append((device, dtype)) or prompt)
    assert main(["generate", "--ckpt", lm]) == 0 and main(["generate", "--ckpt", lm, "--device", "cpu"]) == 0
    assert generated == [(torch.device("cuda"), torch.bfloat16), (torch.device("cpu"), None)]
    monkeypatch.setattr(attnlab.cli, "generate_text", real)
    moved = []  # on the device given: the model, the prompt and the random generator
    monkeypatch.setattr(attnlab.evaluate, "generate", lambda model, prompt, **kw: moved.append(
        (next(model.parameters()).device, prompt.device, kw["generator"].device)) or prompt.tolist())
    assert main(["generate", "--ckpt", lm, "--device", "cpu"]) == 0
    assert moved == [(torch.device("cpu"),) * 3]
    capsys.readouterr()


def test_test_validate_demo_and_the_final_evaluation_decode_on_cuda_in_bf16_when_faked(runs, capsys, monkeypatch):
    """Each command that decodes, with CUDA faked (the decoding and the loss loop stubbed): translate_lines gets
    cuda and bf16 (the recipe trains with precision auto: bf16-mixed on a GPU) and the loss loop a GPU Trainer,
    for `test`, `validate`, `demo` and an ablation trial's final evaluation."""
    seen: list[tuple] = []
    trainers: list[tuple] = []

    def fake_translate(module, tok, lines, beam=None, device=None, dtype=None, engine=None, ckpt_path=None):
        seen.append((device, dtype))
        return ["x"] * len(lines)

    class FakeTrainer:
        def validate(self, module, datamodule=None, verbose=False):
            return [{"val/loss": 1.0, "val/ppl": 2.7}]

        def test(self, module, datamodule=None, verbose=False):
            return [{"test/loss": 1.0, "test/ppl": 2.7}]

    def fake_make_trainer(exp, run_dir, **kw):
        trainers.append((exp.trainer.accelerator, kw.get("devices")))
        return FakeTrainer()

    for mod in (attnlab.cli, final):
        monkeypatch.setattr(mod, "translate_lines", fake_translate)
        monkeypatch.setattr(mod, "make_trainer", fake_make_trainer)
    monkeypatch.setattr(attnlab.cli, "fit", lambda exp, **kw: runs["mt"])  # demo: the run trained already
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    last = str(runs["mt"] / "checkpoints" / "last.ckpt")
    for command in ("test", "validate"):
        assert main([command, "-c", str(runs["recipe"]), "--model.norm", "rmsnorm", "--ckpt", last]) == 0
    assert main(["demo", "-c", str(runs["recipe"]), "--model.norm", "rmsnorm"]) == 0
    langs: list[str] = []  # the final evaluation scores with sacreBLEU's tokenizer for the target language
    real_score = final.score
    monkeypatch.setattr(final, "score", lambda h, r, tgt_lang="": langs.append(tgt_lang) or real_score(h, r, tgt_lang))
    exp = load_experiment(runs["mt"] / "config.yaml")
    final.evaluate_run(exp, runs["mt"])
    assert langs == [exp.data.tgt_lang] * len(final.SPLITS) and exp.data.tgt_lang
    assert seen == [(torch.device("cuda"), torch.bfloat16)] * (3 + len(final.SPLITS))
    assert trainers[:2] == [("gpu", [0])] * 2 and trainers[2][0] == "auto"  # the final evaluation: auto picks it
    capsys.readouterr()

def test_decoding_under_cpu_bf16_autocast_matches_fp32(runs):
    """The same model and sentences in fp32 and under bf16 autocast: teacher-forced logits agree to bf16's
    precision, and greedy decoding gives the same tokens except where fp32 itself nearly ties: at the first token
    where the two outputs part, fp32 prefers its own token over bf16's by less than bf16's error."""
    from attnlab.decode import greedy_search
    from attnlab.evaluate import autocast

    module = load_module(runs["mt"] / "checkpoints" / "last.ckpt")
    tok = Tokenizer.load(runs["mt"] / "tokenizer")
    lines = [s for s, _ in make_pairs(200, seed=7)][:100]
    src = [list(ids) + [module.eos_id] for ids in tok.encode_batch(lines)]
    ids = torch.tensor([row + [0] * (max(map(len, src)) - len(row)) for row in src])  # (100, S)
    cpu, model = torch.device("cpu"), module.model
    with torch.no_grad():
        fp32 = model(ids, ids[:, :8])
        with autocast(cpu, torch.bfloat16):
            bf16 = model(ids, ids[:, :8])
    assert bf16.dtype == torch.bfloat16
    err = (bf16.float() - fp32).abs().max()
    assert err <= 0.03 * fp32.abs().max()
    plain = greedy_search(model, ids, max_len_b=12)
    with autocast(cpu, torch.bfloat16):
        auto = greedy_search(model, ids, max_len_b=12)
    assert sum(a == b for a, b in zip(plain, auto, strict=True)) >= len(lines) // 2
    for row, (a, b) in enumerate(zip(plain, auto, strict=True)):
        if a == b:
            continue
        t = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        prefix = torch.tensor([[module.bos_id] + a[:t]])  # (1, t+1)
        with torch.no_grad():
            logits = model(ids[row:row + 1], prefix)[0, -1]  # (V,) fp32, after the shared prefix
        mine = a[t] if t < len(a) else module.eos_id  # a row that ended takes EOS there
        theirs = b[t] if t < len(b) else module.eos_id
        assert -1e-4 <= logits[mine] - logits[theirs] <= 2 * err, (row, t, float(logits[mine] - logits[theirs]))


def test_token_batching_gives_the_sentence_batchings_translations(runs):
    from attnlab.evaluate import token_batches

    module = load_module(runs["mt"] / "checkpoints" / "last.ckpt")
    tok = Tokenizer.load(runs["mt"] / "tokenizer")
    lines = [s for s, _ in make_pairs(90, seed=3)] + ["", "open the window 7."]
    by_sentence = translate_lines(module, tok, lines, beam=2, device="cpu", batch_sentences=64, max_tokens=0)
    by_tokens = translate_lines(module, tok, lines, beam=2, device="cpu", batch_sentences=64, max_tokens=60)
    assert by_tokens == by_sentence
    lengths = [len(ids) + 1 for ids in tok.encode_batch(lines)]
    batches = token_batches(lengths, 64, 60)
    assert sorted(i for b in batches for i in b) == list(range(len(lines)))  # each sentence once
    assert len(batches) > len(token_batches(lengths, 64, 0)) >= 2  # the token limit really cut more batches
    for b in batches:
        assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= 60
        assert len(b) <= 64
    assert token_batches([5, 100, 7], 64, 50) == [[0, 2], [1]]  # a sentence over the limit: a batch of its own



@pytest.mark.parametrize("fork", [True, False], ids=["processes", "threads"])
def test_on_cpu_threads_batches_decode_side_by_side_with_the_same_translations(no_hang, runs, monkeypatch, tmp_path,
                                                                               fork):
    """With torch on 2 CPU threads, translate_lines decodes 2 batches at once, one thread each (CTranslate2's
    inter_threads), in this thread and a forked process (or 2 threads where a fork is not safe), and gives the
    translations of one thread, each on its own line; torch's thread count is back after. With 1 thread it decodes
    in the calling thread. The parent has run a 2-thread operator before it forks (OpenMP's pool exists), as a CLI
    has."""
    import os
    import threading

    import attnlab.decode_workers

    monkeypatch.setattr(attnlab.decode_workers, "can_fork", lambda: fork)
    module = load_module(runs["mt"] / "checkpoints" / "last.ckpt")
    tok = Tokenizer.load(runs["mt"] / "tokenizer")
    lines = [s for s, _ in make_pairs(60, seed=5)] + ["", "open the window 7."]
    log = tmp_path / "workers.log"  # one line a batch: pid, thread, torch's thread count there, compile stance
    real = module.translate_ids

    def spy(src, beam=None):
        stance = torch._dynamo.eval_frame._stance.stance  # compiled blocks run eagerly throughout
        with open(log, "a") as f:
            f.write(f"{os.getpid()} {threading.current_thread().name} {torch.get_num_threads()} {stance}\n")
        return real(src, beam)

    def seen() -> list[list[str]]:
        rows = [line.split() for line in log.read_text().splitlines()]
        log.unlink()
        return rows

    monkeypatch.setattr(module, "translate_ids", spy)
    threads = torch.get_num_threads()
    here = [str(os.getpid()), threading.current_thread().name]
    try:
        torch.set_num_threads(1)
        alone = translate_lines(module, tok, lines, beam=2, device="cpu", batch_sentences=8, max_tokens=0)
        assert {tuple(r[:2]) for r in seen()} == {tuple(here)}
        torch.set_num_threads(2)
        assert float(torch.ones(1 << 22).exp().sum()) > 0  # an operator on 2 threads before the fork
        side = translate_lines(module, tok, lines, beam=2, device="cpu", batch_sentences=8, max_tokens=0)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    assert side == alone
    rows = seen()
    assert len(rows) == 8 and {r[2] for r in rows} == {"1"} and {r[3] for r in rows} == {"force_eager"}
    assert len({tuple(r[:2]) for r in rows}) == 2
    if fork:  # this thread, and one forked worker
        assert tuple(here) in {tuple(r[:2]) for r in rows} and len({r[0] for r in rows}) == 2
    else:
        assert {r[0] for r in rows} == {here[0]} and all(r[1].startswith("attnlab-decode") for r in rows)
    assert torch._dynamo.eval_frame._stance.stance == "default"
    # a module in training mode, with dropout: decoded in eval mode throughout (no batch's search may turn training
    # mode back on while another decodes), and left in training mode
    for m in module.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.3
    module.train()
    try:
        torch.set_num_threads(2)
        assert translate_lines(module, tok, lines, beam=2, device="cpu", batch_sentences=8, max_tokens=0) == alone
    finally:
        torch.set_num_threads(threads)
    assert module.training


@pytest.mark.parametrize("fork", [True, False], ids=["processes", "threads"])
def test_with_fewer_batches_than_threads_each_batch_gets_its_share_of_them(no_hang, monkeypatch, fork):
    """batch_workers: 4 torch threads and 2 batches give 2 workers of 2 threads (not 2 of 1, leaving 2 cores idle),
    threads even where a fork is safe (a forked child must not open an OpenMP region of 2); 8 batches give 4 workers
    of 1, this thread and 3 forked processes where that is safe; the calling thread's count is 4 again after, and a
    GPU decodes in this thread."""
    import os
    import threading

    import attnlab.decode_workers as workers_mod
    from attnlab.decode_workers import DecodeJob, batch_workers

    def where(job, idx):  # stands in for decode_batch, in whichever worker runs it
        return os.getpid(), threading.current_thread().name, torch.get_num_threads()

    monkeypatch.setattr(workers_mod, "can_fork", lambda: fork)
    monkeypatch.setattr(workers_mod, "decode_batch", where)
    cpu = DecodeJob(None, [], 0, torch.device("cpu"), None, 1)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        for n_batches, workers, each in ((2, 2, 2), (3, 3, 1), (8, 4, 1)):
            with batch_workers(cpu, n_batches) as decode_all:
                seen = list(decode_all([[i] for i in range(4 * n_batches)]))
            assert {n for _, _, n in seen} == {each}, (n_batches, seen)
            assert len({(pid, name) for pid, name, _ in seen}) <= workers  # no more workers than asked for
            if fork and each == 1:  # this thread and workers - 1 forked processes
                here = (os.getpid(), threading.current_thread().name)
                assert here in {(pid, name) for pid, name, _ in seen}
                forked = {pid for pid, _, _ in seen} - {os.getpid()}
                assert forked, f"no batch was decoded in a forked worker: {seen}"
                assert len(forked) <= workers - 1
            else:
                assert all(pid == os.getpid() and name.startswith("attnlab-decode") for pid, name, _ in seen)
            assert torch.get_num_threads() == 4
        gpu = DecodeJob(None, [], 0, torch.device("cuda"), None, 1)
        with batch_workers(gpu, 8) as decode_all:
            assert list(decode_all([[0], [1]])) == [(os.getpid(), threading.current_thread().name, 4)] * 2
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("fork", [True, False], ids=["processes", "threads"])
def test_a_failing_decoding_worker_fails_translate_lines_with_its_error(no_hang, runs, monkeypatch, fork):
    """A batch that raises in a worker raises the same error from translate_lines; a forked worker that dies
    raises BrokenProcessPool rather than leaving the call waiting (the calling thread decodes its share meanwhile)."""
    import os
    from concurrent.futures.process import BrokenProcessPool

    import attnlab.decode_workers

    monkeypatch.setattr(attnlab.decode_workers, "can_fork", lambda: fork)
    module = load_module(runs["mt"] / "checkpoints" / "last.ckpt")
    tok = Tokenizer.load(runs["mt"] / "tokenizer")
    lines = [s for s, _ in make_pairs(30, seed=6)]
    real = module.translate_ids

    def bad(src, beam=None):
        if src.shape[0] < 8:  # the last, shorter batch
            raise ValueError(f"batch of {src.shape[0]} rows refused")
        return real(src, beam)

    monkeypatch.setattr(module, "translate_ids", bad)
    with pytest.raises(ValueError, match="rows refused"):
        translate_lines(module, tok, lines, beam=1, device="cpu", batch_sentences=8, max_tokens=0, workers=2)
    if fork:
        parent = os.getpid()

        def refused_here(src, beam=None):  # the calling thread's share fails, the forked worker's does not
            if os.getpid() == parent:
                raise ValueError("refused in the calling thread")
            return real(src, beam)

        monkeypatch.setattr(module, "translate_ids", refused_here)
        with pytest.raises(ValueError, match="calling thread"):
            translate_lines(module, tok, lines, beam=1, device="cpu", batch_sentences=8, max_tokens=0, workers=2)

        def die(src, beam=None):
            if os.getpid() == parent:
                return real(src, beam)
            os._exit(3)  # the forked worker, at its first batch

        monkeypatch.setattr(module, "translate_ids", die)
        with pytest.raises(BrokenProcessPool):
            translate_lines(module, tok, lines, beam=1, device="cpu", batch_sentences=8, max_tokens=0, workers=2)


# ---------------------------------------------------------------------------------------------- traps
def test_beam_0_is_an_error_not_the_recipes_beam(runs, capsys):
    last = str(runs["mt"] / "checkpoints" / "last.ckpt")
    for argv in (["translate", "--ckpt", last, "--beam", "0"],
                 ["test", "-c", str(runs["recipe"]), "--ckpt", last, "--beam", "0"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2 and "argument --beam: 0 must be >= 1" in capsys.readouterr().err


def test_fit_dry_run_prints_the_resolved_config_and_trains_nothing(runs, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    recipe = write_recipe(tmp_path, name="dry")
    assert main(["fit", "-c", str(recipe), "--dry-run", "--model.norm", "rmsnorm"]) == 0
    out, err = capsys.readouterr()
    printed = yaml.safe_load(out)
    assert printed["model"]["norm"] == "rmsnorm" and printed["trainer"]["max_steps"] == TINY["trainer"]["max_steps"]
    assert "dry run: nothing trained" in err and not (tmp_path / "runs").exists()
    assert not (tmp_path / "data_cache").exists()  # not even the data is prepared
    # the run directory it names is the one fit then writes (a run named by its config's hash: the recipe as given
    # names it, not the config with the tokenizer's vocabulary filled in)
    named = Path(err.split("Run directory: ")[1].split(";")[0])
    assert named.name.startswith("dry-") and not named.exists()
    assert main(["fit", "-c", str(recipe), "--model.norm", "rmsnorm"]) == 0
    assert (named / "checkpoints" / "last.ckpt").is_file() and [p.name for p in named.parent.iterdir()] == [named.name]
    # a run named before this by the resolved config continues where it is
    _, resolved = prepare(load_experiment(recipe, {"model.norm": "rmsnorm"}))
    assert resolved.run_dir() != named
    named.rename(resolved.run_dir())
    assert main(["fit", "-c", str(recipe), "--model.norm", "rmsnorm", "--ckpt-path", "last"]) == 0
    assert [p.name for p in named.parent.iterdir()] == [resolved.run_dir().name]


def test_fit_help_describes_the_slurm_options_in_fit_words(capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--help"])
    out = capsys.readouterr().out
    assert "nodes for the run" in out and "devices) per node for the run" in out
    assert "ablation" not in out and "trial" not in out
    with pytest.raises(SystemExit):
        main(["ablate", "submit", "--help"])
    assert "nodes for each trial" in capsys.readouterr().out


def test_trained_runs_export_to_hf_and_greedy_generate_gives_attnlab_tokens(runs, tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    # runs["mt"] has RMSNorm (no Marian counterpart): the recipe's own post-norm LayerNorm model, trained alike
    assert main(["export", "--ckpt", str(runs["mt"] / "checkpoints" / "last.ckpt"), "--out", str(tmp_path / "x")]) == 2
    assert "model.norm='rmsnorm' (needs 'layernorm')" in capsys.readouterr().err
    assert main(["fit", "-c", str(runs["recipe"]), "--trainer.max_steps=6", "--trainer.run_name", "marian"]) == 0
    mt_ckpt = runs["mt"].with_name("marian") / "checkpoints" / "last.ckpt"
    lm_ckpt = runs["lm"] / "checkpoints" / "last.ckpt"
    assert main(["export", "--ckpt", str(mt_ckpt), "--format", "hf", "--out", str(tmp_path / "mt")]) == 0
    marian = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "mt").eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "mt")
    module, tok = load_module(mt_ckpt), Tokenizer.load(runs["mt"] / "tokenizer")  # the same corpus and settings
    lines, outputs, lengths = [s for s, _ in make_pairs(12, seed=5)], set(), {}
    for line in lines:
        src = torch.tensor([tok.encode(line) + [tok.eos_id]])
        [ours] = module.translate_ids(src, beam=1)
        limit = int(module.decode_cfg.max_len_a * src.shape[1] + module.decode_cfg.max_len_b)
        with torch.no_grad():
            theirs = marian.generate(src, max_new_tokens=limit, do_sample=False, num_beams=1)[0].tolist()
        assert theirs[0] == tok.bos_id and theirs[1:] == ours + [tok.eos_id][: len(theirs) - 1 - len(ours)], line
        assert hf_tok.decode(theirs, skip_special_tokens=True) == tok.decode(ours)
        outputs.add(tuple(ours))
        with torch.no_grad():  # as a Hugging Face user calls it: greedy up to the position table (not 20 tokens)
            default = marian.generate(src)[0].tolist()
        ended = len(ours) < limit  # attnlab's output ended by EOS within its limit: the same tokens
        assert default == theirs if ended else default[: len(theirs)] == theirs and len(default) > 21, line
        lengths[ended] = lengths.get(ended, 0) + 1
    assert lengths.get(False, 0) > 0, "no output ran past HF's default 20 tokens"
    assert len(outputs) > 3  # different inputs, different outputs: the comparison is not between empty lines

    assert main(["export", "--ckpt", str(lm_ckpt), "--out", str(tmp_path / "lm")]) == 0
    llama = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "lm").eval()
    lm = load_module(lm_ckpt).model
    for prompt in ("der Hund", "die Datei", ""):
        ids = torch.tensor([[tok.eos_id] + Tokenizer.load(runs["lm"] / "tokenizer").encode(prompt, side="tgt")])
        ours = attnlab.evaluate.generate(lm, ids, max_new_tokens=15, greedy=True, eos_id=2)[0]
        with torch.no_grad():
            theirs = llama.generate(ids, max_new_tokens=15, do_sample=False)[0].tolist()
        assert theirs == ours and len(ours) > ids.shape[1], prompt
    # as a Hugging Face user calls it: the exported tokenizer and generate() with its default arguments give
    # exactly `attnlab generate`'s text (greedy: --temperature 0; the length: the same default)
    hf_lm_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "lm")
    for prompt in ("der Hund", "Die Datei"):
        capsys.readouterr()
        assert main(["generate", "--ckpt", str(lm_ckpt), "--prompt", prompt, "--temperature", "0"]) == 0
        ours = capsys.readouterr().out.removesuffix("\n")
        inputs = hf_lm_tok(prompt, return_tensors="pt")
        assert inputs["input_ids"][0, 0] == tok.eos_id and hf_lm_tok.bos_token_id == tok.eos_id
        with torch.no_grad():
            theirs = hf_lm_tok.decode(llama.generate(**inputs)[0], skip_special_tokens=True)
        assert theirs == ours and len(ours) > len(prompt) + 5, (prompt, ours)
    assert type(marian).__name__ == "MarianMTModel" and type(llama).__name__ == "LlamaForCausalLM"


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
    # every scored sentence, newlines and all, beside the scores: what they were computed from
    lines = (run_dir / "demo_translations.jsonl").read_text(encoding="utf-8").splitlines()
    rows = [json.loads(line) for line in lines]
    assert result["translations"] == str(run_dir / "demo_translations.jsonl") and len(rows) == len(srcs)
    assert [(r["source"], r["reference"], r["hypothesis"]) for r in rows] == list(zip(srcs, refs, hyps, strict=True))


def test_forked_decoding_workers_end_with_their_parent(tmp_path):
    """A process killed while its forked workers decode (and it decodes its own share) leaves no orphan: the kernel
    kills them (PR_SET_PDEATHSIG), so none keeps a CPU busy or the caller's output pipes open."""
    import os
    import signal
    import subprocess
    import time

    pids = tmp_path / "pids"
    script = f"""
import os, time, torch
import attnlab.decode_workers as w
def sleepy(job, idx):
    with open({str(pids)!r}, "a") as f:
        f.write(f"{{os.getpid()}}\\n")
    time.sleep(120)
w.decode_batch = sleepy
torch.set_num_threads(3)
job = w.DecodeJob(None, [], 0, torch.device("cpu"), None, 1)
with w.batch_workers(job, 3, processes=True) as decode_all:
    list(decode_all([[0], [1], [2]]))
"""
    proc = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (not pids.exists() or len(pids.read_text().split()) < 3):
            time.sleep(0.2)
        decoding = [int(p) for p in pids.read_text().split()]
        workers = [p for p in decoding if p != proc.pid]
        assert len(decoding) == 3 and proc.pid in decoding and len(set(workers)) == 2
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    def alive(pid: int) -> bool:
        try:
            return open(f"/proc/{pid}/stat").read().split(")")[-1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(alive(p) for p in workers):
        time.sleep(0.1)
    left = [p for p in workers if alive(p)]
    for p in left:  # never left running, whatever the assertion says
        os.kill(p, signal.SIGKILL)
    assert not left
