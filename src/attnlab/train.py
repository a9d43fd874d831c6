"""Build a run's Trainer and run it: an Experiment -> datamodule, LightningModule, Trainer; `fit`.

What a Trainer is given lives elsewhere: checkpoint files (atomic saves, migration on resume) in checkpoints.py,
the exact-resume position in the datamodule's own state (data/datamodule.py), the run directory and its metrics
across resumes in rundir.py."""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import signal
import warnings
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import Logger, MLFlowLogger, TensorBoardLogger, WandbLogger
from lightning.pytorch.plugins.environments import LightningEnvironment, SLURMEnvironment
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.exceptions import SIGTERMException

from .best_window import BestWindow
from .bleu import sacrebleu_bleu
from .checkpoint_io import AtomicCheckpointIO, StepCheckpoint, copy_checkpoint, wait_for_writes
from .checkpoints import (
    check_compatible,
    check_same_tokenizer,
    latest_checkpoint,
    load_checkpoint,
    resume_candidates,
)
from .config import ConfigError
from .data.datamodule import LMDataModule, MLMDataModule, TranslationDataModule
from .data.tokenizer import MASK_ID
from .experiment import Experiment
from .files import DiskFull
from .intervals import StretchIntervals, saved_steps
from .launch.requeue import RequeueOnUSR1, unused_allocation
from .lit import LMModule, MLMModule, Seq2SeqModule
from .lit.fused_loss import resolve_fused_loss
from .metrics_csv import WholeRowsCSVLogger
from .models.block import Block
from .progress import progress_callback
from .rundir import archive_previous, clear_fit_done, keep_metrics, mark_fit_done, write_run_dir

log = logging.getLogger("attnlab")
EXTRA_LOGGERS = ("wandb", "mlflow")  # optional extras: attnlab[wandb], attnlab[mlflow]


DATAMODULES = {"translation": TranslationDataModule, "lm": LMDataModule, "mlm": MLMDataModule}


def make_datamodule(exp: Experiment) -> TranslationDataModule | LMDataModule | MLMDataModule:
    return DATAMODULES[exp.task](exp.data, seed=exp.trainer.seed)  # a ConfigError for an arch without a task


def resolve_model(exp: Experiment, dm) -> Experiment:
    """The tokenizer decides the vocabulary: model.vocab_size (and src_vocab_size) come from it."""
    changes = {"vocab_size": dm.vocab_size, "pad_id": dm.pad_id}
    if exp.task == "translation":
        src_vocab = getattr(dm, "src_vocab_size", dm.vocab_size)
        changes["src_vocab_size"] = 0 if src_vocab == dm.vocab_size else src_vocab
    if exp.task in ("lm", "mlm"):
        changes["max_seq_len"] = max(exp.model.max_seq_len, exp.data.seq_len)
    return exp.replace(model=exp.model.replace(**changes))


def make_module(exp: Experiment, dm=None):
    kw = {"model": exp.model.to_dict(), "optim": exp.optim.to_dict(), "compile": exp.trainer.compile,
          "loss_chunk": exp.trainer.loss_chunk, "fused_loss": exp.trainer.fused_loss_choice}
    if exp.task == "translation":
        module = Seq2SeqModule(decode=exp.decode.to_dict(), bos_id=getattr(dm, "bos_id", 1),
                               eos_id=getattr(dm, "eos_id", 2), tgt_lang=exp.data.tgt_lang, **kw)
        if dm is not None:
            module.set_tokenizer(dm.tokenizer.decode_batch)
    elif exp.task == "mlm":
        module = MLMModule(mask_id=getattr(dm, "mask_id", MASK_ID), seed=exp.trainer.seed, **kw)
    else:
        module = LMModule(**kw)
    if dm is not None:
        module.tokenizer_files = dm.tokenizer.to_files()
    return module


def check_extras(exp: Experiment) -> None:
    """Before any work: the optional packages this experiment needs are installed (loggers, MeCab for BLEU)."""
    t = exp.trainer
    missing = [n for n in t.logger_names if n in EXTRA_LOGGERS and importlib.util.find_spec(n) is None]
    if missing:
        raise ConfigError(f"trainer.loggers={t.loggers!r} names {', '.join(missing)}, which is not installed: "
                          f"pip install 'attnlab[{','.join(missing)}]' (or drop it from trainer.loggers)")
    if exp.task == "translation":
        sacrebleu_bleu(exp.data.tgt_lang)  # the validation BLEU's tokenizer for the target language
    cuda = t.accelerator in ("auto", "gpu") and torch.cuda.is_available()  # the module checks its device at fit start
    resolve_fused_loss(t.fused_loss_choice, "cuda" if cuda else "cpu", exp.optim.label_smoothing, exp.model.z_loss)


