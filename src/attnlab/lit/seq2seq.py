"""LightningModule for translation: label-smoothed CE (+ z-loss), loss/perplexity, sacreBLEU and chrF."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import sacrebleu
import torch
import torch.distributed as dist

from ..bleu import sacrebleu_bleu
from ..config import DecodeConfig
from ..decode import beam_search, graph_unsupported, greedy_search
from .base import BaseModule, eager_blocks


def gather_strings(items: list[str], world_size: int) -> list[str]:
    """Every rank's strings, rank by rank (all ranks get the whole list); the list itself on one process."""
    if world_size <= 1 or not (dist.is_available() and dist.is_initialized()):
        return list(items)
    parts: list[list[str] | None] = [None] * world_size
    dist.all_gather_object(parts, list(items))
    return [x for part in parts for x in (part or [])]


class Seq2SeqModule(BaseModule):
    """Encoder-decoder translation. Batches: src (B, S), tgt_in (B, T) = BOS + y, tgt_out (B, T) = y + EOS."""

    EVAL_CURVES = (*BaseModule.EVAL_CURVES, "bleu", "chrf")  # bleu, chrf: of the decode.val_sentences decoded

    def __init__(self, model: dict, optim: dict, decode: dict | None = None, compile: bool = False,
                 bos_id: int = 1, eos_id: int = 2, loss_chunk: int = 0, tgt_lang: str = "",
                 fused_loss: str = "auto") -> None:
        super().__init__(model, optim, compile, loss_chunk, fused_loss)
        if self.model_cfg.arch != "encoder_decoder":
            raise ValueError(f"Seq2SeqModule needs model.arch=encoder_decoder, got model.arch={self.model_cfg.arch}")
        self.decode_cfg = DecodeConfig.from_dict(decode or {})
        self.bos_id, self.eos_id = bos_id, eos_id
        self.bleu = sacrebleu_bleu(tgt_lang)  # its tokenizer suits the target language (fails now if MeCab is missing)
        self.detokenize: Callable[[list[list[int]]], list[str]] | None = None  # set by set_tokenizer
        self.signature_dir: Path | None = None  # where to write the sacreBLEU signature
        # sacreBLEU itself on detokenised text (torchmetrics' SacreBLEUScore has no 'exp' smoothing and its
        # CHRFScore defaults to chrF++): hypotheses and references are gathered across ranks at the epoch end
        self._hyps: list[str] = []
        self._refs: list[str] = []
        self._decoded, self._stride = 0, 0
        self.examples: list[tuple[str, str]] = []

    def set_tokenizer(self, decode_batch: Callable[[list[list[int]]], list[str]]) -> None:
        self.detokenize = decode_batch

    # ------------------------------------------------------------------ steps
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        out = self.model(batch["src"], batch["tgt_in"], return_hidden=self.loss_kernel != "plain",
                         src_padded=batch.get("src_padded", True))  # (B, T, V) or (B, T, d)
        loss_sum, nll_sum, n = self.train_loss(out, batch["tgt_out"])
        self.log_train_step(loss_sum / n.clamp_min(1), nll_sum, n)
        return self.step_loss(loss_sum, n)

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._eval_step(batch, self.decode_cfg.val_beam)

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._eval_step(batch, self.decode_cfg.beam)

    def _eval_step(self, batch: dict[str, torch.Tensor], beam: int) -> None:
        logits = self.model(batch["src"], batch["tgt_in"], src_padded=batch.get("src_padded", True))  # (B, T, V)
        _, nll_sum, n = self.loss(logits, batch["tgt_out"])
        self.eval_nll.update(nll_sum)
        self.eval_tokens.update(n)
        if self.detokenize is None or not self.decode_cfg.val_sentences:
            return
        if "ids" in batch and self._stride:
            # every stride-th sentence of the split by dataset index: the same sample on every rank and at every
            # validation, spread over all lengths (eval batches come sorted by length: a prefix is the shortest)
            pick = batch["ids"].remainder(self._stride).eq(0)  # (B,)
        else:
            budget = self.decode_cfg.val_sentences // max(1, self.trainer.world_size if self._trainer else 1)
            pick = torch.arange(len(batch["src"]), device=batch["src"].device) < budget - self._decoded  # (B,)
        if not bool(pick.any()):
            return
        src = batch["src"][pick]  # (b, S)
        hyps = self.detokenize(self.translate_ids(src, beam))
        refs = self.detokenize(strip_special(batch["tgt_out"][pick], self.eos_id, self.model_cfg.pad_id))
        self._hyps.extend(hyps)
        self._refs.extend(refs)
        self._decoded += len(src)
        if len(self.examples) < 5:
            self.examples.extend(zip(refs, hyps, strict=True))

    @torch.no_grad()
    def translate_ids(self, src: torch.Tensor, beam: int | None = None) -> list[list[int]]:
        """Token ids of the best translation of each row of src (B, S), without BOS/EOS."""
        c = self.decode_cfg
        beam = c.beam if beam is None else beam
        kw = dict(max_len_a=c.max_len_a, max_len_b=c.max_len_b, bos_id=self.bos_id, eos_id=self.eos_id,
                  pad_id=self.model_cfg.pad_id,
                  graph=c.cuda_graph and src.is_cuda and graph_unsupported(self.model) is None)
        with eager_blocks():  # compiled blocks (trainer.compile) would recompile for each decoding length
            if beam == 1:
                return greedy_search(self.model, src, **kw)
            hyps = beam_search(self.model, src, beam_size=beam, len_penalty=c.len_penalty, penalty=c.penalty, **kw)
        return [h[0][0] if isinstance(h[0], tuple) else h for h in hyps]

    # ------------------------------------------------------------------ epoch ends
    def on_validation_epoch_start(self) -> None:
        t = self.trainer
        self._start_eval(t.val_dataloaders, t.num_sanity_val_batches if t.sanity_checking else t.num_val_batches)

    def on_test_epoch_start(self) -> None:
        self._start_eval(self.trainer.test_dataloaders, self.trainer.num_test_batches)

    def _start_eval(self, loader, batches: list[int | float] | int | float) -> None:
        """Decode every k-th sentence of the split (about decode.val_sentences) when every batch runs; when
        limit_val_batches / limit_test_batches cut the loop short, the first val_sentences of the batches that run."""
        self._decoded, self.examples, self._hyps, self._refs = 0, [], [], []
        n = len(loader.dataset) if hasattr(loader, "dataset") and hasattr(loader.dataset, "__len__") else 0
        runs = batches[0] if isinstance(batches, list) and batches else batches
        try:
            cut = isinstance(runs, int | float) and runs < len(loader)
        except TypeError:  # a loader without a length
            cut = True
        k = self.decode_cfg.val_sentences
        self._stride = -(-n // k) if n and k and not cut else 0  # ceil(n / k): about k sentences of the n decoded

    def on_validation_epoch_end(self) -> None:
        self._finish("val")

    def on_test_epoch_end(self) -> None:
        self._finish("test")

    def _finish(self, stage: str) -> None:
        self.log_eval_loss(stage)
        if self.detokenize is None or self.decode_cfg.val_sentences == 0:
            return
        world = self.trainer.world_size if self._trainer else 1
        hyps, refs = gather_strings(self._hyps, world), gather_strings(self._refs, world)
        self._hyps, self._refs = [], []
        if not hyps:
            return
        bleu, chrf = self.bleu, sacrebleu.metrics.CHRF()
        # the same value on every rank (computed from the gathered text): no further reduction
        self.log(f"{stage}/bleu", bleu.corpus_score(hyps, [refs]).score, prog_bar=True)
        self.log(f"{stage}/chrf", chrf.corpus_score(hyps, [refs]).score)
        if self.signature_dir is not None and self.global_rank == 0:
            self.signature_dir.mkdir(parents=True, exist_ok=True)
            (self.signature_dir / "sacrebleu_signature.txt").write_text(
                f"BLEU {bleu.get_signature()}\nchrF {chrf.get_signature()}\n", encoding="utf-8"
            )


def strip_special(ids: torch.Tensor, eos_id: int, pad_id: int) -> list[list[int]]:
    """Rows of token ids cut at the first EOS, padding removed."""
    out = []
    for row in ids.tolist():
        row = row[: row.index(eos_id)] if eos_id in row else row
        out.append([t for t in row if t != pad_id])
    return out
