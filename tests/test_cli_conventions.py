"""LightningCLI habits that work in `attnlab` (no training here): `--help` lists every config field, `--print-config`
round-trips to the same run hash, several `-c` files merge in order, one flag style with the other spelling
accepted for every option, `--version`, and errors with the closest option or key, exit status 2."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import typing
from pathlib import Path

import pytest
import yaml

import attnlab
from attnlab.cli import build_parser, main
from attnlab.config import field_docs
from attnlab.experiment import SECTIONS, load_experiment

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted((REPO / "experiments").glob("*.yaml"))


def all_parsers(parser: argparse.ArgumentParser, path: str = "attnlab"):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from all_parsers(sub, f"{path} {name}")


def test_fit_help_lists_every_config_field_with_type_default_and_description(capsys):
    with pytest.raises(SystemExit) as e:
        main(["fit", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for section, cls in SECTIONS.items():
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            assert docs.get(f.name), f"{section}.{f.name} has no description (a comment on its line)"
            m = re.search(rf"^  --{section}\.{f.name} (\S.*?) = (.+)\n      (.+)$", out, re.M)
            assert m, f"--{section}.{f.name} missing from fit --help"
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            assert json.loads(m.group(2)) == default and m.group(3) == docs[f.name]
    assert "--model.norm {layernorm,rmsnorm}" in out and "--optim.lr float = 1.0" in out


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.stem for p in RECIPES])
def test_print_config_loads_back_with_the_same_run_hash(recipe, tmp_path, capsys):
    assert main(["fit", "-c", str(recipe), "--print_config", "--model.dropout", "0.3"]) == 0
    printed = capsys.readouterr().out
    path = tmp_path / "printed.yaml"
    path.write_text(printed, encoding="utf-8")
    original, again = load_experiment(recipe, {"model.dropout": 0.3}), load_experiment(path)
    assert again.config_hash() == original.config_hash() and again.run_dir() == original.run_dir()
    assert again == original and again.model.dropout == 0.3
    assert main(["test", "-c", str(path), "--ckpt", "x.ckpt", "--print-config"]) == 0  # validate/test/demo too
    assert capsys.readouterr().out == printed


def test_several_config_files_merge_in_order(tmp_path, capsys):
    base = REPO / "experiments" / "demo_en_de.yaml"
    a = tmp_path / "small.yaml"
    a.write_text("model: {d_model: 64, n_heads: 2}\noptim: {lr: 0.5}\n", encoding="utf-8")
    b = tmp_path / "smaller.yaml"
    b.write_text("model: {d_model: 32}\ntrainer: {max_steps: 7}\n", encoding="utf-8")
    exp = load_experiment([base, a, b], {"trainer.max_steps": 9})
    assert (exp.model.d_model, exp.model.n_heads, exp.optim.lr, exp.trainer.max_steps) == (32, 2, 0.5, 9)
    assert exp.name == "demo_en_de" and exp.data.vocab_size == 4000  # the first file's name and other values
    assert load_experiment([base, b, a]).model.d_model == 64  # order matters: the later file wins
    b.write_text("name: renamed\n", encoding="utf-8")
    assert load_experiment([base, b]).name == "renamed"
    assert main(["fit", "-c", str(base), "-c", str(a), "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"]["d_model"] == 64 and printed["model"]["n_enc_layers"] == 2
    a.write_text("model: {d_modle: 64}\n", encoding="utf-8")
    assert main(["fit", "-c", str(base), "-c", str(a)]) == 2
    assert "model.d_modle (did you mean model.d_model?)" in capsys.readouterr().err


def test_one_flag_style_with_the_other_spelling_accepted_everywhere():
    parser = build_parser()
    seen = 0
    for path, p in all_parsers(parser):
        for action in p._actions:
            for option in action.option_strings:
                if not option.startswith("--") or option in ("--help", "--version"):
                    continue
                assert "_" not in option, f"{path} {option}: options are spelled with dashes"
                if "-" in option[2:] and action.nargs != 0 and not action.required:
                    ns, rest = p.parse_known_args([option.replace("-", "_").replace("__", "--", 1), "1"]
                                                  + required_args(p))
                    assert rest == [] and getattr(ns, action.dest) is not None, (path, option)
                    seen += 1
    assert seen >= 10  # --ckpt-path, --run-dir, --top-p, --tasks-per-node, --max-trials, ...


def required_args(p: argparse.ArgumentParser) -> list[str]:
    out: list[str] = []
    for action in p._actions:
        if action.required and action.option_strings:
            out += [action.option_strings[-1], "x.yaml"]
        elif not action.option_strings and not isinstance(action, argparse._SubParsersAction):
            out.append("x.yaml")
    return out


def test_old_spellings_still_work(tmp_path, capsys):
    args, _ = build_parser().parse_known_args(["fit", "-c", "r.yaml", "--ckpt_path", "last"])
    assert args.ckpt_path == "last"
    args, _ = build_parser().parse_known_args(["generate", "--ckpt", "x", "--top_p", "0.9", "--max_new_tokens=3"])
    assert (args.top_p, args.max_new_tokens) == (0.9, 3)
    args, _ = build_parser().parse_known_args(["average", "--run_dir", "runs/x"])
    assert args.run_dir == "runs/x"


def test_version_and_unknown_options(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith(f"attnlab {attnlab.__version__} (torch ")
    recipe = str(REPO / "experiments" / "demo_en_de.yaml")
    assert main(["fit", "-c", recipe, "--ckpt-pth", "last"]) == 2
    assert "unknown option --ckpt-pth (did you mean --ckpt-path?)" in capsys.readouterr().err
    assert main(["fit", "-c", recipe, "--model.nrom", "rmsnorm"]) == 2
    assert "model.nrom (did you mean model.norm?)" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # argparse's own errors keep status 2
        main(["fit"])
    assert e.value.code == 2


def test_every_config_field_has_a_type_the_help_can_name():
    for cls in SECTIONS.values():
        for name, tp in typing.get_type_hints(cls).items():
            if name != "prefix":
                assert tp in (int, float, bool, str) or typing.get_origin(tp) is not None, (cls.__name__, name, tp)


def test_demo_without_catalogs_stops_before_training_saying_where_it_looked(tmp_path, capsys):
    empty = tmp_path / "no-locale"
    empty.mkdir()
    argv = ["demo", "-c", str(REPO / "experiments" / "demo_en_de.yaml"), "--data.locale_dir", f"[{empty}]",
            "--data.data_dir", str(tmp_path / "cache"), "--trainer.runs_dir", str(tmp_path / "runs")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "gettext:de: 0 English->de pairs in 0 catalog(s); data.min_pairs asks for 10,000." in err
    assert f"Searched: {empty}/de/LC_MESSAGES, " not in err and f"Searched: {empty}/de/LC_MESSAGES." in err
    assert "Debian: sudo apt-get install" in err and "Ubuntu: sudo apt-get install language-pack-de" in err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "cache").exists()  # nothing trained or cached