def make_loggers(exp: Experiment, run_dir: Path) -> list[Logger]:
    """Lightning's own loggers, as trainer.loggers names them: csv -> <run>/logs/metrics.csv (what the ablation
    tables read), tensorboard -> <run>/tensorboard/, wandb -> a W&B run named after the run directory (project
    $WANDB_PROJECT or attnlab; WANDB_MODE=offline keeps it in <run>/wandb/), mlflow -> an MLflow run in the
    experiment named after the recipe, in $MLFLOW_TRACKING_URI or else <runs_dir>/mlflow.db (MLflow's local SQLite
    store: no server; `mlflow ui --backend-store-uri sqlite:///runs/mlflow.db` shows it)."""
    t = exp.trainer
    check_extras(exp)
    made: list[Logger] = []
    for name in t.logger_names:
        if name == "csv":
            made.append(WholeRowsCSVLogger(str(run_dir), name="", version="logs",  # whole rows on a full disk
                                           flush_logs_every_n_steps=t.log_every))
        elif name == "tensorboard":
            made.append(TensorBoardLogger(str(run_dir), name="", version="tensorboard"))
        elif name == "wandb":
            made.append(WandbLogger(name=run_dir.name, project=os.environ.get("WANDB_PROJECT", "attnlab"),
                                    save_dir=str(run_dir)))
        elif name == "mlflow":
            uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path(t.runs_dir).resolve() / 'mlflow.db'}"
            made.append(MLFlowLogger(experiment_name=exp.name, run_name=run_dir.name, tracking_uri=uri))
    return made


class RedoCutValidation(Callback):
    """A checkpoint saved while a validation of fit runs (SIGTERM, an exception, SLURM's USR1) marks that
    validation as cut inside its first batch, so a resume from it runs the whole validation again, at the same
    step, before training on; otherwise Lightning resumes past it and that validation is never logged."""

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        loops = checkpoint.get("loops", {}).get("fit_loop", {})
        progress = loops.get("epoch_loop.val_loop.batch_progress")
        if not (trainer.state.fn == TrainerFn.FITTING and trainer.validating and not trainer.sanity_checking
                and progress and not progress["is_last_batch"]):
            return
        before = progress["total"]["completed"] - progress["current"]["completed"]  # batches of earlier validations
        # Lightning's "restarted mid-evaluation": a batch started, none finished; the loop reruns from the first
        progress["total"] = {"ready": before + 1, "started": before + 1, "processed": before, "completed": before}
        progress["current"] = {"ready": 1, "started": 1, "processed": 0, "completed": 0}


class SigtermAtStepEnd(Callback):
    """SIGTERM inside an accumulation window (optim.accumulate > 1) stops the fit when the window's optimizer step
    is done, not after the micro-batch it arrived in. Lightning stops after any micro-batch: its checkpoint records
    the data position of the window's micro-batches so far but not their gradients, and the resumed run skipped
    them (another data order, the dropout RNG ahead). Lightning's SIGTERM flag (no public setter) is held back
    until the optimizer steps. One process only: under DDP Lightning's signal handler broadcasts rank 0's SIGTERM
    to the other ranks at once and they stop at their next micro-batch, so rank 0 must too (a rank holding back
    would wait in a collective the others have left)."""

    def __init__(self) -> None:
        self.held = False

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.world_size > 1:
            return
        signals = trainer._signal_connector  # what Lightning's handler sets and its loop reads after this hook
        if trainer.fit_loop.epoch_loop._should_accumulate():  # a micro-batch inside a window: no step yet
            if signals.received_sigterm:
                signals.received_sigterm, self.held = False, True
        elif self.held:  # the window's step is done: stop now, at a step boundary
            signals.received_sigterm, self.held = True, False


