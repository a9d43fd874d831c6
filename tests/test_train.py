"""`fit` on a tiny translation recipe (d_model 32, 1+1 layers, a synthetic TSV corpus): the logged metrics and the
run directory; exact resume from periodic checkpoints and from a SIGTERM-killed `attnlab fit`; atomic checkpoint
writes; clear errors for truncated, foreign and mismatched checkpoints."""

from __future__ import annotations

import csv
import errno
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import sacrebleu
import torch
import torch.nn.functional as F
import yaml
from lightning.pytorch.callbacks import Callback

from attnlab.checkpoint_io import AtomicCheckpointIO
from attnlab.checkpoints import check_compatible, load_checkpoint
from attnlab.config import ConfigError
from attnlab.data.tokenizer import Tokenizer
from attnlab.decode import beam_search, greedy_search
from attnlab.evaluate import load_module
from attnlab.experiment import load_experiment
from attnlab.lit import seq2seq
from attnlab.lit.optim import lr_factor
from attnlab.lit.seq2seq import strip_special
from attnlab.rundir import archive_previous, fit_done, mark_fit_done, run_metrics
from attnlab.train import fit, make_module, make_trainer, prepare
from conftest import make_pairs

TINY = {
    "model": {"d_model": 32, "n_heads": 2, "n_enc_layers": 1, "n_dec_layers": 1, "d_ff": 64, "dropout": 0.1,
              "z_loss": 1e-3, "max_seq_len": 256},
    "data": {"vocab_size": 400, "max_len": 64, "max_tokens": 1024, "valid_fraction": 0.05, "test_fraction": 0.05},
    "optim": {"lr": 2e-3, "schedule": "inverse_sqrt", "warmup_steps": 4, "label_smoothing": 0.1},
    "trainer": {"max_steps": 8, "val_every": 4, "ckpt_every": 4, "log_every": 1, "progress_bar": False},
    "decode": {"val_sentences": 8, "beam": 2, "max_len_b": 10},
}


def write_recipe(root: Path, name: str = "tiny", n_pairs: int = 600, **sections: dict) -> Path:
    """A recipe with absolute paths (corpus, caches, runs under `root`), TINY updated section by section."""
    corpus = root / "corpus.tsv"
    if not corpus.exists():
        corpus.write_text("".join(f"{s}\t{t}\n" for s, t in make_pairs(n_pairs)), encoding="utf-8")
    raw = {k: dict(v) for k, v in TINY.items()}
    raw["data"].update(corpus=str(corpus), data_dir=str(root / "data_cache"))
    raw["trainer"]["runs_dir"] = str(root / "runs")
    for section, values in sections.items():
        raw[section].update(values)
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"name": name, **raw}), encoding="utf-8")
    return path


