"""Checkpoint files (attnlab.checkpoints): averaging, finding a run's last and latest checkpoints, and loading the
layout written before attnlab_format 2 (tests/fixtures/v1_*, made at e1b08b1 by make_v1_checkpoints.py)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from attnlab.checkpoints import (
    FORMAT,
    average_checkpoints,
    checkpoint_step,
    last_checkpoints,
    latest_checkpoint,
    load_checkpoint,
    resume_candidates,
    save_atomic,
    v1_norm_key,
)
from attnlab.config import ConfigError
from attnlab.data.tokenizer import Tokenizer
from attnlab.evaluate import load_module
from attnlab.experiment import from_raw
from attnlab.rundir import run_metrics
from attnlab.train import fit
from conftest import make_pairs

FIXTURES = Path(__file__).parent / "fixtures"
V1_MODELS = sorted(p.name.removesuffix(".expected.pt") for p in FIXTURES.glob("v1_*.expected.pt"))


# ---------------------------------------------------------------------------------------------- the v1 layout
def test_the_fixtures_are_there():
    assert V1_MODELS == ["v1_lm_parallel_post", "v1_lm_parallel_sandwich", "v1_seq2seq_parallel_pre",
                         "v1_seq2seq_post", "v1_seq2seq_sandwich"]


@pytest.mark.parametrize("name", V1_MODELS)
def test_a_v1_checkpoint_loads_and_computes_what_it_computed_then(name):
    raw = torch.load(FIXTURES / f"{name}.ckpt", weights_only=True)
    assert "attnlab_format" not in raw and any(".norms." in k for k in raw["state_dict"])  # really the old layout
    module = load_module(FIXTURES / f"{name}.ckpt")  # strict: every weight finds its place, none is left over
    expected = torch.load(FIXTURES / f"{name}.expected.pt", weights_only=True)
    ids = expected["input"]
    with torch.no_grad():
        out = module.model(ids, ids[:, :5]) if module.model_cfg.arch == "encoder_decoder" else module.model(ids[:, :5])
    # the same function: equal up to float rounding (the fixture was computed with other thread counts; a weight in
    # the wrong place changes outputs by orders of magnitude more)
    torch.testing.assert_close(out, expected["output"], rtol=1e-5, atol=1e-5)
    ckpt = load_checkpoint(FIXTURES / f"{name}.ckpt")
    assert ckpt["attnlab_format"] == FORMAT and not any(".norms." in k or "out_norms" in k for k in ckpt["state_dict"])


@pytest.mark.parametrize(("position", "block", "old", "new"), [
    ("post", "serial", "decoder.layers.3.norms.cross_attn.weight", "decoder.layers.3.cross_attn_post_norm.weight"),
    ("post", "parallel", "decoder.layers.0.norms.self_attn.bias", "decoder.layers.0.post_norm.bias"),
    ("pre", "serial", "encoder.layers.1.norms.ffn.weight", "encoder.layers.1.ffn_norm.weight"),
    ("sandwich", "parallel", "decoder.layers.0.out_norms.ffn.weight", "decoder.layers.0.ffn_out_norm.weight"),
    ("sandwich", "serial", "decoder.norm.weight", "decoder.norm.weight"),
    ("post", "serial", "decoder.layers.0.self_attn.qkv_proj.weight", "decoder.layers.0.self_attn.qkv_proj.weight"),
])
def test_v1_norm_keys_map_by_norm_position_and_block(position, block, old, new):
    assert v1_norm_key(f"model.{old}", position, block) == f"model.{new}"


def test_a_checkpoint_from_a_newer_attnlab_is_refused(tmp_path):
    ckpt = torch.load(FIXTURES / "v1_seq2seq_post.ckpt", weights_only=True)
    ckpt["attnlab_format"] = FORMAT + 1
    torch.save(ckpt, tmp_path / "new.ckpt")
    with pytest.raises(ValueError, match=r"new\.ckpt: checkpoint layout 3 is newer"):
        load_checkpoint(tmp_path / "new.ckpt")


def test_a_v1_mid_epoch_checkpoint_resumes_exactly(tmp_path, monkeypatch):
    """A real fit's step checkpoint in the v1 layout (its data position held by the old ResumePoint callback):
    resumed by today's fit, the later losses equal those of the uninterrupted v1 run (up to float rounding: the
    fixture was made with two threads; another batch, or a lost RNG state, moves a loss by 1e-2 or more)."""
    monkeypatch.chdir(tmp_path)
    info = yaml.safe_load((FIXTURES / "v1_fit_mid_epoch.yaml").read_text(encoding="utf-8"))
    corpus = tmp_path / "corpus.tsv"
    corpus.write_text("".join(f"{s}\t{t}\n" for s, t in make_pairs(info["n_pairs"])), encoding="utf-8")
    raw = info["recipe"]
    raw["data"].update(corpus=str(corpus), data_dir=str(tmp_path / "cache"))
    raw["trainer"].update(runs_dir=str(tmp_path / "runs"), run_name="resumed")
    ckpt = tmp_path / "v1.ckpt"
    shutil.copy(FIXTURES / "v1_fit_mid_epoch.ckpt", ckpt)
    assert torch.load(ckpt, weights_only=True)["callbacks"]["ResumePoint"] == {"epoch": 0, "batches": 4}
    run_dir = fit(from_raw(raw), ckpt_path=str(ckpt))
    losses = dict(run_metrics(run_dir)["train/loss"])
    want = {int(k): v for k, v in info["losses_after"].items()}
    assert sorted(losses) == sorted(want)
    assert [losses[k] for k in sorted(want)] == pytest.approx([want[k] for k in sorted(want)], rel=1e-5, abs=0)


# ---------------------------------------------------------------------------------------------- finding
def test_latest_checkpoint_is_the_newest_of_last_and_hpc(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    (tmp_path / "checkpoints").mkdir()
    last = tmp_path / "checkpoints" / "last.ckpt"
    torch.save({"global_step": 7}, last)
    assert latest_checkpoint(tmp_path) == last
    hpc = tmp_path / "hpc_ckpt_1.ckpt"
    torch.save({"global_step": 9}, hpc)
    os.utime(last, ns=(1, 1))
    assert latest_checkpoint(tmp_path) == hpc
    assert checkpoint_step(hpc) == 9
    (tmp_path / "broken.ckpt").write_bytes(b"not a zip")
    assert checkpoint_step(tmp_path / "broken.ckpt").startswith("unknown (")


def test_latest_checkpoint_is_the_highest_step_whatever_the_files_times(tmp_path):
    """A run directory copied without its modification times (cp -r) resumes from its highest step, not from the
    file the copy happened to write last; equal steps go by time."""
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    for i, (name, step) in enumerate([("step=40.ckpt", 40), ("last.ckpt", 40), ("step=30.ckpt", 30),
                                      ("step=5.ckpt", 5)]):
        torch.save({"global_step": step}, folder / name)
        os.utime(folder / name, ns=(10**9 * (i + 1),) * 2)  # the lower steps look newer
    torch.save({"global_step": 35}, tmp_path / "hpc_ckpt_2.ckpt")
    os.utime(tmp_path / "hpc_ckpt_2.ckpt", ns=(10**10,) * 2)
    assert [p.name for p in resume_candidates(tmp_path)] == [
        "last.ckpt", "step=40.ckpt", "hpc_ckpt_2.ckpt", "step=30.ckpt", "step=5.ckpt"]
    assert latest_checkpoint(tmp_path) == folder / "last.ckpt"
    (folder / "last.ckpt").write_bytes(b"cut sh")  # unreadable: tried first, skipped with a warning
    assert resume_candidates(tmp_path)[0].name == "last.ckpt"
    assert latest_checkpoint(tmp_path) == folder / "step=40.ckpt"
    torch.save({"global_step": 40}, folder / "step=40-v1.ckpt")  # a second branch at the same step: the newer
    assert latest_checkpoint(tmp_path) == folder / "step=40-v1.ckpt"


SAVER = """
import sys, torch
from pathlib import Path
from attnlab.checkpoints import save_atomic
folder, atomic = Path(sys.argv[1]), sys.argv[2] == "atomic"
save = save_atomic if atomic else torch.save
small = {"global_step": 10, "state_dict": {"w": torch.zeros(4)}}
save(small, folder / "step=10.ckpt")
save(small, folder / "last.ckpt")
big = {"global_step": 20, "state_dict": {"w": torch.randn(48, 1 << 20)}}  # 192 MB: long enough to kill mid-write
print("saved", flush=True)
while True:
    save(big, folder / "last.ckpt")
