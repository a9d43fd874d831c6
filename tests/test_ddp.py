"""`attnlab demo` with 2 DDP processes on CPU (gloo): each rank trains on its own shard of every step's batches,
rank 0 alone decodes and scores after the fit, and the checkpoint it saves evaluates (`attnlab validate`, one
process) to the validation loss the 2 ranks logged. And trainer.strategy=fsdp on 2 gloo ranks: every Block is its
own FSDP unit, the parameters sharded, training runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from attnlab.checkpoints import load_checkpoint
from attnlab.experiment import load_experiment
from attnlab.models.accounting import count_parameters
from attnlab.train import fit, prepare
from test_train import read_metrics, write_recipe

DRIVER = '''
"""attnlab demo, its fit with a callback that records, per rank, the dataset ids of every training batch."""
import json
import os
import sys
from pathlib import Path

import torch

from lightning.pytorch.callbacks import Callback

import attnlab.cli
from attnlab.train import fit


class Record(Callback):
    def __init__(self):
        self.ids = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.ids.append(batch["ids"].tolist())

    def on_train_end(self, trainer, pl_module):
        out = Path(sys.argv[2]) / f"rank{trainer.global_rank}.json"
        out.write_text(json.dumps({"world": trainer.world_size, "ids": self.ids}))


# `attnlab demo` (fit, average, decode, score) with the callback added to its fit
attnlab.cli.fit = lambda exp, **kw: fit(exp, callbacks=[Record()], **kw)
assert attnlab.cli.main(["demo", "-c", sys.argv[1]]) == 0
Path(sys.argv[2], f"after{os.environ.get('LOCAL_RANK', '0')}.json").write_text(
    json.dumps(torch.distributed.is_initialized()))
'''


@pytest.mark.slow
def test_two_process_ddp_fit_shards_batches_and_saves_a_checkpoint_that_evaluates_the_same(tmp_path, monkeypatch):
    from attnlab.cli import main

    monkeypatch.chdir(tmp_path)
    steps = 4
    recipe = write_recipe(tmp_path, n_pairs=900, trainer={
        "devices": 2, "strategy": "ddp", "accelerator": "cpu", "max_steps": steps, "val_every": steps,
        "ckpt_every": steps, "run_name": "ddp"}, decode={"val_sentences": 4})
    dm, _ = prepare(load_experiment(recipe))  # caches built once, before two processes start
    order = dm.sampler("train", True).batches(0)  # the single-process order of epoch 0
    n_val = len(dm.sampler("valid", False).batches(0))
    assert len(order) >= 2 * steps + 2, len(order)
    # an odd count would make the last rank repeat a batch (every rank must run as many), counted twice
    assert n_val % 2 == 0, f"{n_val} validation batches: change the corpus size so that 2 ranks split them evenly"

    (tmp_path / "driver.py").write_text(DRIVER, encoding="utf-8")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, str(tmp_path / "driver.py"), str(recipe), str(tmp_path)], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    # after the fit, rank 0 alone averages, decodes the test split and writes demo_results.json: rank 1 stops
    assert r.stdout.count("BLEU signature:") == 1, r.stdout[-3000:]
    assert r.stdout.count("run directory:") == 1, r.stdout[-3000:]

    seen = {k: json.loads((tmp_path / f"rank{k}.json").read_text()) for k in (0, 1)}
    # the fit ended the process group it started, on both ranks: gloo's threads do not outlive the interpreter
    assert [json.loads((tmp_path / f"after{k}.json").read_text()) for k in (0, 1)] == [False, False]
    assert seen[0]["world"] == seen[1]["world"] == 2
    for k in (0, 1):  # rank k trains batches k, k + 2, k + 4, ... of the epoch's order
        assert seen[k]["ids"] == [order[i].tolist() for i in range(k, 2 * steps, 2)], k
    for a, b in zip(seen[0]["ids"], seen[1]["ids"], strict=True):
        assert not set(a) & set(b)  # different sentences on the two ranks at every step

    run_dir = tmp_path / "runs" / "ddp"
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    saved = load_checkpoint(ckpt)
    assert saved["global_step"] == steps
    assert not [k for k in saved["state_dict"] if k.startswith(("module.", "_forward_module."))]
    logged = read_metrics(run_dir / "logs" / "metrics.csv")
    assert sorted(logged["train/loss"]) == list(range(steps))
    ddp_val = logged["val/loss"][steps - 1][0]  # both ranks' halves of the validation split, summed

    assert main(["validate", "-c", str(recipe), "--ckpt", str(ckpt)]) == 0  # one process
    single = json.loads((run_dir / "valid_results.json").read_text(encoding="utf-8"))
    assert single["val/loss"] == pytest.approx(ddp_val, rel=1e-5)
    assert single["sentences"] == len(dm.split_texts("valid")[0]) and single["bleu_signature"].startswith("nrefs:1|")


class RankNote(Callback):
    """Writes rank<k>.json into the run directory at the end of training: the world size and the GPUs visible."""

    def __init__(self, run_dir) -> None:
        self.run_dir = run_dir

    def on_train_end(self, trainer, pl_module) -> None:
        (self.run_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(
            {"world": trainer.world_size, "cuda": os.environ.get("CUDA_VISIBLE_DEVICES")}))


def rank_fit(exp, ckpt_path=None):
    """attnlab.train.fit, noting each rank's world size and visible GPUs."""
    return fit(exp, ckpt_path=ckpt_path, callbacks=[RankNote(exp.run_dir())])


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                    reason="torch.distributed with gloo is not available")
def test_a_two_device_trial_runs_ddp_under_the_local_runner(tmp_path, monkeypatch):
    """An ablation trial with resources.devices 2, its worker given GPUs 0,1 (none exists here: the trial runs on
    the CPU): the trial runs as its own process, and Lightning's DDP starts its second rank from that process's
    command (not the worker's, which would claim points of its own). Both ranks see the worker's slice."""
    from attnlab.ablate.runner import Options, run_study
    from attnlab.ablate.spec import load_spec
    from attnlab.ablate.study import connect

    monkeypatch.chdir(tmp_path)
    tests = os.path.dirname(__file__)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    recipe = write_recipe(tmp_path, n_pairs=900, trainer={"strategy": "ddp", "accelerator": "cpu", "val_every": 4,
                                                          "ckpt_every": 4}, decode={"val_sentences": 0})
    prepare(load_experiment(recipe))  # caches built once, before the processes start
    study = tmp_path / "study.yaml"
    study.write_text(f"base: {recipe}\nmetric: {{name: val/loss, direction: min}}\nbudget: {{steps: 4}}\n"
                     "resources: {devices: 2}\naxes:\n  model.norm: [layernorm]\n", encoding="utf-8")
    spec = load_spec(study)
    counts = run_study(spec, tmp_path / "s", workers=1, opts=Options(fit="test_ddp:rank_fit", heartbeat_s=2),
                       gpus=["0", "1"])
    assert counts == {"done": 1}, counts
    (trial,) = connect(spec, tmp_path / "s").study.get_trials()
    assert trial.user_attrs["cuda_visible_devices"] == "0,1"
    run_dir = tmp_path / "s" / "runs" / trial.user_attrs["run_dir"].rsplit("/", 1)[-1]
    ranks = {k: json.loads((run_dir / f"rank{k}.json").read_text()) for k in (0, 1)}
    assert ranks[0] == ranks[1] == {"world": 2, "cuda": "0,1"}
    assert sorted(read_metrics(run_dir / "logs" / "metrics.csv")["train/loss"]) == [0, 1, 2, 3]