def make_trainer(exp: Experiment, run_dir: Path, extra_callbacks: list[Callback] | None = None,
                 stretched: dict[str, int] | None = None, **overrides: Any) -> L.Trainer:
    """The Trainer of a run: step checkpoints (atomic; one on SIGTERM or an exception too), trainer.loggers.
    `extra_callbacks` are added to those; `overrides` replace Trainer arguments."""
    t = exp.trainer
    gpu = torch.cuda.is_available() and t.accelerator in ("auto", "gpu", "cuda")
    precision = t.precision if t.precision != "auto" else ("bf16-mixed" if gpu else "32-true")
    strategy: Any = t.strategy
    if t.strategy == "fsdp":
        strategy = FSDPStrategy(auto_wrap_policy={Block}, sharding_strategy="FULL_SHARD")
    elif t.strategy == "ddp" and not gpu:
        strategy = DDPStrategy(process_group_backend="gloo")
    # checkpoint files written in a thread while training goes on (checkpoint_io.py); FSDP writes its own folders
    background = t.checkpoint_writes == "background" or (t.checkpoint_writes == "auto" and gpu and t.strategy != "fsdp")
    devices, num_nodes, plugins, callbacks = t.devices, t.num_nodes, [AtomicCheckpointIO(background)], []
    if unused_allocation():  # the batch script itself: SLURM's task count describes srun steps, not this process
        plugins.append(LightningEnvironment())  # not SLURM's: Lightning would read the tasks as its ranks (fit warns)
    elif "SLURM_NTASKS" in os.environ and os.environ.get("SLURM_JOB_NAME") not in ("bash", "interactive"):
        # started by srun in a SLURM job (Lightning's own test): one process per device, as many as SLURM started
        num_nodes = int(os.environ.get("SLURM_NNODES", "1"))
        per_node = os.environ.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]  # "8", or "8(x2)" in some versions
        devices = int(per_node) if per_node else int(os.environ["SLURM_NTASKS"]) // num_nodes
        if (devices, num_nodes) != (t.devices, t.num_nodes):
            log.info("SLURM runs %d node(s) x %d task(s); trainer.devices=%d, trainer.num_nodes=%d give way",
                     num_nodes, devices, t.devices, t.num_nodes)
        plugins.append(SLURMEnvironment(auto_requeue=False))
        callbacks.append(RequeueOnUSR1(run_dir))  # on USR1: hpc_ckpt_N.ckpt at a step boundary, `scontrol requeue`
    ckpt = StepCheckpoint(
        dirpath=run_dir / "checkpoints", filename="step={step}", auto_insert_metric_name=False,
        every_n_train_steps=stretched["ckpt"] if stretched else t.ckpt_every, save_top_k=t.keep_checkpoints,
        monitor="step", mode="max",
        save_last=True, save_on_exception=True,
        # True: never defer a step checkpoint to the next validation. Lightning 2.6 otherwise postpones the save
        # due at an epoch's last batch until a validation it expects right after (with step-based validation
        # that may be many steps later), and that step's checkpoint is never written.
        save_on_train_epoch_end=True,
    )
    callbacks = [ckpt, RedoCutValidation(), *callbacks, *(extra_callbacks or [])]
    if exp.task == "translation" and exp.decode.average_at == "best":  # the checkpoints at the lowest val/loss
        callbacks.append(BestWindow(run_dir / "checkpoints", exp.decode.average_last))
    if exp.optim.accumulate > 1:
        callbacks.append(SigtermAtStepEnd())
    if t.val_every_min or t.ckpt_every_min:  # intervals that last at least so long on a fast device
        callbacks.append(StretchIntervals(ckpt, t.val_every, t.ckpt_every, t.val_every_min, t.ckpt_every_min,
                                          steps=stretched, divide=not t.max_time_min))
    if t.progress_bar:  # a bar on a terminal, plain lines in a log file
        callbacks.append(progress_callback(t.log_every, run_dir.name))
    kwargs: dict[str, Any] = dict(
        max_steps=t.max_steps,
        max_time=timedelta(minutes=t.max_time_min) if t.max_time_min else None,
        val_check_interval=t.val_every * exp.optim.accumulate,  # Lightning counts batches; val_every is steps
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
        logger=make_loggers(exp, run_dir),
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


def find_resume(run_dir: Path, ckpt_path: str | None) -> str | None:
    """The checkpoint a fit resumes: None, the path given, or for 'last' the run's newest checkpoint that loads
    (`latest_checkpoint`: last.ckpt, or when it is damaged the newest step=N / hpc_ckpt_N that loads, with a
    warning naming both)."""
    if ckpt_path != "last":
        return ckpt_path
    folder = run_dir / "checkpoints"
    candidates = resume_candidates(run_dir)
    if not candidates:
        raise FileNotFoundError(f"--ckpt-path last: no checkpoint in {folder}; nothing to resume (run fit without it)"
                                + hashed_siblings(run_dir))
    latest = latest_checkpoint(run_dir)
    if latest is None:
        raise ValueError(f"--ckpt-path last: no checkpoint in {folder} loads (cut short?): "
                         f"{', '.join(p.name for p in candidates)}; resume one by its path, or run fit without it")
    return str(latest)


def hashed_siblings(run_dir: Path) -> str:
    """For a run directory named <recipe>-<config hash>: the other runs of the recipe that have checkpoints, and how
    to continue one (every config value, trainer.max_steps too, is in the hash: a longer run is another name)."""
    prefix, _, digest = run_dir.name.rpartition("-")
    if not prefix or len(digest) != 10 or any(c not in "0123456789abcdef" for c in digest):
        return ""
    others = sorted((p for p in run_dir.parent.glob(f"{prefix}-*") if p != run_dir and resume_candidates(p)),
                    key=lambda p: p.stat().st_mtime)
    if not others:
        return ""
    return (f". This run directory is named by its config's hash, which trainer.max_steps is part of; runs of "
            f"{prefix} with checkpoints: {', '.join(p.name for p in others)}. To continue one, add "
            f"--trainer.run_name {others[-1].name}")


def resume_hint(e: DiskFull) -> DiskFull:
    """A checkpoint that found the disk full: the run stops, saying how it continues once there is space."""
    return DiskFull(e.errno, f"{e} Free space there (or set trainer.runs_dir elsewhere) and continue the run "
                             "from its last checkpoint with --ckpt-path last.")


@contextlib.contextmanager
def deterministic_algorithms(on: bool) -> Iterator[None]:
    """trainer.deterministic: torch's deterministic algorithms, cuDNN's autotuner off and cuBLAS's fixed workspace
    (which they need on a GPU) while a fit runs; torch's flags as they were after it."""
    if not on:
        yield
        return
    was = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    benchmark, workspace = torch.backends.cudnn.benchmark, os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # before cuBLAS first runs in this process
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])
        torch.backends.cudnn.benchmark = benchmark
        if workspace is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        else:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = workspace


