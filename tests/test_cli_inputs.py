"""The `attnlab` command given what a user gets wrong or brings from elsewhere: text that YAML would misread, a
results file's place, a copied checkpoint beside someone else's config.yaml, a byte-order mark, paths that are
folders or taken, values out of range, a recipe that is not UTF-8. Each is a clear one-line error with exit
status 2 naming the value or file, or does what the user meant; nothing saved before is touched."""

from __future__ import annotations

import json
import shutil

import pytest
import sacrebleu
import yaml

from attnlab.cli import main
from attnlab.experiment import load_experiment
from attnlab.train import prepare
from test_cli import make_runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return make_runs(tmp_path_factory.mktemp("cli_inputs"))


def test_a_text_field_takes_the_command_line_value_as_written(runs, capsys):
    """YAML would read `no` as False and `001` as 1; a text field takes the text (LightningCLI does too)."""
    argv = ["fit", "-c", str(runs["recipe"]), "--data.tgt_lang", "no", "--trainer.run_name", "001", "--print-config"]
    assert main(argv) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["data"]["tgt_lang"] == "no" and printed["trainer"]["run_name"] == "001"


def test_test_results_of_a_checkpoint_outside_a_run_go_beside_it(runs, tmp_path, capsys):
    """test_results.json goes to the run directory of a checkpoint in one, else beside the checkpoint: never into
    the folder above it, where it replaced a file of the same name."""
    mine = tmp_path / "sub" / "mine.ckpt"
    mine.parent.mkdir()
    shutil.copy(runs["mt"] / "checkpoints" / "last.ckpt", mine)
    precious = tmp_path / "test_results.json"
    precious.write_text('{"precious": true}', encoding="utf-8")
    assert main(["test", "-c", str(runs["recipe"]), "--model.norm", "rmsnorm", "--ckpt", str(mine)]) == 0
    assert json.loads(precious.read_text(encoding="utf-8")) == {"precious": True}
    out = capsys.readouterr()
    assert json.loads((mine.parent / "test_results.json").read_text(encoding="utf-8")) == json.loads(out.out)
    assert f"results in {mine.parent / 'test_results.json'}" in out.err
    rows = [json.loads(line) for line in (mine.parent / "test_translations.jsonl").read_text(encoding="utf-8")
            .splitlines()]
    srcs, refs = prepare(load_experiment(runs["recipe"]))[0].split_texts("test")
    assert [(r["source"], r["reference"]) for r in rows] == list(zip(srcs, refs, strict=True))
    hyps = [r["hypothesis"] for r in rows]
    assert json.loads(out.out)["bleu"] == round(sacrebleu.corpus_bleu(hyps, [refs]).score, 2)


def test_a_copied_checkpoint_ignores_a_config_yaml_beside_it_and_a_byte_order_mark(runs, tmp_path, capsys):
    src = tmp_path / "in.txt"
    src.write_text("the red house 5.\nopen the window 7.\n", encoding="utf-8")
    assert main(["translate", "--ckpt", str(runs["mt"] / "checkpoints" / "last.ckpt"), "--input", str(src)]) == 0
    expected = capsys.readouterr().out
    alone = tmp_path / "elsewhere" / "model.ckpt"
    alone.parent.mkdir()
    shutil.copy(runs["mt"] / "checkpoints" / "last.ckpt", alone)
    (alone.parent / "config.yaml").write_text("trainer: 5\n", encoding="utf-8")  # not this model's recipe
    bom = tmp_path / "bom.txt"
    bom.write_bytes(b"\xef\xbb\xbf" + src.read_bytes())  # as Windows editors save UTF-8
    assert main(["translate", "--ckpt", str(alone), "--input", str(bom)]) == 0
    assert capsys.readouterr().out == expected
    bom.write_bytes(b"\xef\xbb\xbfok\nbad \xff\n")
    assert main(["translate", "--ckpt", str(alone), "--input", str(bom)]) == 2
    assert "line 2 is not UTF-8" in capsys.readouterr().err  # the line counted in the file as saved


def test_paths_that_are_folders_or_taken_are_one_line_errors(runs, tmp_path, capsys):
    last = str(runs["mt"] / "checkpoints" / "last.ckpt")
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine", encoding="utf-8")
    a_file = tmp_path / "a_file"
    a_file.write_text("x", encoding="utf-8")
    lm = str(runs["lm"] / "checkpoints" / "last.ckpt")  # Llama-shaped: the HF export takes it
    for argv, needle in ((["export", "--ckpt", lm, "--out", str(taken)], "exists and is not empty"),
                         (["export", "--ckpt", lm, "--out", str(a_file)], str(a_file)),
                         (["translate", "--ckpt", last, "--input", str(tmp_path)], str(tmp_path)),
                         (["info", str(tmp_path)], str(tmp_path)),
                         (["fit", "-c", str(tmp_path)], str(tmp_path))):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith(f"attnlab {argv[0]}: error: ") and needle in err and "Traceback" not in err, argv
    assert (taken / "keep.txt").read_text(encoding="utf-8") == "mine" and a_file.read_text(encoding="utf-8") == "x"


def test_values_out_of_range_and_recipes_that_are_not_text_name_what_is_wrong(runs, tmp_path, capsys):
    for n in ("0", "-3"):
        with pytest.raises(SystemExit) as e:  # argparse's own errors: status 2
            main(["info", str(runs["recipe"]), "--seq-len", n])
        assert e.value.code == 2 and "--seq-len" in capsys.readouterr().err
    assert main(["generate", "--ckpt", str(runs["lm"] / "checkpoints" / "last.ckpt"), "--temperature", "nan"]) == 2
    assert "temperature=nan" in capsys.readouterr().err
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes("name: caf\xe9\nbase: x.yaml\n".encode("latin-1"))
    child = tmp_path / "child.yaml"
    child.write_text("base: 5\n", encoding="utf-8")
    parent, grandchild = tmp_path / "parent.yaml", tmp_path / "grandchild.yaml"
    parent.write_text(f"base: {runs['recipe']}\nmodel: {{d_model: abc}}\n", encoding="utf-8")
    grandchild.write_text("base: parent.yaml\nname: g\n", encoding="utf-8")
    for argv, needle in ((["fit", "-c", str(latin1)], f"{latin1}: not UTF-8 text"),
                         (["fit", "-c", str(child)], f"{child}: base: 5 must be the path"),
                         (["fit", "-c", str(grandchild)], f"{parent}: model.d_model='abc' has type str"),
                         (["info", str(tmp_path / "nothere")], f"config file not found: {tmp_path / 'nothere'}")):
        assert main(argv) == 2, argv
        assert needle in capsys.readouterr().err, argv
