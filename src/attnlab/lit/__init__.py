"""LightningModules: they wrap a model built from a ModelConfig and own loss, metrics, optimizer and schedule."""

from .lm import LMModule
from .seq2seq import Seq2SeqModule

__all__ = ["LMModule", "Seq2SeqModule"]
