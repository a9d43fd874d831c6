"""What a run gives other tools: progress lines in a log file (a bar only on a terminal), Lightning's loggers as
trainer.loggers selects them (W&B offline and MLflow's file store when installed), BLEU with sacreBLEU's tokenizer
for the target language (zh on the machine's Chinese gettext catalogs), a tokenizer folder that loads with
transformers.AutoTokenizer."""

from __future__ import annotations

import importlib.util
import io
import json
import re
import struct
from pathlib import Path

import pytest
import sacrebleu
from lightning.pytorch.callbacks import TQDMProgressBar

import attnlab.train
from attnlab.bleu import sacrebleu_bleu
from attnlab.cli import main
from attnlab.config import ConfigError
from attnlab.data.tokenizer import Tokenizer
from attnlab.evaluate import score
from attnlab.experiment import TrainConfig, load_experiment
from attnlab.progress import LineProgress, progress_callback
from attnlab.rundir import run_metrics
from attnlab.train import fit
from test_train import write_recipe

LOCALE_ZH = "/usr/share/locale/zh_CN/LC_MESSAGES"


# ---------------------------------------------------------------------------------------------- progress
def test_progress_is_a_bar_on_a_terminal_and_plain_lines_in_a_log_file(tmp_path, capsys):
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert isinstance(progress_callback(50, "run", Terminal()), TQDMProgressBar)
    assert isinstance(progress_callback(50, "run", io.StringIO()), LineProgress)
    recipe = write_recipe(tmp_path, trainer={"progress_bar": True, "log_every": 2, "max_steps": 6, "val_every": 3,
                                             "run_name": "lines"})
    fit(load_experiment(recipe))
    err = capsys.readouterr().err  # pytest's stderr is not a terminal, as a log file or a SLURM job's output
    assert "\r" not in err
    lines = [line for line in err.splitlines() if line.startswith("[lines] step ")]
    steps = [line for line in lines if "validation" not in line]
    assert [int(re.search(r"step (\d+)/6", line).group(1)) for line in steps] == [2, 4, 6]
    for line in steps:
        assert re.fullmatch(r"\[lines\] step \d+/6 \| loss [\d.]+ \| lr [\d.e+-]+ \| [\d,]+ tokens/s \| "
                            r"ETA \d+:\d\d:\d\d", line), line
    validations = [line for line in lines if "validation" in line]
    assert len(validations) == 2 and "val/loss" in validations[0] and "val/bleu" in validations[0]
    if importlib.util.find_spec("tensorboard"):  # the `tensorboard` extra's viewer reads what the run wrote
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(tmp_path / "runs" / "lines" / "tensorboard")).Reload()
        assert [e.step for e in events.Scalars("train/loss")] == [1, 3, 5] and events.Scalars("val/bleu")


# ---------------------------------------------------------------------------------------------- loggers
def test_trainer_loggers_are_checked_before_any_work(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="trainer.loggers='csv,comet': comet is not one of: csv, tensorboard, wandb"):
        TrainConfig(loggers="csv,comet")
    real = importlib.util.find_spec
    monkeypatch.setattr(attnlab.train.importlib.util, "find_spec", lambda n, *a: None if n == "wandb" else real(n, *a))
    recipe = write_recipe(tmp_path, trainer={"loggers": "csv,wandb"})
    with pytest.raises(ConfigError, match=r"names wandb, which is not installed: pip install 'attnlab\[wandb\]'"):
        fit(load_experiment(recipe))
    assert not (tmp_path / "data_cache").exists()  # stopped before the tokenizer was trained
    exp = load_experiment(recipe, {"trainer.loggers": "csv"})
    assert exp.config_hash() == load_experiment(recipe).config_hash()  # where it logs is not what it trains
    assert load_experiment(recipe, {"data.min_pairs": 5}).config_hash() == exp.config_hash()  # nor a data check
    assert [type(lg).__name__ for lg in attnlab.train.make_loggers(exp, tmp_path)] == ["WholeRowsCSVLogger"]  # csv only


