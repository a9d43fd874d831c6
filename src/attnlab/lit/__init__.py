"""LightningModules (translation, language modelling, masked language modelling): each wraps a model built from
a ModelConfig and owns its loss, metrics, optimizer and schedule."""

from .lm import LMModule
from .mlm import MLMModule
from .seq2seq import Seq2SeqModule

__all__ = ["LMModule", "MLMModule", "Seq2SeqModule"]
