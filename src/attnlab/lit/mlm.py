"""LightningModule for masked language modelling with an encoder-only model (BERT, Devlin et al. 2019,
arXiv:1810.04805, section 3.1 "Task #1: Masked LM"): loss on the masked positions only, perplexity, masked-token
accuracy."""

from __future__ import annotations

import torch
from torchmetrics.aggregation import SumMetric

from ..data.tokenizer import MASK_ID
from .base import BaseModule

MASK_PROB = 0.15  # share of the tokens chosen for prediction (BERT, section 3.1)
MASK_REPLACE = (0.8, 0.1)  # of those: replaced by <mask>, by a random token; the rest (0.1) kept as they are


def mask_tokens(ids: torch.Tensor, mask_id: int, first_token: int, vocab_size: int, pad_id: int = 0,
                prob: float = MASK_PROB, generator: torch.Generator | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT's masking of ids (B, T) -> (inputs (B, T), target (B, T)).

    Each ordinary token (id >= first_token: never PAD, BOS, EOS, UNK or <mask>) is chosen with probability `prob`;
    a chosen token becomes <mask> with probability 0.8, a random ordinary token with 0.1, and stays with 0.1. The
    target holds the original id at the chosen positions and pad_id elsewhere (ignored by the loss). The draws come
    from `generator` (a CPU one: the same masks on any device), else from the global RNG on ids' device."""
    device = ids.device if generator is None else torch.device("cpu")
    draw = torch.rand((3, *ids.shape), generator=generator, device=device).to(ids.device)  # (3, B, T)
    random_ids = (first_token + draw[2] * (vocab_size - first_token)).long().clamp_max(vocab_size - 1)  # (B, T)
    chosen = (draw[0] < prob) & ids.ge(first_token)  # (B, T)
    to_mask = chosen & (draw[1] < MASK_REPLACE[0])  # (B, T)
    to_random = chosen & (draw[1] >= MASK_REPLACE[0]) & (draw[1] < sum(MASK_REPLACE))  # (B, T)
    inputs = torch.where(to_random, random_ids, ids).masked_fill(to_mask, mask_id)  # (B, T)
    return inputs, ids.masked_fill(~chosen, pad_id)


class MLMModule(BaseModule):
    """Encoder-only masked language modelling. Batches: {input (B, T)} token windows (the LM datamodule's; `target`
    is ignored). Training masks with the global RNG (whose state the checkpoints keep); validation and test with a
    generator seeded by `seed` and the batch index, so a validation pass gives the same numbers every time.
    Logs `val/loss` and `val/ppl` (cross-entropy over the masked positions) and `val/mlm_acc` (their accuracy)."""

    EVAL_CURVES = (*BaseModule.EVAL_CURVES, "mlm_acc")

    def __init__(self, model: dict, optim: dict, compile: bool = False, loss_chunk: int = 0, mask_id: int = MASK_ID,
                 first_token: int = MASK_ID + 1, seed: int = 1, fused_loss: str = "auto") -> None:
        super().__init__(model, optim, compile, loss_chunk, fused_loss)
        if self.model_cfg.arch != "encoder_only":
            raise ValueError(f"MLMModule needs model.arch=encoder_only, got model.arch={self.model_cfg.arch}")
        if not 0 <= mask_id < first_token < self.model_cfg.vocab_size:
            raise ValueError(f"need 0 <= mask_id={mask_id} < first_token={first_token} < model.vocab_size="
                             f"{self.model_cfg.vocab_size}")
        self.mask_id, self.first_token, self.seed = mask_id, first_token, seed
        self.eval_correct, self.eval_masked = SumMetric(), SumMetric()

    def masked(self, ids: torch.Tensor, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return mask_tokens(ids, self.mask_id, self.first_token, self.model_cfg.vocab_size, self.model_cfg.pad_id,
                           generator=generator)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, target = self.masked(batch["input"])  # (B, T) each
        # windows of the token stream hold no padding: no mask, so SDPA may take its flash kernel
        out = self.model(inputs, return_hidden=self.loss_kernel != "plain", padded=False)  # (B, T, V) or (B, T, d)
        loss_sum, nll_sum, n = self.train_loss(out, target)
        self.log_train_step(loss_sum / n.clamp_min(1), nll_sum, n)
        return self.step_loss(loss_sum, n)

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + batch_idx)
        inputs, target = self.masked(batch["input"], g)  # (B, T) each
        logits = self.model(inputs, padded=False)  # (B, T, V)
        _, nll_sum, n = self.loss(logits, target)
        self.eval_nll.update(nll_sum)
        self.eval_tokens.update(n)
        chosen = target.ne(self.model_cfg.pad_id)  # (B, T)
        self.eval_correct.update((logits.argmax(-1).eq(target) & chosen).sum())
        self.eval_masked.update(chosen.sum())

    test_step = validation_step

    def _finish(self, stage: str) -> None:
        n = float(self.eval_masked.compute())
        if n > 0:
            self.log(f"{stage}/mlm_acc", float(self.eval_correct.compute()) / n)  # summed over ranks already
        self.eval_correct.reset()
        self.eval_masked.reset()
        self.log_eval_loss(stage)

    def on_validation_epoch_end(self) -> None:
        self._finish("val")

    def on_test_epoch_end(self) -> None:
        self._finish("test")
