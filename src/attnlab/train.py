"""fit / validate / test: an Experiment -> datamodule, LightningModule, Trainer and run directory."""

from __future__ import annotations

import csv
import logging
import os
import shutil
import signal
import subprocess
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, TQDMProgressBar
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.utils.data import DataLoader

from .config import ConfigError, ModelConfig
from .data import LMDataModule, TranslationDataModule
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
    """Exact mid-epoch resume. Keeps (epoch, batches trained in it) in the checkpoint, from Lightning's own
    counters; on resume the train batch sampler skips that many batches of that epoch's order (a function of
    the seed and the epoch), so training continues with exactly the batch the interrupted run would have seen.
    Lightning alone restarts the epoch's data from its first batch (its loaders are not resumable)."""

    def __init__(self) -> None:
        self.epoch, self.batches = 0, 0
        self.pending: tuple[int, int] | None = None  # (epoch, batches) loaded from a checkpoint, not yet used

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self.epoch, self.batches = trainer.current_epoch, batch_idx + 1  # batch_idx counts within the epoch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batches": self.batches}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.batches = state["epoch"], state["batches"]
        self.pending = (self.epoch, self.batches)

    def take(self, n_batches: int) -> tuple[int, int] | None:
        """(epoch, batches to skip) for the first pass over the data after a resume, else None. A checkpoint
        taken at the end of an epoch resumes at the start of the next one."""
        if self.pending is None:
            return None
        (epoch, done), self.pending = self.pending, None
        return (epoch + 1, 0) if done >= n_batches else (epoch, done)


class _SetEpoch:
    """Lightning calls `set_epoch` on `loader.batch_sampler.sampler`, not on the batch sampler itself."""

    def __init__(self, owner: Any) -> None:
        self.owner = owner

    def set_epoch(self, epoch: int) -> None:
        self.owner.set_epoch(epoch)


class SkippingBatchSampler:
    """Wraps a batch sampler (with set_epoch) so a resumed epoch starts where the checkpoint left it."""

    def __init__(self, inner: Any, point: ResumePoint) -> None:
        self.inner, self.point = inner, point
        self.sampler = _SetEpoch(self)

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.inner, "set_epoch"):
            self.inner.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self):
        resume = self.point.take(len(self.inner))
        skip = 0
        if resume is not None:  # the epoch comes from the checkpoint: with workers, iteration starts before
            epoch, skip = resume  # Lightning's set_epoch call for the resumed epoch
            self.set_epoch(epoch)
        for i, batch in enumerate(self.inner):
            if i >= skip:
                yield batch


def own_generator(loader: DataLoader, seed: int, batch_sampler: Any = None) -> DataLoader:
    """The same loader drawing its per-iterator base seed from its own generator, not the global torch RNG.
    Otherwise every new iterator (each validation, each epoch) consumes a global draw, and dropout after a
    resume from a checkpoint taken just before one would differ from the uninterrupted run."""
    return DataLoader(
        loader.dataset, batch_sampler=batch_sampler or loader.batch_sampler, collate_fn=loader.collate_fn,
        num_workers=loader.num_workers, pin_memory=loader.pin_memory,
        persistent_workers=loader.persistent_workers if loader.num_workers else False,
        generator=torch.Generator().manual_seed(seed),
    )


def resumable(loader: DataLoader, point: ResumePoint, seed: int = 0) -> DataLoader:
    """The same loader with its batch sampler wrapped in a SkippingBatchSampler (and its own generator)."""
    return own_generator(loader, seed, SkippingBatchSampler(loader.batch_sampler, point))


class _RunData:
    """What `fit` adds to a datamodule: a resumable train loader; loaders that leave the global RNG alone."""

    resume_point: ResumePoint | None = None

    def train_dataloader(self) -> DataLoader:
        loader = super().train_dataloader()  # type: ignore[misc]
        if self.resume_point is None:
            return own_generator(loader, self.seed)
        return resumable(loader, self.resume_point, self.seed)

    def val_dataloader(self) -> DataLoader:
        return own_generator(super().val_dataloader(), self.seed)  # type: ignore[misc]

    def test_dataloader(self) -> DataLoader:
        return own_generator(super().test_dataloader(), self.seed)  # type: ignore[misc]


class RunTranslationData(_RunData, TranslationDataModule):
    pass


class RunLMData(_RunData, LMDataModule):
    pass