def fit(exp: Experiment, ckpt_path: str | None = None, trainer_overrides: dict | None = None,
        callbacks: list[Callback] | None = None) -> Path:
    """Train; returns the run directory. `ckpt_path='last'` resumes the run's newest checkpoint that loads (a path
    resumes that checkpoint: `find_resume`). On SIGTERM (preemption, `kill`) the exact state is checkpointed, then
    the process exits with status 143; `--ckpt_path last` continues it with the same per-step losses as an
    uninterrupted run (a validation the signal cut short is run again first: `RedoCutValidation`). With
    trainer.deterministic, a GPU run repeats bit for bit (`deterministic_algorithms`)."""
    dist = torch.distributed
    ours = dist.is_available() and not dist.is_initialized()  # a process group this fit starts, this fit ends
    with deterministic_algorithms(exp.trainer.deterministic):
        run_dir = fit_run(exp, ckpt_path, trainer_overrides, callbacks)
    if ours and dist.is_initialized():
        # after the last collective (the final checkpoints): a process that exits with gloo's group alive can
        # abort at exit, "terminate called without an active exception" (pytorch/pytorch#190489), and srun then
        # cancels the step's other tasks
        dist.destroy_process_group()
    return run_dir


def fit_rank() -> int:
    """The global rank of this process in the last fit (Lightning's strategy sets it when it starts the process
    group; before that, the launcher's environment), 0 for a single process. Under DDP on one machine Lightning
    starts ranks 1.. as copies of this command, so work after a fit (averaging, decoding, writing results) is
    rank 0's alone."""
    return int(rank_zero_only.rank)


