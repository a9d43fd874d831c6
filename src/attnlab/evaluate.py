"""Load a trained model with its tokenizer; translate and score with sacreBLEU/chrF on real text; the device and
precision decoding runs in.

Decoding runs on CUDA when there is one (`--device` chooses: cuda, cuda:N, cpu), under bf16 autocast where the
recipe trains in bf16 (trainer.precision auto or bf16-*), fp16 autocast for 16-mixed, and in fp32 on a CPU.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import sacrebleu
import torch
from tqdm.auto import tqdm

from .bleu import sacrebleu_bleu
from .checkpoints import checked, load_checkpoint, load_tokenizer, run_dir_of  # noqa: F401 (evaluate's API too)
from .config import ConfigError, DecodeConfig, load_yaml
from .decode import GENERATE_MAX_NEW_TOKENS, generate, position_cap  # noqa: F401 (the CLI's default)
from .decode_workers import DecodeJob, batch_workers
from .files import write_text_atomic
from .lit import LMModule, MLMModule, Seq2SeqModule
from .lit.base import eager_blocks
from .models.prepack import prepacked_linears

log = logging.getLogger("attnlab")


def load_module(ckpt_path: str | Path, decode: DecodeConfig | None = None,
                ckpt: dict[str, Any] | None = None) -> Seq2SeqModule | LMModule | MLMModule:
    """Rebuild the exact model from the checkpoint's hyper-parameters and load its weights (eval mode). `ckpt`: the
    checkpoint already read from `ckpt_path`, if it was."""
    ckpt = load_checkpoint(ckpt_path) if ckpt is None else checked(ckpt, ckpt_path)
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


def pick_device(device: str | None = None) -> torch.device:
    """The device to decode on: `device` when given (cuda, cuda:N, cpu), else CUDA when available, else the CPU."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ConfigError(f"--device {device!r}: expected cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (dev.index or 0) >= n:
            raise ConfigError(f"--device {device}: this machine has {n} CUDA device(s) (torch {torch.__version__}"
                              f"{', a CPU build' if torch.version.cuda is None else ''}); use --device cpu")
    elif dev.type != "cpu":
        raise ConfigError(f"--device {device!r}: expected cpu, cuda or cuda:N")
    return dev


def decode_dtype(device: torch.device, precision: str = "auto") -> torch.dtype | None:
    """The autocast dtype decoding uses on `device` for a recipe trained with trainer.precision `precision`;
    None (fp32) on a CPU and for 32-true."""
    if device.type != "cuda":
        return None
    if precision in ("auto", "bf16-mixed", "bf16-true"):
        return torch.bfloat16
    return torch.float16 if precision == "16-mixed" else None


def recipe_precision(ckpt_path: str | Path) -> str:
    """trainer.precision of the run a checkpoint belongs to: its run directory's config.yaml, for a checkpoint in
    <run>/checkpoints/; 'auto' for a checkpoint elsewhere (a copied .ckpt: a config.yaml beside it is not its
    recipe) or a run without one."""
    ckpt = Path(ckpt_path).resolve()
    path = ckpt.parent.parent / "config.yaml"
    if ckpt.parent.name != "checkpoints" or not path.is_file():
        return "auto"
    trainer = load_yaml(path).get("trainer")
    return str(trainer.get("precision", "auto")) if isinstance(trainer, dict) else "auto"


@contextlib.contextmanager
def autocast(device: torch.device, dtype: torch.dtype | None) -> Iterator[None]:
    """Autocast to `dtype` on `device` (nothing when dtype is None)."""
    with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
        yield


