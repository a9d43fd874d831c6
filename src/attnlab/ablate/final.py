"""The final evaluation of a trial, as its recipe defines it, and `attnlab ablate evaluate` for a finished study.

1. Average the last `decode.average_last` step checkpoints of the run (Vaswani et al. 2017 average the last 5).
2. Loss and perplexity over the whole valid and test splits (token-weighted, as `attnlab validate` / `test`).
3. Translation: beam search (`decode.beam`, the recipe's length penalty and maximum length) over the whole valid
   and test splits, scored with sacreBLEU and chrF on the real text. The hypotheses and references are written
   to <run_dir>/eval/{valid,test}.{hyp,ref}, one segment a line (a newline inside a segment becomes a space,
   and the scores are those of the files), so `sacrebleu REF -i HYP ...` reproduces them. With
   `decode.engine: ctranslate2` (e.g. the study's `overrides:`; not part of the run's identity) CTranslate2
   decodes instead, from the averaged checkpoint converted once (export_ct2.converted).

The scores (valid_loss, valid_ppl, valid_bleu, valid_chrf, test_...) go to <run_dir>/eval/final.json and into the
trial: its user attr `final`, or, for a trial that had finished before (`ablate evaluate`), the study's user
attr `final:<trial number>` (optuna keeps a finished trial read-only). A study's metric may name any of them
as final/<name>, e.g. final/test_bleu.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.environments import LightningEnvironment

from ..best_window import checkpoints_to_average
from ..checkpoints import average_checkpoints
from ..evaluate import decode_dtype, load_module, score, translate_lines
from ..experiment import Experiment, load_experiment
from ..files import write_texts_atomic
from ..train import make_trainer, prepare
from .study import DONE, StudyHandle, final_scores, point_states

log = logging.getLogger("attnlab.ablate")

SPLITS = ("valid", "test")
DEFAULT_EVALUATE = "attnlab.ablate.final:evaluate_run"  # module:function, like the runner's fit


def one_line(text: str) -> str:
    """A segment as one line of a .hyp / .ref file, as sacreBLEU's command line reads it back (rstrip)."""
    return text.replace("\r", " ").replace("\n", " ").rstrip()


def lines_text(lines: list[str]) -> str:
    return "".join(f"{line}\n" for line in lines)


def write_lines(path: Path, lines: list[str]) -> None:
    """A .hyp / .ref file, one segment a line, written whole (files.write_texts_atomic)."""
    write_texts_atomic({path: lines_text(lines)})


def eval_device(exp: Experiment) -> str:
    return "cuda" if torch.cuda.is_available() and exp.trainer.accelerator in ("auto", "gpu", "cuda") else "cpu"


def evaluate_run(exp: Experiment, run_dir: Path) -> dict[str, Any]:
    """Evaluate a trained run as its recipe defines it (see the module docstring); returns the scores."""
    t0 = time.perf_counter()
    run_dir = Path(run_dir)
    dm, resolved = prepare(exp)
    paths, at, which = checkpoints_to_average(run_dir, exp.decode.average_last, exp.decode.average_at)
    if not paths:
        raise FileNotFoundError(f"{run_dir / 'checkpoints'}: no checkpoints to evaluate")
    ckpt, averaged = paths[-1], None
    if len(paths) > 1:
        ckpt = run_dir / "checkpoints" / f"averaged_{at}{len(paths)}.ckpt"
        averaged = average_checkpoints(paths, ckpt)  # written to ckpt, and loaded from memory here
    translation = exp.task == "translation"
    module = load_module(ckpt, resolved.decode if translation else None, ckpt=averaged)
    if translation:  # the loops below compute the loss only; decoding is done once, over the whole splits
        module.decode_cfg = module.decode_cfg.replace(val_sentences=0)
    # one process on one device, wherever it runs (a SLURM worker too: the job's task count is not this one's)
    trainer = make_trainer(resolved, run_dir, logger=False, callbacks=[], enable_progress_bar=False, devices=1,
                           num_nodes=1, strategy="auto", limit_val_batches=None, plugins=[LightningEnvironment()])
    out: dict[str, Any] = {}
    for split, stage, run in (("valid", "val", trainer.validate), ("test", "test", trainer.test)):
        metrics = run(module, datamodule=dm, verbose=False)[0]
        out[f"{split}_loss"], out[f"{split}_ppl"] = float(metrics[f"{stage}/loss"]), float(metrics[f"{stage}/ppl"])
    eval_dir = run_dir / "eval"
    files: dict[Path, str] = {}  # written together at the end, whole (a full disk leaves the previous ones)
    if translation:
        device = torch.device(eval_device(exp))
        for split in SPLITS:
            srcs, refs = dm.split_texts(split)
            hyps = translate_lines(module, dm.tokenizer, srcs, beam=exp.decode.beam, device=device,
                                   dtype=decode_dtype(device, exp.trainer.precision),  # the recipe's dtype
                                   engine=exp.decode.engine, ckpt_path=ckpt)
            hyps, refs = [one_line(h) for h in hyps], [one_line(r) for r in refs]
            files[eval_dir / f"{split}.hyp"], files[eval_dir / f"{split}.ref"] = lines_text(hyps), lines_text(refs)
            scores = score(hyps, refs, exp.data.tgt_lang)  # sacreBLEU's tokenizer for the target language
            out[f"{split}_bleu"], out[f"{split}_chrf"] = scores["bleu"], scores["chrf"]
            out["bleu_signature"], out["chrf_signature"] = scores["bleu_signature"], scores["chrf_signature"]
        out["beam"], out["engine"] = exp.decode.beam, exp.decode.engine
    out["checkpoints"] = [str(p) for p in paths]
    out["eval_dir"] = str(eval_dir)
    out["seconds"] = round(time.perf_counter() - t0, 1)
    files[eval_dir / "final.json"] = json.dumps(out, indent=2)
    write_texts_atomic(files)
    return out


def evaluate_study(h: StudyHandle, evaluate, force: bool = False) -> list[str]:
    """Evaluate every finished trial of a study that has no final evaluation yet (all of them with `force`), from
    its run directory and the config it trained with, without retraining. Returns a line per trial."""
    lines = []
    attrs = h.study.user_attrs  # read once: this loop adds only keys of trials it has passed
    for s in point_states(h).values():
        t = s.result
        if s.status != DONE or t is None:
            continue
        if not force and final_scores(t, attrs):
            lines.append(f"{s.variant} (seed {s.seed}): already evaluated")
            continue
        run_dir = Path(t.user_attrs["run_dir"])
        exp = load_experiment(run_dir / "config.yaml")  # what it trained: the resolved config of the run
        final = evaluate(exp, run_dir)
        h.study.set_user_attr(f"final:{t.number}", final)
        shown = ", ".join(f"{k} {v:.4g}" for k, v in final.items() if isinstance(v, float) and k != "seconds")
        lines.append(f"{s.variant} (seed {s.seed}): {shown}")
        log.info("trial %d %s seed %d evaluated: %s", t.number, s.variant, s.seed, shown)
    return lines