class _KeepingWriter(ExperimentWriter):
    """CSV writer that continues an existing metrics.csv (rows before `keep_below` kept, later ones dropped)
    instead of deleting it, so a resumed run keeps its whole history in one file."""

    def __init__(self, log_dir: str, keep_below: int | None) -> None:
        self.keep_below = keep_below
        super().__init__(log_dir)

    def _check_log_dir_exists(self) -> None:
        path = Path(self.metrics_file_path)
        if self.keep_below is None or not path.is_file():
            super()._check_log_dir_exists()
            return
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            keys = list(reader.fieldnames or [])
            rows = [r for r in reader if r.get("step") and int(float(r["step"])) < self.keep_below]
        tmp = path.with_name(f".{path.name}.tmp")
        with open(tmp, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=keys)
            writer.writeheader()
            writer.writerows(rows)
        os.replace(tmp, path)
        self.metrics_keys = keys


class RunCSVLogger(CSVLogger):
    """logs/metrics.csv of a run. `keep_below`: a resume from the checkpoint at that step keeps the rows
    logged before it (Lightning's CSVLogger would delete the file)."""

    def __init__(self, save_dir: str, keep_below: int | None = None, **kwargs: Any) -> None:
        super().__init__(save_dir, name="", version="logs", **kwargs)
        self._keep_below = keep_below

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _KeepingWriter(self.log_dir, self._keep_below)
        return self._experiment


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
    hp = ckpt["hyper_parameters"]
    if not isinstance(hp, dict) or not isinstance(hp.get("model"), dict) or not isinstance(hp.get("optim"), dict):
        keys = sorted(hp)[:10] if isinstance(hp, dict) else type(hp).__name__
        raise ValueError(f"{path}: not an attnlab checkpoint (its hyper_parameters hold no model / optim config: "
                         f"{keys})")
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


def make_datamodule(exp: Experiment) -> RunTranslationData | RunLMData:
    cls = RunTranslationData if exp.task == "translation" else RunLMData
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
    kw = {"model": exp.model.to_dict(), "optim": exp.optim.to_dict(), "compile": exp.trainer.compile,
          "loss_chunk": exp.trainer.loss_chunk}
    if exp.task == "translation":
        module = Seq2SeqModule(decode=exp.decode.to_dict(), bos_id=getattr(dm, "bos_id", 1),
                               eos_id=getattr(dm, "eos_id", 2), **kw)
        if dm is not None:
            module.set_tokenizer(dm.tokenizer.decode_batch)
        return module
    return LMModule(**kw)


def make_trainer(exp: Experiment, run_dir: Path, extra_callbacks: list[Callback] | None = None,
                 keep_logs_below: int | None = None, **overrides: Any) -> L.Trainer:
    """The Trainer of a run: step checkpoints (atomic; one on SIGTERM or an exception too), CSV + TensorBoard logs,
    the exact-resume callback. `extra_callbacks` are added to those; `overrides` replace Trainer arguments."""
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
    devices, num_nodes, plugins = t.devices, t.num_nodes, [AtomicCheckpointIO()]
    if "SLURM_NTASKS" in os.environ and os.environ.get("SLURM_JOB_NAME") not in ("bash", "interactive"):
        # started by srun in a SLURM job (Lightning's own test): one process per device, as many as SLURM started
        from lightning.pytorch.plugins.environments import SLURMEnvironment

        num_nodes = int(os.environ.get("SLURM_NNODES", "1"))
        per_node = os.environ.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]  # "8", or "8(x2)" in some versions
        devices = int(per_node) if per_node else int(os.environ["SLURM_NTASKS"]) // num_nodes
        if (devices, num_nodes) != (t.devices, t.num_nodes):
            log.info("SLURM runs %d node(s) x %d task(s); trainer.devices=%d, trainer.num_nodes=%d give way",
                     num_nodes, devices, t.devices, t.num_nodes)
        plugins.append(SLURMEnvironment(auto_requeue=True))  # on USR1: save hpc_ckpt_N.ckpt, `scontrol requeue`
    ckpt = ModelCheckpoint(
        dirpath=run_dir / "checkpoints", filename="step={step}", auto_insert_metric_name=False,
        every_n_train_steps=t.ckpt_every, save_top_k=t.keep_checkpoints, monitor="step", mode="max",
        save_last=True, save_on_exception=True,
        # True: never defer a step checkpoint to the next validation. Lightning 2.6 otherwise postpones the save
        # due at an epoch's last batch until a validation it expects right after (with step-based validation
        # that may be many steps later), and that step's checkpoint is never written.
        save_on_train_epoch_end=True,
    )
    callbacks = [ckpt, ResumePoint(), *(extra_callbacks or [])]
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
        devices=devices,
        num_nodes=num_nodes,
        strategy=strategy,
        gradient_clip_val=exp.optim.grad_clip or None,
        accumulate_grad_batches=exp.optim.accumulate,
        use_distributed_sampler=False,  # the datamodule's token-count sampler shards by rank itself
        num_sanity_val_steps=0,
        enable_progress_bar=t.progress_bar,
        enable_model_summary=False,
        default_root_dir=str(run_dir),
        logger=[RunCSVLogger(str(run_dir), keep_below=keep_logs_below, flush_logs_every_n_steps=t.log_every),
                TensorBoardLogger(str(run_dir), name="", version="tensorboard")],
        callbacks=callbacks,
        plugins=plugins,
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