def token_batches(lengths: list[int], batch_sentences: int, max_tokens: int = 0) -> list[list[int]]:
    """Indices sorted by length (less padding), cut into batches of at most `batch_sentences` sentences and, when
    max_tokens > 0, at most max_tokens source tokens with padding counted (n * the longest). A sentence longer than
    max_tokens gets a batch of its own."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    for i in order:
        b = batches[-1] if batches else None
        full = b is None or len(b) >= batch_sentences or (max_tokens and (len(b) + 1) * lengths[i] > max_tokens)
        if full:
            batches.append([i])
        else:
            b.append(i)
    return batches


# CTranslate2's batches on a CPU, in source tokens (padding counted): the fastest of 2,048, 4,096 and 8,192 on the
# demo's 918 test sentences at 2 threads when it was chosen (commit 3220d31; that comparison kept no raw file)
CPU_ENGINE_TOKENS = 2048
# attnlab's own batches on a CPU: by tokens, as CTranslate2's users batch (4,096 source tokens, padding counted), and
# at most 1,024 rows (sentences x beam: the logits of a step, rows x vocabulary floats, stay a few hundred MB).
# A step's fixed cost (Python and small kernels: about 0.3 ms on the demo model) is then paid by fewer steps: the
# demo's 918 test sentences in 6 batches, not 9, decoded 9% faster greedy and 6% at beam 4 on one thread, about 1%
# on two, than in its recipe's batches of 128 sentences (bench/results/decode_vs_ct2_cpu_2026-11-27.json)
CPU_TOKENS, CPU_ROWS = 4096, 1024


def batch_sizes(decode: DecodeConfig, device: torch.device, beam: int, batch_sentences: int | None = None,
                max_tokens: int | None = None) -> tuple[int, int]:
    """(sentences, source tokens; 0 = no limit) of attnlab's decoding batches: `batch_sentences` and `max_tokens`
    when given; else on CUDA the decode config's (decode.batch_sentences bounds a batch's memory there), on a CPU at
    most CPU_ROWS // beam sentences and the smaller of decode.max_tokens and CPU_TOKENS tokens."""
    sentences, tokens = decode.batch_sentences, decode.max_tokens
    if device.type == "cpu":
        sentences, tokens = max(CPU_ROWS // max(beam, 1), 1), min(tokens or CPU_TOKENS, CPU_TOKENS)
    return batch_sentences or sentences, tokens if max_tokens is None else max_tokens


@torch.no_grad()
def translate_lines(module: Seq2SeqModule, tokenizer, lines: list[str], beam: int | None = None,
                    batch_sentences: int | None = None, max_tokens: int | None = None,
                    device: str | torch.device | None = None, dtype: torch.dtype | None = None,
                    engine: str | None = None, ckpt_path: str | Path | None = None,
                    workers: int | None = None) -> list[str]:
    """Translate raw text lines on `device` (default: `pick_device()`), under autocast to `dtype` when given.
    `engine` (default: the module's decode.engine): attnlab, or ctranslate2 on the checkpoint file `ckpt_path`
    (the module's weights; converted once and cached: export_ct2.converted).
    Batches are formed by length (less padding): at most `batch_sentences` sentences and `max_tokens` source tokens,
    and put back in order. Their defaults (`batch_sizes`): on CUDA the module's decode config; on a CPU batches by
    tokens (at most 1,024 rows of sentences x beam, and decode.max_tokens but at most 4,096 tokens), where a small
    batch pays a step's fixed cost for few sentences. On a CPU `workers` batches (default: torch's thread count) are
    decoded at once, each on one thread, here and in forked processes on Linux (decode_workers.batch_workers); the
    texts depend on neither.
    CTranslate2 takes batches of `max_tokens` tokens (on a CPU at most CPU_ENGINE_TOKENS) whatever their sentences.
    Empty lines give empty translations; lines longer than the model's max_seq_len tokens are cut there, with a
    warning (a learned position table ends there; other positions were never trained beyond it either, and the
    output budget a * length + b grows with it)."""
    cfg = module.model_cfg
    dev = device if isinstance(device, torch.device) else pick_device(device)
    beam = beam or module.decode_cfg.beam
    eos = module.eos_id
    limit = cfg.max_seq_len
    encoded = []
    for i, ids in enumerate(tokenizer.encode_batch(lines)):
        ids = list(ids) + [eos]  # sources end in EOS, as in training
        if len(ids) > limit:
            log.warning("line %d has %d tokens; cut to the model's %d positions", i + 1, len(ids), limit)
            ids = ids[: limit - 1] + [eos]
        encoded.append(ids)
    todo = [i for i in range(len(lines)) if lines[i].strip()]
    lengths = [len(encoded[i]) for i in todo]
    out: list[str] = [""] * len(lines)
    engine = engine or module.decode_cfg.engine
    workers = workers or (torch.get_num_threads() if dev.type == "cpu" else 1)
    if engine == "ctranslate2":
        if ckpt_path is None:
            raise ValueError("translate_lines with engine=ctranslate2 needs the checkpoint file (ckpt_path)")
        from .export_ct2 import ct2_translate  # the ctranslate2 extra

        # batches by tokens alone; on a CPU at most CPU_ENGINE_TOKENS, so that its workers share them evenly
        tokens = module.decode_cfg.max_tokens if max_tokens is None else max_tokens
        tokens = min(tokens or CPU_ENGINE_TOKENS, CPU_ENGINE_TOKENS) if dev.type == "cpu" else tokens
        batches = [[todo[j] for j in b] for b in token_batches(lengths, max(len(todo), 1), tokens)]
        ids = ct2_translate(ckpt_path, encoded, batches, module.decode_cfg, beam, dev, dtype, cap=position_cap(cfg),
                            workers=workers)
        for i, h in zip(todo, tokenizer.decode_batch([ids[i] for i in todo]), strict=True):
            out[i] = h
        return out
    batches = [[todo[j] for j in b] for b in token_batches(
        lengths, *batch_sizes(module.decode_cfg, dev, beam, batch_sentences, max_tokens))]
    module.to(dev)
    job = DecodeJob(module, encoded, cfg.pad_id, dev, dtype, beam)
    # the costliest first, so that no worker is left with a long batch at the end (the texts stay the same: each
    # batch is decoded alone, on whichever worker)
    batches.sort(key=lambda b: -batch_cost([len(encoded[i]) for i in b]))
    # a progress bar on a terminal only (disable=None), and only when there is more than a batch or two
    bar = tqdm(total=len(batches), desc="translating", unit="batch", disable=None if len(batches) > 2 else True,
               leave=False)
    was_training = module.training
    module.eval()  # for the whole call: a search that restored training mode would turn dropout on in the others
    try:
        # compiled blocks run eagerly for the whole call: the stance is process-wide, and searches on several threads
        # entering and leaving it each (translate_ids) would leave it off while another still decodes
        # a CPU's fp32 linears on weights packed once for the call, not once a batch (models/prepack.py), before
        # any worker is forked; under a given autocast dtype they stay torch's, which autocast casts
        packed = prepacked_linears(module.model) if dtype is None else contextlib.nullcontext()
        with bar, eager_blocks(), packed, batch_workers(job, len(batches), workers) as decode_all:
            for idx, ids in zip(batches, decode_all(batches), strict=True):
                for i, h in zip(idx, tokenizer.decode_batch(ids), strict=True):
                    out[i] = h
                bar.update()
    finally:
        module.train(was_training)
    return out


def batch_cost(lengths: list[int]) -> int:
    """A batch's decoding time, roughly, from its sources' lengths: its steps (the longest output, which grows with
    the longest source) each cost a fixed part and a part per sentence (on a CPU, about as much as 8 sentences)."""
    return max(lengths) * (len(lengths) + 8)


@torch.no_grad()
def generate_text(module: LMModule, tokenizer, prompt: str, max_new_tokens: int, seed: int,
                  device: str | torch.device | None = None, dtype: torch.dtype | None = None, **sampling: Any) -> str:
    """Continue `prompt` with a language model on `device` (default: `pick_device()`), under autocast to `dtype`
    when given; `sampling`: decode.generate's temperature, top_k, top_p. The random generator is made on that
    device from `seed`, so a seed reproduces the text on the device it ran on. LM training streams documents
    each followed by EOS (no BOS anywhere), so EOS is what precedes the start of a document: the prompt is
    conditioned on it, and generation stops at the next one."""
    dev = device if isinstance(device, torch.device) else pick_device(device)
    ids = [tokenizer.eos_id] + list(tokenizer.encode(prompt, side="tgt"))
    g = torch.Generator(device=dev).manual_seed(seed)
    with autocast(dev, dtype):
        out = generate(module.model.to(dev), torch.tensor([ids], device=dev), max_new_tokens=max_new_tokens,
                       eos_id=tokenizer.eos_id, generator=g, **sampling)
    return tokenizer.decode(list(out[0]), side="tgt")


def score(hyps: list[str], refs: list[str], tgt_lang: str = "") -> dict[str, Any]:
    """sacreBLEU (with the tokenizer for `tgt_lang`, see `bleu.sacrebleu_bleu`) and chrF on detokenised text, with
    their signatures."""
    bleu, chrf = sacrebleu_bleu(tgt_lang), sacrebleu.metrics.CHRF()
    b, c = bleu.corpus_score(hyps, [refs]), chrf.corpus_score(hyps, [refs])
    return {"bleu": round(b.score, 2), "chrf": round(c.score, 2), "bleu_signature": str(bleu.get_signature()),
            "chrf_signature": str(chrf.get_signature()), "bleu_detail": str(b), "sentences": len(hyps)}


def write_translations(path: Path, sources: list[str], references: list[str], hypotheses: list[str]) -> Path:
    """Every scored sentence as a JSON line {"source", "reference", "hypothesis"} (a message may hold newlines, so
    not one sentence a line of text): what a paired comparison of two systems or a look at the long sentences
    needs, beside the corpus scores. Written whole."""
    rows = zip(sources, references, hypotheses, strict=True)
    write_text_atomic(path, "".join(json.dumps({"source": s, "reference": r, "hypothesis": h}, ensure_ascii=False)
                                    + "\n" for s, r, h in rows))
    return path
