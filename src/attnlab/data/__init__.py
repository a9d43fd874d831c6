"""Data: corpora, byte-level BPE tokenizers, memory-mapped token caches, token-count batching, datamodules."""

from .batching import TokenBatchSampler, WindowBatchSampler, collate_pairs, collate_windows
from .config import DataConfig, DataError
from .corpora import open_documents, open_parallel
from .datamodule import LMDataModule, MLMDataModule, TranslationDataModule
from .gettext import gettext_pairs
from .tokenizer import BOS_ID, EOS_ID, MASK_ID, PAD_ID, UNK_ID, Tokenizer

__all__ = [
    "BOS_ID", "EOS_ID", "MASK_ID", "PAD_ID", "UNK_ID",
    "DataConfig", "DataError", "LMDataModule", "MLMDataModule", "TokenBatchSampler", "Tokenizer",
    "TranslationDataModule", "WindowBatchSampler", "collate_pairs", "collate_windows", "gettext_pairs",
    "open_documents", "open_parallel",
]