def fit_run(exp: Experiment, ckpt_path: str | None, trainer_overrides: dict | None,
            callbacks: list[Callback] | None) -> Path:
    check_extras(exp)
    if exp.task == "translation" and exp.trainer.keep_checkpoints < exp.decode.average_last:
        log.warning("trainer.keep_checkpoints=%d keeps fewer step checkpoints than decode.average_last=%d averages: "
                    "demo and the ablation's final evaluation will average the last %d", exp.trainer.keep_checkpoints,
                    exp.decode.average_last, exp.trainer.keep_checkpoints)
    unused = unused_allocation()
    if unused:  # evaluations in a batch script (an ablation worker's) run on one device on purpose; training not
        log.warning("attnlab fit runs in SLURM job %s's batch script, not under srun: this one process trains on "
                    "one device and the allocation's %s go unused (with several tasks Lightning would wait for the "
                    "others forever). Start it as `srun attnlab fit ...` (#SBATCH --ntasks-per-node=<GPUs per "
                    "node>), or submit with `attnlab fit --slurm`", os.environ["SLURM_JOB_ID"], unused)
    run_dir = exp.run_dir()  # named by the recipe as given, as `fit --dry-run` and `fit --slurm` name it
    dm, exp = prepare(exp)
    before = exp.run_dir()  # what attnlab named it before 2026-11-26: by the config with the tokenizer's vocabulary
    if before != run_dir and not run_dir.exists() and before.exists():
        log.info("continuing in %s (the name its config hash gave it in an earlier attnlab)", before)
        run_dir = before
    resume = find_resume(run_dir, ckpt_path)
    stretched = None
    if resume:
        ckpt = load_checkpoint(resume)
        check_compatible(ckpt, exp.model, resume)
        check_same_tokenizer(ckpt, dm.tokenizer, resume)
        stretched = saved_steps(ckpt)  # the intervals the run had stretched to (trainer.*_every_min)
    module = make_module(exp, dm)
    if exp.task == "translation":
        module.signature_dir = run_dir
    trainer = make_trainer(exp, run_dir, extra_callbacks=callbacks, stretched=stretched, **(trainer_overrides or {}))
    if trainer.global_rank == 0:
        if resume:
            keep_metrics(run_dir)  # the resumed attempt's logger starts logs/metrics.csv afresh
        else:
            archive_previous(run_dir)
        write_run_dir(run_dir, exp.to_yaml(), dm.tokenizer)
        clear_fit_done(run_dir)
    log.info("run directory: %s", run_dir)
    try:
        with warnings.catch_warnings():
            # on a resume, metrics.csv was moved aside above (nothing is lost), and the datamodule's state resumes
            # the data mid-epoch (Lightning only sees that the DataLoader itself keeps no state)
            warnings.filterwarnings("ignore", message=r"(Experiment logs|Checkpoint) directory .* exists and is not")
            warnings.filterwarnings("ignore", message=r".*your dataloader is not resumable")
            trainer.fit(module, datamodule=dm, ckpt_path=resume, weights_only=True if resume else None)
    except SIGTERMException:
        log.warning("SIGTERM at step %d: state saved to %s; continue with --ckpt-path last", trainer.global_step,
                    run_dir / "checkpoints" / "last.ckpt")
        raise SystemExit(128 + signal.SIGTERM) from None
    except DiskFull as e:
        raise resume_hint(e) from e
    finally:
        for logger in trainer.loggers:  # a W&B run stays open until finished: the next fit in this process would
            if isinstance(logger, WandbLogger) and trainer.global_rank == 0:  # log into it
                logger.experiment.finish()
    # the final state, whatever the checkpoint interval: a step checkpoint (for averaging) and last.ckpt.
    # Every rank must take the same branch (save_checkpoint is collective): rank 0 decides.
    step_ckpt = run_dir / "checkpoints" / f"step={trainer.global_step}.ckpt"
    last = run_dir / "checkpoints" / "last.ckpt"
    wrote_step = trainer.strategy.broadcast(not step_ckpt.exists(), src=0)
    if wrote_step:
        trainer.save_checkpoint(step_ckpt, weights_only=False)
    if not (wrote_step and copy_checkpoint(trainer, step_ckpt, last)):  # the same state: copied, not saved again
        trainer.save_checkpoint(last, weights_only=False)
    wait_for_writes(trainer)  # the files on disk before the run is marked done and read (demo, the final evaluation)
    if trainer.global_rank == 0:
        mark_fit_done(run_dir, trainer.global_step)
    return run_dir
