"""LightningModule for translation: label-smoothed CE (+ z-loss), loss/perplexity, sacreBLEU and chrF."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import sacrebleu
import torch
from torchmetrics.text import CHRFScore, SacreBLEUScore

from ..config import DecodeConfig
from ..decode import beam_search, greedy_search
from .base import BaseModule


def _signature(metric) -> str:
    metric.num_refs = 1  # one reference per sentence; sacrebleu otherwise learns this from a corpus_score call
    return str(metric.get_signature())


def bleu_signature() -> str:
    """The sacreBLEU signature of the BLEU that torchmetrics' SacreBLEUScore computes (13a, exp smoothing)."""
    return _signature(sacrebleu.metrics.BLEU(tokenize="13a"))


def chrf_signature() -> str:
    return _signature(sacrebleu.metrics.CHRF())


class Seq2SeqModule(BaseModule):
    """Encoder-decoder translation. Batches: src (B, S), tgt_in (B, T) = BOS + y, tgt_out (B, T) = y + EOS."""

    def __init__(self, model: dict, optim: dict, decode: dict | None = None, compile: bool = False,
                 bos_id: int = 1, eos_id: int = 2) -> None:
        super().__init__(model, optim, compile)
        if self.model_cfg.arch != "encoder_decoder":
            raise ValueError(f"Seq2SeqModule needs model.arch=encoder_decoder, got model.arch={self.model_cfg.arch}")
        self.decode_cfg = DecodeConfig.from_dict(decode or {})
        self.bos_id, self.eos_id = bos_id, eos_id
        self.detokenize: Callable[[list[list[int]]], list[str]] | None = None  # set by set_tokenizer
        self.signature_dir: Path | None = None  # where to write the sacreBLEU signature
        self.bleu, self.chrf = SacreBLEUScore(tokenize="13a"), CHRFScore()
        self._decoded = 0
        self.examples: list[tuple[str, str]] = []

    def set_tokenizer(self, decode_batch: Callable[[list[list[int]]], list[str]]) -> None:
        self.detokenize = decode_batch

    # ------------------------------------------------------------------ steps
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        logits = self.model(batch["src"], batch["tgt_in"])  # (B, T, V)
        loss_sum, nll_sum, n = self.loss(logits, batch["tgt_out"])
        loss = loss_sum / n.clamp_min(1)
        self.log_train_step(loss, nll_sum, n)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._eval_step(batch, self.decode_cfg.val_beam)

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._eval_step(batch, self.decode_cfg.beam)

    def _eval_step(self, batch: dict[str, torch.Tensor], beam: int) -> None:
        logits = self.model(batch["src"], batch["tgt_in"])  # (B, T, V)
        _, nll_sum, n = self.loss(logits, batch["tgt_out"])
        self.eval_nll.update(nll_sum)
        self.eval_tokens.update(n)
        budget = self.decode_cfg.val_sentences // max(1, self.trainer.world_size if self._trainer else 1)
        if self.detokenize is None or self._decoded >= budget:
            return
        src = batch["src"][: budget - self._decoded]
        hyps = self.detokenize(self.translate_ids(src, beam))
        refs = self.detokenize(strip_special(batch["tgt_out"][: len(src)], self.eos_id, self.model_cfg.pad_id))
        self.bleu.update(hyps, [[r] for r in refs])
        self.chrf.update(hyps, [[r] for r in refs])
        self._decoded += len(src)
        if len(self.examples) < 5:
            self.examples.extend(zip(refs, hyps, strict=True))

    @torch.no_grad()
    def translate_ids(self, src: torch.Tensor, beam: int | None = None) -> list[list[int]]:
        """Token ids of the best translation of each row of src (B, S), without BOS/EOS."""
        c = self.decode_cfg
        beam = c.beam if beam is None else beam
        kw = dict(max_len_a=c.max_len_a, max_len_b=c.max_len_b, bos_id=self.bos_id, eos_id=self.eos_id,
                  pad_id=self.model_cfg.pad_id)
        if beam == 1:
            return greedy_search(self.model, src, **kw)
        hyps = beam_search(self.model, src, beam_size=beam, len_penalty=c.len_penalty, penalty=c.penalty, **kw)
        return [h[0][0] if isinstance(h[0], tuple) else h for h in hyps]

    # ------------------------------------------------------------------ epoch ends
    def on_validation_epoch_start(self) -> None:
        self._decoded, self.examples = 0, []

    on_test_epoch_start = on_validation_epoch_start

    def on_validation_epoch_end(self) -> None:
        self._finish("val")

    def on_test_epoch_end(self) -> None:
        self._finish("test")

    def _finish(self, stage: str) -> None:
        self.log_eval_loss(stage)
        if self.detokenize is None or self.decode_cfg.val_sentences == 0:
            return
        # computed on every rank from the n-gram statistics summed across ranks
        self.log(f"{stage}/bleu", float(self.bleu.compute()) * 100, prog_bar=True)
        self.log(f"{stage}/chrf", float(self.chrf.compute()) * 100)
        self.bleu.reset()
        self.chrf.reset()
        if self.signature_dir is not None and self.global_rank == 0:
            self.signature_dir.mkdir(parents=True, exist_ok=True)
            (self.signature_dir / "sacrebleu_signature.txt").write_text(
                f"BLEU {bleu_signature()}\nchrF {chrf_signature()}\n", encoding="utf-8"
            )


def strip_special(ids: torch.Tensor, eos_id: int, pad_id: int) -> list[list[int]]:
    """Rows of token ids cut at the first EOS, padding removed."""
    out = []
    for row in ids.tolist():
        row = row[: row.index(eos_id)] if eos_id in row else row
        out.append([t for t in row if t != pad_id])
    return out
