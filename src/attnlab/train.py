"""fit / validate / test: an Experiment -> datamodule, LightningModule, Trainer and run directory."""

from __future__ import annotations

import logging
import os
import subprocess
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, TQDMProgressBar
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.plugins.io import TorchCheckpointIO
from torch.utils.data import DataLoader

from .config import ConfigError, ModelConfig
from .experiment import Experiment
from .lit import LMModule, Seq2SeqModule

log = logging.getLogger("attnlab")


class AtomicCheckpointIO(TorchCheckpointIO):
    """Write to a temporary file in the same folder, fsync, then rename: a kill while saving leaves the
    previous checkpoint intact, never a truncated one."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


class ResumePoint(Callback):
    """Exact mid-epoch resume: counts the batches each epoch has trained on, keeps the count in the
    checkpoint, and on resume has the train batch sampler skip that many batches of the same epoch's order
    (the order is a function of the seed and the epoch, so the skipped batches are exactly those seen).

    Lightning prefetches a batch ahead, so a count kept by the loader itself would be off by one."""

    def __init__(self) -> None:
        self.epoch, self.batches = 0, 0
        self.resume: tuple[int, int] | None = None

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.epoch != trainer.current_epoch:
            self.epoch, self.batches = trainer.current_epoch, 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.batches += 1

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batches": self.batches}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.batches = state["epoch"], state["batches"]
        self.resume = (self.epoch, self.batches)

    def skip_for(self, epoch: int) -> int:
        """Batches to skip at the start of `epoch` (once, right after a resume)."""
        if self.resume is None:
            return 0
        skip = self.resume[1] if self.resume[0] == epoch else 0
        self.resume = None
        return skip


class SkippingBatchSampler:
    """Wraps a batch sampler (with set_epoch) so a resumed epoch starts where the checkpoint left it."""

    def __init__(self, inner: Any, point: ResumePoint) -> None:
        self.inner, self.point, self.epoch = inner, point, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if hasattr(self.inner, "set_epoch"):
            self.inner.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self):
        skip = self.point.skip_for(self.epoch)
        for i, batch in enumerate(self.inner):
            if i >= skip:
                yield batch


def resumable(loader: DataLoader, point: ResumePoint) -> DataLoader:
    """The same loader with its batch sampler wrapped in a SkippingBatchSampler."""
    return DataLoader(
        loader.dataset, batch_sampler=SkippingBatchSampler(loader.batch_sampler, point),
        collate_fn=loader.collate_fn, num_workers=loader.num_workers, pin_memory=loader.pin_memory,
        persistent_workers=loader.persistent_workers if loader.num_workers else False,
    )


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """A checkpoint with weights-only unpickling; a missing, truncated or foreign file is a clear error."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated zip, garbage bytes, pickled code objects
        raise ValueError(f"{path}: not a readable checkpoint ({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt or "hyper_parameters" not in ckpt:
        raise ValueError(f"{path}: not an attnlab checkpoint (no state_dict / hyper_parameters)")
    return ckpt


def check_compatible(ckpt: dict[str, Any], model_cfg: ModelConfig, path: str | Path) -> None:
    """Refuse a checkpoint trained with a different model config, naming the fields that differ."""
    saved = ckpt["hyper_parameters"].get("model", {})
    now = model_cfg.to_dict()
    diff = [f"model.{k}: checkpoint {saved.get(k)!r} vs config {now[k]!r}" for k in now if saved.get(k) != now[k]]
    if diff:
        raise ConfigError(f"{path} was trained with a different model config: " + "; ".join(diff))


def git_state() -> str:
    root = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "commit: unknown\ndirty: unknown\n"
    if commit.returncode != 0:
        return "commit: unknown (not a git checkout)\ndirty: unknown\n"
    return f"commit: {commit.stdout.strip()}\ndirty: {bool(dirty.stdout.strip())}\n"


def make_datamodule(exp: Experiment):
    from .data import LMDataModule, TranslationDataModule

    cls = TranslationDataModule if exp.task == "translation" else LMDataModule
    return cls(exp.data, seed=exp.trainer.seed)


def resolve_model(exp: Experiment, dm) -> Experiment:
    """The tokenizer decides the vocabulary: model.vocab_size (and src_vocab_size) come from it."""
    changes = {"vocab_size": dm.vocab_size, "pad_id": dm.pad_id}
    if exp.task == "translation":
        src_vocab = getattr(dm, "src_vocab_size", dm.vocab_size)
        changes["src_vocab_size"] = 0 if src_vocab == dm.vocab_size else src_vocab
    if exp.task == "lm":
        changes["max_seq_len"] = max(exp.model.max_seq_len, exp.data.seq_len)
    return exp.replace(model=exp.model.replace(**changes))


def make_module(exp: Experiment, dm=None):
    kw = {"model": exp.model.to_dict(), "optim": exp.optim.to_dict(), "compile": exp.trainer.compile}
    if exp.task == "translation":
        module = Seq2SeqModule(decode=exp.decode.to_dict(), bos_id=getattr(dm, "bos_id", 1),
                               eos_id=getattr(dm, "eos_id", 2), **kw)
        if dm is not None:
            module.set_tokenizer(dm.tokenizer.decode_batch)
        return module
    return LMModule(**kw)


def make_trainer(exp: Experiment, run_dir: Path, **overrides: Any) -> L.Trainer:
    t = exp.trainer
    gpu = torch.cuda.is_available() and t.accelerator in ("auto", "gpu", "cuda")
    precision = t.precision if t.precision != "auto" else ("bf16-mixed" if gpu else "32-true")
    strategy: Any = t.strategy
    if t.strategy == "fsdp":
        from lightning.pytorch.strategies import FSDPStrategy

        from .models.block import Block

        strategy = FSDPStrategy(auto_wrap_policy={Block}, sharding_strategy="FULL_SHARD")
    elif t.strategy == "ddp" and not gpu:
        from lightning.pytorch.strategies import DDPStrategy

        strategy = DDPStrategy(process_group_backend="gloo")
    ckpt = ModelCheckpoint(
        dirpath=run_dir / "checkpoints", filename="step={step}", auto_insert_metric_name=False,
        every_n_train_steps=t.ckpt_every, save_top_k=t.keep_checkpoints, monitor="step", mode="max",
        save_last=True, save_on_exception=True,
    )
    callbacks: list[Any] = [ckpt]
    if t.progress_bar:
        callbacks.append(TQDMProgressBar(refresh_rate=max(1, t.log_every // 5)))
    kwargs: dict[str, Any] = dict(
        max_steps=t.max_steps,
        max_time=timedelta(minutes=t.max_time_min) if t.max_time_min else None,
        val_check_interval=t.val_every,
        check_val_every_n_epoch=None,  # validation by step, across epoch boundaries
        limit_val_batches=t.limit_val_batches or None,
        log_every_n_steps=t.log_every,
        precision=precision,
        accelerator=t.accelerator,
        devices=t.devices,
        num_nodes=t.num_nodes,
        strategy=strategy,
        gradient_clip_val=exp.optim.grad_clip or None,
        accumulate_grad_batches=exp.optim.accumulate,
        use_distributed_sampler=False,  # the datamodule's token-count sampler shards by rank itself
        num_sanity_val_steps=0,
        enable_progress_bar=t.progress_bar,
        enable_model_summary=False,
        default_root_dir=str(run_dir),
        logger=[CSVLogger(str(run_dir), name="", version="logs"),
                TensorBoardLogger(str(run_dir), name="", version="tensorboard")],
        callbacks=callbacks,
        plugins=[AtomicCheckpointIO()],
    )
    kwargs.update(overrides)
    return L.Trainer(**kwargs)


def prepare(exp: Experiment):
    """Datamodule (tokenizer trained or loaded, caches built) and the experiment with the real vocabulary."""
    L.seed_everything(exp.trainer.seed, workers=True, verbose=False)
    dm = make_datamodule(exp)
    dm.prepare_data()
    dm.setup("fit")
    return dm, resolve_model(exp, dm)


def write_run_dir(exp: Experiment, dm, run_dir: Path) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(exp.to_yaml(), encoding="utf-8")
    (run_dir / "git.txt").write_text(git_state(), encoding="utf-8")
    dm.tokenizer.save(run_dir / "tokenizer")


def find_resume(run_dir: Path, ckpt_path: str | None) -> str | None:
    if ckpt_path is None:
        return None
    if ckpt_path == "last":
        last = run_dir / "checkpoints" / "last.ckpt"
        if not last.exists():
            raise FileNotFoundError(f"--ckpt_path last: no {last}; nothing to resume (run fit without it)")
        return str(last)
    return ckpt_path


def fit(exp: Experiment, ckpt_path: str | None = None, trainer_overrides: dict | None = None) -> Path:
    """Train; returns the run directory. `ckpt_path='last'` resumes the run's last checkpoint."""
    dm, exp = prepare(exp)
    run_dir = exp.run_dir()
    resume = find_resume(run_dir, ckpt_path)
    if resume:
        check_compatible(load_checkpoint(resume), exp.model, resume)
    module = make_module(exp, dm)
    if exp.task == "translation":
        module.signature_dir = run_dir
    trainer = make_trainer(exp, run_dir, **(trainer_overrides or {}))
    if trainer.global_rank == 0:
        write_run_dir(exp, dm, run_dir)
    log.info("run directory: %s", run_dir)
    trainer.fit(module, datamodule=dm, ckpt_path=resume, weights_only=True if resume else None)
    # the final state, whatever the checkpoint interval: a step checkpoint (for averaging) and last.ckpt
    step_ckpt = run_dir / "checkpoints" / f"step={trainer.global_step}.ckpt"
    if not step_ckpt.exists():
        trainer.save_checkpoint(step_ckpt)
    trainer.save_checkpoint(run_dir / "checkpoints" / "last.ckpt")
    return run_dir
