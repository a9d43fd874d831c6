"""LightningModules (translation, language modelling, masked language modelling): each wraps a model built from
a ModelConfig and owns its loss, metrics, optimizer and schedule."""

from .lm import LMModule
from .mlm import MLMModule
from .seq2seq import Seq2SeqModule

# the module fit trains for each task (experiment.TASKS), and so the curves a run of that task logs
TASK_MODULES = {"translation": Seq2SeqModule, "lm": LMModule, "mlm": MLMModule}

__all__ = ["TASK_MODULES", "LMModule", "MLMModule", "Seq2SeqModule"]
