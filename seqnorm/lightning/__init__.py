"""LightningModules for the seqnorm tasks: thin wrappers that own the loss, the metrics and the logging."""

from seqnorm.lightning.classifier import SequenceClassifier
from seqnorm.lightning.language_model import LanguageModel
from seqnorm.lightning.precise_bn import PreciseBN
from seqnorm.lightning.prediction_writer import PredictionWriter
from seqnorm.lightning.sync import SyncBatchNorm

__all__ = ["LanguageModel", "PreciseBN", "PredictionWriter", "SequenceClassifier", "SyncBatchNorm"]
