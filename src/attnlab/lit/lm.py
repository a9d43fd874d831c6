"""LightningModule for decoder-only language modelling: cross-entropy and perplexity."""

from __future__ import annotations

import torch

from .base import BaseModule


class LMModule(BaseModule):
    """Decoder-only language modelling: cross-entropy, perplexity."""

    def __init__(self, model: dict, optim: dict, compile: bool = False, loss_chunk: int = 0,
                 fused_loss: str = "auto") -> None:
        super().__init__(model, optim, compile, loss_chunk, fused_loss)
        if self.model_cfg.arch != "decoder_only":
            raise ValueError(f"LMModule needs model.arch=decoder_only, got model.arch={self.model_cfg.arch}")

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        out = self.model(batch["input"], return_hidden=self.loss_kernel != "plain")  # (B, T, V) or (B, T, d)
        loss_sum, nll_sum, n = self.train_loss(out, batch["target"])
        self.log_train_step(loss_sum / n.clamp_min(1), nll_sum, n)
        return self.step_loss(loss_sum, n)

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        _, nll_sum, n = self.loss(self.model(batch["input"]), batch["target"])
        self.eval_nll.update(nll_sum)
        self.eval_tokens.update(n)

    test_step = validation_step

    def on_validation_epoch_end(self) -> None:
        self.log_eval_loss("val")

    def on_test_epoch_end(self) -> None:
        self.log_eval_loss("test")