FSDP_DRIVER = '''
"""Train with the FSDP strategy make_trainer builds, on 2 CPU processes, and record how the model was wrapped.
Two shims, both for running on a CPU: Lightning refuses its FSDPStrategy class itself without CUDA (a check on the
exact type, so a subclass passes), and FSDP will not infer a CPU device (it is given one). Checkpoints are left
out: gathering a full state dict of a CPU FSDP model crashes inside torch 2.13, which no GPU run goes through."""
import json
import sys
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import FSDPStrategy
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import fully_sharded_data_parallel

import attnlab.train
from attnlab.experiment import load_experiment
from attnlab.models.block import Block


class CPUFSDP(FSDPStrategy):
    pass


attnlab.train.FSDPStrategy = CPUFSDP
_device_handle = fully_sharded_data_parallel._init_device_handle
fully_sharded_data_parallel._init_device_handle = (
    lambda state, module, ignored, device: _device_handle(state, module, ignored, device or torch.device("cpu")))


class Record(Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(trainer.callback_metrics["train/loss"]))

    def on_train_end(self, trainer, pl_module):
        root = trainer.strategy.model
        out = {"world": trainer.world_size, "losses": self.losses,
               "units": sorted(n for n, m in root.named_modules() if isinstance(m, FSDP)),
               "blocks": sorted(n for n, m in root.named_modules() if isinstance(m, Block)),
               "local": sum(p.numel() for p in pl_module.model.parameters())}
        with FSDP.summon_full_params(root):
            out["full"] = sum(p.numel() for p in pl_module.model.parameters())
        (Path(sys.argv[2]) / f"rank{trainer.global_rank}.json").write_text(json.dumps(out))


dm, exp = attnlab.train.prepare(load_experiment(sys.argv[1]))
trainer = attnlab.train.make_trainer(exp, exp.run_dir(), extra_callbacks=[Record()], logger=False,
                                     enable_progress_bar=False)
trainer.callbacks = [c for c in trainer.callbacks if not isinstance(c, ModelCheckpoint)]
trainer.fit(attnlab.train.make_module(exp, dm), datamodule=dm)
'''


@pytest.mark.slow
def test_fsdp_wraps_each_block_on_two_gloo_ranks(tmp_path):
    steps = 4
    recipe = write_recipe(tmp_path, n_pairs=900, model={"n_enc_layers": 2, "n_dec_layers": 2},
                          trainer={"devices": 2, "strategy": "fsdp", "accelerator": "cpu", "max_steps": steps,
                                   "val_every": 1000, "ckpt_every": 1000, "run_name": "fsdp"})
    exp = load_experiment(recipe)
    prepare(exp)  # caches built once, before two processes start
    (tmp_path / "driver.py").write_text(FSDP_DRIVER, encoding="utf-8")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, str(tmp_path / "driver.py"), str(recipe), str(tmp_path)], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    seen = [json.loads((tmp_path / f"rank{k}.json").read_text()) for k in (0, 1)]
    wrapped = "_fsdp_wrapped_module."
    blocks = [f"{wrapped}model.{stack}.layers.{i}" for stack in ("decoder", "encoder") for i in range(2)]
    total = count_parameters(prepare(exp)[1].model)["total"]
    for rank in seen:
        assert rank["world"] == 2
        assert rank["units"] == ["", *blocks]  # the root (embeddings, head, final norms) and one unit per Block
        assert rank["blocks"] == [f"{b}.{wrapped[:-1]}" for b in blocks]  # each Block inside its own unit
        assert rank["full"] == total and rank["local"] == total // 2  # FULL_SHARD: half the parameters a rank
        assert len(rank["losses"]) == steps and rank["losses"][-1] < rank["losses"][0]
    assert seen[0]["losses"] != seen[1]["losses"]  # each rank trains on its own batches
