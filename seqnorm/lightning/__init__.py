"""LightningModules for the seqnorm tasks: thin wrappers that own the loss, the metrics and the logging."""

from seqnorm.lightning.classifier import SequenceClassifier
from seqnorm.lightning.language_model import LanguageModel

__all__ = ["LanguageModel", "SequenceClassifier"]
