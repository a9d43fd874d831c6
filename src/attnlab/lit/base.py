"""What both LightningModules share: the model, optimizer and schedule, step logging, RNG state in checkpoints."""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any

import lightning as L
import torch
from torchmetrics.aggregation import SumMetric

from ..config import ModelConfig, OptimConfig
from ..models.transformer import build_model
from .fused_loss import FUSED_LOSSES, fused_linear_cross_entropy, resolve_fused_loss
from .loss import linear_cross_entropy, token_loss
from .optim import make_optimizer, make_scheduler, scale_grads_


def eager_blocks() -> contextlib.AbstractContextManager:
    """Run torch.compile'd code eagerly inside (torch >= 2.6): step-by-step decoding through compiled blocks
    recompiles for every new length and cache state until dynamo's recompile limit."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance("force_eager") if set_stance is not None else contextlib.nullcontext()


class BaseModule(L.LightningModule):
    """Builds the network from plain config dicts (kept in the checkpoint's hyper-parameters, so a checkpoint
    loads with weights-only unpickling and rebuilds the exact model)."""

    # The curves it logs to metrics.csv: train/<name> every trainer.log_every steps, val/<name> at each validation
    # (test/<name> only under trainer.test, which fit does not run). An ablation's metric is checked against them.
    TRAIN_CURVES: tuple[str, ...] = ("loss", "nll", "lr", "tokens_per_s", "tokens", "time", "grad_norm")
    EVAL_CURVES: tuple[str, ...] = ("loss", "ppl")

    @classmethod
    def curves(cls) -> tuple[str, ...]:
        """Every curve a fit with this module logs: train/loss, ..., val/loss, ..."""
        return tuple(f"train/{n}" for n in cls.TRAIN_CURVES) + tuple(f"val/{n}" for n in cls.EVAL_CURVES)

    def __init__(self, model: dict, optim: dict, compile: bool = False, loss_chunk: int = 0,
                 fused_loss: str = "auto") -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model_cfg = ModelConfig.from_dict(model)
        self.optim_cfg = OptimConfig.from_dict(optim)
        self.model = build_model(self.model_cfg)
        self._compile = compile
        self.loss_chunk = loss_chunk  # > 0: training loss from hidden states, this many tokens at a time
        self.fused_loss = fused_loss  # auto | liger | cce | off: a fused kernel library's loss (lit/fused_loss.py)
        if fused_loss not in FUSED_LOSSES:  # the device and the library are checked at fit start (on_fit_start)
            raise ValueError(f"fused_loss={fused_loss!r} is not one of: {', '.join(FUSED_LOSSES)}")
        self._last_step_time: float | None = None
        self._val_start: float | None = None
        self._rng_to_restore: dict | None = None
        self.tokenizer_files: dict[str, str] | None = None  # Tokenizer.to_files(): every checkpoint carries them
        self._tokens: torch.Tensor | int = 0  # target tokens trained on, all ranks together (kept in checkpoints)
        # token-weighted loss over a whole split, summed across DDP ranks (not a mean of batch means)
        self.eval_nll, self.eval_tokens = SumMetric(), SumMetric()
        # loss tokens of the micro-batches of the optimizer step under way
        self._step_tokens = torch.zeros((), dtype=torch.long)

    # ------------------------------------------------------------------ model
    def configure_model(self) -> None:
        if self._compile:
            # compile each block, not the whole model: fast to compile, robust to varying shapes. In place
            # (nn.Module.compile): the blocks keep their class and their parameter names, so a compiled run's
            # checkpoint loads in every command. Decoding runs them eagerly (eager_blocks).
            for stack in (getattr(self.model, "encoder", None), getattr(self.model, "decoder", None)):
                for layer in stack.layers if stack is not None else ():
                    if getattr(layer, "_compiled_call_impl", None) is None:
                        layer.compile(dynamic=True)

    def loss(self, logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cfg = self.model_cfg
        smoothing = self.optim_cfg.label_smoothing if self.training else 0.0
        return token_loss(logits, target, cfg.pad_id, smoothing, cfg.z_loss if self.training else 0.0)

    @property
    def loss_kernel(self) -> str:
        """What computes the training loss on this module's device: liger | cce (trainer.fused_loss, which takes
        precedence where it resolves to a library), chunked (trainer.loss_chunk) or plain (the logits)."""
        fused = resolve_fused_loss(self.fused_loss, self.device.type, self.optim_cfg.label_smoothing,
                                   self.model_cfg.z_loss)
        return fused if fused != "off" else "chunked" if self.loss_chunk else "plain"

    def on_fit_start(self) -> None:
        _ = self.loss_kernel  # a library that cannot run on this device fails here, before the first step

    def train_loss(self, out: torch.Tensor, target: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """The training loss of the model's output: logits (B, T, V), or, when `loss_kernel` is not plain, the final
        hidden states (B, T, d), whose logits are never materialised for the whole batch (a fused library's kernel,
        or linear_cross_entropy's chunks). A fused loss gives nll_sum only on logging steps (else None)."""
        kernel = self.loss_kernel
        if kernel == "plain":
            return self.loss(out, target)
        cfg, m = self.model_cfg, self.model
        weight = m.head.weight if m.head is not None else m.output_embedding().weight  # (V, d)
        smoothing = self.optim_cfg.label_smoothing if self.training else 0.0
        z_loss = cfg.z_loss if self.training else 0.0
        if kernel == "chunked":
            return linear_cross_entropy(out, weight, target, cfg.pad_id, smoothing, z_loss, cfg.logit_softcap,
                                        self.loss_chunk)
        with_nll = self._trainer is None or self._logging_step()  # the nll costs a second call: only when logged
        return fused_linear_cross_entropy(out, weight, target, cfg.pad_id, smoothing, z_loss, cfg.logit_softcap,
                                          kernel, with_nll)

    def log_eval_loss(self, stage: str) -> None:
        n = float(self.eval_tokens.compute())
        if n > 0:
            loss = float(self.eval_nll.compute()) / n
            self.log(f"{stage}/loss", loss, prog_bar=True)  # already summed over ranks
            self.log(f"{stage}/ppl", math.exp(min(loss, 50.0)))
        self.eval_nll.reset()
        self.eval_tokens.reset()

    # ------------------------------------------------------------------ optimisation
    def configure_optimizers(self) -> dict[str, Any]:
        opt = make_optimizer(self.model, self.optim_cfg)
        sched = make_scheduler(opt, self.optim_cfg, self.model_cfg.d_model)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def _logging_step(self) -> bool:
        """Whether this step's values reach the loggers (every trainer.log_every steps). Only then does it call
        self.log: Lightning's log moves its whole record to the value's device through apply_to_collection,
        ~70 nested Python calls per call, 6 calls a step: host time between two GPU steps. A training value
        logged on other steps was never written anywhere."""
        return self.trainer._logger_connector.should_update_logs

    def log_train_step(self, loss: torch.Tensor, nll: torch.Tensor | None, n_tokens: torch.Tensor) -> None:
        now = time.perf_counter()
        last, self._last_step_time = self._last_step_time, now
        if not self._logging_step():
            return
        # not prog_bar: Lightning converts progress-bar metrics to Python numbers after every batch (a host sync per
        # step); the bar reads train/loss itself when it refreshes (progress.py): the last logged step's
        self.log("train/loss", loss)
        self.log("train/nll", nll / n_tokens.float().clamp_min(1))
        self.log("train/lr", self.optimizers().param_groups[0]["lr"])  # a float becomes a device tensor
        if last is not None:  # tokens of this step over the time since the last one
            self.log("train/tokens_per_s", n_tokens.float() / max(now - last, 1e-9))

    def on_validation_start(self) -> None:
        self._val_start = time.perf_counter()

    def on_validation_end(self) -> None:
        # validation time is not training time: tokens/s of the next step measures the step only
        if self._last_step_time is not None and self._val_start is not None:
            self._last_step_time += time.perf_counter() - self._val_start
        self._val_start = None

    def step_loss(self, loss_sum: torch.Tensor, n_tokens: torch.Tensor) -> torch.Tensor:
        """What training_step returns for backward: the summed loss of its micro-batch. `on_before_optimizer_step`
        divides the gradients by the tokens of the whole optimizer step, over its micro-batches (optim.accumulate)
        and the DDP ranks: an accumulated step is the step on the joined batch, however the micro-batches' token
        counts differ (fairseq's normalisation; a mean of per-batch means would weight a short batch's tokens more)."""
        self._step_tokens = self._step_tokens.to(n_tokens.device) + n_tokens.detach()
        return loss_sum

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        t = self.trainer
        # Lightning divided each micro-batch's loss by accumulate, DDP (and FSDP) average the ranks' gradients
        tokens = self._step_tokens.clone()  # long: exact at any batch size
        if t.world_size > 1:  # one all-reduce, no barrier (Lightning's strategy.reduce adds one: a host wait)
            torch.distributed.all_reduce(tokens)
        scale = t.accumulate_grad_batches * t.world_size / tokens.clamp_min(1)
        self._step_tokens = torch.zeros_like(self._step_tokens)
        self._tokens = self._tokens + tokens  # the same all-reduce counts the run's tokens: every rank holds the total
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        logging = self._logging_step()
        norm = scale_grads_(grads, scale, norm=logging) if grads else None
        if logging:
            self.log("train/tokens", self._tokens.double())
            # the wall clock beside them (Unix seconds, float64: exact to the microsecond): tokens over the time
            # between two logged steps, validation and checkpoints included, is the fit's speed by the clock
            self.log("train/time", torch.tensor(time.time(), dtype=torch.float64))
            if norm is not None:
                self.log("train/grad_norm", norm)

    # ------------------------------------------------------------------ exact resume
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """RNG streams (dropout) go into the checkpoint, so a resumed run draws what the original would; the tokens
        trained so far, so its train/tokens count goes on; and the tokenizer, so that the checkpoint alone
        translates or generates."""
        if self._rng_to_restore is not None:  # resumed, and no batch trained since: the state it will train with
            checkpoint["rng"] = dict(self._rng_to_restore)  # (a second cut in the redone validation, a crash at start)
        else:
            checkpoint["rng"] = {"torch": torch.get_rng_state()}
            if torch.cuda.is_available():
                checkpoint["rng"]["cuda"] = torch.cuda.get_rng_state_all()
        checkpoint["tokens_trained"] = int(self._tokens)
        if self.tokenizer_files is not None:  # plain strings: they load with weights-only unpickling
            checkpoint["tokenizer"] = dict(self.tokenizer_files)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._rng_to_restore = checkpoint.get("rng")
        self._tokens = int(checkpoint.get("tokens_trained", 0))

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # restored here, not at load time: the loops draw random numbers between loading and the first batch
        if self._rng_to_restore is not None:
            torch.set_rng_state(self._rng_to_restore["torch"])
            if "cuda" in self._rng_to_restore and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(self._rng_to_restore["cuda"])
            self._rng_to_restore = None