def archive_previous(run_dir: Path) -> Path | None:
    """A fresh fit in a run directory that already holds checkpoints or logs (same recipe, same config hash) moves
    them to <run_dir>/previous/<k>/, so checkpoint averaging never mixes two runs' files."""
    parts = [run_dir / n for n in ("checkpoints", "logs", "tensorboard", "sacrebleu_signature.txt")]
    parts = [p for p in parts if p.exists()]
    if not parts:
        return None
    k = 0
    while (run_dir / "previous" / str(k)).exists():
        k += 1
    dest = run_dir / "previous" / str(k)
    dest.mkdir(parents=True)
    for p in parts:
        shutil.move(str(p), str(dest / p.name))
    log.warning("%s held an earlier run; moved its %s to %s (resume instead with --ckpt_path last)",
                run_dir, ", ".join(p.name for p in parts), dest)
    return dest


def fit(exp: Experiment, ckpt_path: str | None = None, trainer_overrides: dict | None = None,
        callbacks: list[Callback] | None = None) -> Path:
    """Train; returns the run directory. `ckpt_path='last'` resumes the run's last checkpoint (a path resumes that
    checkpoint). On SIGTERM (preemption, `kill`) the exact state is checkpointed, then the process exits with
    status 143; `--ckpt_path last` continues it with the same per-step losses as an uninterrupted run."""
    dm, exp = prepare(exp)
    run_dir = exp.run_dir()
    resume = find_resume(run_dir, ckpt_path)
    keep_below = None
    if resume:
        ckpt = load_checkpoint(resume)
        check_compatible(ckpt, exp.model, resume)
        keep_below = int(ckpt.get("global_step", 0))  # metrics.csv rows logged after the checkpoint are dropped
        del ckpt
    module = make_module(exp, dm)
    if exp.task == "translation":
        module.signature_dir = run_dir
    trainer = make_trainer(exp, run_dir, extra_callbacks=callbacks, keep_logs_below=keep_below,
                           **(trainer_overrides or {}))
    dm.resume_point = next((c for c in trainer.callbacks if isinstance(c, ResumePoint)), None)
    if trainer.global_rank == 0:
        if not resume:
            archive_previous(run_dir)
        write_run_dir(exp, dm, run_dir)
    log.info("run directory: %s", run_dir)
    try:
        trainer.fit(module, datamodule=dm, ckpt_path=resume, weights_only=True if resume else None)
    except SIGTERMException:
        log.warning("SIGTERM at step %d: state saved to %s; continue with --ckpt_path last", trainer.global_step,
                    run_dir / "checkpoints" / "last.ckpt")
        raise SystemExit(128 + signal.SIGTERM) from None
    # the final state, whatever the checkpoint interval: a step checkpoint (for averaging) and last.ckpt.
    # Every rank must take the same branch (save_checkpoint is collective): rank 0 decides.
    step_ckpt = run_dir / "checkpoints" / f"step={trainer.global_step}.ckpt"
    if trainer.strategy.broadcast(not step_ckpt.exists(), src=0):
        trainer.save_checkpoint(step_ckpt, weights_only=False)
    trainer.save_checkpoint(run_dir / "checkpoints" / "last.ckpt", weights_only=False)
    return run_dir
