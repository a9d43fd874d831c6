"""CTranslate2 (the `ctranslate2` extra): `attnlab export --format ctranslate2` writes a model folder for fast CPU
and GPU inference with `ctranslate2.Translator` (translation) or `ctranslate2.Generator` (language models), and
`decode.engine: ctranslate2` (`--engine ctranslate2` of test, validate, translate and demo; the ablation's final
evaluation) decodes with it: the checkpoint is converted once, into `<run dir>/ct2/<checkpoint>-<its SHA-256>/`,
and every later decoding of the same checkpoint file loads that folder.

The checkpoint is first exported to Hugging Face (export.py: Marian or Llama), then converted by CTranslate2's own
Transformers converter, so every variant the HF export maps converts, and any other is refused with the same
list of fields. One difference needs a loader of attnlab's own: CTranslate2's Marian loader assumes a Marian
vocabulary (`<pad>` last, dropped, and the decoder started from a zero embedding), where attnlab keeps `<pad>` at
id 0 and starts the decoder from `<s>`; `BosStartMarianLoader` keeps the vocabulary whole and the start token
`<s>`. The tokenizer files go into the folder too, so `transformers.AutoTokenizer.from_pretrained(folder)` gives
the tokens CTranslate2 takes (an LM's tokenizer starts every prompt with `</s>`, as attnlab generate does).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from .checkpoints import run_dir_of
from .config import ConfigError, DecodeConfig
from .export import export_hf

log = logging.getLogger("attnlab")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _ct2(what: str):
    """The ctranslate2 module, or a ConfigError saying how to install it."""
    try:
        import ctranslate2
    except ImportError:
        raise ConfigError(f"{what} needs CTranslate2: pip install 'attnlab[ctranslate2]'") from None
    return ctranslate2


def export_ctranslate2(ckpt_path: str | Path, out_dir: str | Path, quantization: str | None = None) -> Path:
    """Write the checkpoint as a CTranslate2 model folder (with its tokenizer) to `out_dir`."""
    _ct2("attnlab export --format ctranslate2")
    from ctranslate2.converters import transformers as ct2_hf  # its converters import transformers
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"--out {out}: exists and is not empty; give a new folder")
    with tempfile.TemporaryDirectory(prefix="attnlab-hf-") as tmp:
        hf_dir = export_hf(ckpt_path, Path(tmp) / "hf")
        converter = AttnlabConverter(ct2_hf, str(hf_dir), copy_files=list(TOKENIZER_FILES))
        converter.convert(str(out), quantization=quantization)
    return out


def AttnlabConverter(ct2_hf, model_dir: str, copy_files: list[str]):  # noqa: N802 (a class made at call time)
    """CTranslate2's TransformersConverter, with BosStartMarianLoader for Marian (the converter classes exist only
    once the optional `ctranslate2` is imported, hence a factory)."""

    class BosStartMarianLoader(ct2_hf.MarianMTLoader):
        """Marian as attnlab writes it: the whole vocabulary (`<pad>` is id 0, not an extra last row) and the
        decoder started from the `<s>` embedding, not from zeros."""

        def get_model_spec(self, model):
            model.config.normalize_before = False  # post-norm, no embedding norm: what export.py maps
            model.config.normalize_embedding = False
            return ct2_hf.BartLoader.get_model_spec(self, model)

        def set_config(self, config, model, tokenizer):
            config.bos_token, config.eos_token = tokenizer.bos_token, tokenizer.eos_token
            config.unk_token = tokenizer.unk_token
            config.decoder_start_token = tokenizer.bos_token

        def set_decoder(self, spec, decoder):
            ct2_hf.BartLoader.set_decoder(self, spec, decoder)

        def get_vocabulary(self, model, tokenizer):
            return ct2_hf.BartLoader.get_vocabulary(self, model, tokenizer)

    class Converter(ct2_hf.TransformersConverter):
        def _load(self):
            marian = ct2_hf._MODEL_LOADERS.get("MarianConfig")
            ct2_hf._MODEL_LOADERS["MarianConfig"] = BosStartMarianLoader()
            try:
                return super()._load()
            finally:
                ct2_hf._MODEL_LOADERS["MarianConfig"] = marian

    return Converter(model_dir, copy_files=copy_files)


# ---------------------------------------------------------------------------------------------- the engine
def converted(ckpt_path: str | Path) -> Path:
    """The CTranslate2 folder of this checkpoint file, converted on first use: `<run dir>/ct2/<stem>-<SHA-256 of
    the file, 12 digits>/` (a checkpoint rewritten in place, as averaged_lastN.ckpt is, gets a new folder). Written
    beside and renamed into place, so a killed conversion leaves nothing half-made and two processes that convert
    at once both end with the one folder."""
    ckpt_path = Path(ckpt_path).resolve()
    digest = hashlib.sha256()
    with open(ckpt_path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    folder = run_dir_of(ckpt_path) / "ct2" / f"{ckpt_path.stem}-{digest.hexdigest()[:12]}"
    if (folder / "model.bin").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        try:
            export_ctranslate2(ckpt_path, tmp / "model")
        except ConfigError as e:
            raise ConfigError(f"decode.engine=ctranslate2 cannot decode it (use decode.engine=attnlab): {e}") from None
        try:
            os.rename(tmp / "model", folder)
        except OSError:  # another process converted it meanwhile
            if not (folder / "model.bin").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("converted %s for CTranslate2 into %s", ckpt_path, folder)
    return folder


def compute_type(dtype: torch.dtype | None) -> str:
    """CTranslate2's compute type for the dtype attnlab would decode in (evaluate.decode_dtype)."""
    return {torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(dtype, "float32")  # type: ignore[arg-type]


def vocabulary(folder: Path) -> list[str]:
    """The token of each id: the converter keeps attnlab's vocabulary whole and in order."""
    path = folder / "shared_vocabulary.json"
    if not path.is_file():
        path = folder / "target_vocabulary.json"
    return json.loads(path.read_text(encoding="utf-8"))


def ct2_translate(ckpt_path: str | Path, sources: list[list[int]], batches: list[list[int]], decode: DecodeConfig,
                  beam: int, device: torch.device, dtype: torch.dtype | None) -> list[list[int]]:
    """Decode the token ids of `sources` (each ending in EOS), batch by batch (lists of indices), with
    CTranslate2 on `device`: beam search with `beam` and length penalty decode.len_penalty, at most
    int(max_len_a * source length + max_len_b) tokens, as attnlab. Returns each sentence's output ids without EOS.
    A hypothesis cut at that length is scored without an EOS (attnlab, as fairseq, forces and counts one).
    CTranslate2 normalises a finished hypothesis by len^alpha, fairseq's penalty; with decode.penalty gnmt that
    form is used all the same (a warning says so)."""
    ct2 = _ct2("decode.engine=ctranslate2")
    folder = converted(ckpt_path)
    if beam > 1 and decode.penalty != "fairseq" and decode.len_penalty:
        log.warning("decode.engine=ctranslate2 ranks beams by log p / len^%g (decode.penalty fairseq); this recipe "
                    "says decode.penalty=%s", decode.len_penalty, decode.penalty)
    # On a CPU: torch's thread count as that many batches at once, one thread each. In a process where torch has
    # run on several threads, CTranslate2's own intra-op threads slow it down instead (measured on 2 cores: 2
    # intra threads 232 sent/s greedy, 2 inter threads 556, 1 thread 446; bench/RESULTS.md).
    workers = torch.get_num_threads() if device.type == "cpu" else 1
    with cuda_libraries(ct2):
        translator = ct2.Translator(str(folder), device=device.type, device_index=device.index or 0,
                                    compute_type=compute_type(dtype), inter_threads=workers, intra_threads=1)
    vocab = vocabulary(folder)
    index = {t: i for i, t in enumerate(vocab)}
    out: list[list[int]] = [[] for _ in sources]
    # decode.max_lengths' rule; its learned-position cap never applies here (the Marian route has sinusoids)
    limits = [int(decode.max_len_a * len(ids) + decode.max_len_b) for ids in sources]
    pending: list[tuple[list[int], list]] = []
    for batch in batches:
        # CTranslate2 takes one maximum length a batch. Greedy: decode to the batch's largest and cut each output
        # at its own (a greedy output's prefix does not depend on how far it goes on). Beam: a batch per limit.
        by_limit = [[i for i in batch if limits[i] == n] for n in sorted({limits[i] for i in batch})]
        parts = [batch] if beam == 1 else by_limit
        for idx in parts:  # queued at once: the translator's workers take them in turn
            pending.append((idx, translator.translate_batch(
                [[vocab[t] for t in sources[i]] for i in idx], beam_size=beam, length_penalty=decode.len_penalty,
                max_decoding_length=max(limits[i] for i in idx), asynchronous=True)))
    with cuda_libraries(ct2):  # CTranslate2 opens cuBLAS at its first matrix product on a GPU
        for idx, results in pending:
            for i, r in zip(idx, results, strict=True):
                out[i] = [index[t] for t in r.result().hypotheses[0][: limits[i]]]
    return out


@contextlib.contextmanager
def cuda_libraries(ct2):
    """Turn CTranslate2's "Library libcublas.so.12 is not found or cannot be loaded" into a ConfigError that says
    what to install: its PyPI wheels open CUDA 12's libraries by name, which a machine with only another CUDA's
    (such as CUDA 13, torch's own there) lacks."""
    try:
        yield
    except RuntimeError as e:
        if "is not found or cannot be loaded" not in str(e):
            raise
        raise ConfigError(
            f"decode.engine=ctranslate2 on a GPU: CTranslate2 {getattr(ct2, '__version__', '?')} says \"{e}\". Its "
            "wheels are built for CUDA 12: pip install nvidia-cublas-cu12 and put that package's lib folder "
            "(site-packages/nvidia/cublas/lib) on LD_LIBRARY_PATH before starting Python, or decode with "
            "decode.engine=attnlab") from e