def wandb_records(path: Path) -> list:
    """The protobuf Records of an offline W&B run file (what `wandb sync` uploads), read independently of wandb's
    own (Go) reader: a 7-byte header (":W&B", magic 0xBEE1, version 0), then LevelDB-log blocks of 32 KiB whose
    chunks carry a 7-byte header (CRC-32C, length, type: 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert struct.unpack("<4sHB", data[:7]) == (b":W&B", 0xBEE1, 0), path
    records, pos, chunks = [], 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header is padding
            pos += 32768 - pos % 32768
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        chunks += data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            records.append(record)
            chunks = b""
    return records


def test_wandb_offline_run(tmp_path, monkeypatch):
    """Read back from the offline run file: its name, the hyper-parameters, and train/loss at every step equal to
    what the CSV logger wrote for the same run."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    recipe = write_recipe(tmp_path, trainer={"loggers": "csv,wandb", "run_name": "wb", "max_steps": 4})
    run_dir = fit(load_experiment(recipe))
    [offline] = (run_dir / "wandb").glob("offline-run-*")
    [records] = offline.glob("run-*.wandb")
    history, config, names = [], {}, []
    for r in wandb_records(records):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            names.append(r.run.display_name)
        elif kind == "config":
            config.update({i.key: json.loads(i.value_json) for i in r.config.update})
        elif kind == "history":
            history.append({"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in r.history.item})
    assert names == ["wb"] and config["model"]["d_model"] == 32 and config["optim"]["lr"] == 2e-3
    logged = {h["trainer/global_step"]: h["train/loss"] for h in history if "train/loss" in h}
    csv_loss = dict(run_metrics(run_dir)["train/loss"])
    assert sorted(logged) == [0, 1, 2, 3] and logged == pytest.approx(csv_loss, rel=1e-6)
    assert any("val/bleu" in h for h in history)
    import wandb

    assert wandb.run is None  # finished: a next fit in this process starts its own run


def test_mlflow_local_stores(tmp_path, monkeypatch):
    """No server: by default MLflow's SQLite store in runs_dir; a file store where MLFLOW_TRACKING_URI names one."""
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    recipe = write_recipe(tmp_path, trainer={"loggers": "csv,mlflow", "run_name": "mlf", "max_steps": 4})
    runs = {"mlf": fit(load_experiment(recipe))}
    file_store = tmp_path / "mlruns"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", file_store.as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps file stores behind this switch
    runs["mlf2"] = fit(load_experiment(recipe, {"trainer.run_name": "mlf2"}))
    for uri, name in ((f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}", "mlf"), (file_store.as_uri(), "mlf2")):
        client = mlflow.tracking.MlflowClient(uri)
        [run] = client.search_runs([client.get_experiment_by_name("tiny").experiment_id])
        assert run.info.run_name == name
        logged = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "train/loss")}
        assert sorted(logged) == [0, 1, 2, 3]  # and the values the CSV logger wrote for the same run
        assert logged == pytest.approx(dict(run_metrics(runs[name])["train/loss"]), rel=1e-6)
        assert run.data.params["model/d_model"] == "32"  # the module's hyper-parameters


# ---------------------------------------------------------------------------------------------- BLEU
def test_bleu_tokenizer_follows_the_target_language():
    hyp, ref = ["我很喜欢这只猫。"], ["我很喜欢那只猫。"]
    zh, plain = score(hyp, ref, "zh_CN"), score(hyp, ref, "de")
    assert "tok:zh" in zh["bleu_signature"] and "tok:13a" in plain["bleu_signature"]
    assert plain["bleu"] == 0.0  # 13a: the sentence is one "word", and it differs
    assert zh["bleu"] == round(sacrebleu.corpus_bleu(hyp, [ref], tokenize="zh").score, 2) > 20  # by character
    assert "tok:13a" in score(hyp, ref)["bleu_signature"]  # no language given: sacreBLEU's default


def test_japanese_bleu_needs_mecab_and_says_which_extra(monkeypatch):
    if importlib.util.find_spec("MeCab") and importlib.util.find_spec("ipadic"):
        result = score(["猫が好きです。"], ["猫が好きです。"], "ja")
        assert result["bleu_signature"].split("tok:")[1].startswith("ja-mecab") and result["bleu"] == 100.0
    from sacrebleu.tokenizers import tokenizer_ja_mecab

    monkeypatch.setattr(tokenizer_ja_mecab, "MeCab", None)  # as on a machine without it
    with pytest.raises(ConfigError, match=r"ja-mecab tokenizer, which needs MeCab .*pip install 'attnlab\[mecab\]'"):
        sacrebleu_bleu("ja")


@pytest.mark.skipif(not list(__import__("pathlib").Path(LOCALE_ZH).glob("*.mo")), reason=f"no catalogs in {LOCALE_ZH}")
def test_demo_on_chinese_catalogs_scores_with_the_zh_tokenizer_and_labels_by_language(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    recipe = write_recipe(tmp_path, data={"corpus": "gettext:zh_CN", "tgt_lang": "zh_CN", "tokenizer_max_lines": 4000,
                                          "test_fraction": 0.005, "valid_fraction": 0.005},
                          trainer={"max_steps": 4, "val_every": 4, "ckpt_every": 2, "run_name": "zh"},
                          decode={"beam": 1, "max_len_a": 0.0, "max_len_b": 6, "batch_sentences": 256,
                                  "average_last": 2, "val_sentences": 50})
    assert main(["demo", "-c", str(recipe)]) == 0
    out = capsys.readouterr().out
    assert "BLEU signature: nrefs:1|case:mixed|eff:no|tok:zh|" in out
    assert re.search(r"^  EN     \S", out, re.M) and re.search(r"^  ZH_CN  \S", out, re.M) and "  DE  " not in out
    run = tmp_path / "runs" / "zh"
    assert "tok:zh" in (run / "sacrebleu_signature.txt").read_text(encoding="utf-8")  # validation BLEU too
    # the run's tokenizer folder, as transformers loads it: the same ids and special tokens
    hf = transformers.AutoTokenizer.from_pretrained(run / "tokenizer")
    ours = Tokenizer.load(run / "tokenizer")
    assert (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id, hf.unk_token_id) == (0, 1, 2, 3)
    for text in ("需要指定文件名", "A filename is required </s>", "  two  spaces, 2 . marks "):
        ids = ours.encode(text)
        assert hf(text)["input_ids"] == ids and hf.decode(ids) == ours.decode(ids) == text
