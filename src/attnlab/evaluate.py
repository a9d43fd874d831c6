"""Load a trained model with its tokenizer; translate, score with sacreBLEU/chrF on real text, generate."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import sacrebleu
import torch
from tqdm.auto import tqdm

from .checkpoints import load_checkpoint
from .config import DecodeConfig
from .data.tokenizer import Tokenizer
from .lit import LMModule, MLMModule, Seq2SeqModule

log = logging.getLogger("attnlab")


def run_dir_of(ckpt_path: str | Path) -> Path:
    """runs/<name>/checkpoints/x.ckpt -> runs/<name>; a checkpoint elsewhere -> its own folder."""
    p = Path(ckpt_path).resolve()
    return p.parent.parent if p.parent.name == "checkpoints" else p.parent


def load_tokenizer(run_dir: Path) -> Tokenizer:
    tok_dir = run_dir / "tokenizer"
    if not tok_dir.exists():
        raise FileNotFoundError(
            f"no tokenizer beside the checkpoint: expected {tok_dir} (fit writes it into the run directory)"
        )
    return Tokenizer.load(tok_dir)


def load_module(ckpt_path: str | Path, decode: DecodeConfig | None = None) -> Seq2SeqModule | LMModule | MLMModule:
    """Rebuild the exact model from the checkpoint's hyper-parameters and load its weights (eval mode)."""
    ckpt = load_checkpoint(ckpt_path)
    hp: dict[str, Any] = dict(ckpt["hyper_parameters"])
    hp["compile"] = False
    try:
        if hp["model"].get("arch") == "encoder_decoder":
            if decode is not None:
                hp["decode"] = decode.to_dict()
            module: Seq2SeqModule | LMModule | MLMModule = Seq2SeqModule(**hp)
        else:
            hp.pop("decode", None)
            module = (MLMModule if hp["model"].get("arch") == "encoder_only" else LMModule)(**hp)
        missing, unexpected = module.load_state_dict(ckpt["state_dict"], strict=False)
    except (TypeError, ValueError, RuntimeError) as e:  # unknown hyper-parameters, bad config, size mismatch
        raise ValueError(f"{ckpt_path}: cannot rebuild its model: {type(e).__name__}: {str(e)[:500]}") from None
    missing = [k for k in missing if not k.startswith(("bleu", "chrf", "eval_"))]
    if missing or unexpected:
        raise ValueError(f"{ckpt_path}: weights do not fit the model: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    return module.eval()


@torch.no_grad()
def translate_lines(module: Seq2SeqModule, tokenizer, lines: list[str], beam: int | None = None,
                    batch_sentences: int | None = None, device: str | torch.device = "cpu") -> list[str]:
    """Translate raw text lines. Batches are formed by length (less padding) and put back in order.
    Empty lines give empty translations; lines longer than the model's max_seq_len tokens are cut there, with a
    warning (a learned position table ends there; other positions were never trained beyond it either, and the
    output budget a * length + b grows with the input)."""
    cfg = module.model_cfg
    bs = batch_sentences or module.decode_cfg.batch_sentences
    eos = module.eos_id
    limit = cfg.max_seq_len
    encoded = []
    for i, ids in enumerate(tokenizer.encode_batch(lines)):
        ids = list(ids) + [eos]  # sources end in EOS, as in training
        if len(ids) > limit:
            log.warning("line %d has %d tokens; cut to the model's %d positions", i + 1, len(ids), limit)
            ids = ids[: limit - 1] + [eos]
        encoded.append(ids)
    order = sorted(range(len(lines)), key=lambda i: len(encoded[i]))
    out: list[str] = [""] * len(lines)
    module.to(device)
    steps = range(0, len(order), bs)
    # a progress bar on a terminal only (disable=None), and only when there is more than a batch or two
    for start in tqdm(steps, desc="translating", unit="batch", disable=None if len(steps) > 2 else True, leave=False):
        idx = [i for i in order[start : start + bs] if lines[i].strip()]
        if not idx:
            continue
        width = max(len(encoded[i]) for i in idx)
        src = torch.full((len(idx), width), cfg.pad_id, dtype=torch.long)
        for row, i in enumerate(idx):
            src[row, : len(encoded[i])] = torch.tensor(encoded[i])
        hyps = tokenizer.decode_batch(module.translate_ids(src.to(device), beam))
        for i, h in zip(idx, hyps, strict=True):
            out[i] = h
    return out


def score(hyps: list[str], refs: list[str]) -> dict[str, Any]:
    """sacreBLEU and chrF on detokenised text, with their signatures."""
    bleu, chrf = sacrebleu.metrics.BLEU(), sacrebleu.metrics.CHRF()
    b, c = bleu.corpus_score(hyps, [refs]), chrf.corpus_score(hyps, [refs])
    return {"bleu": round(b.score, 2), "chrf": round(c.score, 2), "bleu_signature": str(bleu.get_signature()),
            "chrf_signature": str(chrf.get_signature()), "bleu_detail": str(b), "sentences": len(hyps)}
