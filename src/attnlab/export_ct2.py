"""`attnlab export --format ctranslate2`: a CTranslate2 model folder (the `ctranslate2` extra), for fast CPU and
GPU inference with `ctranslate2.Translator` (translation) or `ctranslate2.Generator` (language models).

The checkpoint is first exported to Hugging Face (export.py: Marian or Llama), then converted by CTranslate2's own
Transformers converter, so every variant the HF export maps converts, and any other is refused with the same
list of fields. One difference needs a loader of attnlab's own: CTranslate2's Marian loader assumes a Marian
vocabulary (`<pad>` last, dropped, and the decoder started from a zero embedding), where attnlab keeps `<pad>` at
id 0 and starts the decoder from `<s>`; `BosStartMarianLoader` keeps the vocabulary whole and the start token
`<s>`. The tokenizer files go into the folder too, so `transformers.AutoTokenizer.from_pretrained(folder)` gives
the tokens CTranslate2 takes (an LM's tokenizer starts every prompt with `</s>`, as attnlab generate does).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from .config import ConfigError
from .export import export_hf

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def export_ctranslate2(ckpt_path: str | Path, out_dir: str | Path, quantization: str | None = None) -> Path:
    """Write the checkpoint as a CTranslate2 model folder (with its tokenizer) to `out_dir`."""
    try:
        import ctranslate2  # noqa: F401  (the extra; its converters import transformers)
        from ctranslate2.converters import transformers as ct2_hf
    except ImportError:
        raise ConfigError("attnlab export --format ctranslate2 needs CTranslate2: pip install "
                          "'attnlab[ctranslate2]'") from None
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
