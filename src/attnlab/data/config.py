"""`DataConfig`: where the text comes from and how it becomes batches. Frozen; validated on construction.

It shares the strict dict/YAML helpers of `attnlab.config` (unknown keys and wrong types are `ConfigError`s
naming the key), so `data:` sections of a recipe load exactly like `model:` ones.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field

from ..config import ConfigError, StrictConfig, check_types

# Settings that change what ends up in a cache: the cache key is a hash of these (plus the corpus identity).
# num_workers and data_dir only change where and how fast, so they are left out.
TOKENIZER_KEYS = ("src_lang", "tgt_lang", "locale_dir", "text_field", "vocab_size", "joint_vocab", "min_frequency",
                  "tokenizer_max_lines", "valid_fraction", "test_fraction")
CACHE_KEYS = (*TOKENIZER_KEYS, "max_len", "max_ratio")
# Where gettext:<lang> looks by default: Debian's catalogs, and Ubuntu's language packs (language-pack-<lang>)
LOCALE_DIRS = ("/usr/share/locale", "/usr/share/locale-langpack")


class DataError(ValueError):
    """Bad input data or an unusable corpus. The message names the file and line, or the key, at fault."""


@dataclass(frozen=True)
class DataConfig(StrictConfig):
    """Corpus, tokenizer and batching. Defaults: the offline demo (English->German UI strings from gettext).

    corpus specs (see `attnlab.data.corpora.open_corpus`):
      gettext:<lang>            English -> <lang> pairs from <each locale_dir>/<lang>/LC_MESSAGES/*.mo
      gettext-mono:<lang>[:en]  the <lang> (or English) side of those catalogs, as documents (LM)
      hf:<name>[:<config>]      a Hugging Face hub dataset (e.g. hf:wmt14:de-en); needs network or the HF cache
      <dir saved by save_to_disk> (or hf:<dir>)   a local Dataset / DatasetDict
      <file>.tsv | <file>.jsonl | <prefix> (with <prefix>.<src_lang>, <prefix>.<tgt_lang>) | <file>.txt (LM)
      <dir> holding train/valid/test files of one of those kinds
    """

    prefix: typing.ClassVar[str] = "data"

    corpus: str = "gettext:de"  # what to read: gettext:<lang>, hf:<name>[:<config>], a file or folder (see above)
    src_lang: str = "en"  # source language code (file suffixes, JSONL keys, example labels)
    tgt_lang: str = "de"  # target language code; also picks sacreBLEU's tokenizer (zh, ja-mecab, ko-mecab)
    data_dir: str = "data_cache"  # cache root: tokenizers and token arrays live under it, keyed by a settings hash
    locale_dir: str | list[str] = field(default_factory=lambda: list(LOCALE_DIRS))  # gettext catalog folder(s)
    text_field: str = "text"  # LM: the JSONL key / dataset column holding a document
    vocab_size: int = 8000  # BPE vocabulary per tokenizer, special tokens and the 256 byte symbols included
    joint_vocab: bool = True  # one BPE for source and target (False: one per side)
    min_frequency: int = 2  # BPE merges need a pair seen at least this often
    tokenizer_max_lines: int = 0  # train BPE on at most this many training lines per side (0 = all)
    max_len: int = 256  # training pairs with more tokens on either side (EOS/BOS included) are dropped
    max_ratio: float = 3.0  # training pairs whose token-length ratio exceeds this are dropped (0 = off)
    max_tokens: int = 4096  # tokens per batch, padding counted: B * max(len) <= max_tokens for src and tgt
    seq_len: int = 256  # LM window length; an LM batch holds max(1, max_tokens // seq_len) windows
    min_pairs: int = 0  # gettext:<lang>: stop before training when the catalogs give fewer pairs (0 = any)
    valid_fraction: float = 0.01  # share of an unsplit corpus held out for validation (by a hash of the source)
    test_fraction: float = 0.02  # share held out for test, likewise
    num_workers: int = 0  # DataLoader worker processes

    def __post_init__(self) -> None:
        check_types(self, "data")
        if not self.corpus.strip():
            raise ConfigError("data.corpus='' is empty; give e.g. gettext:de, a .tsv/.jsonl file or hf:wmt14:de-en")
        for key in ("src_lang", "tgt_lang", "data_dir", "text_field"):
            if not getattr(self, key):
                raise ConfigError(f"data.{key}='' must not be empty")
        if self.src_lang == self.tgt_lang:
            raise ConfigError(f"data.src_lang and data.tgt_lang are both {self.src_lang!r}")
        for key in ("vocab_size", "min_frequency", "max_len", "max_tokens", "seq_len"):
            if getattr(self, key) < 1:
                raise ConfigError(f"data.{key}={getattr(self, key)} must be >= 1")
        if not self.locale_dirs or not all(self.locale_dirs):
            raise ConfigError(f"data.locale_dir={self.locale_dir!r}: give a folder or a list of folders")
        for key in ("tokenizer_max_lines", "num_workers", "min_pairs"):
            if getattr(self, key) < 0:
                raise ConfigError(f"data.{key}={getattr(self, key)} must be >= 0")
        if self.max_ratio != 0 and self.max_ratio < 1:
            raise ConfigError(f"data.max_ratio={self.max_ratio} must be >= 1 (or 0 = no ratio filter)")
        for key in ("valid_fraction", "test_fraction"):
            if not 0.0 <= getattr(self, key) < 1.0:
                raise ConfigError(f"data.{key}={getattr(self, key)} must be in [0, 1)")
        if self.valid_fraction + self.test_fraction >= 1.0:
            raise ConfigError(f"data.valid_fraction + data.test_fraction = "
                              f"{self.valid_fraction + self.test_fraction} leaves nothing to train on")
        if self.max_tokens < self.max_len:
            raise ConfigError(f"data.max_tokens={self.max_tokens} < data.max_len={self.max_len}: "
                              "the longest kept pair would not fit in a batch")

    @property
    def locale_dirs(self) -> list[str]:
        """data.locale_dir as a list (one folder may be given as a string)."""
        return [self.locale_dir] if isinstance(self.locale_dir, str) else list(self.locale_dir)

    def settings(self, keys: tuple[str, ...] = CACHE_KEYS) -> dict[str, typing.Any]:
        """The fields that determine a cache's content (the cache key hashes these and the corpus identity)."""
        return {k: getattr(self, k) for k in keys}