def read_metrics(path: Path) -> dict[str, dict[int, list[float]]]:
    """column -> step -> the values logged at that step, from a CSVLogger metrics.csv."""
    out: dict[str, dict[int, list[float]]] = {}
    with open(path, newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            for k, v in row.items():
                if k not in ("step", "epoch") and v:
                    out.setdefault(k, {}).setdefault(int(row["step"]), []).append(float(v))
    return out


def read_run(run_dir: Path) -> dict[str, dict[int, list[float]]]:
    """read_metrics over a run's attempts (a resumed run's earlier ones are kept as metrics.partK.csv)."""
    out: dict[str, dict[int, list[float]]] = {}
    for col, points in run_metrics(run_dir).items():
        for step, value in points:
            out.setdefault(col, {}).setdefault(step, []).append(value)
    return out


def train_rows(metrics: dict[str, dict[int, list[float]]]) -> dict[str, dict[int, list[float]]]:
    """The per-step training curves that must be reproduced exactly (tokens/s and the clock are timings)."""
    timings = ("train/tokens_per_s", "train/time")
    return {k: v for k, v in metrics.items() if k.startswith("train/") and k not in timings}


def sample_scores(dm, module, beam: int, sentences: int) -> tuple[float, float]:
    """sacreBLEU's BLEU and chrF of every k-th validation sentence (k = ceil(n / sentences), what validation
    decodes), each translated alone by greedy search (beam 1) or beam search, detokenised, against its raw text."""
    ds, (_, refs) = dm.dataset("valid"), dm.split_texts("valid")
    c, model = module.decode_cfg, module.model
    kw = dict(max_len_a=c.max_len_a, max_len_b=c.max_len_b)
    hyps, picked = [], range(0, len(ds), -(-len(ds) // sentences))
    for i in picked:
        src = torch.tensor([ds[i][0].tolist() + [dm.eos_id]])  # (1, S): the source as collated, ending in EOS
        best = (greedy_search(model, src, **kw)[0] if beam == 1 else
                beam_search(model, src, beam_size=beam, len_penalty=c.len_penalty, penalty=c.penalty, **kw)[0][0][0])
        hyps.append(dm.tokenizer.decode(best))
    ref = [[refs[i] for i in picked]]
    return sacrebleu.corpus_bleu(hyps, ref).score, sacrebleu.corpus_chrf(hyps, ref).score


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> tuple[Path, Path]:
    """(recipe, run directory) of an 8-step fit without dropout (so the first step's loss can be recomputed)."""
    root = tmp_path_factory.mktemp("tiny")
    recipe = write_recipe(root, model={"dropout": 0.0})
    return recipe, fit(load_experiment(recipe))


def test_precision_auto_is_bf16_mixed_on_a_gpu_and_fp32_on_cpu(tiny_run, tmp_path, monkeypatch):
    recipe, _ = tiny_run
    exp = load_experiment(recipe)
    assert make_trainer(exp, tmp_path / "cpu", logger=False).precision == "32-true"
    seen = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr("attnlab.train.L.Trainer", lambda **kw: seen.update(kw))
    make_trainer(exp, tmp_path / "gpu")
    assert seen["precision"] == "bf16-mixed"
    make_trainer(load_experiment(recipe, {"trainer.precision": "32-true"}), tmp_path / "forced")
    assert seen["precision"] == "32-true"


def test_bf16_mixed_training_runs_under_cpu_autocast(tmp_path):
    """The bf16-mixed path (autocast, what a GPU run uses by default) end to end on the CPU: finite losses that
    fall, and an fp32 checkpoint."""
    recipe = write_recipe(tmp_path, model={"dropout": 0.0}, trainer={"precision": "bf16-mixed", "max_steps": 12})
    run_dir = fit(load_experiment(recipe))
    loss = [v[0] for _, v in sorted(read_metrics(run_dir / "logs" / "metrics.csv")["train/loss"].items())]
    assert len(loss) == 12 and all(math.isfinite(x) for x in loss) and loss[-1] < loss[0]
    ckpt = load_checkpoint(run_dir / "checkpoints" / "last.ckpt")
    assert all(v.dtype == torch.float32 for v in ckpt["state_dict"].values() if v.is_floating_point())


# --------------------------------------------------------------------------------------------- logging, run dir
def test_fit_logs_training_and_validation_metrics(tiny_run):
    recipe, run_dir = tiny_run
    m = read_metrics(run_dir / "logs" / "metrics.csv")
    for col in ("train/loss", "train/lr", "train/grad_norm"):
        assert sorted(m[col]) == list(range(8)), col  # every step, log_every 1
    assert sorted(m["train/tokens_per_s"]) == list(range(1, 8))  # from the second step: a rate needs an interval
    assert all(v[0] > 0 and math.isfinite(v[0]) for v in m["train/tokens_per_s"].values())
    assert all(v[0] > 0 and math.isfinite(v[0]) for v in m["train/grad_norm"].values())
    exp = load_experiment(recipe)
    factor = lr_factor(exp.optim, exp.model.d_model)
    assert [m["train/lr"][s][0] for s in range(8)] == pytest.approx([2e-3 * factor(s) for s in range(8)])
    losses = [m["train/loss"][s][0] for s in range(8)]
    assert losses[-1] < losses[0]  # it learns
    for col in ("val/loss", "val/ppl", "val/bleu", "val/chrf"):
        assert sorted(m[col]) == [3, 7], col  # validation after steps 4 and 8
    # train/tokens: the target tokens (EOS included, padding not) of every batch trained so far
    dm, _ = prepare(exp)
    batches = [b for _, b in zip(range(8), dm.train_dataloader(), strict=False)]
    seen = [int(b["tgt_out"].ne(0).sum()) for b in batches]
    assert [m["train/tokens"][s][0] for s in range(8)] == [sum(seen[: s + 1]) for s in range(8)]
    for s in (3, 7):
        assert m["val/ppl"][s][0] == pytest.approx(math.exp(m["val/loss"][s][0]), rel=1e-5)
    # the last validation ran on the final weights (last.ckpt): its scores are those of their greedy translations
    dm, _ = prepare(exp)
    bleu, chrf = sample_scores(dm, load_module(run_dir / "checkpoints" / "last.ckpt"), 1, exp.decode.val_sentences)
    assert m["val/bleu"][7][0] == pytest.approx(bleu, rel=1e-6, abs=1e-9)
    assert m["val/chrf"][7][0] == pytest.approx(chrf, rel=1e-6) and chrf > 0  # 8 steps: some characters right
    sig = (run_dir / "sacrebleu_signature.txt").read_text(encoding="utf-8").splitlines()
    assert sig[0].startswith("BLEU nrefs:1|case:mixed|") and "|tok:13a|smooth:exp|" in sig[0]
    assert sig[0].endswith(f"version:{sacrebleu.__version__}")
    assert sig[1].startswith("chrF nrefs:1|") and "|nc:6|nw:0|" in sig[1]


def test_first_step_loss_is_label_smoothed_ce_plus_z_loss_over_non_padding(tiny_run):
    """The logged train/loss of step 0, recomputed by hand from the same initial weights and first batch."""
    recipe, run_dir = tiny_run
    dm, exp = prepare(load_experiment(recipe))  # seeds exactly as fit did, then builds the same initial model
    module = make_module(exp, dm).train()
    batch = next(iter(dm.train_dataloader()))
    assert batch["tgt_out"].eq(0).any(), "the first batch should hold padding for this test to mean something"
    logits = module.model(batch["src"], batch["tgt_in"]).float()  # (B, T, V)
    keep = batch["tgt_out"].ne(exp.model.pad_id)  # (B, T)
    lp = F.log_softmax(logits, -1)[keep]  # (N, V): non-padding positions only
    tgt = batch["tgt_out"][keep]  # (N,)
    nll = -lp.gather(1, tgt[:, None]).squeeze(1)
    smooth = -lp.mean(-1)
    log_z = torch.logsumexp(logits[keep], -1)
    expected = ((0.9 * nll + 0.1 * smooth) + 1e-3 * log_z**2).mean()
    logged = read_metrics(run_dir / "logs" / "metrics.csv")["train/loss"][0][0]
    assert logged == pytest.approx(float(expected), rel=1e-5)
    assert abs(logged - float(nll.mean())) > 1e-3  # smoothing and z-loss do change it


def test_validation_bleu_and_chrf_are_sacrebleu_on_the_real_text(tiny_run, tmp_path):
    """Validation decodes about decode.val_sentences sentences, every k-th of the split by index (k = ceil(n / 6)
    here), spread over all lengths. A stand-in decoder answers the reference for every other one of those and
    copies the source for the rest; the logged val/bleu and val/chrf are then sacreBLEU's BLEU and chrF of exactly
    those texts against their raw references."""
    recipe, run_dir = tiny_run
    dm, exp = prepare(load_experiment(recipe, {"decode.val_sentences": 6}))
    module = load_module(run_dir / "checkpoints" / "last.ckpt", exp.decode)
    module.set_tokenizer(dm.tokenizer.decode_batch)
    ds = dm.dataset("valid")
    index = {tuple(ds[i][0].tolist()): i for i in range(len(ds))}  # sources are distinct: they end in a number
    stride = -(-len(ds) // 6)
    assert stride > 1  # a sample, not the whole split

    def stand_in(src, beam=None):
        rows = strip_special(src, module.eos_id, exp.model.pad_id)
        return [ds[index[tuple(r)]][1].tolist() if (index[tuple(r)] // stride) % 2 == 0 else r for r in rows]

    module.translate_ids = stand_in
    trainer = make_trainer(exp, tmp_path, logger=False, callbacks=[], enable_progress_bar=False)
    logged = trainer.validate(module, datamodule=dm, verbose=False)[0]
    srcs, refs = dm.split_texts("valid")
    ids = [i for b in dm.val_dataloader() for i in b["ids"].tolist() if i % stride == 0]  # decoded, in order
    assert 4 <= len(ids) <= 6 and len({len(ds[i][0]) for i in ids}) > 1  # lengths spread, not just the shortest
    hyps = [refs[i] if (i // stride) % 2 == 0 else srcs[i] for i in ids]
    bleu = sacrebleu.metrics.BLEU().corpus_score(hyps, [[refs[i] for i in ids]]).score
    chrf = sacrebleu.metrics.CHRF().corpus_score(hyps, [[refs[i] for i in ids]]).score
    assert 10.0 < bleu < 100.0 and 10.0 < chrf < 100.0
    assert logged["val/bleu"] == pytest.approx(bleu, abs=1e-4)
    assert logged["val/chrf"] == pytest.approx(chrf, abs=1e-4)


def test_validation_decodes_with_decode_val_beam(tiny_run, tmp_path, monkeypatch):
    """decode.val_beam 3: validation translates by beam search of width 3 (not greedy, not decode.beam = 2), and its
    scores are those of beam-3 translations of the same sample."""
    recipe, run_dir = tiny_run
    dm, exp = prepare(load_experiment(recipe, {"decode.val_beam": 3}))
    module = load_module(run_dir / "checkpoints" / "last.ckpt", exp.decode)
    module.set_tokenizer(dm.tokenizer.decode_batch)
    widths = []
    monkeypatch.setattr(seq2seq, "greedy_search", None)  # calling it would fail
    monkeypatch.setattr(seq2seq, "beam_search", lambda m, src, beam_size, **kw: widths.append(beam_size)
                        or beam_search(m, src, beam_size=beam_size, **kw))
    trainer = make_trainer(exp, tmp_path, logger=False, callbacks=[], enable_progress_bar=False)
    logged = trainer.validate(module, datamodule=dm, verbose=False)[0]
    assert widths and set(widths) == {3}
    bleu, chrf = sample_scores(dm, module, 3, exp.decode.val_sentences)
    assert logged["val/bleu"] == pytest.approx(bleu, rel=1e-6, abs=1e-9)
    assert logged["val/chrf"] == pytest.approx(chrf, rel=1e-6) and chrf > 0


def test_validation_cut_short_by_limit_val_batches_decodes_the_first_sentences(tiny_run, tmp_path):
    """With limit_val_batches the loop never sees most of the split, so every k-th sentence may be none of the
    ones it sees: it decodes the first val_sentences of the batches that run instead, and still logs val/bleu."""
    recipe, run_dir = tiny_run
    dm, exp = prepare(load_experiment(recipe, {"decode.val_sentences": 3, "trainer.limit_val_batches": 1}))
    module = load_module(run_dir / "checkpoints" / "last.ckpt", exp.decode)
    module.set_tokenizer(dm.tokenizer.decode_batch)
    seen: list[int] = []

    def stand_in(src, beam=None):
        seen.append(len(src))
        return strip_special(src, module.eos_id, exp.model.pad_id)

    module.translate_ids = stand_in
    trainer = make_trainer(exp, tmp_path, logger=False, callbacks=[], enable_progress_bar=False)
    logged = trainer.validate(module, datamodule=dm, verbose=False)[0]
    assert seen == [min(3, len(next(iter(dm.val_dataloader()))["src"]))]
    assert "val/bleu" in logged and "val/chrf" in logged


def test_run_directory_holds_config_git_tokenizer_checkpoints_and_logs(tiny_run):
    recipe, run_dir = tiny_run
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8"))
    tok = Tokenizer.load(run_dir / "tokenizer")
    assert cfg["model"]["vocab_size"] == tok.vocab_size  # resolved from the tokenizer, not the recipe's 32000
    assert cfg["model"]["d_model"] == 32 and cfg["trainer"]["max_steps"] == 8 and cfg["name"] == "tiny"
    git = (run_dir / "git.txt").read_text(encoding="utf-8")
    assert re.fullmatch(r"commit: [0-9a-f]{40}\ndirty: (True|False)\n", git), git
    names = {p.name for p in (run_dir / "checkpoints").iterdir()}
    assert {"step=4.ckpt", "step=8.ckpt", "last.ckpt"} <= names
    assert not [n for n in names if n.endswith(".tmp")]
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    ckpt = load_checkpoint(run_dir / "checkpoints" / "last.ckpt")  # weights-only unpickling
    assert ckpt["global_step"] == 8 and "rng" in ckpt and ckpt["hyper_parameters"]["model"]["d_model"] == 32
    assert fit_done(run_dir) == {"step": 8}  # written last: the ablation runner's sign that the fit ended


# --------------------------------------------------------------------------------------------- exact resume
def test_a_checkpoint_is_serialized_once_and_last_ckpt_is_a_copy_of_it(tmp_path, monkeypatch):
    """Each checkpoint serializes the state once: last.ckpt at a step whose step=N.ckpt was just written is a copy
    of that file, made by the kernel (a base model's state is 0.6 GB), holding the same state, last.ckpt's own path
    included, so a resume from it goes on saving into last.ckpt (not a last-v1.ckpt). Two files, not two names: a
    damaged last.ckpt leaves the step checkpoint whole. Without sendfile the copy goes through Python."""
    from attnlab import checkpoint_io, files

    monkeypatch.chdir(tmp_path)
    saves: list[str] = []
    real = checkpoint_io.save_atomic
    monkeypatch.setattr(checkpoint_io, "save_atomic",
                        lambda obj, path: saves.append(Path(path).name) or real(obj, path))
    recipe = write_recipe(tmp_path, trainer={"max_steps": 10, "val_every": 100, "ckpt_every": 4,
                                             "keep_checkpoints": 2, "run_name": "once"})
    ck = fit(load_experiment(recipe)) / "checkpoints"
    # steps 4 and 8 by the interval, 10 at the end; last.ckpt never serialized on its own
    assert saves == ["step=4.ckpt", "step=8.ckpt", "step=10.ckpt"], saves
    assert (ck / "last.ckpt").read_bytes() == (ck / "step=10.ckpt").read_bytes()
    assert not (ck / "last.ckpt").samefile(ck / "step=10.ckpt")
    assert sorted(p.name for p in ck.iterdir()) == ["last.ckpt", "step=10.ckpt", "step=4.ckpt", "step=8.ckpt"]
    first = torch.load(ck / "step=4.ckpt", map_location="cpu", weights_only=True)  # the first copied from
    [state] = [v for k, v in first["callbacks"].items() if k.startswith("ModelCheckpoint")]
    assert Path(state["last_model_path"]) == ck / "last.ckpt"
    saves.clear()
    fit(load_experiment(recipe, {"trainer.max_steps": 13}), ckpt_path="last")
    assert saves == ["step=12.ckpt", "step=13.ckpt"], saves
    assert sorted(p.name for p in ck.iterdir()) == ["last.ckpt", "step=10.ckpt", "step=12.ckpt", "step=13.ckpt",
                                                    "step=8.ckpt"]  # no last-v1.ckpt, no temporary file
    assert (ck / "last.ckpt").read_bytes() == (ck / "step=13.ckpt").read_bytes()
    (ck / "last.ckpt").write_bytes(b"damaged")
    assert load_checkpoint(ck / "step=13.ckpt")["global_step"] == 13

    def no_sendfile(*args):
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(files.os, "sendfile", no_sendfile)
    files.copy_atomic(ck / "step=13.ckpt", ck / "last.ckpt")
    assert load_checkpoint(ck / "last.ckpt")["global_step"] == 13
    # a source that ends early (changed under the copy): an error, and the old file in place, whole
    monkeypatch.setattr(files.os, "sendfile", lambda out, src, offset, count: min(count, 1000) if offset < 3000 else 0)
    with pytest.raises(OSError, match="3,000 of its"):
        files.copy_atomic(ck / "step=12.ckpt", ck / "last.ckpt")
    assert load_checkpoint(ck / "last.ckpt")["global_step"] == 13
    assert not [p for p in ck.iterdir() if p.name.endswith(".tmp")]


def test_resume_from_periodic_checkpoints_reproduces_the_losses(tmp_path, monkeypatch):
    """Checkpoints taken before a validation (mid-epoch) and at an epoch's end: resuming either gives the
    uninterrupted run's per-step losses bit for bit (dropout on, so the RNG state and the data position matter)."""
    monkeypatch.chdir(tmp_path)
    probe = load_experiment(write_recipe(tmp_path))
    dm, _ = prepare(probe)
    per_epoch = len(dm.train_dataloader())
    assert per_epoch >= 6, per_epoch
    val_every = per_epoch // 2  # a validation step in the middle of epoch 0
    steps = per_epoch + 3
    recipe = write_recipe(tmp_path, trainer={"max_steps": steps, "val_every": val_every, "ckpt_every": 1,
                                             "keep_checkpoints": 100, "run_name": "full"})
    full_dir = fit(load_experiment(recipe))
    full = train_rows(read_metrics(full_dir / "logs" / "metrics.csv"))
    assert sorted(full["train/loss"]) == list(range(steps))
    for k in (val_every, per_epoch):
        resumed_dir = fit(load_experiment(recipe, {"trainer.run_name": f"from{k}"}),
                          ckpt_path=str(full_dir / "checkpoints" / f"step={k}.ckpt"))
        resumed = train_rows(read_metrics(resumed_dir / "logs" / "metrics.csv"))
        assert sorted(resumed["train/loss"]) == list(range(k, steps)), k
        for col, by_step in resumed.items():
            assert by_step == {s: full[col][s] for s in range(k, steps)}, (k, col)
        a = load_checkpoint(full_dir / "checkpoints" / "last.ckpt")["state_dict"]
        b = load_checkpoint(resumed_dir / "checkpoints" / "last.ckpt")["state_dict"]
        assert all(torch.equal(a[n], b[n]) for n in a), k


def _sigterm_when_logged(proc: subprocess.Popen, metrics: Path, step: int, out: dict) -> None:
    """Watcher thread: SIGTERM `proc` once metrics.csv holds a train/loss row for `step`."""
    deadline = time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < deadline:
        if metrics.is_file():
            loss = read_metrics(metrics).get("train/loss", {})
            if max(loss, default=-1) >= step:
                proc.send_signal(signal.SIGTERM)
                out["signalled_after"] = max(loss)
                return
        time.sleep(0.02)


@pytest.mark.slow
def test_sigterm_mid_epoch_then_resume_reproduces_the_uninterrupted_losses(tmp_path, monkeypatch):
    """`attnlab fit` killed with SIGTERM in the middle of its second epoch saves the exact state and exits 143;
    `fit --ckpt_path last` then continues it, and every per-step value equals the uninterrupted run's."""

    monkeypatch.chdir(tmp_path)
    small = {"max_tokens": 512}  # small batches: many cheap steps, so the kill lands well inside an epoch
    dm, _ = prepare(load_experiment(write_recipe(tmp_path, data=small)))  # caches built before two processes race
    per_epoch = len(dm.train_dataloader())
    assert per_epoch >= 12, per_epoch
    steps, kill_after = 2 * per_epoch + 4, per_epoch + 1  # stop early in epoch 1, far from its end
    recipe = write_recipe(tmp_path, data=small, trainer={"max_steps": steps, "val_every": 7, "ckpt_every": 1000})
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "attnlab.cli", "fit", "-c", str(recipe), "--trainer.run_name", "cut"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    watch: dict = {}
    watcher = threading.Thread(target=_sigterm_when_logged,
                               args=(proc, tmp_path / "runs" / "cut" / "logs" / "metrics.csv", kill_after, watch))
    watcher.start()
    # Meanwhile the uninterrupted run, also a CLI process with the same environment: the runs compared bit for bit
    # are never one in this pytest process and one outside it (a suite's earlier tests can leave process-wide
    # state behind; a CI run once saw last-bit differences from step 10 between the two).
    full_cmd = [*cmd[:-1], "full"]
    try:
        ran = subprocess.run(full_cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        output, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
        watcher.join()
    assert ran.returncode == 0, (ran.stdout + ran.stderr)[-3000:]
    full_dir = tmp_path / "runs" / "full"
    assert "signalled_after" in watch, f"the run ended before it could be killed:\n{output[-3000:]}"
    assert proc.returncode == 128 + signal.SIGTERM, output[-3000:]
    cut_dir = tmp_path / "runs" / "cut"
    last = load_checkpoint(cut_dir / "checkpoints" / "last.ckpt")
    stopped = last["global_step"]
    assert watch["signalled_after"] < stopped < steps, (watch, stopped)  # saved on SIGTERM, not at an interval
    assert (cut_dir / "checkpoints" / f"step={stopped}.ckpt").is_file()
    assert stopped % per_epoch != 0, f"killed at an epoch boundary (step {stopped}); the test wants mid-epoch"
    # the exact-resume position is the datamodule's state: the epoch and the batches of it trained
    assert last["TranslationDataModule"] == {"epoch": stopped // per_epoch, "batches": stopped % per_epoch,
                                          "sort_by": "longer"}
    partial = read_metrics(cut_dir / "logs" / "metrics.csv")
    assert max(partial["train/loss"]) == stopped - 1

    resumed = subprocess.run([*cmd, "--ckpt_path", "last"], cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=300)
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
    assert (cut_dir / "logs" / "metrics.part0.csv").is_file()  # the first attempt's rows, kept
    full = read_metrics(full_dir / "logs" / "metrics.csv")
    cut = read_run(cut_dir)
    assert sorted(cut["train/loss"]) == list(range(steps))  # one history: the first attempt + the resumed one
    assert train_rows(cut) == train_rows(full)
    for col in ("val/loss", "val/bleu"):  # a validation cut short by the signal is run again on resume
        assert cut[col] == full[col], col
    a = load_checkpoint(full_dir / "checkpoints" / "last.ckpt")["state_dict"]
    b = load_checkpoint(cut_dir / "checkpoints" / "last.ckpt")["state_dict"]
    assert all(torch.equal(a[n], b[n]) for n in a)


class _SigtermInValidation(Callback):
    """Sends this process SIGTERM inside the first batch of the validation after `step` steps."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if trainer.global_step == self.step and batch_idx == 0:
            os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_during_validation_redoes_that_validation_on_resume(tmp_path):
    """SIGTERM in the middle of a validation: the state is saved and fit exits 143 without logging it; the resumed
    fit runs that validation again, at its step, and is cut there once more (its checkpoint keeps the RNG state
    it resumed with, not one from before a batch trained), then crashes as it starts again; resumed once more,
    every value logged equals the uninterrupted run's."""
    recipe = write_recipe(tmp_path, data={"max_tokens": 256}, trainer={"max_steps": 12, "val_every": 4,
                                                                        "ckpt_every": 1000})
    dm, _ = prepare(load_experiment(recipe))
    assert len(dm.val_dataloader()) >= 2, "the signal must land before the validation's last batch"
    full_dir = fit(load_experiment(recipe, {"trainer.run_name": "full"}))
    with pytest.raises(SystemExit) as e:
        fit(load_experiment(recipe, {"trainer.run_name": "cut"}), callbacks=[_SigtermInValidation(8)])
    assert e.value.code == 128 + signal.SIGTERM
    cut_dir = tmp_path / "runs" / "cut"
    assert load_checkpoint(cut_dir / "checkpoints" / "last.ckpt")["global_step"] == 8
    assert sorted(read_metrics(cut_dir / "logs" / "metrics.csv")["val/loss"]) == [3], "the cut validation is not logged"
    assert fit_done(cut_dir) is None  # a fit cut short has not ended
    with pytest.raises(SystemExit) as e:  # cut again, in the validation it redoes: nothing trained in between
        fit(load_experiment(recipe, {"trainer.run_name": "cut"}), ckpt_path="last", callbacks=[_SigtermInValidation(8)])
    assert e.value.code == 128 + signal.SIGTERM
    with pytest.raises(RuntimeError, match="crash"):  # and a crash as it starts, which saves a checkpoint too
        fit(load_experiment(recipe, {"trainer.run_name": "cut"}), ckpt_path="last", callbacks=[_CrashAtStart()])

    fit(load_experiment(recipe, {"trainer.run_name": "cut"}), ckpt_path="last")
    cut, full = read_run(cut_dir), read_run(full_dir)
    assert sorted(cut["val/loss"]) == [3, 7, 11]
    for col in ("val/loss", "val/ppl", "val/bleu", "val/chrf"):
        assert cut[col] == full[col], col
    assert train_rows(cut) == train_rows(full)


# --------------------------------------------------------------------------------------------- checkpoint files
def test_a_failed_save_leaves_the_previous_checkpoint_intact(tmp_path, monkeypatch):
    io = AtomicCheckpointIO()
    path = tmp_path / "checkpoints" / "last.ckpt"
    io.save_checkpoint({"state_dict": {"w": torch.ones(3)}, "global_step": 1}, path)
    before = path.read_bytes()
    real_save = torch.save

    def dying_save(obj, f, *a, **k):  # writes part of the file, then the process "dies"
        f.write(b"PK\x03\x04 half a zip")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        io.save_checkpoint({"state_dict": {"w": torch.zeros(3)}, "global_step": 2}, path)
    monkeypatch.setattr(torch, "save", real_save)
    assert path.read_bytes() == before
    assert [p.name for p in path.parent.iterdir()] == ["last.ckpt"]  # no temporary file left behind
    assert torch.load(path, weights_only=True)["global_step"] == 1


def test_every_trainer_saves_through_the_atomic_writer(tiny_run, tmp_path):
    recipe, _ = tiny_run
    for over in ({}, {"trainer.devices": 2, "trainer.strategy": "ddp", "trainer.accelerator": "cpu"}):
        trainer = make_trainer(load_experiment(recipe, over), tmp_path)  # DDP processes start only at fit
        assert isinstance(trainer.strategy.checkpoint_io, AtomicCheckpointIO), over


def test_corrupt_truncated_and_foreign_checkpoints_are_clear_errors(tiny_run, tmp_path):
    recipe, run_dir = tiny_run
    good = run_dir / "checkpoints" / "last.ckpt"
    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    garbage = tmp_path / "garbage.ckpt"
    garbage.write_bytes(os.urandom(4096))
    pickled = tmp_path / "pickled.ckpt"
    torch.save({"state_dict": {}, "hyper_parameters": {}, "evil": Path("/etc/passwd")}, pickled)
    plain = tmp_path / "plain.ckpt"
    torch.save({"w": torch.ones(2)}, plain)
    for path in (truncated, garbage, pickled):
        with pytest.raises(ValueError, match="not a readable checkpoint") as e:
            load_checkpoint(path)
        assert str(path) in str(e.value)
    with pytest.raises(ValueError, match="not an attnlab checkpoint") as e:
        load_checkpoint(plain)
    assert str(plain) in str(e.value)
    with pytest.raises(FileNotFoundError, match="missing.ckpt"):
        load_checkpoint(tmp_path / "missing.ckpt")


def test_a_checkpoint_from_another_model_config_is_refused_naming_the_fields(tiny_run):
    recipe, run_dir = tiny_run
    last = run_dir / "checkpoints" / "last.ckpt"
    _, exp = prepare(load_experiment(recipe, {"model.d_model": 64, "model.norm": "rmsnorm"}))
    with pytest.raises(ConfigError) as e:
        check_compatible(load_checkpoint(last), exp.model, last)
    msg = str(e.value)
    assert str(last) in msg and "model.d_model: checkpoint 32 vs config 64" in msg and "model.norm" in msg
    with pytest.raises(ConfigError, match="model.d_model"):  # fit refuses before training a step
        fit(load_experiment(recipe, {"model.d_model": 64, "trainer.run_name": "other"}), ckpt_path=str(last))
    with pytest.raises(FileNotFoundError, match="nothing to resume"):
        fit(load_experiment(recipe, {"trainer.run_name": "never_ran"}), ckpt_path="last")


def test_a_resume_whose_data_builds_another_tokenizer_is_refused_keeping_the_runs(tiny_run):
    """The same vocabulary size is not the same tokenizer: BPE learnt from fewer lines gives its ids to other
    pieces. The resume is refused before the run directory's tokenizer/ is written over."""
    recipe, run_dir = tiny_run
    before = {p.name: p.read_bytes() for p in (run_dir / "tokenizer").iterdir()}
    with pytest.raises(ConfigError, match=r"last\.ckpt was trained with another tokenizer"):
        fit(load_experiment(recipe, {"data.tokenizer_max_lines": 150, "trainer.run_name": run_dir.name}),
            ckpt_path="last")
    assert {p.name: p.read_bytes() for p in (run_dir / "tokenizer").iterdir()} == before


def test_a_fresh_fit_moves_an_earlier_runs_files_aside(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "step=4.ckpt").write_bytes(b"x")
    (run / "logs").mkdir()
    (run / "config.yaml").write_text("a: 1")
    assert archive_previous(run) == run / "previous" / "0"
    assert (run / "previous" / "0" / "checkpoints" / "step=4.ckpt").is_file()
    assert not (run / "checkpoints").exists() and (run / "config.yaml").exists()
    (run / "checkpoints").mkdir()
    assert archive_previous(run) == run / "previous" / "1"
    assert archive_previous(run) is None


class _CrashAtStart(Callback):
    def on_train_start(self, trainer, pl_module) -> None:
        raise RuntimeError("crash")


def test_a_fit_that_starts_removes_an_earlier_fits_done_mark(tmp_path):
    """fit_done.json says the fit in a run directory ran to its end: a fit that starts there (fresh or resuming
    to train further) removes it first, so a crash leaves none behind for the ablation runner to trust."""
    exp = load_experiment(write_recipe(tmp_path, trainer={"max_steps": 2}))
    run_dir = exp.run_dir()  # named by the recipe as given
    run_dir.mkdir(parents=True)
    mark_fit_done(run_dir, 2)
    with pytest.raises(RuntimeError, match="crash"):
        fit(exp, callbacks=[_CrashAtStart()])
    assert fit_done(run_dir) is None