"""


def kill_mid_save(folder: Path, atomic: bool) -> None:
    """Run SAVER, SIGKILL it while it writes the large checkpoint (its temporary file, or last.ckpt itself, is
    partly written)."""
    folder.mkdir(parents=True)
    proc = subprocess.Popen([sys.executable, "-c", SAVER, str(folder), "atomic" if atomic else "plain"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "saved\n"
        deadline = time.time() + 120
        while time.time() < deadline:
            writing = list(folder.glob(".last.ckpt@*.tmp")) if atomic else [folder / "last.ckpt"]
            sizes = [p.stat().st_size for p in writing if p.exists()]
            if sizes and 1 << 20 < max(sizes) < 150 << 20:
                break
        else:
            raise AssertionError("never saw the large checkpoint being written")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


@pytest.mark.slow
def test_a_checkpoint_write_killed_with_sigkill_leaves_one_that_loads(tmp_path):
    """A real kill mid-save: with save_atomic, last.ckpt is the previous checkpoint, whole, and the next save beside
    it removes the dead writer's temporary file; a plain torch.save leaves last.ckpt cut short, which the next
    attempt skips for the newest checkpoint that loads."""
    run = tmp_path / "atomic"
    kill_mid_save(run / "checkpoints", atomic=True)
    last = run / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] in (10, 20)  # the old one, or the new one whole
    assert latest_checkpoint(run) == last
    (orphan,) = (run / "checkpoints").glob(".last.ckpt@*.tmp")
    save_atomic({"global_step": 30}, run / "checkpoints" / "step=30.ckpt")
    assert not orphan.exists(), "the dead writer's temporary file is removed by the next save"

    run = tmp_path / "plain"
    kill_mid_save(run / "checkpoints", atomic=False)
    with pytest.raises(ValueError, match="not a readable checkpoint"):
        load_checkpoint(run / "checkpoints" / "last.ckpt")
    assert latest_checkpoint(run) == run / "checkpoints" / "step=10.ckpt"


# ---------------------------------------------------------------------------------------------
# checkpoint averaging
# ---------------------------------------------------------------------------------------------
def write_ckpts(tmp_path: Path, n: int = 3, lightning: bool = True) -> tuple[list[str], list[dict]]:
    paths, states = [], []
    for i in range(n):
        w = torch.randn(4, 3, generator=torch.Generator().manual_seed(i))
        emb = torch.randn(5, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(10 + i))
        sd = {"w": w, "half": w.to(torch.bfloat16), "emb": emb, "head": emb, "count": torch.tensor([7, 8])}
        obj = {"state_dict": sd, "epoch": i, "global_step": 100 * (i + 1)} if lightning else sd
        p = tmp_path / f"step={100 * (i + 1)}.ckpt"
        torch.save(obj, p)
        paths.append(str(p))
        states.append(sd)
    return paths, states


@pytest.mark.parametrize("lightning", [True, False])
def test_average_of_known_tensors_is_exact(tmp_path, lightning):
    paths, states = write_ckpts(tmp_path, lightning=lightning)
    out = tmp_path / "avg" / "averaged.ckpt"
    result = average_checkpoints(paths, str(out))
    loaded = torch.load(out, weights_only=True)
    sd = loaded["state_dict"] if lightning else loaded
    want = sum(s["w"].double() for s in states) / 3
    assert torch.equal(sd["w"], want.float()) and sd["w"].dtype == torch.float32
    assert torch.equal(sd["half"], (sum(s["half"].double() for s in states) / 3).to(torch.bfloat16))
    assert torch.allclose(sd["emb"], sum(s["emb"] for s in states) / 3, rtol=0, atol=1e-15)
    assert torch.equal(sd["count"], torch.tensor([7, 8]))
    assert sd["emb"].data_ptr() == sd["head"].data_ptr()  # tied weights stay tied
    if lightning:
        assert loaded["epoch"] == 2 and loaded["global_step"] == 300  # metadata of the last checkpoint
        assert torch.equal(result["state_dict"]["w"], sd["w"])


def test_average_rejects_mismatched_keys_naming_key_and_file(tmp_path):
    paths, _ = write_ckpts(tmp_path)
    bad = torch.load(paths[1], weights_only=True)
    bad["state_dict"]["extra.bias"] = bad["state_dict"].pop("w")
    torch.save(bad, paths[1])
    with pytest.raises(ValueError, match=r"step=200\.ckpt.*missing \['w'\], extra \['extra\.bias'\]"):
        average_checkpoints(paths)


def test_average_rejects_differing_integer_tensors_and_shapes(tmp_path):
    paths, _ = write_ckpts(tmp_path)
    bad = torch.load(paths[0], weights_only=True)
    bad["state_dict"]["count"] = torch.tensor([7, 9])
    torch.save(bad, paths[0])
    with pytest.raises(ValueError, match=r"count: non-floating entry differs between .*step=100\.ckpt"):
        average_checkpoints(paths)
    bad["state_dict"]["count"] = torch.tensor([7, 8])
    bad["state_dict"]["w"] = torch.zeros(3, 4)
    torch.save(bad, paths[0])
    with pytest.raises(ValueError, match=r"w: .*step=100\.ckpt has \(3, 4\)"):
        average_checkpoints(paths)


def test_average_refuses_checkpoints_of_other_models_or_tokenizers(tmp_path, tokenizer):
    """Same keys and shapes are not the same model: a ReLU run averaged into a GELU one, or two runs whose BPE
    gave the same ids to other pieces, are refused naming the field; training-only fields (dropout) may differ."""
    paths, _ = write_ckpts(tmp_path)
    other = Tokenizer.train([t for pair in make_pairs(100) for t in pair], None, 320)  # 320 ids, other pieces
    tokenizers = {"tok-a": tokenizer.to_files(), "tok-b": other.to_files()}

    def stamp(path, tokenizer="tok-a", **model):
        ckpt = torch.load(path, weights_only=True)
        ckpt.update(attnlab_format=FORMAT, tokenizer=tokenizers[tokenizer],
                    hyper_parameters={"model": {"ffn": "relu", "dropout": 0.1, **model}})
        torch.save(ckpt, path)

    for p in paths:
        stamp(p)
    stamp(paths[0], dropout=0.3)
    assert average_checkpoints(paths)["hyper_parameters"]["model"]["dropout"] == 0.1  # the last file's
    stamp(paths[1], ffn="gelu")
    with pytest.raises(ConfigError, match=r"step=200\.ckpt with .*step=300\.ckpt: a different model config: "
                                          r"model\.ffn: 'gelu' vs 'relu'$"):
        average_checkpoints(paths)
    stamp(paths[1], tokenizer="tok-b")
    with pytest.raises(ConfigError, match=r"step=200\.ckpt with .*step=300\.ckpt: they carry different tokenizers"):
        average_checkpoints(paths)


def test_average_writes_atomically(tmp_path, monkeypatch):
    paths, _ = write_ckpts(tmp_path)
    out = tmp_path / "averaged.ckpt"
    out.write_bytes(b"previous")

    def failing_save(obj, f):
        f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(OSError, match="disk full"):
        average_checkpoints(paths, out)
    assert out.read_bytes() == b"previous"  # the target is never a partial file
    monkeypatch.undo()
    average_checkpoints(paths, out)
    assert torch.load(out, weights_only=True)["global_step"] == 300
    assert sorted(p.name for p in tmp_path.iterdir()) == ["averaged.ckpt"] + sorted(Path(p).name for p in paths)


def test_last_checkpoints_by_step_then_mtime(tmp_path):
    for name in ["step=1000.ckpt", "step=50.ckpt", "epoch=0-step=500.ckpt", "last.ckpt", "averaged_last5.ckpt"]:
        (tmp_path / name).write_bytes(b"")
    assert [p.name for p in last_checkpoints(tmp_path, 2)] == ["epoch=0-step=500.ckpt", "step=1000.ckpt"]
    assert len(last_checkpoints(tmp_path, 10)) == 3
    plain = tmp_path / "plain"
    plain.mkdir()
    for i, name in enumerate(["c.ckpt", "a.ckpt", "b.ckpt"]):
        (plain / name).write_bytes(b"")
        os.utime(plain / name, (1000 + i, 1000 + i))
    assert [p.name for p in last_checkpoints(plain, 2)] == ["a.ckpt", "b.ckpt"]
    with pytest.raises(FileNotFoundError):
        last_checkpoints(tmp_path / "missing", 5)
